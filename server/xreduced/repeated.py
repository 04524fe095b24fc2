"""Repeated calls: a process that sends a request again, byte for byte, its tensors in shared memory.

A training step's all-reduce through shared memory sends the same request every
step: the same regions, offsets, dtypes, shapes, devices, destinations and
options; only the bytes in the regions change. Through the full path each such
call is parsed, validated field by field, its regions looked up and its output
laid out again, some thousands of bytecode instructions for a reduction whose
arithmetic takes a few microseconds.

So when the local lane serves a *solo* call (no collective: one process's
devices) whose tensors and output are all host shared-memory regions of the
caller's session, the service keeps what validating it found, a :class:`Repeat`:
each tensor's region, offset, dtype and shape, the output's slots, the op and
options. The lane files it under the request's bytes for that connection, with
the reply the full path sent. When the same bytes come again, the lane serves
them with :meth:`Repeat.run`: the regions are pinned and checked as a call
checks them, the engine reduces into the same output slots, and the kept reply
(the same bytes the full path would encode: it names only those slots) goes
back. The call is still admitted in the in-flight budget, counted, timed and
logged like any call, and drained on shutdown (:meth:`xreduced.pipeline.CallPipeline.begin_repeat`).

Nothing is trusted that could have changed: a region of the request that was
unregistered, registered again, or that belongs to a session that ended makes
the kept repeat *stale*, and the call takes the full path, which answers it as
it always has (with its error, if it is one). A repeat holds no region: only
their names and weak references to the regions it was validated against.

Example:
    >>> import numpy as np
    >>> piece = Piece("xrs-1", 0, 8, np.dtype(np.float32), (2,))
    >>> piece.nbytes, piece.shape
    (8, (2,))
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from xreduce.wire import codec

from xreduced.deadline import Deadline
from xreduced.decode import Slot, timeout_seconds
from xreduced.engine import Engine, Value

REPEATS_KEPT = 8
"""Requests a lane connection keeps for repeats; the least recently used is forgotten first."""

REPEAT_MAX_REQUEST_BYTES = 16 << 10
"""A request longer than this (a batch of very many tensors) is not kept: a connection's repeats stay small."""


class Stale(Exception):
    """A kept repeat no longer fits the session's regions: the call takes the full path."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor in a region: where, and as what."""

    region: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Pair:
    devices: tuple[int, ...]
    inputs: tuple[Piece, ...]
    field: str
    parts: tuple
    destinations: tuple[int, ...]
    outputs: tuple[tuple[int, Piece], ...]

    @property
    def places(self) -> tuple[Piece, ...]:
        """The outputs' places, each once (destinations of one place: ``output_one_copy``)."""
        return tuple(dict.fromkeys(o for _, o in self.outputs))


@dataclasses.dataclass(frozen=True)
class Repeat:
    """What the service found validating a solo region request, kept to serve its repeats.

    Made by :func:`kept` from a call the full path served; run by :meth:`run`."""

    kind: str
    """``Reduce`` or ``BatchReduce``."""
    op: str
    num_packs: int
    algorithm: str
    reduce_to: int | None
    timeout: float | None
    """The request's own ``timeout`` in seconds, or None."""
    dest_fields: tuple[str, ...]
    pairs: tuple[_Pair, ...]
    regions: tuple[tuple[str, Any], ...]
    """Each region the request names, with a weak reference to the region it named when validated."""
    replica_bytes: int
    held: int
    """The call's working set in the in-flight budget, as the full path admitted it."""
    region_bytes: int = 0
    """Bytes of the regions' slices it reads and writes: over the lane's inline bound, a worker serves it."""
    prepared: list = dataclasses.field(default_factory=list, compare=False, repr=False)
    """Filled by the first :meth:`run`: the engine's :class:`~xreduced.engine.PreparedReduction`, or None
    when the engine cannot prepare it."""
    binding: _Binding = dataclasses.field(default_factory=lambda: _Binding(), compare=False, repr=False)
    """The prepared reduction bound to views of the regions, kept between runs (:meth:`run`)."""

    def deadline(self, call_seconds: float | None) -> Deadline:
        """The call's deadline, as :func:`xreduced.decode.deadline` makes it for a solo call.

        Example:
            >>> Repeat("Reduce", "SUM", 1, "hierarchical_copy", None, 5.0, (), (), (), 0, 0).deadline(2.0).seconds
            2.0
        """
        limits = [s for s in (self.timeout, call_seconds) if s is not None]
        return Deadline(min(limits) if limits else None)

    def run(self, pin: Callable[[Sequence[str]], list | None], unpin: Callable[[list], None], engine: Engine,
            call_seconds: float | None) -> None:
        """Reduces the regions' current bytes into the output slots: ``pin(names)`` pins the session's regions of
        those names (None when one is gone), ``unpin`` releases them, ``engine`` reduces. Its first run prepares
        the reduction (:meth:`xreduced.engine.Engine.prepare`: checked and planned once) and binds it to views
        of the regions (:meth:`xreduced.engine.PreparedReduction.bind`: the regions are the ones validated, so
        the views stay right until one of them closes, which drops them); later runs only do the arithmetic.

        Raises:
            Stale: a region is not the one validated (unregistered, registered again, the session ended).
            Whatever the region checks or the engine raise (the full path then answers the call).
        """
        regions = self._pin(pin, unpin)
        try:
            deadline = self.deadline(call_seconds)
            bound = self.binding.bound
            if bound is None:
                pairs, outs = self._views(regions)
                if not self.prepared:
                    self.prepared.append(engine.prepare(self.op, pairs, num_packs=self.num_packs,
                                                        algorithm=self.algorithm, reduce_to=self.reduce_to,
                                                        dest_fields=list(self.dest_fields), out=outs))
                prepared = self.prepared[0]
                if prepared is None:
                    engine.batch_reduce(self.op, pairs, num_packs=self.num_packs, algorithm=self.algorithm,
                                        reduce_to=self.reduce_to, deadline=deadline,
                                        dest_fields=list(self.dest_fields), out=outs)
                    return
                bound = self.binding.bind(prepared.bind(pairs, outs), regions)
            if not bound.run(deadline):  # another thread runs it now: views of this call's own
                self.prepared[0].run(*self._views(regions), deadline)
        finally:
            unpin(regions)

    @contextlib.contextmanager
    def views(self, pin: Callable[[Sequence[str]], list | None], unpin: Callable[[list], None]):
        """The request's (value, destinations) pairs and output slots as views of its regions' current bytes,
        the regions pinned (``pin``, ``unpin`` as :meth:`run` takes them) while the ``with`` block runs.

        Raises:
            Stale: a region is not the one validated; or what the region checks raise.
        """
        regions = self._pin(pin, unpin)
        try:
            yield self._views(regions)
        finally:
            unpin(regions)

    def _pin(self, pin: Callable[[Sequence[str]], list | None], unpin: Callable[[list], None]) -> list:
        """The request's regions, pinned and checked: each the one validated, none shrunk (unpinned again when
        not)."""
        regions = pin([name for name, _ in self.regions])
        if regions is None:
            raise Stale("a region is gone")
        try:
            for (name, ref), region in zip(self.regions, regions):
                if region is not ref():
                    raise Stale(f"region {name!r} was registered again")
                if region.check is not None:
                    region.check()
        except BaseException:
            unpin(regions)
            raise
        return regions

    def _views(self, regions: list) -> tuple[list, list]:
        """The (value, destinations) pairs and output slots, as views of ``regions`` (pinned)."""
        by_name = {name: region for (name, _), region in zip(self.regions, regions)}
        pairs, outs = [], []
        for p in self.pairs:
            arrays = tuple(by_name[i.region].view(i.offset, i.dtype, i.shape) for i in p.inputs)
            pairs.append((Value(p.devices, arrays, p.field, p.parts), p.destinations))
            made = {o: by_name[o.region].view(o.offset, o.dtype, o.shape) for o in p.places}  # one view a place
            outs.append({d: made[o] for d, o in p.outputs})
        return pairs, outs


class _Binding:
    """A repeat's reduction bound to views of its regions (:meth:`xreduced.engine.PreparedReduction.bind`),
    kept between its runs; each region drops it when it closes (:meth:`xreduced.regions.Region.hold`), so a
    region is never kept mapped by it.

    Example:
        >>> binding = _Binding()
        >>> binding.bind("bound", [])
        'bound'
        >>> binding.drop(); binding.bound is None
        True
    """

    __slots__ = ("bound", "__weakref__")

    def __init__(self):
        self.bound = None

    def bind(self, bound, regions: Sequence) -> Any:
        """Keeps ``bound``, made from views of ``regions``; returns it."""
        for region in regions:
            region.hold(self)
        self.bound = bound
        return bound

    def drop(self) -> None:
        """Lets the views go (a region closes)."""
        self.bound = None


@dataclasses.dataclass(frozen=True)
class Held:
    """One process's share of a collective that its lane connection sent before but for the sequence number
    (:func:`collective_key`): its kept :class:`Repeat`, the reply the full path sent, and the caller's session.
    The express lane holds it until every process of the collective has come so (:mod:`xreduced.express`).

    Example:
        >>> Held("repeat", b"reply", "s1").session_id
        's1'
    """

    repeat: Repeat
    reply: bytes
    session_id: str


def collective_key(message) -> bytes:
    """A collective request's bytes with its ``collective.sequence`` cleared: what a training step's calls in a
    group have in common (each has the next sequence number). Under it a lane connection keeps its group's
    repeats (:class:`Held`).

    Example:
        >>> from xreduce.v1 import xreduce_pb2 as pb
        >>> def request(sequence):
        ...     return pb.ReduceRequest(collective=pb.CollectiveSpec(group="g", num_processes=2, sequence=sequence))
        >>> collective_key(request(3)) == collective_key(request(4)) != collective_key(pb.ReduceRequest())
        True
    """
    if not message.HasField("collective"):
        return message.SerializeToString(deterministic=True)
    spec = message.collective
    sequence = spec.sequence
    spec.ClearField("sequence")
    try:
        return message.SerializeToString(deterministic=True)
    finally:
        spec.sequence = sequence


def kept(kind: str, request, op: str, num_packs: int, algorithm: str, reduce_to: int | None,  # noqa: PLR0913
         dest_fields: Sequence[str], resolved: Sequence[tuple[Value, tuple[int, ...]]],
         slots: Sequence[dict[int, Slot] | None], pinned: dict[str, Any], held: int) -> Repeat | None:
    """The :class:`Repeat` of a solo request the service validated and reduced, or None when it cannot be
    repeated: a tensor not in a region, a sparse or typed value, no output region, a region not pinned by the
    call (``pinned``: the call's regions by name), a host region it is not.

    Example:
        >>> from xreduce.v1 import xreduce_pb2 as pb
        >>> kept("Reduce", pb.ReduceRequest(), "SUM", 1, "hierarchical_copy", None, [], [], [None], {}, 0) is None
        True
    """
    values = [request.value] if kind == "Reduce" else [p.value for p in request.pairs]
    if not values or any(s is None for s in slots) or len(values) != len(resolved):
        return None
    pairs = []
    names: dict[str, Any] = {}
    for message, (value, dests), slot in zip(values, resolved, slots):
        inputs = []
        for component in message.components:
            if not component.HasField("tensor") or not component.tensor.HasField("region"):
                return None
            dtype, shape = codec.spec(component.tensor)
            r = component.tensor.region
            inputs.append(Piece(r.name, r.offset, r.byte_size, dtype, tuple(shape)))
            names[r.name] = pinned.get(r.name)
        outputs = []
        for d, s in slot.items():
            outputs.append((d, Piece(s.region, s.offset, s.view.nbytes, s.view.dtype, tuple(s.view.shape))))
            names[s.region] = pinned.get(s.region)
        pairs.append(_Pair(value.devices, tuple(inputs), value.field, value.parts, tuple(dests), tuple(outputs)))
    if any(region is None or region.kind != "shm" for region in names.values()):
        return None
    timeout = timeout_seconds(request.timeout) if request.HasField("timeout") else None
    replica_bytes = sum(int(v.arrays[0].nbytes) for v, _ in resolved)
    region_bytes = sum(piece.nbytes for p in pairs for piece in p.inputs + p.places)
    return Repeat(kind, op, num_packs, algorithm, reduce_to, timeout, tuple(dest_fields), tuple(pairs),
                  tuple((name, weakref.ref(region)) for name, region in names.items()), replica_bytes, held,
                  region_bytes)


class Repeats:
    """A lane connection's kept repeats: request bytes -> (:class:`Repeat`, the reply's bytes), the most recent
    :data:`REPEATS_KEPT`.

    Example:
        >>> repeats = Repeats()
        >>> repeats.keep(b"request", "repeat", b"reply"); repeats.get(b"request")
        ('repeat', b'reply')
        >>> repeats.forget(b"request"); repeats.get(b"request") is None
        True
    """

    def __init__(self, kept: int = REPEATS_KEPT):
        self._kept = kept
        self._entries: OrderedDict[bytes, tuple[Repeat, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request: bytes) -> tuple[Repeat, bytes] | None:
        """The repeat and reply kept for ``request``, or None."""
        entry = self._entries.get(request)
        if entry is not None:
            self._entries.move_to_end(request)
        return entry

    def keep(self, request: bytes, repeat: Repeat, reply: bytes) -> None:
        """Files ``repeat`` and its ``reply`` under the request's bytes (not one longer than
        :data:`REPEAT_MAX_REQUEST_BYTES`)."""
        if len(request) > REPEAT_MAX_REQUEST_BYTES:
            return
        self._entries[request] = (repeat, reply)
        self._entries.move_to_end(request)
        while len(self._entries) > self._kept:
            self._entries.popitem(last=False)

    def forget(self, request: bytes) -> None:
        """Drops the entry of ``request`` (a stale one)."""
        self._entries.pop(request, None)

