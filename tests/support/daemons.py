"""The tests' daemon factory: starts real ``xreduced`` subprocesses and stops every one it started.

``tests/conftest.py`` wraps it in the ``start_daemon`` (per test) and
``start_module_daemon`` (per module) fixtures; a helper that manages its own
daemons' lifetime uses it as a context manager.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from xreduce_bench.daemon import DaemonProcess


class Daemons:
    """Starts ``python -m xreduced FLAGS...`` on each call; :meth:`close` stops what is still running.

    Args:
        stop_signal: what :meth:`close` sends a daemon that is still running
            (SIGTERM: a graceful stop; SIGKILL for tests that must not wait for one).

    Example:
        >>> with Daemons() as start:
        ...     proc = start("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
        ...     proc.address.startswith("127.0.0.1:")
        True
    """

    def __init__(self, stop_signal: int = signal.SIGTERM):
        self._stop_signal = stop_signal
        self._started: list[DaemonProcess] = []

    def __call__(self, *flags: str, env: dict[str, str] | None = None, timeout: float = 30.0,
                 wrapper: list[str] | None = None) -> DaemonProcess:
        """Starts a daemon with ``flags`` (nothing added), ``env`` over this process's environment, under
        ``wrapper`` (a command such as ``setpriv ... --``) if given, and waits at most ``timeout`` seconds
        for it to serve."""
        proc = DaemonProcess(list(flags), env=env, timeout=timeout, wrapper=wrapper)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        """Stops every daemon still running, the last started first."""
        for proc in reversed(self._started):
            if proc.proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # terminate() has killed it then
                    proc.terminate(self._stop_signal)
        self._started.clear()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_log(daemon: DaemonProcess, pattern: str, timeout: float = 10.0) -> re.Match:
    """The first match of ``pattern`` in the daemon's log, waiting up to ``timeout`` seconds for it.

    Example:
        >>> with Daemons() as start:
        ...     proc = start("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
        ...     wait_log(proc, r"event=serving .*devices=(\\d+)").group(1)
        '2'
    """
    deadline = time.monotonic() + timeout
    while not (m := re.search(pattern, daemon.log())):
        assert time.monotonic() < deadline, f"no log line matches {pattern!r}:\n{daemon.log()}"
        time.sleep(0.02)
    return m


def metrics(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    """Every sample the daemon's metrics endpoint (``--metrics-listen``) serves now: (name, sorted labels) ->
    value."""
    address = re.search(r"event=metrics address=(\S+)", daemon.log()).group(1)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
