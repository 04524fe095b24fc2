"""Starts the real ``xreduced`` as a subprocess: :class:`DaemonProcess` for the scripts in ``bench/`` and for the
tests, :func:`embedded_daemon` for ``xreduce bench --embedded``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import xreduce

from xreduce_bench.sweep import BenchError
from xreduce_bench.workers import _popen, _stop

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


@contextlib.contextmanager
def embedded_daemon(tmp: str, devices: int, timeout: float) -> Iterator[tuple[str, int]]:
    """``python -m xreduced`` on a unix socket in ``tmp`` with ``devices`` devices, for one run of
    ``xreduce bench``: yields (its address, its pid); its log is ``tmp/xreduced.log``; stopped (SIGTERM, then
    killed after 30 s) when the block ends.

    Raises:
        BenchError: it exited, or did not serve within ``timeout`` seconds; the message holds its log.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, embedded_daemon(tmp, 2, 30) as (address, pid):
        ...     address.startswith("unix:"), device_names(address, 30)
        (True, (['CPU:0', 'CPU:1'], 'numpy'))
    """
    log_path = os.path.join(tmp, "xreduced.log")
    with open(log_path, "w") as log:
        proc = _popen([sys.executable, "-m", "xreduced", "--listen", f"unix:{tmp}/xreduced.sock",
                       "--virtual-devices", str(devices)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        address = None
        while address is None:
            with open(log_path) as f:
                m = _SERVING.search(f.read())
            address = m and m.group(1)
            if address is None and (proc.poll() is not None or time.monotonic() > deadline):
                with open(log_path) as f:
                    raise BenchError(f"the daemon did not start:\n{f.read()}")
            time.sleep(0.05)
        yield address, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        _stop(proc, 30)


def device_names(address: str, timeout: float) -> tuple[list[str], str]:
    """The short names of the devices of the daemon at ``address`` (``CPU:0``, ...), and its backend.

    Example: see :func:`embedded_daemon`.
    """
    with xreduce.Client(address, timeout=timeout) as client:
        reply = client.list_devices()
    return [xreduce.DeviceName.parse(d.name).short for d in reply.devices], reply.backend
