"""Starts the real ``xreduced`` as a subprocess, for the scripts in ``bench/`` and for the tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

_SERVING = re.compile(r"event=serving address=(\S+)")


class DaemonProcess:
    """A running ``python -m xreduced ARGS``; ``address`` is where it listens.

    Its stderr is drained by a thread into ``lines`` so it can never block.

    Example:
        >>> proc = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2"])
        >>> proc.address.startswith("127.0.0.1:"), proc.terminate()
        (True, 0)
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 30.0,
                 wrapper: list[str] | None = None):
        """``wrapper``: a command the daemon runs under (``["setpriv", ..., "--"]``); none by default."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*(wrapper or ()), sys.executable, "-m", "xreduced", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.lines: list[str] = []
        self.address: str | None = None
        self.serving_after: float | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(timeout) or self.address is None:
            self.kill()
            raise RuntimeError(f"xreduced did not start within {timeout}s:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _SERVING.search(line)
            if m and self.address is None:
                self.address = m.group(1)
                self.serving_after = time.monotonic() - self.started
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Sends ``sig`` and waits (bounded) for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
