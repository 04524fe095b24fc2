"""A batch reduction that a caller repeats with the same shapes: its request and segments made once.

A training step's gradient all-reduce is the same call step after step: the
same dtypes, shapes, devices and destinations, new bytes. Through
``batch_reduce`` each call is checked, named, fused, staged, encoded and its
reply decoded again, about half a millisecond of Python in the caller for a
reduction of a few hundred microseconds. :class:`PreparedBatch` does that work
once. In a process whose daemon shares its host and offers a local lane (alone,
or in a multi-process group of that one daemon), it keeps a staging segment and
an output segment registered with the daemon, and the serialized request that
names them (the pairs of one kind, devices, destinations and dtype, fused into
one value: each replica's arrays back to back, so the daemon sums one flat
tensor); each call copies the arrays into the staging segment, sends the same
bytes over the lane (in a group, with the collective's spec and its next
sequence number appended), and returns views of the output segment, which is
reused once they are all gone (a few are kept, :data:`MAX_SLOTS`, for results
still in use). The daemon serves those bytes as a kept repeat
(:mod:`xreduced.repeated`; a group's, once every process has sent its share).

Anything else takes ``batch_reduce`` (the same numbers: the daemon reduces both
alike): a group across nodes, the ``wire`` transport, no lane or no shared memory, another
thread's call in progress, a session that ended (the next call prepares again).
A call that got no answer (a timeout, a broken lane) gives its segments up (the
daemon may still use them); one the daemon refused keeps them.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from xreduce import _transports
from xreduce._call import ReduceCall
from xreduce._errors import XReduceError
from xreduce._job_devices import reduce_to, to_daemon
from xreduce._lane import Lane, Refused
from xreduce._ops import CommunicationOptions, ReduceOp
from xreduce._runtime import ProcessGroup
from xreduce._segments import Segment
from xreduce._shared_memory import SharedMemory
from xreduce._values import Mirrored, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire import lane as frames
from xreduce.wire.contract import mean_dtype
from xreduce.wire.layout import OUTPUT_ALIGNMENT, output_layout


@dataclasses.dataclass(frozen=True)
class Spec:
    """One pair of a :class:`PreparedBatch`: its replicas' devices and destinations (any device-name form), and
    the dtype and shape every replica's array has.

    Example:
        >>> Spec(("CPU:0", "CPU:1"), ("CPU:0", "CPU:1"), np.dtype("float32"), (2, 3)).nbytes
        24
    """

    devices: tuple[str, ...]
    destinations: tuple[str, ...]
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's array."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class PreparedBatch:
    """``ops.batch_reduce(op, pairs, options)`` for pairs of fixed :class:`Spec` s, called again and again.

    Args:
        ops: the SDK's ``CrossDeviceOps`` (``xreduce.distribute.HierarchicalCopyAllReduce`` and so on).
        op: ``"SUM"`` or ``"MEAN"`` (any form ``ReduceOp.from_value`` takes).
        specs: the pairs.
        timeout_seconds: ``CommunicationOptions.timeout_seconds`` of every call, or None.

    Raises:
        ValueError: an op that is neither, no pairs, a pair without devices or destinations, a dtype the daemon
            does not reduce.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     ops = xreduce.distribute.HierarchicalCopyAllReduce()
        ...     spec = Spec(("CPU:0", "CPU:1"), ("CPU:0", "CPU:1"), np.dtype("float32"), (2,))
        ...     prepared = PreparedBatch(ops, "SUM", [spec])
        ...     [prepared([np.float32([1, 2]), np.float32([3, 4])])[0] for _ in range(3)][-1]
        ...     prepared.close()
        array([4., 6.], dtype=float32)
    """

    def __init__(self, ops, op: str, specs: Sequence[Spec], timeout_seconds: float | None = None):
        self.op = ReduceOp.from_value(op).value
        if not specs:
            raise ValueError("specs: a prepared batch needs at least one pair; got none")
        for k, s in enumerate(specs):
            if not s.devices or not s.destinations:
                raise ValueError(f"specs[{k}]: needs devices and destinations; got {s.devices!r}, {s.destinations!r}")
            codec.dtype_enum(s.dtype)
        self.specs = tuple(specs)
        self._ops = ops
        self._options = CommunicationOptions(timeout_seconds=timeout_seconds) if timeout_seconds else None
        self._timeout = timeout_seconds
        self._arity = sum(len(s.devices) for s in self.specs)
        self._lock = threading.Lock()
        self._fast: _Fast | None = None
        self._native: Native | None = None
        self._holder: list[_Fast | None] = [None, None]  # what the finalizer closes once this batch is collected:
        weakref.finalize(self, _Fast.close_of, self._holder)  # the prepared path, and the native part's
        self.fast_calls = 0
        """Calls that took the prepared path (the others took ``batch_reduce``)."""

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each pair's result on its first destination device, from ``arrays``: every replica's array of every
        pair, in order. The results are views of shared memory (or new arrays), never written again while in use.

        Raises:
            ValueError: not one array per replica, or one of another dtype or shape than its spec.
            xreduce.XReduceError: what ``batch_reduce`` raises.
        """
        if len(arrays) != self._arity:
            raise ValueError(f"arrays: {self._arity} (one per replica of each pair) expected; got {len(arrays)}")
        i = 0
        for k, s in enumerate(self.specs):
            for _ in s.devices:
                a = arrays[i]
                if a.dtype != s.dtype or a.shape != s.shape:
                    raise ValueError(f"arrays[{i}]: {s.dtype.name}{list(s.shape)} expected (pair {k}); got "
                                     f"{a.dtype.name}{list(a.shape)}")
                i += 1
        if self._lock.acquire(blocking=False):
            try:
                fast = self._ready()
                if fast is not None:
                    try:
                        results = fast.call(arrays)
                    except _Busy:
                        pass
                    except Refused:
                        self._drop()
                    except XReduceError as e:
                        if not e.answered:  # the daemon may still use the segments
                            self._drop(failed=True)
                        raise
                    else:
                        self.fast_calls += 1
                        return results
            finally:
                self._lock.release()
        return self._slow(arrays)

    def _slow(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        it = iter(arrays)
        batch = [(PerReplica([next(it) for _ in s.devices], devices=list(s.devices)), list(s.destinations))
                 for s in self.specs]
        results = self._ops.batch_reduce(self.op, batch, self._options)
        return [r.values[0] if isinstance(r, Mirrored) else r for r in results]

    def _ready(self) -> _Fast | None:
        """The prepared path for this call, made (again) if needed; None when the call is to take
        ``batch_reduce``."""
        fast = self._fast
        group = self._ops._group()
        if group is not None and group.num_nodes > 1:
            return None
        client = self._ops.client
        lane = client.local_lane()
        if lane is None:
            return None
        if fast is not None:
            if fast.lane is lane and lane.usable() and fast.group is group:
                return fast
            self._drop()
        shm = client.shared_memory()
        if shm is None:
            return None
        try:
            fast = _Fast(shm, lane, self._request(group), self._deadline(client.timeout), group, client)
        except OSError:  # no room in /dev/shm: batch_reduce falls back as it can
            return None
        self._fast = self._holder[0] = fast
        return fast

    def _deadline(self, default: float) -> float:
        return default if self._timeout is None else self._timeout + _transports.DEADLINE_SLACK_SECONDS

    def _request(self, group: ProcessGroup | None) -> _Layout:
        """The request and where everything goes (:func:`_layout`), with this ops' algorithm (packing aside where
        the dtypes differ: the values of one kind are fused already, and a pack holds one dtype) and
        ``output_one_copy`` (only each pair's first destination's result is read); in ``group``, without its
        collective, which each call adds (:meth:`_Fast.body`)."""
        algorithm = self._ops._algorithm()
        if algorithm.num_packs and len({s.dtype for s in self.specs}) > 1:
            algorithm = dataclasses.replace(algorithm, num_packs=0)
        if algorithm.reduce_to_device:
            algorithm = dataclasses.replace(algorithm, reduce_to_device=reduce_to(algorithm.reduce_to_device, group))
        # Only each pair's first destination is read (``__call__``): the daemon writes that one copy.
        request = pb.BatchReduceRequest(**_transports._fields(ReduceCall(self.op, (), algorithm, self._timeout)),
                                        output_one_copy=True)
        return _layout(request, self.specs, group)

    def _drop(self, failed: bool = False) -> None:
        fast, self._fast, self._holder[0] = self._fast, None, None
        if fast is not None:
            fast.close(failed)

    def native(self) -> Native | None:
        """This batch's call as a kernel outside Python makes it (``xreduce.tensorflow``'s TF kernel), made once:
        segments of its own, which nothing else writes, registered in the session, and a first call made (with
        zeros) to learn where the daemon places the results. None when there is no prepared path (a group, no
        local lane, no shared memory, no room in ``/dev/shm``).

        The segments stay until the batch is closed or collected (then they are unlinked: a kernel still
        holding them keeps its own mapping, and the daemon answers its calls that the regions are gone).

        Raises:
            xreduce.XReduceError: the daemon refused the first call (what ``batch_reduce`` raises).

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     ops = xreduce.distribute.HierarchicalCopyAllReduce()
            ...     spec = Spec(("CPU:0", "CPU:1"), ("CPU:0",), np.dtype("float32"), (2, 3))
            ...     prepared = PreparedBatch(ops, "SUM", [spec])
            ...     native = prepared.native()
            ...     native.input_offsets, native.outputs[0][1:], native.hello[4:8]
            ...     prepared.close()
            ((0, 64), (dtype('float32'), (2, 3)), b'XRL1')
        """
        with self._lock:
            group = self._ops._group()
            if self._native is None and (group is None or group.num_nodes == 1):
                self._native = self._make_native(group)
            return self._native

    def _make_native(self, group: ProcessGroup | None) -> Native | None:
        client = self._ops.client
        lane = client.local_lane()
        shm = client.shared_memory() if lane is not None else None
        if shm is None:
            return None
        layout = self._request(group)
        try:
            fast = _Fast(shm, lane, layout, self._deadline(client.timeout), group, client)
            slot = fast.stage_slot() if layout.in_place else fast._slot()
        except OSError:
            return None
        self._holder[1] = fast
        slot.free = False  # the kernel's for good
        fast.stage.base[:] = 0
        staged = sum(nbytes for _, nbytes in _spans(layout))
        phases = _phased(slot.body, PHASES) if len(layout.request.pairs) == 1 and staged >= PHASED_BYTES else \
            [(slot.body, [])]
        try:  # each phase's request once (the daemon checks and keeps them); the first's reply places the results
            replies = [fast.send(_Slot(slot.seg, body)) for body, _ in phases]
            places = _placed(replies[0], slot.seg, fast._parts)
        except BaseException:  # refused, no answer, or a reply that placed nothing here
            self._holder[1] = None
            fast.give_up()
            raise
        collective = b""
        if group is not None:
            collective = pb.CollectiveSpec(group=group.group, num_processes=group.num_processes,
                                           process_id=group.process_id, epoch=group.epoch).SerializeToString()
        requests = tuple(frames.request("BatchReduce", fast.timeout, body) for body, _ in phases)
        return Native(address=lane.address, daemon=client.address, hello=lane.hello, request=requests[0],
                      staging=fast.stage.name, staging_bytes=fast.stage.size, output=slot.seg.name,
                      output_bytes=slot.seg.size, input_offsets=tuple(at for at, _, _ in layout.inputs),
                      outputs=tuple((at, dtype, shape) for at, _, dtype, shape in places), timeout=fast.timeout,
                      group=group, collective=collective,
                      phases=tuple(zip(requests, (tuple(ranges) for _, ranges in phases))) if len(phases) > 1 else ())

    def close(self) -> None:
        """Gives the segments back (a later call prepares again); the native part's are unlinked."""
        with self._lock:
            self._drop()
            native, self._holder[1], self._native = self._holder[1], None, None
            if native is not None:
                native.give_up()


@dataclasses.dataclass(frozen=True)
class Native:
    """A prepared batch's call as a kernel outside Python makes it (:meth:`PreparedBatch.native`): over a local-lane
    connection of its own (a hello, then the same request frame each call), inputs copied into the staging segment,
    results copied out of the output segment. Segments are files of ``/dev/shm``, by name.

    Example:
        >>> Native("unix:/run/x.sock.lane", "unix:/run/x.sock", b"", b"", "xrs", 64, "xro", 64, (0,),
        ...        ((0, np.dtype("float32"), (2,)),), 65.0).staging_bytes
        64
    """

    address: str
    """The local lane's address (``unix:PATH`` or ``unix-abstract:NAME``)."""
    daemon: str
    """The daemon's address, for messages."""
    hello: bytes
    """The connection's hello frame (:func:`xreduce.wire.lane.hello`)."""
    request: bytes
    """The request frame (:func:`xreduce.wire.lane.request`)."""
    staging: str
    staging_bytes: int
    output: str
    output_bytes: int
    input_offsets: tuple[int, ...]
    """Where each array goes in the staging segment, in the order ``PreparedBatch`` takes them."""
    outputs: tuple[tuple[int, np.dtype, tuple[int, ...]], ...]
    """Each spec's result in the output segment: (offset, dtype, shape)."""
    timeout: float
    """Seconds a call may take, the daemon's answer included."""
    group: ProcessGroup | None = None
    """The multi-process group whose collective each call is, or None: then :attr:`request` is the whole call."""
    collective: bytes = b""
    """In a group, its ``CollectiveSpec`` serialized without a sequence number: each call appends it to the
    request as field :data:`COLLECTIVE_FIELD` with the group's next sequence number."""
    phases: tuple[tuple[bytes, tuple[tuple[int, int], ...]], ...] = ()
    """A call in phases (:func:`_phased`; none: :attr:`request` is the whole call): each phase's request frame
    (the first is :attr:`request`) and the staging bytes (begin, end) it reduces. The kernel copies a phase's
    inputs, sends its request, and goes on to the next phase's while the daemon reduces it; then it reads the
    replies. In a group, each phase is one collective."""


@dataclasses.dataclass
class _Layout:
    """A prepared batch's request and where its bytes go: made once (:func:`_layout`)."""

    request: pb.BatchReduceRequest
    """The ``BatchReduce`` request, its regions' offsets set, their names not yet."""
    inputs: list[tuple[int, np.dtype, tuple[int, ...]]]
    """Each array's (offset in the staging segment, dtype, shape), in the order the arrays come."""
    stage_bytes: int
    out_bytes: int
    parts: list[tuple[int, int, tuple[int, ...]]]
    """Each spec's (pair of the request, first element in that pair's flat value, shape)."""
    in_place: bool = False
    """Whether the staging segment can be the output too (:meth:`_Fast.stage_slot`): laid out from its start, each
    pair's (first) result lies exactly over its first replica's input (the same dtype: not an integer MEAN; and no
    more destinations than replicas)."""


def _layout(request: pb.BatchReduceRequest, specs: Sequence[Spec], group: ProcessGroup | None = None) -> _Layout:
    """``request`` (its op and options set) filled in: the specs of one kind (devices, destinations, dtype) as one
    pair whose value is *fused* (each replica's arrays back to back, one flat tensor, ``fused_parts`` naming
    them), a spec alone as its own pair; each replica's tensor at an aligned offset of the staging segment. A fused
    pair's parts of a multiple of :data:`OUTPUT_ALIGNMENT` bytes come first, so that each of them starts aligned too,
    in the staging segment and in the result (xreduce's TF kernel hands such a result to TF in place: TF's tensors
    are 64-byte aligned); the others follow, in order. In a
    ``group``, one pair per spec, as ``batch_reduce`` sends them: a process whose call takes ``batch_reduce``
    (its lane cannot be had, its output segments are all in use) still matches the others'.

    Example:
        >>> f32 = np.dtype("float32")
        >>> layout = _layout(pb.BatchReduceRequest(), [Spec(("CPU:0", "CPU:1"), ("CPU:0",), f32, (2, 3)),
        ...                                             Spec(("CPU:0", "CPU:1"), ("CPU:0",), f32, (5,))])
        >>> len(layout.request.pairs), list(layout.request.pairs[0].value.components[1].tensor.shape)
        (1, [11])
        >>> [at for at, _, _ in layout.inputs], layout.parts
        ([0, 64, 24, 88], [(0, 0, (2, 3)), (0, 6, (5,))])
        >>> layout = _layout(pb.BatchReduceRequest(), [Spec(("CPU:0",), ("CPU:0",), f32, (5,)),
        ...                                             Spec(("CPU:0",), ("CPU:0",), f32, (4, 4))])
        >>> layout.parts  # the 64 bytes first
        [(0, 16, (5,)), (0, 0, (4, 4))]
    """
    groups: dict[tuple, list[int]] = {}
    for k, s in enumerate(specs):
        groups.setdefault((s.devices, s.destinations, s.dtype, k if group is not None else None), []).append(k)
    mean = request.reduce_op == pb.REDUCE_OP_MEAN
    inputs: list = [None] * sum(len(s.devices) for s in specs)
    first = [0]
    for s in specs:
        first.append(first[-1] + len(s.devices))
    parts: list = [None] * len(specs)
    results, firsts, at = [], [], 0
    for g, ((devices, destinations, dtype, _), members) in enumerate(groups.items()):
        pair = request.pairs.add()
        pair.destinations.extend(to_daemon(d, group, f"specs[{members[0]}].destinations[{i}]")
                                 for i, d in enumerate(destinations))
        members.sort(key=lambda k: specs[k].nbytes % OUTPUT_ALIGNMENT != 0)  # stable: aligned sizes first
        elements, start = 0, []
        for k in members:
            start.append(elements)
            parts[k] = (g, elements, specs[k].shape)
            elements += specs[k].nbytes // dtype.itemsize
        shape = specs[members[0]].shape if len(members) == 1 else (elements,)
        if len(members) > 1:
            pair.value.fused_parts.extend(pb.FusedPart(shape=specs[k].shape, index=k) for k in members)
        for r, d in enumerate(devices):
            at += -at % OUTPUT_ALIGNMENT
            if r == 0:
                firsts.append(at)
            component = pair.value.components.add(device=to_daemon(d, group, f"specs[{members[0]}].devices[{r}]"))
            component.tensor.dtype = codec.dtype_enum(dtype)
            component.tensor.shape.extend(shape)
            component.tensor.region.offset, component.tensor.region.byte_size = at, elements * dtype.itemsize
            for k, e in zip(members, start):
                inputs[first[k] + r] = (at + e * dtype.itemsize, dtype, specs[k].shape)
            at += elements * dtype.itemsize
        results.append((len(destinations), mean_dtype(dtype) if mean else dtype, shape))
    out = output_layout(results)
    in_place = out.nbytes <= at and all(places[0] == first and result[1] == key[2]
                                        for places, first, key, result in zip(out.offsets, firsts, groups, results))
    return _Layout(request, inputs, max(at, 1), max(out.nbytes, 1), parts, in_place)


PHASED_BYTES = 4 << 20
"""A native call (:meth:`PreparedBatch.native`) of one pair whose inputs reach this many bytes is made in
:data:`PHASES` phases (:func:`_phased`): the daemon reduces one while the kernel copies the next one's inputs
(below it, the hand-offs of a second request cost more than the overlap saves)."""

PHASES = 2
"""Phases of a phased native call."""


def _spans(layout: _Layout) -> list[tuple[int, int]]:
    """Each component's (offset in the staging segment, bytes)."""
    return [(c.tensor.region.offset, c.tensor.region.byte_size)
            for pair in layout.request.pairs for c in pair.value.components]


def _phased(body: bytes, phases: int) -> list[tuple[bytes, list[tuple[int, int]]]]:
    """A request of one pair (serialized, ``body``) as ``phases`` requests, each of a run of the value's elements
    (a flat tensor; runs start at multiples of :data:`OUTPUT_ALIGNMENT` bytes, as each result must): each
    serialized, with the staging bytes (begin, end) it reads. The results are the same element for element (a
    dense all-reduce adds each element apart); together they lie where the whole request's would.

    Example:
        >>> request = pb.BatchReduceRequest(output=pb.RegionSlice(name="s", offset=0, byte_size=352))
        >>> pair = request.pairs.add(destinations=["CPU:0", "CPU:1"])
        >>> for k in range(2):
        ...     c = pair.value.components.add(device=f"CPU:{k}")
        ...     c.tensor.dtype = codec.dtype_enum(np.float32)
        ...     c.tensor.region.offset, c.tensor.region.byte_size = 192 * k, 160
        ...     c.tensor.shape.append(40)
        >>> [ranges for _, ranges in _phased(request.SerializeToString(), 2)]  # 16 floats, then 24
        [[(0, 64), (192, 256)], [(64, 160), (256, 352)]]
    """
    whole = pb.BatchReduceRequest.FromString(body)
    components = whole.pairs[0].value.components
    dtype = codec.spec(components[0].tensor)[0]
    elements = components[0].tensor.region.byte_size // dtype.itemsize
    unit = max(1, OUTPUT_ALIGNMENT // dtype.itemsize)
    bounds = sorted({*(elements * k // phases // unit * unit for k in range(phases)), elements})
    out = []
    for begin, end in zip(bounds, bounds[1:]):
        request = pb.BatchReduceRequest()
        request.CopyFrom(whole)
        pair = request.pairs[0]
        pair.value.ClearField("fused_parts")
        for c in pair.value.components:
            del c.tensor.shape[:]
            c.tensor.shape.append(end - begin)
            c.tensor.region.offset += begin * dtype.itemsize
            c.tensor.region.byte_size = (end - begin) * dtype.itemsize
        request.output.offset = whole.output.offset + begin * dtype.itemsize
        request.output.byte_size = output_layout([(len(pair.destinations), dtype, (end - begin,))]).nbytes
        regions = [c.tensor.region for c in pair.value.components]
        out.append((request.SerializeToString(), [(r.offset, r.offset + r.byte_size) for r in regions]))
    return out


COLLECTIVE_FIELD = pb.BatchReduceRequest.DESCRIPTOR.fields_by_name["collective"].number
"""The ``BatchReduceRequest`` field a group's call appends its ``CollectiveSpec`` as (a field appended to a
serialized message sets it).

Example:
    >>> COLLECTIVE_FIELD
    7
"""

MAX_SLOTS = 3
"""Output segments a prepared batch keeps at most: results are views of one, which is reused once they are all
gone; while that many are still held, a call takes ``batch_reduce``."""


class _Busy(Exception):
    """Every output segment still holds results in use: this call takes ``batch_reduce``."""


class _Slot:
    """One output segment of a prepared batch, the request that names it, the reply it got last and where that
    placed each pair's first result."""

    def __init__(self, seg: Segment, body: bytes):
        self.seg, self.body = seg, body
        self.reply: bytes | None = None
        self.places: list[tuple[int, int, np.dtype, tuple[int, ...]]] = []
        self.free = True
        """No result of this segment is in use (set by the finalizer of the array its results are views of)."""
        self.closed: tuple[SharedMemory, bool] | None = None
        """Once the prepared path has closed: where the segment goes back when its results are gone."""

    def released(self) -> None:
        """The results are all gone (a finalizer's: it may run in any thread)."""
        self.free = True
        if self.closed is not None:
            shm, failed = self.closed
            shm.later(shm.give_back, self.seg, True, failed)


class _Fast:
    """The prepared path of one session: the staging segment, the output segments (:class:`_Slot`), the request."""

    def __init__(self, shm: SharedMemory, lane: Lane, layout: _Layout, timeout: float,
                 group: ProcessGroup | None = None, client=None):
        self.shm, self.lane, self.timeout = shm, lane, timeout
        self.group, self._client = group, client
        self._out_bytes = layout.out_bytes
        self._parts = layout.parts
        self.stage: Segment | None = shm.segment(layout.stage_bytes, output=False)
        for pair in layout.request.pairs:
            for component in pair.value.components:
                component.tensor.region.name = self.stage.name
        base = self.stage.base
        self.inputs = [base[at:at + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)
                       for at, dtype, shape in layout.inputs]
        self._message = layout.request
        self.slots: list[_Slot] = []
        """The output segments."""

    def _slot(self) -> _Slot:
        for slot in self.slots:
            if slot.free:
                return slot
        if len(self.slots) >= MAX_SLOTS:
            raise _Busy()
        seg = self.shm.segment(self._out_bytes, output=True)
        self._message.output.name, self._message.output.byte_size = seg.name, seg.size
        slot = _Slot(seg, self._message.SerializeToString())
        self.slots.append(slot)
        return slot

    def stage_slot(self) -> _Slot:
        """A request whose results go over the inputs, in the staging segment itself (the layout's
        :attr:`_Layout.in_place`): the daemon adds each pair's replicas into its first replica's place, with no
        output segment to write. For a caller whose results are gone before it copies in again (xreduce's TF kernel
        moves those TF still holds aside first); not one of :attr:`slots`."""
        self._message.output.name, self._message.output.byte_size = self.stage.name, self._out_bytes
        return _Slot(self.stage, self._message.SerializeToString())

    def call(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The results of one call: views of a free output segment, which stays in use until they are gone."""
        slot = self._slot()
        for view, a in zip(self.inputs, arrays):
            np.copyto(view, a)
        slot.free = False  # the daemon writes there from now on, even if no answer comes
        try:
            payload = self.send(slot)
            if payload != slot.reply:
                slot.places = _placed(payload, slot.seg, self._parts)
                slot.reply = payload
        except XReduceError as e:
            slot.free = e.answered  # else it is given up with the others (the caller drops this path)
            raise
        except Exception:  # nothing sent (Refused), or a reply that placed nothing here: the daemon is done
            slot.free = True
            raise
        hold = np.frombuffer(slot.seg.mm, np.uint8, slot.seg.size)  # every result is a view of it
        weakref.finalize(hold, slot.released)
        return [hold[at:at + nbytes].view(dtype).reshape(shape) for at, nbytes, dtype, shape in slot.places]

    def send(self, slot: _Slot) -> bytes:
        """Sends ``slot``'s request over the lane and returns the reply's bytes; in a group, as its next collective
        (:func:`xreduce._transports.collective`: abandoned for every process if this side fails before the daemon
        answers), over gRPC if the lane cannot be had (its number is taken).

        Raises:
            Refused: no group, and the lane cannot be had (nothing was sent).
            xreduce.XReduceError: what the daemon answered, or no answer.
        """
        if self.group is None:
            return self.lane.exchange("BatchReduce", slot.body, self.timeout)
        with _transports.collective(self._client, self.group) as spec:
            body = slot.body + pb.BatchReduceRequest(collective=spec).SerializeToString()
            try:
                return self.lane.exchange("BatchReduce", body, self.timeout)
            except Refused:
                return self._client.batch_reduce(pb.BatchReduceRequest.FromString(body), self.timeout,
                                                 session=self.lane.session_id).SerializeToString()

    def close(self, failed: bool = False) -> None:
        """Gives the segments back to their pools (``failed``: unlinks them, the daemon may still use them); an
        output segment whose results are still in use goes back once they are gone."""
        self.inputs = []
        stage, self.stage = self.stage, None
        if stage is not None:
            self.shm.give_back(stage, output=False, failed=failed)
        for slot in self.slots:
            slot.closed = (self.shm, failed)
            if slot.free:
                self.shm.give_back(slot.seg, output=True, failed=failed)
        self.slots = []

    def give_up(self) -> None:
        """Closes a native part (:meth:`PreparedBatch.native`): its segments unlinked, never reused (a kernel may
        still hold them)."""
        for slot in self.slots:
            slot.free = True
        self.close(failed=True)

    @staticmethod
    def close_of(holder: list) -> None:
        """A finalizer's: closes the :class:`_Fast` s in ``holder`` (the prepared path's, the native part's)."""
        if holder[0] is not None:
            holder[0].close()
        if holder[1] is not None:
            holder[1].give_up()


def _placed(payload: bytes, seg: Segment,
            parts: list[tuple[int, int, tuple[int, ...]]]) -> list[tuple[int, int, np.dtype, tuple[int, ...]]]:
    """Where a reply placed each spec's result (its pair's first, of a fused pair the part's elements) in the output
    segment ``seg``: (offset, bytes, dtype, shape).

    Raises:
        ValueError: a result outside the segment, or not in it.
    """
    placed = []
    for k, r in enumerate(pb.BatchReduceResponse.FromString(payload).results):
        tensor = r.result.components[0].tensor
        s = tensor.region
        if not tensor.HasField("region") or s.name != seg.name or s.offset + s.byte_size > seg.size:
            raise ValueError(f"the daemon placed result {k} at {s.name}[{s.offset}:+{s.byte_size}], not in the "
                             f"output segment {seg.name} of {seg.size} bytes")
        placed.append((s.offset, codec.spec(tensor)[0]))
    out = []
    for g, element, shape in parts:
        offset, dtype = placed[g]
        out.append((offset + element * dtype.itemsize, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype,
                    shape))
    return out
