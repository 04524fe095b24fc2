"""The rendezvous: matches the contributions of several processes to one collective.

A collective (a :class:`Meeting`) is keyed by its
:class:`~xreduced.decode.CollectiveKey`: its group, and its sequence number or
name. Each process's call (a :class:`Participant`) brings its contribution and
waits, bounded, until every process of the group has arrived; the last to
arrive runs the computation once and every waiter gets its own share of the
result, or the same error. A collective that fails (a timeout, a
disagreement, a participant leaving) fails for everyone; late arrivals to it
get the same error for a while (a bounded, expiring record), and the group's
next collective starts afresh.

A collective is OPEN while participants arrive, COMPLETE once the last one has
(it computes; nobody leaving can abort it now), then DONE or FAILED; FAILED
may also come straight from OPEN. One method changes that state, under the
rendezvous's lock; the deferred participants it ends are answered after the
lock is released.

A participant may also arrive without waiting (``defer``, the local lane's
calls): it leaves a :class:`~xreduced.deferred.Deferred` that the last arrival
resolves with its share after computing, or the failure with the error, in
that thread; its own deadline comes when its thread calls the deferred's
``wake`` (see :mod:`xreduced.deferred`).

A collective that waits long says so in the log, without a thread of its own:
its waiting participants wake when a report is due (``report_after`` seconds
after the first arrival, then at gaps that double up to 30 s: at 10, 30, 60,
90 s... by default) and the first awake logs who has arrived and who is missing::

    event=collective_waiting group="train" collective=3 waited_s=10.0 num_processes=4 arrived=0,2 missing=1,3
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from xreduced.deferred import Deferred
from xreduced.errors import Aborted, DeadlineExceeded, Internal, InvalidArgument, ServiceError

if TYPE_CHECKING:
    from xreduced.decode import CollectiveKey

log = logging.getLogger("xreduced.rendezvous")

ABANDON_POLL = 0.25
"""Seconds between two asks of a waiting collective's ``abandoned`` (how soon a failed epoch is noticed)."""

MAX_REPORT_GAP_SECONDS = 30.0
"""The longest gap between two reports of one waiting collective (unless the first report comes later)."""


def _next_gap(first: float, gap: float) -> float:
    """The gap after ``gap`` between two reports: double, up to 30 s (or ``first`` if longer)."""
    return min(2 * gap, max(MAX_REPORT_GAP_SECONDS, first))


def missing_ids(num_processes: int, arrived) -> list[int]:
    """The ids in ``[0, num_processes)`` not in ``arrived``: at most 11 of them, enough to name.

    Example:
        >>> missing_ids(5, {0, 3})
        [1, 2, 4]
    """
    out = []
    for pid in range(num_processes):
        if pid not in arrived:
            out.append(pid)
            if len(out) > 10:
                break
    return out


def _unfinished(c: _Collective, timeout: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"{c.label}: every process arrived but the reduction did not finish within "
                            f"{max(timeout, 1.0):.3g}s more")


def _ids(ids: list[int]) -> str:
    """``[1, 2]``, or the first ten and how many more."""
    return str(ids) if len(ids) <= 10 else f"{ids[:10]} and more"


def _log_ids(ids: list[int], count: int) -> str:
    """``1,3`` for a log line (no spaces), or the first ten and ``...+N``."""
    shown = ",".join(str(i) for i in ids[:10])
    return shown + (f",...+{count - 10}" if count > 10 else "") if shown else "none"


def _timed_out(c: _Collective, timeout: float) -> DeadlineExceeded:
    missing = c.missing()
    return DeadlineExceeded(f"{c.label} timed out after {timeout:.3g}s waiting for process(es) {_ids(missing)}; "
                            f"arrived: {_ids(sorted(c.arrived))}", process_ids=missing)


def _left(c: _Collective, process_id: int) -> Aborted:
    return Aborted(f"{c.label} was aborted: process {process_id} left (its call ended or its process died) before "
                   "every process arrived", process_ids=(process_id,))


def _aborted(c: _Collective, error: ServiceError) -> ServiceError:
    """``error`` for one collective of a group that lost a process: its own copy, named by its label."""
    return error.copy(f"{c.label} was aborted: {error}")


@dataclasses.dataclass(slots=True)
class Meeting:
    """One collective, as a participant names it: what every participant of it must agree on, and how it
    may fail. Not to be changed once made (not frozen only because a frozen dataclass takes twice the work
    to make, and every call makes one).

    Example:
        >>> from xreduced.decode import CollectiveKey
        >>> key = CollectiveKey("train", 17)
        >>> Meeting(key, key.label, num_processes=4, expected=frozenset({0, 1})).label
        'collective 17 in group "train"'
    """

    key: CollectiveKey
    """Which collective: its group, and its sequence number or name."""
    label: str
    """Names it in messages, e.g. ``collective 17 in group "train"``."""
    num_processes: int
    """The group's processes; every participant must say the same."""
    expected: frozenset[int] | None = None
    """The participants that meet here, when not all of ``range(num_processes)`` (a group across nodes meets
    node by node)."""
    remember_failure: bool = True
    """Keep a failure (a timeout, a participant leaving, a disagreement, the computation's error) for late
    arrivals."""
    abandoned: Callable[[], ServiceError | None] | None = None
    """Asked while a participant waits in its thread (every ``ABANDON_POLL`` s): an error that ends the
    collective for everyone (the group's epoch failed), or None."""


@dataclasses.dataclass(slots=True)
class Participant:
    """One process's arrival at a collective: who, what it brings, and how it waits (not frozen: see
    :class:`Meeting`).

    Example:
        >>> Participant(1, contribution=[1.0, 2.0], timeout=30.0, defer=True).process_id
        1
    """

    process_id: int
    contribution: Any
    timeout: float
    """Seconds to wait for the others."""
    on_leave: Callable[[Callable[[], None]], Any] | None = None
    """Registers a function to call if this participant's call ends before the collective completes (gRPC's
    ``add_callback``; False: the call has already ended)."""
    defer: bool = False
    """True: a participant that is not the last does not wait: a :class:`~xreduced.deferred.Deferred` is
    returned at once, and resolved later with this process's share or the error (see the module). Not with a
    meeting's ``abandoned``."""


class _State(enum.Enum):
    """Where a collective is: OPEN, then COMPLETE, then DONE; or FAILED, from OPEN or COMPLETE. Only
    :meth:`Rendezvous._transition` changes it."""

    OPEN = "open"
    """Waiting for participants: a timeout, a participant leaving or the group's end fails it."""
    COMPLETE = "complete"
    """Everyone arrived and the last arrival computes: nobody leaving can abort it any more."""
    DONE = "done"
    """The results are there."""
    FAILED = "failed"
    """The error is there."""


class _Arrived(enum.Enum):
    """What an arrival did (:meth:`Rendezvous._arrive`)."""

    LAST = "last"
    """It completed the collective: it computes."""
    WAITING = "waiting"
    """Others are still to come: it waits, in its thread or deferred."""


@dataclasses.dataclass
class _Collective:
    meeting: Meeting
    """As its first participant named it."""
    count: int
    """How many participants meet here: the meeting's ``expected``, or every process of the group."""
    state: _State = _State.OPEN
    arrived: dict[int, Any] = dataclasses.field(default_factory=dict)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when DONE or FAILED."""
    results: Mapping[int, Any] | None = None
    error: ServiceError | None = None
    opened: float = dataclasses.field(default_factory=time.monotonic)
    report_at: float = math.inf
    """When the next ``event=collective_waiting`` line is due (monotonic seconds); inf: none."""
    report_gap: float = 0.0
    deferred: dict[int, Deferred] = dataclasses.field(default_factory=dict)
    """The participants that wait without a thread, by process id."""

    @property
    def label(self) -> str:
        return self.meeting.label

    def missing(self) -> list[int]:
        """Up to 11 participants not arrived yet, enough to name."""
        expected = self.meeting.expected
        if expected is None:
            return missing_ids(self.meeting.num_processes, self.arrived)
        return sorted(expected - set(self.arrived))[:11]

    def fresh_error(self) -> ServiceError:
        """A copy of the error: one exception object raised in several threads would keep every
        thread's frames (and their tensors) alive."""
        return self.error.copy()

    def raise_error(self) -> NoReturn:
        """Raises a fresh copy of the error."""
        error = self.fresh_error()
        try:
            raise error
        finally:
            del error  # this frame would hold its own traceback, and every caller's frame with it


class Rendezvous:
    """Matches contributions; thread-safe; every wait is bounded.

    Args:
        failed_ttl: seconds a failed collective's error is kept for late arrivals.
        max_failed: how many failed collectives are remembered at most.
        report_after: seconds a collective waits before its waiting is logged
            (then at gaps that double up to 30 s); 0: never.
        arriving: told the key of a collective a participant has just joined here without completing it:
            the express lane (:meth:`xreduced.express.Express.claim`) hands over what it holds of that
            collective; None: nobody is told.
        failing: told the name of a group :meth:`fail_group` failed: the express lane
            (:meth:`xreduced.express.Express.claim_group`) hands over what it holds of that group at once, for the
            full path to answer with the group's error; None: nobody is told.

    Example:
        >>> import threading
        >>> from xreduced.decode import CollectiveKey
        >>> r = Rendezvous()
        >>> meeting = Meeting(CollectiveKey("g", 0), "collective 0", num_processes=2)
        >>> out = {}
        >>> def member(pid):
        ...     out[pid] = r.run(meeting, Participant(pid, pid * 10, timeout=5.0),
        ...                      lambda c: {p: sum(c.values()) for p in c})
        >>> threads = [threading.Thread(target=member, args=(p,)) for p in (0, 1)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> sorted(out.items())
        [(0, 10), (1, 10)]
    """

    def __init__(self, failed_ttl: float = 60.0, max_failed: int = 4096, report_after: float = 10.0,
                 arriving: Callable[[CollectiveKey], None] | None = None,
                 failing: Callable[[str], None] | None = None):
        self._lock = threading.Lock()
        self._report_after = report_after
        self._open: dict[CollectiveKey, _Collective] = {}
        """The OPEN collectives, by key."""
        self._failed: collections.OrderedDict[CollectiveKey, tuple[float, ServiceError]] = (
            collections.OrderedDict()
        )
        self._failed_ttl = failed_ttl
        self._max_failed = max_failed
        self._arriving = arriving
        self._failing = failing

    def knows(self, key: CollectiveKey) -> bool:
        """Whether collective ``key`` is waiting here, or failed here recently (its error kept for late arrivals).

        Example:
            >>> from xreduced.decode import CollectiveKey
            >>> Rendezvous().knows(CollectiveKey("g", 1))
            False
        """
        with self._lock:
            return key in self._open or key in self._failed

    def pending(self) -> int:
        """Collectives waiting for participants now."""
        with self._lock:
            return len(self._open)

    def remembered_failures(self) -> int:
        """Failed collectives whose errors are still kept for late arrivals."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._failed)

    def run(self, meeting: Meeting, participant: Participant,
            compute: Callable[[dict[int, Any]], Mapping[int, Any]]) -> Any:
        """Contributes and waits (at most ``participant.timeout`` s); returns this process's share, or, for
        a participant with ``defer`` that is not the last, a :class:`~xreduced.deferred.Deferred` of it.

        Args:
            meeting: the collective, as this participant names it.
            participant: who arrives, with what.
            compute: runs once, in the last arrival's thread, on every
                contribution; returns each participant's share.

        Raises:
            InvalidArgument: participants disagree, or ``compute`` says so.
            DeadlineExceeded: not everyone arrived in time; names who is missing.
            Aborted: a participant's call ended before the collective completed.
        """
        c, arrived, defer = self._arrive(meeting, participant)
        if arrived is _Arrived.LAST:
            return self._complete(meeting, c, participant, compute)
        if self._arriving is not None:
            self._arriving(meeting.key)
        if participant.on_leave is not None:
            leave = lambda: self._leave(meeting, c, participant.process_id)  # noqa: E731
            if participant.on_leave(leave) is False:  # gRPC: the call had already ended
                leave()
        if defer is not None:
            return defer
        return self._await(meeting, c, participant)

    def _arrive(self, meeting: Meeting, participant: Participant) -> tuple[_Collective, _Arrived, Deferred | None]:
        """Records the contribution, under the lock: LAST when it completes the collective (which is then
        COMPLETE), else WAITING, with a deferred participant's :class:`~xreduced.deferred.Deferred`
        (:meth:`_deferred`), kept to be answered when the collective ends.

        Raises:
            ServiceError: the collective's remembered failure.
            InvalidArgument: the participant disagrees with those arrived (the collective fails for
                everyone), or is not one expected here (the others go on).
        """
        key, pid = meeting.key, participant.process_id
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if key in self._failed:
                raise self._failed[key][1].copy()
            c = self._open.get(key)
            opened = c is None
            if opened:
                c = self._opened(meeting, now)
            error = self._refusal(meeting, c, pid)  # raises, with nothing kept, for a process not expected here
            if opened:
                self._open[key] = c
            if error is None:
                c.arrived[pid] = participant.contribution
                if len(c.arrived) == c.count:
                    self._transition(c, _State.OPEN, _State.COMPLETE)
                    return c, _Arrived.LAST, None
                if not participant.defer:
                    return c, _Arrived.WAITING, None
                defer = c.deferred[pid] = self._deferred(c, participant.timeout, meeting.remember_failure, now)
                return c, _Arrived.WAITING, defer
            waiting = self._transition(c, _State.OPEN, _State.FAILED, error=error, remember=meeting.remember_failure)
        self._answer(c, waiting)  # the participants waiting without a thread learn it too
        c.raise_error()

    def _opened(self, meeting: Meeting, now: float) -> _Collective:
        """A new collective, its first waiting report due ``report_after`` s from now."""
        count = len(meeting.expected) if meeting.expected is not None else meeting.num_processes
        c = _Collective(meeting, count, opened=now)
        if self._report_after > 0:
            c.report_at = now + self._report_after
            c.report_gap = _next_gap(self._report_after, self._report_after)
        return c

    @staticmethod
    def _refusal(meeting: Meeting, c: _Collective, process_id: int) -> InvalidArgument | None:
        """What fails OPEN collective ``c`` for everyone if ``process_id`` arrives at it naming ``meeting``, or
        None; raises for a process not expected here (its arrival is refused, the collective goes on)."""
        first = c.meeting
        if meeting.num_processes != first.num_processes:
            return InvalidArgument(
                f"process {process_id} says num_processes={meeting.num_processes} but process {min(c.arrived)} "
                f"said num_processes={first.num_processes} for {meeting.label}")
        if first.expected is not None and process_id not in first.expected:
            raise InvalidArgument(
                f"process {process_id} is not one of this node's processes {sorted(first.expected)} for "
                f"{meeting.label}; each process must call its own node's daemon (the one it joined the group "
                "through)")
        if process_id in c.arrived:
            return InvalidArgument(
                f"process {process_id} contributed twice to {meeting.label}; each process_id must be used by one "
                "process: if two jobs share this daemon, give each job its own XREDUCE_GROUP")
        return None

    def _complete(self, meeting: Meeting, c: _Collective, participant: Participant,
                  compute: Callable[[dict[int, Any]], Mapping[int, Any]]) -> Any:
        """The last arrival's turn: computes every share in this thread, then the collective is DONE (or FAILED
        with the computation's error) and its deferred participants are answered, here."""
        try:
            results = compute(dict(c.arrived))
        except ServiceError as e:
            self._end(c, _State.COMPLETE, _State.FAILED, error=e, remember=meeting.remember_failure)
            raise
        except Exception as e:  # a bug: the waiters must not wait for nothing
            self._end(c, _State.COMPLETE, _State.FAILED, remember=meeting.remember_failure, error=Internal(
                f"{meeting.label} failed in the daemon ({type(e).__name__}); see its log"))
            raise
        self._end(c, _State.COMPLETE, _State.DONE, results=results)
        return results[participant.process_id]

    def _deferred(self, c: _Collective, timeout: float, remember: bool, now: float) -> Deferred:
        """A deferred participant's :class:`~xreduced.deferred.Deferred`, returned at once; the collective's
        end resolves it. Its waiting thread is told when to wake (``wake_at``): at the next report or the
        deadline, when the collective times out; once everyone has arrived, the reduction gets
        ``max(timeout, 1)`` s more."""
        end = now + timeout
        finish = end + max(timeout, 1.0)

        def wake_at() -> float:
            return min(end, c.report_at) if c.state is _State.OPEN else finish

        def wake(now: float) -> None:
            state = c.state
            if state is _State.OPEN:
                if now >= end:
                    self._time_out(c, timeout, remember)
                else:
                    self._report(c, now)
            elif state is _State.COMPLETE and now >= finish:
                defer.resolve(error=_unfinished(c, timeout))

        defer = Deferred(wake_at=wake_at, wake=wake)
        return defer

    def _await(self, meeting: Meeting, c: _Collective, participant: Participant) -> Any:
        """A waiting participant's turn: waits in its thread (at most its timeout) for the collective to end;
        its share, or the error raised."""
        timeout = participant.timeout
        if not self._wait(meeting, c, timeout):
            self._time_out(c, timeout, meeting.remember_failure)
            # Unless it has just timed out, everyone arrived and the last arrival is computing: its deadline
            # bounds the work.
            if not c.done.wait(max(timeout, 1.0)):
                raise _unfinished(c, timeout)
        if c.state is _State.FAILED:
            c.raise_error()
        return c.results[participant.process_id]

    def _wait(self, meeting: Meeting, c: _Collective, timeout: float) -> bool:
        """Waits at most ``timeout`` s for ``c`` to be done, waking when a report is due (and every
        ``ABANDON_POLL`` s to ask the meeting's ``abandoned``)."""
        abandoned = meeting.abandoned
        end = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wake = min(end, c.report_at, now + ABANDON_POLL if abandoned is not None else math.inf)
            if c.done.wait(max(wake - now, 0.0)):
                return True
            now = time.monotonic()
            if abandoned is not None and self._abandon(c, abandoned):
                return True
            if now >= end:
                return False
            self._report(c, now)

    def _abandon(self, c: _Collective, abandoned: Callable[[], ServiceError | None]) -> bool:
        """Asks ``abandoned`` (outside the lock): its error fails ``c`` for everyone, remembered, unless everyone
        has arrived; whether ``c`` has ended."""
        error = abandoned()
        if error is None:
            return False
        self._end(c, _State.OPEN, _State.FAILED, error=error)
        return c.done.is_set()

    def _time_out(self, c: _Collective, timeout: float, remember: bool) -> None:
        """A participant's wait ended at its deadline: an OPEN collective fails, naming who is missing."""
        self._end(c, _State.OPEN, _State.FAILED, error=lambda c: _timed_out(c, timeout), remember=remember)

    def _leave(self, meeting: Meeting, c: _Collective, process_id: int) -> None:
        """Participant ``process_id``'s call ended: an OPEN collective fails, naming it."""
        self._end(c, _State.OPEN, _State.FAILED, error=lambda c: _left(c, process_id),
                  remember=meeting.remember_failure)

    def _report(self, c: _Collective, now: float) -> None:
        """Logs who has arrived and who is missing, once per report time (the first waiter awake does)."""
        with self._lock:
            if now < c.report_at:
                return  # another waiter has reported
            if c.state is not _State.OPEN:
                c.report_at = math.inf
                return
            while c.report_at <= now:
                c.report_at += c.report_gap
                c.report_gap = _next_gap(self._report_after, c.report_gap)
            arrived = sorted(c.arrived)
            missing = c.missing()
        key = c.meeting.key
        log.warning("event=collective_waiting group=%s collective=%s waited_s=%.1f num_processes=%d arrived=%s "
                    "missing=%s", json.dumps(key.group), key.log_ident, now - c.opened, c.meeting.num_processes,
                    _log_ids(arrived, len(arrived)), _log_ids(missing, c.count - len(arrived)))

    def forget_failures(self, group: str) -> None:
        """Forgets the remembered failures of ``group``: a new job of that name starts afresh."""
        with self._lock:
            for key in [k for k in self._failed if k.group == group]:
                del self._failed[key]

    def fail(self, key: CollectiveKey, label: str, num_processes: int, error: ServiceError) -> None:
        """Fails collective ``key`` for everyone with ``error`` (e.g. one participant's
        request was invalid), whether or not anyone has arrived yet."""
        with self._lock:
            c = self._open.get(key) or self._opened(Meeting(key, label, num_processes), time.monotonic())
            waiting = self._transition(c, _State.OPEN, _State.FAILED, error=error)
        self._answer(c, waiting)

    def fail_group(self, group: str, error: ServiceError) -> None:
        """Fails every collective of ``group`` waiting now but its join, for everyone, with ``error`` (the group
        lost a process: they cannot complete). Each gets its own copy, named by its label.

        Example:
            >>> r = Rendezvous()
            >>> r.fail_group("g", Aborted("process 1 died"))  # nothing waits: nothing to fail
            >>> r.pending()
            0
        """
        with self._lock:
            ended = [(c, self._transition(c, _State.OPEN, _State.FAILED, error=lambda c: _aborted(c, error)))
                     for key, c in list(self._open.items()) if key.group == group and not key.is_join]
        for c, waiting in ended:
            self._answer(c, waiting)
        if self._failing is not None:
            self._failing(group)

    def _end(self, c: _Collective, before: _State, after: _State, *, results: Mapping[int, Any] | None = None,
             error: ServiceError | Callable[[_Collective], ServiceError] | None = None, remember: bool = True) -> None:
        """:meth:`_transition` under the lock, then, outside it, the deferred participants answered."""
        with self._lock:
            waiting = self._transition(c, before, after, results=results, error=error, remember=remember)
        self._answer(c, waiting)

    def _transition(self, c: _Collective, before: _State, after: _State, *,
                    results: Mapping[int, Any] | None = None,
                    error: ServiceError | Callable[[_Collective], ServiceError] | None = None,
                    remember: bool = True) -> dict[int, Deferred] | None:
        """With the lock held, the one place a collective's state changes: ``c`` goes from ``before`` to
        ``after``; None, with nothing changed, if it is no longer ``before`` (it completed, or ended, meanwhile).

        COMPLETE: nobody can join it or abort it any more. DONE (with ``results``) and FAILED (with ``error``,
        or ``error(c)`` made now, for a message that names who is missing): its contributions are dropped, a
        failure is kept for late arrivals (with ``remember``), and its event is set, which wakes the waiting
        threads. Returns the deferred participants it had, to answer with :meth:`_answer` once the lock is
        released (never call out while holding it).
        """
        if c.state is not before:
            return None
        c.state = after
        key = c.meeting.key
        if self._open.get(key) is c:
            del self._open[key]
        if after is _State.COMPLETE:
            return {}
        if after is _State.FAILED:
            c.error = error(c) if callable(error) else error
            if remember:
                self._failed[key] = (time.monotonic() + self._failed_ttl, c.error.copy())  # without its traceback
                self._failed.move_to_end(key)
                while len(self._failed) > self._max_failed:
                    self._failed.popitem(last=False)
        else:
            c.results = results
        c.arrived.clear()
        c.done.set()
        waiting, c.deferred = c.deferred, {}
        return waiting

    @staticmethod
    def _answer(c: _Collective, waiting: dict[int, Deferred] | None) -> None:
        """Resolves the deferred participants :meth:`_transition` took from ``c``, each with its share or a
        copy of the error, in this thread."""
        if not waiting:
            return
        for pid, defer in waiting.items():
            if c.state is _State.FAILED:
                defer.resolve(error=c.fresh_error())
            else:
                defer.resolve(c.results[pid])

    def _expire(self, now: float) -> None:
        while self._failed:
            key, (expires, _) = next(iter(self._failed.items()))
            if expires > now:
                break
            del self._failed[key]
