"""The reaper: a small process that unlinks this process's shared-memory segments if it ends without doing so.

The SDK unlinks its segments itself when they are freed and at exit. A process
that is killed (SIGKILL, the OOM killer) or leaves with ``os._exit`` (as
``multiprocessing`` children do) cannot: its reaper then unlinks what is left,
without a word, once its pipe closes.

Not ``multiprocessing``'s resource tracker: one tracker serves a process and
every child it starts, so the segments of a killed child were reported as
"leaked" by the survivors at their exit, and the tracker warns about every
segment it cleans up. A reaper serves one process, and only it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

_PROGRAM = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the terminal is for the process it watches
signal.signal(signal.SIGTERM, signal.SIG_IGN)
names = set()
for line in sys.stdin.buffer:
    name = line[1:].strip().decode("ascii", "replace")
    if "/" not in name:
        (names.add if line[:1] == b"+" else names.discard)(name)
for name in names:
    try:
        os.unlink(os.path.join(sys.argv[1], name))
    except OSError:
        pass
"""


class Reaper:
    """The segments this process made and has not unlinked, and the reaper process that unlinks them
    if this process ends first. The reaper starts with the first segment.

    Args:
        directory: where the segments' files are (``/dev/shm``).

    Example:
        >>> import tempfile
        >>> tmp = tempfile.mkdtemp()
        >>> reaper = Reaper(tmp)
        >>> open(os.path.join(tmp, "seg"), "w").close()
        >>> reaper.add("seg")
        >>> reaper.names()
        ['seg']
        >>> reaper.close()
        >>> reaper.names(), os.listdir(tmp)
        ([], [])
    """

    def __init__(self, directory: str):
        self._directory = directory
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._proc: subprocess.Popen | None = None
        self._pipe: int | None = None  # the write end of the reaper's stdin
        self._started = False

    def add(self, name: str) -> None:
        """Tracks a segment this process just made."""
        with self._lock:
            self._names.add(name)
            if not self._started:
                self._start()
            self._tell(b"+", name)

    def remove(self, name: str) -> None:
        """Stops tracking a segment (this process unlinked it)."""
        with self._lock:
            if name in self._names:
                self._names.discard(name)
                self._tell(b"-", name)

    def names(self) -> list[str]:
        """The segments tracked, sorted."""
        with self._lock:
            return sorted(self._names)

    def unlink_all(self) -> None:
        """Unlinks every segment still tracked (their mappings stay valid until they are unmapped)."""
        for name in self.names():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._directory, name))
            self.remove(name)

    def close(self) -> None:
        """At exit: unlinks every segment still tracked, and ends the reaper (it has nothing left to do)."""
        self.unlink_all()
        with self._lock:
            proc, self._proc, self._pipe = self._proc, None, None
        if proc is not None:
            proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)

    def after_fork_in_child(self) -> None:
        """A forked child's segments are its own: it starts its own reaper, and lets its parent's go."""
        self._lock = threading.Lock()
        self._names = set()
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # the child's copy; the parent's reaper then follows the parent alone
        self._proc = self._pipe = None
        self._started = False

    def _start(self) -> None:
        """Starts the reaper; without one (no interpreter to start) the segments are unlinked at exit only."""
        self._started = True
        if getattr(sys, "frozen", False):  # sys.executable is the application itself
            return
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _PROGRAM, self._directory], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
        except OSError:
            return
        self._pipe = self._proc.stdin.fileno()

    def _tell(self, op: bytes, name: str) -> None:
        if self._pipe is not None:
            with contextlib.suppress(OSError):  # a reaper that died: the segments are unlinked at exit only
                os.write(self._pipe, op + name.encode("ascii") + b"\n")  # one write under PIPE_BUF: atomic
