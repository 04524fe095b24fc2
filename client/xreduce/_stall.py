"""The stall warning: a collective that waits long for the other processes says so.

A collective of several processes blocks until every process of its group
has reached it; the daemon bounds the wait (``--collective-timeout``) and logs
who is missing. A process whose partners never started would otherwise wait
in silence, so after :data:`ENV_STALL_WARNING` seconds (default 10) the SDK
logs a warning on the ``xreduce.stall`` logger naming the collective, this
process, the processes it waits for and what the daemon reports (one short
``GetStatus``), then again at gaps that double up to 30 s, as the daemon's
log does. The daemon reads the same variable.

One watcher thread per process, started on first use, sleeps until the next
warning is due: a call that completes in time costs a lock and a dict entry,
and nothing polls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from xreduce.v1 import xreduce_pb2 as pb

ENV_STALL_WARNING = "XREDUCE_STALL_WARNING_SECONDS"
"""Seconds a collective may wait before the SDK warns (and the daemon logs); 0 turns the warnings off."""

DEFAULT_STALL_WARNING_SECONDS = 10.0
"""The warning's delay when :data:`ENV_STALL_WARNING` is unset: the daemon's ``--stall-warning-seconds`` too."""

MAX_GAP_SECONDS = 30.0
"""The longest gap between two warnings for one collective (unless the first came later)."""

STATUS_TIMEOUT_SECONDS = 2.0
"""How long the watcher waits for the daemon's ``GetStatus`` before warning without it."""

log = logging.getLogger("xreduce.stall")


class StatusSource(Protocol):
    """What the watcher asks the daemon through: a :class:`xreduce.Client`."""

    address: str

    def get_status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        """The daemon's ``GetStatus``."""


def warning_seconds(environ: Mapping[str, str] | None = None) -> float | None:
    """The delay before the first stall warning, from :data:`ENV_STALL_WARNING`; None: no warnings.

    Raises:
        ValueError: the variable is not a number of seconds >= 0; the message names it and the value.

    Example:
        >>> warning_seconds({}), warning_seconds({"XREDUCE_STALL_WARNING_SECONDS": "2.5"})
        (10.0, 2.5)
        >>> warning_seconds({"XREDUCE_STALL_WARNING_SECONDS": "0"}) is None
        True
        >>> warning_seconds({"XREDUCE_STALL_WARNING_SECONDS": "soon"})
        Traceback (most recent call last):
        ...
        ValueError: XREDUCE_STALL_WARNING_SECONDS must be a number of seconds >= 0 (0: no warnings); got 'soon'
    """
    raw = (os.environ if environ is None else environ).get(ENV_STALL_WARNING, "").strip()
    if not raw:
        return DEFAULT_STALL_WARNING_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"{ENV_STALL_WARNING} must be a number of seconds >= 0 (0: no warnings); got {raw!r}")
    return value or None


def label(spec: pb.CollectiveSpec) -> str:
    """How the SDK (and the daemon) names a collective.

    Example:
        >>> label(pb.CollectiveSpec(group="train", sequence=3))
        'collective 3 in group "train"'
        >>> label(pb.CollectiveSpec(group="train", name="join"))
        'collective "join" in group "train"'
    """
    ident = f'"{spec.name}"' if spec.name else str(spec.sequence)
    return f'collective {ident} in group "{spec.group}"'


def message(spec: pb.CollectiveSpec, waited: float, daemon: str) -> str:
    """The warning for collective ``spec`` after ``waited`` seconds; ``daemon``: what the daemon reports.

    Example:
        >>> spec = pb.CollectiveSpec(group="train", num_processes=2, process_id=0, sequence=3)
        >>> print(message(spec, 10.02, "The daemon at 127.0.0.1:50551 has 1 collective waiting."))
        collective 3 in group "train" has not completed after 10 s (this is process 0 of 2; it waits for
        process 1). The daemon at 127.0.0.1:50551 has 1 collective waiting. Is process 1 running, with the same
        XREDUCE_GROUP? (XREDUCE_STALL_WARNING_SECONDS=0 turns this warning off.)
    """
    others = [p for p in range(spec.num_processes) if p != spec.process_id]
    if len(others) == 1:
        waits = f"process {others[0]}"
        question = f"Is process {others[0]} running"
    else:
        shown = str(others) if len(others) <= 10 else f"{str(others[:10])[:-1]}, ...]"
        waits = f"some of processes {shown}"
        question = "Are they all running"
    return (f"{label(spec)} has not completed after {round(waited, 1):g} s (this is process {spec.process_id} of "
            f"{spec.num_processes}; it waits for {waits}). {daemon} {question}, with the same XREDUCE_GROUP? "
            f"({ENV_STALL_WARNING}=0 turns this warning off.)")


def daemon_report(source: StatusSource | None) -> str:
    """What the daemon says about waiting collectives, a sentence of the warning (one ``GetStatus``).

    Example:
        >>> daemon_report(None)
        "The daemon's log names who is missing (event=collective_waiting)."
    """
    if source is None:
        return "The daemon's log names who is missing (event=collective_waiting)."
    try:
        status = source.get_status(timeout=STATUS_TIMEOUT_SECONDS)
    except Exception as e:  # noqa: BLE001 - a warning must not fail; it says why it knows less
        return f"The daemon at {source.address} did not answer GetStatus ({type(e).__name__}: {e})."
    if status.collectives_waiting == 0:
        return (f"The daemon at {source.address} has no collective waiting for processes: all may have arrived "
                "and the reduction itself is slow.")
    limit = status.limits.collective_timeout_seconds
    return (f"The daemon at {source.address} has {status.collectives_waiting} collective(s) waiting"
            + (f" (--collective-timeout {limit:g} s)" if limit > 0 else "")
            + "; its log names who is missing (event=collective_waiting).")


def join_report(coordinator: str) -> str:
    """What the warning says of a join across nodes, in place of the daemon's count of waiting collectives
    (the join waits at the group's coordinator, not in the daemon's rendezvous).

    Example:
        >>> join_report("10.0.0.1:50570")
        "The join waits at the group's coordinator, 10.0.0.1:50570, where every process registers through its own \
node's daemon."
    """
    return (f"The join waits at the group's coordinator, {coordinator}, where every process registers through its "
            "own node's daemon.")


@dataclasses.dataclass
class _Stall:
    spec: pb.CollectiveSpec
    source: StatusSource | None
    started: float
    due: float
    gap: float
    first: float
    note: str | None = None
    """Said in place of the daemon's report (a join across nodes)."""

    def advance(self, now: float) -> None:
        """Moves ``due`` past ``now``."""
        while self.due <= now:
            self.due += self.gap
            self.gap = _next_gap(self.first, self.gap)


def _next_gap(first: float, gap: float) -> float:
    """The gap after ``gap`` between two warnings: double, up to :data:`MAX_GAP_SECONDS` (or ``first`` if longer)."""
    return min(2 * gap, max(MAX_GAP_SECONDS, first))


class Watcher:
    """Warns about the watched collectives that wait too long; one thread, asleep until a warning is due.

    Args:
        emit: where a warning goes (the ``xreduce.stall`` logger's ``warning``).
        report: what the daemon says, given the watched call's client (:func:`daemon_report`).

    Example:
        >>> seen = []
        >>> w = Watcher(emit=seen.append, report=lambda source: "The daemon says nothing.")
        >>> spec = pb.CollectiveSpec(group="g", num_processes=2, process_id=1, sequence=0)
        >>> with w.watching(spec, None, 0.05):
        ...     while not seen:
        ...         time.sleep(0.01)
        >>> print(seen[0].split(" s (")[1])  # the seconds waited come first
        this is process 1 of 2; it waits for process 0). The daemon says nothing. Is process 0 running, with the
        same XREDUCE_GROUP? (XREDUCE_STALL_WARNING_SECONDS=0 turns this warning off.)
        >>> before = len(seen)
        >>> with w.watching(spec, None, 10.0):
        ...     pass  # completes in time: no warning
        >>> len(seen) == before
        True
    """

    def __init__(self, emit: Callable[[str], None] | None = None,
                 report: Callable[[StatusSource | None], str] = daemon_report):
        self._emit = emit or log.warning
        self._report = report
        self._ids = itertools.count()
        self._reset()

    def _reset(self) -> None:
        """Fresh state: at first use, and in a forked child (the parent's thread and lock are not its own)."""
        self._cond = threading.Condition()
        self._stalls: dict[int, _Stall] = {}
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, spec: pb.CollectiveSpec, source: StatusSource | None, delay: float,
                 coordinator: str = "") -> Iterator[None]:
        """Warns about collective ``spec`` after ``delay`` seconds (and later) until the block ends; with a
        ``coordinator``, ``spec`` is a join across nodes: its group is named ``group@coordinator``, as the
        daemons name it, and the warning says where the join waits."""
        now = time.monotonic()
        note = None
        if coordinator:
            spec = pb.CollectiveSpec(group=f"{spec.group}@{coordinator}", num_processes=spec.num_processes,
                                     process_id=spec.process_id, name=spec.name)
            note = join_report(coordinator)
        stall = _Stall(spec, source, now, now + delay, _next_gap(delay, delay), delay, note)
        with self._cond:
            key = next(self._ids)
            self._stalls[key] = stall
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="xreduce-stall-watcher", daemon=True)
                self._thread.start()
            elif stall.due < self._wake_at:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                # No notify: the thread wakes when it meant to, finds nothing due, and sleeps on.
                self._stalls.pop(key, None)

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                now = time.monotonic()
                due = [(key, s) for key, s in self._stalls.items() if s.due <= now]
                for _, s in due:
                    s.advance(now)
                self._wake_at = min((s.due for s in self._stalls.values()), default=math.inf)
                if not due:
                    cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
            for key, s in due:
                text = message(s.spec, now - s.started, s.note or self._report(s.source))
                with cond:
                    still = key in self._stalls  # the call may have completed while the daemon was asked
                if still:
                    self._emit(text)


_watcher = Watcher()
os.register_at_fork(after_in_child=_watcher._reset)


def watch(source: StatusSource | None, spec: pb.CollectiveSpec | None,
          coordinator: str = "") -> contextlib.AbstractContextManager[None]:
    """Warns while collective ``spec`` waits longer than :data:`ENV_STALL_WARNING` seconds (no-op without
    a ``spec`` of several processes, or with the variable at 0).

    Args:
        source: the client whose daemon is asked (``GetStatus``) when a warning is due; None: not asked.
        spec: the collective, as its request names it (``JoinGroup``'s with ``name="join"``).
        coordinator: the group's coordinator, for a join across nodes (see :meth:`Watcher.watching`).

    Raises:
        ValueError: :data:`ENV_STALL_WARNING` is not a number of seconds >= 0.

    Example:
        >>> with watch(None, None):
        ...     pass
    """
    if spec is None or spec.num_processes < 2:
        return contextlib.nullcontext()
    delay = warning_seconds()
    if delay is None:
        return contextlib.nullcontext()
    return _watcher.watching(spec, source, delay, coordinator)
