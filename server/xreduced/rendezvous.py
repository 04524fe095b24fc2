"""The rendezvous: matches the contributions of several processes to one collective.

A collective is keyed by (group, id). Each process's call brings its
contribution and waits, bounded, until every process of the group has
arrived; the last to arrive runs the computation once and every waiter gets
its own share of the result, or the same error. A collective that fails (a
timeout, a disagreement, a participant leaving) fails for everyone; late
arrivals to it get the same error for a while (a bounded, expiring record),
and the group's next collective starts afresh.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from xreduced.errors import Aborted, DeadlineExceeded, Internal, InvalidArgument, ServiceError


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


def _ids(ids: list[int]) -> str:
    """``[1, 2]``, or the first ten and how many more."""
    return str(ids) if len(ids) <= 10 else f"{ids[:10]} and more"


@dataclasses.dataclass
class _Collective:
    label: str
    num_processes: int
    arrived: dict[int, Any] = dataclasses.field(default_factory=dict)
    complete: bool = False  # everyone arrived: nobody leaving can abort it any more
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    results: Mapping[int, Any] | None = None
    error: ServiceError | None = None

    def raise_error(self) -> None:
        """Raises a fresh copy of the error: one exception object raised in several
        threads would keep every thread's frames (and their tensors) alive."""
        raise type(self.error)(str(self.error))


class Rendezvous:
    """Matches contributions; thread-safe; every wait is bounded.

    Args:
        failed_ttl: seconds a failed collective's error is kept for late arrivals.
        max_failed: how many failed collectives are remembered at most.

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

    def __init__(self, failed_ttl: float = 60.0, max_failed: int = 4096):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], _Collective] = {}
        self._failed: collections.OrderedDict[tuple[str, str], tuple[float, type[ServiceError], str]] = (
            collections.OrderedDict()
        )
        self._failed_ttl = failed_ttl
        self._max_failed = max_failed

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

        Raises:
            InvalidArgument: participants disagree, or ``compute`` says so.
            DeadlineExceeded: not everyone arrived in time; names who is missing.
            Aborted: a participant's call ended before the collective completed.
        """
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if key in self._failed:
                _, kind, message = self._failed[key]
                raise kind(message)
            c = self._open.get(key)
            if c is None:
                c = self._open[key] = _Collective(label, num_processes)
            if num_processes != c.num_processes:
                first = min(c.arrived)
                self._fail(key, c, InvalidArgument(
                    f"process {process_id} says num_processes={num_processes} but process {first} said "
                    f"num_processes={c.num_processes} for {label}"), remember_failure)
                c.raise_error()
            if process_id in c.arrived:
                self._fail(key, c, InvalidArgument(
                    f"process {process_id} contributed twice to {label}; each process_id must be used by "
                    "one process: if two jobs share this daemon, give each job its own "
                    "XREDUCE_GROUP"), remember_failure)
                c.raise_error()
            c.arrived[process_id] = contribution
            last = len(c.arrived) == num_processes
            if last:
                c.complete = True
                del self._open[key]
        if last:
            try:
                results = compute(dict(c.arrived))
            except ServiceError as e:
                with self._lock:
                    self._fail(key, c, e, remember_failure)
                raise
            except Exception as e:  # a bug: the waiters must not wait for nothing
                with self._lock:
                    self._fail(key, c, Internal(f"{label} failed in the daemon ({type(e).__name__}); see its log"),
                               remember_failure)
                raise
            c.results = results
            c.arrived.clear()
            c.done.set()
            return results[process_id]
        if on_leave is not None:
            leave = lambda: self._leave(key, c, process_id, remember_failure)  # noqa: E731
            if on_leave(leave) is False:  # gRPC: the call had already ended
                leave()
        if not c.done.wait(timeout):
            with self._lock:
                if not c.done.is_set() and not c.complete:
                    self._fail(key, c, DeadlineExceeded(
                        f"{label} timed out after {timeout:.3g}s waiting for process(es) "
                        f"{_ids(missing_ids(num_processes, c.arrived))}; arrived: {_ids(sorted(c.arrived))}"),
                        remember_failure)
            # Everyone arrived and the last arrival is computing: its deadline bounds the work.
            if c.complete and not c.done.wait(max(timeout, 1.0)):
                raise DeadlineExceeded(f"{label}: every process arrived but the reduction did not finish "
                                       f"within {max(timeout, 1.0):.3g}s more")
        if c.error is not None:
            c.raise_error()
        return c.results[process_id]

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

    def _leave(self, key, c: _Collective, process_id: int, remember: bool) -> None:
        with self._lock:
            if not c.done.is_set() and not c.complete:
                self._fail(key, c, Aborted(
                    f"{c.label} was aborted: process {process_id} left (its call ended or its process "
                    "died) before every process arrived"), remember)

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
