"""The rendezvous: matches the contributions of several processes to one collective.

A collective is keyed by (group, id). Each process's call brings its
contribution and waits, bounded, until every process of the group has
arrived; the last to arrive runs the computation once and every waiter gets
its own share of the result, or the same error. A collective that fails (a
timeout, a disagreement, a participant leaving) fails for everyone; late
arrivals to it get the same error for a while (a bounded, expiring record),
and the group's next collective starts afresh.

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
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from xreduced.deferred import Deferred
from xreduced.errors import Aborted, DeadlineExceeded, Internal, InvalidArgument, ServiceError

log = logging.getLogger("xreduced.rendezvous")

ABANDON_POLL = 0.25
"""Seconds between two asks of a waiting collective's ``abandoned`` (how soon a failed epoch is noticed)."""

JOIN = "name:join"
"""The id of a group's join (``JoinGroup``), which a new membership starts with."""

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


def _ident(key: tuple[str, str]) -> str:
    """How the log names a collective within its group: its sequence number or its quoted name."""
    kind, _, ident = key[1].partition(":")
    return ident if kind == "seq" else json.dumps(ident)


@dataclasses.dataclass
class _Collective:
    label: str
    num_processes: int
    arrived: dict[int, Any] = dataclasses.field(default_factory=dict)
    complete: bool = False  # everyone arrived: nobody leaving can abort it any more
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    results: Mapping[int, Any] | None = None
    error: ServiceError | None = None
    opened: float = dataclasses.field(default_factory=time.monotonic)
    report_at: float = math.inf
    """When the next ``event=collective_waiting`` line is due (monotonic seconds); inf: none."""
    report_gap: float = 0.0
    expected: frozenset[int] | None = None
    """Who meets here, when not every process of the group."""
    deferred: dict[int, Deferred] = dataclasses.field(default_factory=dict)
    """The participants that wait without a thread, by process id."""

    @property
    def count(self) -> int:
        """How many participants meet here."""
        return len(self.expected) if self.expected is not None else self.num_processes

    def missing(self) -> list[int]:
        """Up to 11 participants not arrived yet, enough to name."""
        if self.expected is None:
            return missing_ids(self.num_processes, self.arrived)
        return sorted(self.expected - set(self.arrived))[:11]

    def fresh_error(self) -> ServiceError:
        """A copy of the error: one exception object raised in several threads would keep every
        thread's frames (and their tensors) alive."""
        error = type(self.error)(str(self.error))
        error.process_ids = getattr(self.error, "process_ids", ())
        return error

    def raise_error(self) -> None:
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

    Example:
        >>> import threading
        >>> r = Rendezvous()
        >>> out = {}
        >>> def member(pid):
        ...     out[pid] = r.run(("g", "0"), "collective 0", 2, pid, pid * 10, 5.0,
        ...                      lambda c: {p: sum(c.values()) for p in c})
        >>> threads = [threading.Thread(target=member, args=(p,)) for p in (0, 1)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> sorted(out.items())
        [(0, 10), (1, 10)]
    """

    def __init__(self, failed_ttl: float = 60.0, max_failed: int = 4096, report_after: float = 10.0):
        self._lock = threading.Lock()
        self._report_after = report_after
        self._open: dict[tuple[str, str], _Collective] = {}
        self._failed: collections.OrderedDict[tuple[str, str], tuple[float, type[ServiceError], str]] = (
            collections.OrderedDict()
        )
        self._failed_ttl = failed_ttl
        self._max_failed = max_failed
        self.arriving: Callable[[tuple[str, str]], None] | None = None
        """Told the key of a collective a participant has just joined here without completing it: the
        express lane (:mod:`xreduced.express`) hands over what it holds of that collective."""

    def knows(self, key: tuple[str, str]) -> bool:
        """Whether collective ``key`` is waiting here, or failed here recently (its error kept for late arrivals).

        Example:
            >>> Rendezvous().knows(("g", "seq:1"))
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

    def run(
        self,
        key: tuple[str, str],
        label: str,
        num_processes: int,
        process_id: int,
        contribution: Any,
        timeout: float,
        compute: Callable[[dict[int, Any]], Mapping[int, Any]],
        on_leave: Callable[[Callable[[], None]], Any] | None = None,
        remember_failure: bool = True,
        expected: frozenset[int] | None = None,
        abandoned: Callable[[], ServiceError | None] | None = None,
        defer: Deferred | None = None,
    ) -> Any:
        """Contributes and waits (at most ``timeout`` s); returns this process's share.

        Args:
            key: identifies the collective.
            label: names it in messages, e.g. ``collective 17 in group "train"``.
            num_processes: participants; every one must say the same.
            process_id: this participant.
            contribution: what this participant brings.
            timeout: seconds to wait for the others.
            compute: runs once, in the last arrival's thread, on every
                contribution; returns each participant's share.
            on_leave: registers a function to call if this participant's call
                ends before the collective completes (gRPC's ``add_callback``).
            remember_failure: keep a failure for late arrivals.
            expected: the participants that meet here, when not all of
                ``range(num_processes)`` (a group across nodes meets node by node).
            abandoned: asked while waiting (every ``ABANDON_POLL`` s): an error
                that ends the collective for everyone (the group's epoch failed),
                or None.
            defer: when given, a participant that is not the last does not wait:
                ``defer`` is returned at once, and resolved later with this
                process's share or the error (see the module). Not with ``abandoned``.

        Raises:
            InvalidArgument: participants disagree, or ``compute`` says so.
            DeadlineExceeded: not everyone arrived in time; names who is missing.
            Aborted: a participant's call ended before the collective completed.
        """
        failed: _Collective | None = None
        try:
            with self._lock:
                now = time.monotonic()
                self._expire(now)
                if key in self._failed:
                    _, kind, message = self._failed[key]
                    raise kind(message)
                c = self._open.get(key)
                if c is None:
                    c = self._open[key] = _Collective(label, num_processes, opened=now, expected=expected)
                    if self._report_after > 0:
                        c.report_at = now + self._report_after
                        c.report_gap = _next_gap(self._report_after, self._report_after)
                if num_processes != c.num_processes:
                    first = min(c.arrived)
                    failed = c
                    self._fail(key, c, InvalidArgument(
                        f"process {process_id} says num_processes={num_processes} but process {first} said "
                        f"num_processes={c.num_processes} for {label}"), remember_failure)
                    c.raise_error()
                if c.expected is not None and process_id not in c.expected:
                    raise InvalidArgument(
                        f"process {process_id} is not one of this node's processes {sorted(c.expected)} for "
                        f"{label}; each process must call its own node's daemon (the one it joined the group "
                        "through)")
                if process_id in c.arrived:
                    failed = c
                    self._fail(key, c, InvalidArgument(
                        f"process {process_id} contributed twice to {label}; each process_id must be used by "
                        "one process: if two jobs share this daemon, give each job its own "
                        "XREDUCE_GROUP"), remember_failure)
                    c.raise_error()
                c.arrived[process_id] = contribution
                last = len(c.arrived) == c.count
                if last:
                    c.complete = True
                    del self._open[key]
                elif defer is not None:
                    c.deferred[process_id] = defer
        finally:
            if failed is not None:
                self._flush(failed)  # the participants waiting without a thread learn it too
        if not last and self.arriving is not None:
            self.arriving(key)
        if last:
            try:
                results = compute(dict(c.arrived))
            except ServiceError as e:
                with self._lock:
                    self._fail(key, c, e, remember_failure)
                self._flush(c)
                raise
            except Exception as e:  # a bug: the waiters must not wait for nothing
                with self._lock:
                    self._fail(key, c, Internal(f"{label} failed in the daemon ({type(e).__name__}); see its log"),
                               remember_failure)
                self._flush(c)
                raise
            c.results = results
            c.arrived.clear()
            c.done.set()
            self._flush(c)
            return results[process_id]
        if on_leave is not None:
            leave = lambda: self._leave(key, c, process_id, remember_failure)  # noqa: E731
            if on_leave(leave) is False:  # gRPC: the call had already ended
                leave()
        if defer is not None:
            self._hook(defer, key, c, timeout, remember_failure)
            return defer
        if not self._wait(key, c, timeout, abandoned):
            self._time_out(key, c, timeout, remember_failure)
            # Everyone arrived and the last arrival is computing: its deadline bounds the work.
            if c.complete and not c.done.wait(max(timeout, 1.0)):
                raise _unfinished(c, timeout)
        if c.error is not None:
            c.raise_error()
        return c.results[process_id]

    def _time_out(self, key, c: _Collective, timeout: float, remember: bool) -> None:
        """A participant's wait ended at its deadline: the collective fails, naming who is missing (unless
        everyone has arrived meanwhile)."""
        with self._lock:
            if not c.done.is_set() and not c.complete:
                error = DeadlineExceeded(f"{c.label} timed out after {timeout:.3g}s waiting for process(es) "
                                         f"{_ids(c.missing())}; arrived: {_ids(sorted(c.arrived))}")
                error.process_ids = tuple(c.missing())
                self._fail(key, c, error, remember)
        self._flush(c)

    def _hook(self, defer: Deferred, key, c: _Collective, timeout: float, remember: bool) -> None:
        """What ``defer``'s waiting thread is told: wake at the next report or the deadline; at the deadline,
        the collective times out, and once everyone has arrived, the reduction gets ``max(timeout, 1)`` s more."""
        end = time.monotonic() + timeout
        finish = end + max(timeout, 1.0)

        def wake_at() -> float:
            return finish if c.complete else min(end, c.report_at)

        def wake(now: float) -> None:
            if c.complete:
                if now >= finish and not c.done.is_set():
                    defer.resolve(error=_unfinished(c, timeout))
            elif now >= end:
                self._time_out(key, c, timeout, remember)
            else:
                self._report(key, c, now)

        defer.wake_at_hook, defer.wake_hook = wake_at, wake
        if c.done.is_set():  # it ended before the hooks were set: nobody else resolves it
            self._flush(c)

    def _flush(self, c: _Collective) -> None:
        """Once ``c`` is done: resolves its deferred participants with their shares or the error, here."""
        if not c.done.is_set():
            return
        with self._lock:
            waiting, c.deferred = c.deferred, {}
        for pid, defer in waiting.items():
            if c.error is not None:
                defer.resolve(error=c.fresh_error())
            else:
                defer.resolve(c.results[pid])

    def _wait(self, key: tuple[str, str], c: _Collective, timeout: float,
              abandoned: Callable[[], ServiceError | None] | None = None) -> bool:
        """Waits at most ``timeout`` s for ``c`` to be done, waking when a report is due (and every
        ``ABANDON_POLL`` s to ask ``abandoned``)."""
        end = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wake = min(end, c.report_at, now + ABANDON_POLL if abandoned is not None else math.inf)
            if c.done.wait(max(wake - now, 0.0)):
                return True
            now = time.monotonic()
            error = abandoned() if abandoned is not None else None
            if error is not None:
                with self._lock:
                    if not c.complete:
                        self._fail(key, c, error, True)
                self._flush(c)
                if c.done.is_set():
                    return True
            if now >= end:
                return False
            self._report(key, c, now)

    def _report(self, key: tuple[str, str], c: _Collective, now: float) -> None:
        """Logs who has arrived and who is missing, once per report time (the first waiter awake does)."""
        with self._lock:
            if now < c.report_at:
                return  # another waiter has reported
            if c.done.is_set() or c.complete:
                c.report_at = math.inf
                return
            while c.report_at <= now:
                c.report_at += c.report_gap
                c.report_gap = _next_gap(self._report_after, c.report_gap)
            arrived = sorted(c.arrived)
            missing = c.missing()
        log.warning("event=collective_waiting group=%s collective=%s waited_s=%.1f num_processes=%d arrived=%s "
                    "missing=%s", json.dumps(key[0]), _ident(key), now - c.opened, c.num_processes,
                    _log_ids(arrived, len(arrived)), _log_ids(missing, c.count - len(arrived)))

    def forget_failures(self, group: str) -> None:
        """Forgets the remembered failures of ``group``: a new job of that name starts afresh."""
        with self._lock:
            for key in [k for k in self._failed if k[0] == group]:
                del self._failed[key]

    def fail(self, key: tuple[str, str], label: str, num_processes: int, error: ServiceError) -> None:
        """Fails collective ``key`` for everyone with ``error`` (e.g. one participant's
        request was invalid), whether or not anyone has arrived yet."""
        with self._lock:
            c = self._open.get(key) or _Collective(label, num_processes)
            self._open.setdefault(key, c)
            self._fail(key, c, error, True)
        self._flush(c)

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
            waiting = [(key, c) for key, c in self._open.items() if key[0] == group and key[1] != JOIN]
            for key, c in waiting:
                copy = type(error)(f"{c.label} was aborted: {error}")
                copy.process_ids = getattr(error, "process_ids", ())
                self._fail(key, c, copy, True)
        for _, c in waiting:
            self._flush(c)

    def _leave(self, key, c: _Collective, process_id: int, remember: bool) -> None:
        with self._lock:
            if not c.done.is_set() and not c.complete:
                error = Aborted(f"{c.label} was aborted: process {process_id} left (its call ended or its process "
                                "died) before every process arrived")
                error.process_ids = (process_id,)
                self._fail(key, c, error, remember)
        self._flush(c)

    def _fail(self, key, c: _Collective, error: ServiceError, remember: bool) -> None:
        """With the lock held: fail ``c`` for everyone and forget its contributions."""
        if c.done.is_set():
            return
        c.error = error
        c.arrived.clear()
        if self._open.get(key) is c:
            del self._open[key]
        if remember:
            self._failed[key] = (time.monotonic() + self._failed_ttl, type(error), str(error))
            self._failed.move_to_end(key)
            while len(self._failed) > self._max_failed:
                self._failed.popitem(last=False)
        c.done.set()

    def _expire(self, now: float) -> None:
        while self._failed:
            key, (expires, _, _) = next(iter(self._failed.items()))
            if expires > now:
                break
            del self._failed[key]
