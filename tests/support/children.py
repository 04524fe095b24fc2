"""The environment of the child processes tests start (scripts, test modules run as scripts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

SUPPORT = os.path.dirname(os.path.abspath(__file__))


def child_env() -> dict[str, str]:
    """This process's environment, unbuffered, with this folder on PYTHONPATH.

    A child imports ``xreduce`` and ``xreduced`` as this process does (installed,
    or through the PYTHONPATH it inherits); a test module that runs itself as a
    child also finds the helpers here, as pytest's ``pythonpath`` gives them to it.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, env.get("PYTHONPATH")) if p)
    return env


class Started:
    """The processes a test module starts; :meth:`end_all` ends those still running (a module's autouse fixture
    calls it after each test, so that a failed test leaves no child behind).

    Example:
        >>> import sys
        >>> started = Started()
        >>> proc = started.popen([sys.executable, "-c", "import time; time.sleep(60)"])
        >>> started.end_all()
        >>> proc.returncode is not None
        True
    """

    def __init__(self):
        self._procs: list[subprocess.Popen] = []

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(argv, **kwargs)``, remembered."""
        proc = subprocess.Popen(argv, **kwargs)
        self._procs.append(proc)
        return proc

    def end_all(self) -> None:
        """Kills every remembered process still running, and reaps them all."""
        while self._procs:
            proc = self._procs.pop()
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def stopped(pid: int, timeout: float = 10.0) -> None:
    """Sends ``pid`` SIGSTOP and returns once every thread of it has stopped (state ``T`` in
    ``/proc/PID/task/*/stat``), within ``timeout`` seconds.

    ``kill`` returns before the stop has happened: one thread of the process must run to stop the others, and on a
    busy machine another thread, woken by a request, may still answer it in the meantime. A test that needs a process
    that does not answer waits for this.

    Example:
        >>> import signal, sys
        >>> proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        >>> stopped(proc.pid); proc.send_signal(signal.SIGCONT); proc.kill(); proc.wait()
        -9
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} has not stopped within {timeout}s: threads {states}"
        time.sleep(0.005)
