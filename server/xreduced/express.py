"""The express lane: small collectives of known shapes, matched and reduced by the local lane's thread alone.

A 4-byte all-reduce of two processes over the local lane (:mod:`xreduced.lane`)
is nearly all Python: through the full path each call crosses the call
pipeline, the service, the rendezvous and a deferred reply, some ten thousand
bytecode instructions for the pair. Most of that work decides things that
cannot change between two calls of one shape. So a call the lane's thread
would serve itself (tensors in the message, a group on this node) whose
request shape (:func:`xreduced.prepared.shape_of`) the service has validated
before is held here instead, keyed as the rendezvous keys it; when every
process of the collective has arrived, the service reduces it at once
(:meth:`~xreduced.service.CrossDeviceOpsService.express`: the same engine, the
same plan, the same reply bytes) and each caller gets its reply.

The daemon stays the one place that matches and reduces, and an express call
is still admitted in the in-flight budget, counted, logged and drained like
any call (:meth:`~xreduced.pipeline.CallPipeline.begin_express`). Whatever is
not the plain case goes to the full path, which answers it as it always has
(*handing over*: each held call is served by the lane as if it had just come,
with what is left of its timeout):

- a collective not complete within ``hold`` seconds (``--lane-express-hold``, 0.5 s): the
  full path then waits for the others, logs a long wait, and times out naming
  who is missing;
- a process that arrives twice, or calls another method than the others, or
  says another ``num_processes``, or with a shape not validated before, or a
  collective the rendezvous already knows (a participant waits there, or it
  failed and late arrivals get its error);
- a participant of the collective that comes by another way (gRPC, or the
  lane's full path): the rendezvous tells the express lane (its
  ``arriving`` hook), which hands the collective over;
- a group that fails (one of its processes ended, or left while the others
  use it): the rendezvous tells the express lane (its ``failing`` hook), which
  hands over every collective of the group it holds, for the full path to
  answer with the group's error at once;
- a caller that hangs up while held: the collective is handed over with that
  caller's call, which the full path sees gone, so it fails for everyone as a
  cancelled call does;
- a reduction that raises (bytes that do not fit their shape, processes that
  disagree): nothing has changed, and the full path answers each call.

Each hand-over is logged at debug level with its reason::

    event=express_handed_over group="train" collective=seq:3 processes=0 reason='not complete within the hold'

The held calls are at most one per lane connection, each a small request, so
memory stays bounded by the lane's connection limit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from xreduce.wire.contract import METHOD_PREFIX

from xreduced.decode import CollectiveKey

log = logging.getLogger("xreduced.express")


@dataclasses.dataclass(eq=False)
class Arrival:
    """A call the express lane holds: whose, what it asks, and its place in the pipeline.

    Example:
        >>> key = CollectiveKey("g", 3)
        >>> Arrival("connection", "Reduce", "incoming", None, 0.0, b"shape", "prepared", 1, key)
        Arrival(method='Reduce', process_id=1, key=CollectiveKey(group='g', sequence=3, name=None))
    """

    connection: Any
    method: str
    incoming: Any
    """The request as the pipeline's deserializer left it (``.size``, ``.message``)."""
    timeout: float | None
    started: float
    shape: bytes
    prepared: Any
    process_id: int
    key: CollectiveKey
    call: Any = None
    """The pipeline's call, in flight (:meth:`~xreduced.pipeline.CallPipeline.begin_express`)."""

    def __repr__(self) -> str:
        return f"Arrival(method={self.method!r}, process_id={self.process_id}, key={self.key!r})"

    def remaining(self, now: float) -> float | None:
        """What is left of the caller's timeout (None without one).

        Example:
            >>> Arrival(None, "Reduce", None, 2.0, 10.0, b"", None, 0, CollectiveKey("g", 0)).remaining(10.5)
            1.5
        """
        return None if self.timeout is None else max(self.timeout - (now - self.started), 0.0)


class Express:
    """The calls held until their collective is complete, and what is handed over.

    Args:
        known: the :class:`~xreduced.prepared.Prepared` of a validated shape, or None (``PreparedCalls.get``).
        reduce: the service's :meth:`~xreduced.service.CrossDeviceOpsService.express`.
        busy: whether the rendezvous knows a collective (``Rendezvous.knows``), or the group is one across
            nodes: then the full path serves it.
        begin, end: the pipeline's :meth:`~xreduced.pipeline.CallPipeline.begin_express` and ``end_express``.
        hold: seconds a call waits here for the rest of its collective (``--lane-express-hold``).
        wake: wakes the lane's thread (from any thread) to serve the calls :meth:`claim` handed over
            (:meth:`xreduced.lane.Wakeup.wake`).

    Example (the lane's thread calls it; see tests/unit/test_express_matching.py):
        >>> express = Express(known=lambda shape: None, reduce=None, busy=lambda key, group: False,
        ...                   begin=None, end=None)
        >>> express.wake_at(), express.held()
        (inf, 0)
    """

    def __init__(self, known: Callable[[bytes], Any], reduce: Callable[..., dict[int, bytes]],
                 busy: Callable[[CollectiveKey, str], bool], begin: Callable[..., Any],
                 end: Callable[[Any, int | None], None], hold: float = 0.5,
                 wake: Callable[[], None] = lambda: None):
        self._known, self._reduce, self._busy = known, reduce, busy
        self._begin, self._end = begin, end
        self.hold = hold
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: dict[CollectiveKey, dict[int, Arrival]] = {}
        """The collectives being matched here, each by process id, in arrival order."""
        self._of: dict[Any, Arrival] = {}
        """The call each connection has held here."""
        self._handed: list[Arrival] = []
        """Calls handed over by another thread, for the lane's thread to serve."""

    def held(self) -> int:
        """Calls held now."""
        with self._lock:
            return len(self._of)

    def collectives(self) -> int:
        """Collectives with a call held now."""
        with self._lock:
            return len(self._pending)

    def offer(self, connection, method: str, incoming, timeout: float | None, now: float, shape: bytes,
              held: Any = None) -> tuple[list[tuple[Arrival, bytes]], list[Arrival]] | None:
        """Takes a call of the lane's thread, one ``xreduced.lane.classify`` says may go express (a collective
        of several processes, with its request's ``shape``), if it may: None when it may not (the full path
        serves it), else (the replies now due, each with its call; the calls to hand over to the full path, this
        one among them or not). The lane sends those replies with :meth:`answered` and serves the handed calls.
        ``held`` (a :class:`~xreduced.repeated.Held`, ``shape`` its key) offers it as a group's repeat.
        """
        message = incoming.message
        spec = message.collective
        prepared = held if held is not None else self._known(shape)
        if prepared is None:
            return None
        key = CollectiveKey.of(spec)
        if self._busy(key, spec.group):
            return None
        call = self._begin(METHOD_PREFIX + method, message, incoming.size, shape, key)
        if call is None:
            return None
        arrival = Arrival(connection, method, incoming, timeout, now, shape, prepared, spec.process_id, key, call)
        refused = None
        with self._lock:
            waiting = self._pending.setdefault(key, {})
            first = next(iter(waiting.values()), None)
            if first is not None and first.incoming.message.collective.num_processes != spec.num_processes:
                refused = "the processes disagree on num_processes"
            elif spec.process_id in waiting:  # twice: the full path says so
                refused = "a process arrived twice"
            else:
                waiting[spec.process_id] = arrival
                self._of[connection] = arrival
                if len(waiting) < spec.num_processes:
                    return [], []
            complete = self._release(key)
        if refused is not None:  # handed over with the lock released: the pipeline takes locks of its own
            return [], self._hand([*complete, arrival], refused)
        if any(a.method != method for a in complete):  # Reduce and BatchReduce: the full path names who called what
            return [], self._hand(complete, "the processes called different methods")
        try:
            replies = self._reduce(method, key.label, {
                a.process_id: (a.incoming.message, a.prepared, a.shape) for a in complete})
        except Exception as e:  # noqa: BLE001 -- nothing changed: the full path answers each call, naming the error
            return [], self._hand(complete, f"the reduction raised {type(e).__name__}")
        return [(a, replies[a.process_id]) for a in complete], []

    def answered(self, arrival: Arrival, bytes_out: int) -> None:
        """The reply to ``arrival`` is sent: its call ends (counted and logged)."""
        arrival.incoming.message = None
        self._end(arrival.call, bytes_out)

    def claim(self, key: CollectiveKey) -> None:
        """A participant of collective ``key`` has joined it in the rendezvous (from any thread): the calls held
        for it are handed over, and the lane's thread woken to serve them (:meth:`handed_over`)."""
        self._claim(lambda k: k == key, "a participant came by the full path")

    def claim_group(self, group: str) -> None:
        """Group ``group`` failed (one of its processes ended: :meth:`~xreduced.rendezvous.Rendezvous.fail_group`,
        from any thread): every collective of it held here is handed over at once and the lane's thread woken, so
        that the full path answers the callers with the group's error now, not after the hold."""
        self._claim(lambda k: k.group == group, "the group failed")

    def _claim(self, which: Callable[[CollectiveKey], bool], reason: str) -> None:
        """Hands over the held collectives whose keys ``which`` picks, for the lane's thread (woken if any)."""
        with self._lock:
            keys = [key for key in self._pending if which(key)]
            released = [a for key in keys for a in self._release(key)]
        if not released:
            return
        handed = self._hand(released, reason)
        with self._lock:
            self._handed.extend(handed)
        self._wake()

    def handed_over(self) -> list[Arrival]:
        """The calls :meth:`claim` handed over since last asked, for the full path."""
        with self._lock:
            handed, self._handed = self._handed, []
        return handed

    def hung_up(self, connection) -> list[Arrival]:
        """``connection``'s caller hung up: its collective, with its own call, is handed over (the full path sees
        that call gone, and the collective fails for everyone as it would have)."""
        with self._lock:
            arrival = self._of.get(connection)
            if arrival is None:
                return []
            released = self._release(arrival.key)
        return self._hand(released, f"process {arrival.process_id} hung up")

    def wake_at(self) -> float:
        """When the first held collective is due to be handed over (monotonic seconds), or inf."""
        if not self._pending:  # the lane's thread alone adds to it: empty stays empty until it offers
            return math.inf
        with self._lock:
            if not self._pending:
                return math.inf
            return min(self._due(a) for waiting in self._pending.values() for a in waiting.values())

    def due(self, now: float) -> list[Arrival]:
        """The collectives held past ``hold`` seconds, or past a caller's timeout, handed over."""
        if not self._pending:
            return []
        with self._lock:
            keys = [key for key, waiting in self._pending.items() if any(self._due(a) <= now for a in waiting.values())]
            released = [a for key in keys for a in self._release(key)]
        return self._hand(released, "not complete within the hold")

    def _due(self, arrival: Arrival) -> float:
        end = arrival.started + self.hold
        return end if arrival.timeout is None else min(end, arrival.started + arrival.timeout)

    def _release(self, key: CollectiveKey) -> list[Arrival]:
        """With the lock held: collective ``key``'s calls, no longer held."""
        arrivals = list(self._pending.pop(key, {}).values())
        for a in arrivals:
            if self._of.get(a.connection) is a:
                del self._of[a.connection]
        return arrivals

    def _hand(self, arrivals: list[Arrival], reason: str) -> list[Arrival]:
        """``arrivals`` leave the express lane (logged at debug level with ``reason``): the pipeline forgets
        their calls (the full path makes its own). Never with the lock held: the pipeline takes the admission's
        locks and its own."""
        for a in arrivals:
            self._end(a.call, None)
            a.call = None
        if arrivals and log.isEnabledFor(logging.DEBUG):
            log.debug("event=express_handed_over group=%s collective=%s processes=%s reason=%r",
                      json.dumps(arrivals[0].key.group), arrivals[0].key, ",".join(str(a.process_id) for a in arrivals),
                      reason)
        return arrivals
