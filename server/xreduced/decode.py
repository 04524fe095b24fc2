"""Wire to domain: the fields of a request decoded and checked, the same way for every RPC that has them.

Pure functions of the message and what they are told (the daemon's devices,
the regions a call may name, the call's deadline): no service state, no gRPC
context. Every failure is a :class:`~xreduced.errors.ServiceError` (or the
codec's error) whose message names the field and the value received.

Example:
    >>> from xreduce.v1 import xreduce_pb2 as pb
    >>> group(pb.ReduceRequest(collective=pb.CollectiveSpec(group="g", num_processes=2, process_id=1)))
    Group(key=CollectiveKey(group='g', sequence=0, name=None), label='collective 0 in group "g"', num_processes=2,
          process_id=1, epoch=0)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire import sparse as wire_sparse
from xreduce.wire.layout import OUTPUT_ALIGNMENT, output_layout

from xreduced import planner
from xreduced.deadline import Deadline
from xreduced.devices import DeviceTable
from xreduced.engine import MEAN, SUM, Value
from xreduced.errors import FailedPrecondition, InvalidArgument
from xreduced.regions import CallRegions

MAX_PROCESSES = 65536
"""The most processes a collective may have."""

MAX_TIMEOUT_SECONDS = 86400
"""The longest ``timeout`` a request may ask for: one day."""

OPS = {pb.REDUCE_OP_SUM: SUM, pb.REDUCE_OP_MEAN: MEAN}
ALGORITHMS = {
    pb.ALGORITHM_UNSPECIFIED: planner.HIERARCHICAL_COPY,
    pb.ALGORITHM_HIERARCHICAL_COPY: planner.HIERARCHICAL_COPY,
    pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE: planner.REDUCTION_TO_ONE_DEVICE,
    pb.ALGORITHM_NCCL: planner.NCCL,
}
ROUTES = {
    planner.IDENTITY: pb.ROUTE_IDENTITY,
    planner.HIERARCHICAL_COPY: pb.ROUTE_HIERARCHICAL_COPY,
    planner.REDUCTION_TO_ONE_DEVICE: pb.ROUTE_REDUCTION_TO_ONE_DEVICE,
    planner.NCCL: pb.ROUTE_NCCL,
}
"""The other way: the route the engine took, as the reply names it."""

DATA_FIELDS = ("raw_data", "float_values", "int_values", "uint_values")
"""The fields of a Tensor that carry its data."""


JOIN = "join"
"""The name of a group's join (``JoinGroup``): the collective a new membership starts with."""


class CollectiveKey(NamedTuple):
    """Which collective: a group's collective by sequence number, or by name (then ``sequence`` is None).

    The rendezvous, the express lane and the admission count key collectives by it; messages and log lines
    name them from it. A named tuple, not a frozen dataclass, for speed: the express lane hashes and compares
    it several times a call, which a dataclass does in Python (``bench/lane_work.py`` counted 5% more
    instructions per small all-reduce).

    Example:
        >>> key = CollectiveKey("train", 17)
        >>> key.label, key.log_ident, str(key)
        ('collective 17 in group "train"', '17', 'seq:17')
        >>> named = CollectiveKey("train", name="step")
        >>> named.label, named.log_ident, str(named)
        ('collective "step" in group "train"', '"step"', 'name:step')
    """

    group: str
    sequence: int | None = None
    name: str | None = None

    @classmethod
    def of(cls, spec: pb.CollectiveSpec) -> CollectiveKey:
        """The key of a CollectiveSpec: by its name when it has one, else by its sequence number.

        Example:
            >>> CollectiveKey.of(pb.CollectiveSpec(group="g", name="step", sequence=4))
            CollectiveKey(group='g', sequence=None, name='step')
        """
        return cls(spec.group, None, spec.name) if spec.name else cls(spec.group, spec.sequence)

    @property
    def label(self) -> str:
        """How messages name the collective: ``collective 17 in group "train"``."""
        ident = f'"{self.name}"' if self.name is not None else str(self.sequence)
        return f'collective {ident} in group "{self.group}"'

    @property
    def log_ident(self) -> str:
        """How a log line's ``collective=`` names it within its group: its sequence number or its quoted name."""
        return json.dumps(self.name) if self.name is not None else str(self.sequence)

    @property
    def is_join(self) -> bool:
        """Whether this is its group's join (:data:`JOIN`), which a new membership starts with.

        Example:
            >>> CollectiveKey("g", name=JOIN).is_join, CollectiveKey("g", 0).is_join
            (True, False)
        """
        return self.name == JOIN

    def __str__(self) -> str:
        """``seq:17`` or ``name:step``, as the express lane's log names it."""
        return f"name:{self.name}" if self.name is not None else f"seq:{self.sequence}"


@dataclasses.dataclass(frozen=True)
class Group:
    """A validated CollectiveSpec: the rendezvous key, how messages name it, and this process's place.

    Example:
        >>> group = collective(pb.CollectiveSpec(group="g", name="step", num_processes=4, process_id=3))
        >>> group.key, group.label
        (CollectiveKey(group='g', sequence=None, name='step'), 'collective "step" in group "g"')
    """

    key: CollectiveKey
    label: str
    """How messages name the collective (``key.label``, made once), e.g. ``collective 17 in group "train"``."""
    num_processes: int
    process_id: int
    epoch: int = 0
    """The membership epoch the process joined (groups across nodes), else 0."""

    @property
    def sequence(self) -> int | None:
        """The collective's sequence number, or None for a named collective."""
        return self.key.sequence


@dataclasses.dataclass(frozen=True)
class Options:
    """A reduction's options; ``num_packs`` is the engine's to check (it checks every caller's).

    Example:
        >>> Options(2, planner.HIERARCHICAL_COPY, None, Deadline(None)).algorithm
        <Route.HIERARCHICAL_COPY: 'hierarchical_copy'>
    """

    num_packs: int
    algorithm: str
    reduce_to: int | None
    deadline: Deadline


def group(request) -> Group | None:
    """The request's collective, or None when one process does it alone.

    Example:
        >>> group(pb.ReduceRequest(collective=pb.CollectiveSpec(group="g", num_processes=1))) is None
        True
    """
    if not request.HasField("collective"):
        return None
    found = collective(request.collective)
    return found if found.num_processes > 1 else None


def collective(spec: pb.CollectiveSpec) -> Group:
    """A CollectiveSpec, checked.

    Example:
        >>> collective(pb.CollectiveSpec(group="g", num_processes=2, process_id=2))
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: collective.process_id: must be in [0, num_processes); got process_id=2,
        num_processes=2
    """
    if not spec.group:
        raise InvalidArgument("collective.group: a group name is required; got ''")
    if not 1 <= spec.num_processes <= MAX_PROCESSES:
        raise InvalidArgument(f"collective.num_processes: must be in [1, {MAX_PROCESSES}]; got {spec.num_processes}")
    if not 0 <= spec.process_id < spec.num_processes:
        raise InvalidArgument(
            f"collective.process_id: must be in [0, num_processes); got process_id={spec.process_id}, "
            f"num_processes={spec.num_processes}"
        )
    if spec.sequence < 0:
        raise InvalidArgument(f"collective.sequence: must be >= 0; got {spec.sequence}")
    if spec.epoch < 0:
        raise InvalidArgument(f"collective.epoch: must be >= 0; got {spec.epoch}")
    key = CollectiveKey.of(spec)
    return Group(key, key.label, spec.num_processes, spec.process_id, spec.epoch)


def op(value: int) -> str:
    """A ``reduce_op``: the engine's SUM or MEAN.

    Example:
        >>> op(7)
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got 7
    """
    if value not in OPS:
        raise InvalidArgument(
            f"reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got {_enum_label(pb.ReduceOp, value)}")
    return OPS[value]


def options(request, devices: DeviceTable, deadline: Deadline) -> Options:
    """A Reduce's or BatchReduce's ``num_packs``, ``algorithm`` and ``reduce_to_device``, with its deadline.

    Example:
        >>> from xreduced.backends import DeviceInfo
        >>> table = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(2)])
        >>> request = pb.ReduceRequest(algorithm=pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE, reduce_to_device="CPU:1")
        >>> options(request, table, Deadline(None)).reduce_to
        1
    """
    if request.algorithm not in ALGORITHMS:
        raise InvalidArgument(
            f"algorithm: must be ALGORITHM_HIERARCHICAL_COPY, ALGORITHM_REDUCTION_TO_ONE_DEVICE or ALGORITHM_NCCL; "
            f"got {_enum_label(pb.Algorithm, request.algorithm)}"
        )
    algorithm = ALGORITHMS[request.algorithm]
    reduce_to = None
    if request.reduce_to_device:
        if algorithm != planner.REDUCTION_TO_ONE_DEVICE:
            raise InvalidArgument(
                f"reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got "
                f"{request.reduce_to_device!r} with {_enum_label(pb.Algorithm, request.algorithm)}"
            )
        reduce_to = devices.resolve(request.reduce_to_device, "reduce_to_device")
    num_packs = request.num_packs if request.HasField("num_packs") else 1
    return Options(num_packs, algorithm, reduce_to, deadline)


def deadline(request, call_seconds: float | None, collective_seconds: float | None) -> Deadline:
    """The earliest of the request's ``timeout`` (else ``collective_seconds``, for a process
    waiting on others) and ``call_seconds`` (the call's gRPC deadline, see :func:`call_deadline`).

    Example:
        >>> from google.protobuf.duration_pb2 import Duration
        >>> deadline(pb.ReduceRequest(timeout=Duration(seconds=5)), 2.0, None).seconds
        2.0
    """
    limits = []
    if request.HasField("timeout"):
        limits.append(timeout_seconds(request.timeout))
    elif collective_seconds is not None:
        limits.append(collective_seconds)
    if call_seconds is not None:
        limits.append(call_seconds)
    return Deadline(min(limits) if limits else None)


def call_deadline(context) -> float | None:
    """Seconds left before the call's gRPC deadline, or None without one (gRPC then says about 2**63 s).

    Example:
        >>> from types import SimpleNamespace
        >>> [call_deadline(SimpleNamespace(time_remaining=lambda: s)) for s in (2.5, 2.0**63)]
        [2.5, None]
    """
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining <= MAX_TIMEOUT_SECONDS else None


def timeout_seconds(timeout) -> float:
    """A request's ``timeout`` in seconds, checked as protobuf defines a Duration.

    Example:
        >>> from google.protobuf.duration_pb2 import Duration
        >>> timeout_seconds(Duration(seconds=-1))
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: timeout: must be positive; got -1s
    """
    s, n = timeout.seconds, timeout.nanos
    if not -999_999_999 <= n <= 999_999_999 or (s and n and (s < 0) != (n < 0)):
        raise InvalidArgument(f"timeout: not a valid Duration; got {{seconds: {s}, nanos: {n}}}")
    seconds = s + n / 1e9
    shown = f"{seconds:g}s"
    if seconds <= 0:
        raise InvalidArgument(f"timeout: must be positive; got {shown}")
    if seconds > MAX_TIMEOUT_SECONDS:
        raise InvalidArgument(f"timeout: must be at most {MAX_TIMEOUT_SECONDS}s (one day); got {shown}")
    return seconds


def devices(names: Sequence[str], field: str, table: DeviceTable) -> tuple[int, ...]:
    """Device names (``destinations``, say) as the daemon's device indices, each checked.

    Example:
        >>> from xreduced.backends import DeviceInfo
        >>> table = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(2)])
        >>> devices(["CPU:1", "/cpu:0"], "destinations", table)
        (1, 0)
    """
    return tuple(table.resolve(n, f"{field}[{i}]") for i, n in enumerate(names))


def value(message: pb.DistributedValue, field: str, table: DeviceTable, regions: CallRegions | None) -> Value:
    """A DistributedValue: each component's device and its tensor (see :func:`tensor`), or its
    ``indexed_slices`` (a :class:`~xreduce.wire.sparse.Slices`, see :func:`xreduce.wire.sparse.decode`).

    Example:
        >>> from xreduced.backends import DeviceInfo
        >>> table = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(2)])
        >>> component = pb.Component(device="CPU:1", tensor=codec.encode(np.arange(2.0)))
        >>> value(pb.DistributedValue(components=[component]), "value", table, None)
        Value(devices=(1,), arrays=(array([0., 1.]),), field='value')
    """
    where, arrays = [], []
    for p, comp in enumerate(message.components):
        where.append(table.resolve(comp.device, f"{field}.components[{p}].device"))
        if comp.HasField("indexed_slices"):
            if comp.HasField("tensor"):
                raise InvalidArgument(f"{field}.components[{p}]: sets both tensor and indexed_slices; a component "
                                      "is one of them")
            arrays.append(wire_sparse.decode(comp.indexed_slices, f"{field}.components[{p}].indexed_slices"))
        else:
            arrays.append(tensor(comp.tensor, f"{field}.components[{p}].tensor", regions))
    return Value(tuple(where), tuple(arrays), field, fused_parts(message, field, arrays))


def fused_parts(message: pb.DistributedValue, field: str,
                arrays: Sequence[Any]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A fused value's parts as ``(index, shape)``, checked against its components: dense, one
    dimension, as many elements as the parts together.

    Raises:
        InvalidArgument: naming the field and the value.

    Example:
        >>> m = pb.DistributedValue(fused_parts=[pb.FusedPart(shape=[2], index=0),
        ...                                      pb.FusedPart(shape=[1, 3], index=2)])
        >>> fused_parts(m, "value", [np.zeros(5)])
        ((0, (2,)), (2, (1, 3)))
        >>> try:
        ...     fused_parts(m, "value", [np.zeros(4)])
        ... except InvalidArgument as e:
        ...     print(e)
        value.fused_parts: the parts hold 5 elements but components[0] is float64[4]
    """
    if not message.fused_parts:
        return ()
    parts = []
    for i, part in enumerate(message.fused_parts):
        if any(d < 0 for d in part.shape) or part.index < 0:
            raise InvalidArgument(f"{field}.fused_parts[{i}]: dimensions and index must be >= 0; got "
                                  f"shape={list(part.shape)}, index={part.index}")
        parts.append((part.index, tuple(part.shape)))
    total = sum(math.prod(shape) for _, shape in parts)
    for p, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise InvalidArgument(f"{field}.fused_parts: components[{p}] is sparse; only dense values are fused")
        if a.ndim != 1 or a.size != total:
            raise InvalidArgument(f"{field}.fused_parts: the parts hold {total} elements but components[{p}] is "
                                  f"{a.dtype.name}{list(a.shape)}")
    return tuple(parts)


def tensor(message: pb.Tensor, field: str, regions: CallRegions | None) -> Any:
    """A tensor: decoded from its bytes, or a view of the caller's region (pinned for the call).

    Example:
        >>> tensor(codec.encode(np.arange(3, dtype=np.int16)), "tensor", None)
        array([0, 1, 2], dtype=int16)
    """
    if not message.HasField("region"):
        return codec.decode(message, field)
    dtype, shape = codec.spec(message, field)
    if found := carried(message):
        raise InvalidArgument(f"{field}: names a region and carries {', '.join(found)}; send one of them")
    want = math.prod(shape) * dtype.itemsize
    r = message.region
    if r.byte_size != want:
        raise InvalidArgument(f"{field}.region.byte_size: {r.byte_size} bytes for {dtype.name}{list(shape)}, "
                              f"expected {want}")
    if r.offset % dtype.itemsize:
        raise InvalidArgument(f"{field}.region.offset: must be a multiple of the {dtype.name} item size "
                              f"({dtype.itemsize}); got {r.offset}")
    try:
        return _regions(regions, f"{field}.region").view(r.name, r.offset, r.byte_size, dtype, shape,
                                                         f"{field}.region")
    except ValueError as e:  # e.g. a zero-size shape whose other dimensions overflow numpy's size type
        raise InvalidArgument(f"{field}.shape: numpy cannot make an array of shape {list(shape)} ({e})") from None


def streamed(message: pb.Tensor, field: str) -> tuple[np.dtype, tuple[int, ...]]:
    """A ReduceStream header tensor's dtype and shape (its data follows in chunks), checked as
    the codec checks a tensor's.

    Example:
        >>> streamed(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2, 3], streamed=True), "tensor")
        (dtype('float32'), (2, 3))
    """
    found = carried(message)
    if message.HasField("region"):
        found.append("region")
    if found:
        raise InvalidArgument(f"{field}: a ReduceStream tensor carries no data (its bytes follow in chunks); got "
                              f"{', '.join(found)}")
    if not message.streamed:
        raise InvalidArgument(f"{field}.streamed: must be true in a ReduceStream header (the data follows in "
                              "chunks); got false")
    dtype = codec.numpy_dtype(message.dtype, f"{field}.dtype")
    shape = tuple(message.shape)
    if len(shape) > codec.MAX_DIMS:
        raise InvalidArgument(f"{field}.shape: at most {codec.MAX_DIMS} dimensions; got {len(shape)}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape: dimensions must be >= 0; got {list(shape)}")
    if any(d >= 1 << 62 for d in shape) or math.prod(shape) * dtype.itemsize >= 1 << 62:
        raise InvalidArgument(f"{field}.shape: too large; got {list(shape)}")
    return dtype, shape


def carried(message: pb.Tensor) -> list[str]:
    """The data fields a tensor carries.

    Example:
        >>> carried(pb.Tensor(raw_data=b"1234"))
        ['raw_data']
    """
    return [name for name in DATA_FIELDS if len(getattr(message, name))]


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one result component goes in an output region: the region's name, the offset in
    it, and the writable view there.

    Example:
        >>> Slot("out", 64, np.zeros(2, np.float32)).offset
        64
    """

    region: str
    offset: int
    view: Any


def layout(output: pb.RegionSlice, results: Sequence[tuple[Sequence[int], np.dtype, tuple[int, ...]]],
           regions: CallRegions | None, one_copy: bool = False) -> list[dict[int, Slot]]:
    """Places each result component in ``output`` as :func:`~xreduce.wire.layout.output_layout` says.

    Args:
        results: per result, (destination devices, dtype, shape).
        one_copy: the request's ``output_one_copy``: every destination of a result gets its first destination's
            :class:`Slot` (the same object, which the engine then writes once); the layout is the same.

    Returns:
        Per result, destination device -> its :class:`Slot`.

    Example:
        >>> layout(pb.RegionSlice(name="out", byte_size=64), [((0, 1), np.dtype(np.float32), (2,))], None)
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: output.byte_size: the results need 72 bytes (64-byte aligned, in order);
        the slice has 64
    """
    offsets, total = output_layout([(len(dests), dtype, shape) for dests, dtype, shape in results])
    if total > output.byte_size:
        raise InvalidArgument(f"output.byte_size: the results need {total} bytes ({OUTPUT_ALIGNMENT}-byte "
                              f"aligned, in order); the slice has {output.byte_size}")
    if output.offset % OUTPUT_ALIGNMENT:
        raise InvalidArgument(f"output.offset: must be a multiple of {OUTPUT_ALIGNMENT}; got {output.offset}")
    out = []
    for (dests, dtype, shape), places in zip(results, offsets):
        nbytes = math.prod(shape) * dtype.itemsize
        slots = {}
        for d, at in zip(dests, places):
            if one_copy and slots:
                slots[d] = next(iter(slots.values()))
                continue
            view = _regions(regions, "output").view(output.name, output.offset + at, nbytes, dtype, shape, "output")
            slots[d] = Slot(output.name, output.offset + at, view)
        out.append(slots)
    return out


def views(slots: dict[int, Slot] | None) -> dict[int, Any] | None:
    """The engine's ``out=`` for one result: destination device -> the view to write.

    Example:
        >>> views({0: Slot("out", 128, "the view")})
        {0: 'the view'}
    """
    return None if slots is None else {d: slot.view for d, slot in slots.items()}


def encoding(values: Sequence[pb.DistributedValue]) -> str:
    """The request's encoding, which its reply answers in: typed if any tensor carries typed values.

    Example:
        >>> encoding([pb.DistributedValue(components=[pb.Component(tensor=pb.Tensor(float_values=[1.0]))])])
        'typed'
    """
    for v in values:
        for comp in v.components:
            if comp.HasField("indexed_slices"):
                if wire_sparse.encoding_of(comp.indexed_slices) == codec.TYPED:
                    return codec.TYPED
            elif codec.encoding_of(comp.tensor) == codec.TYPED:
                return codec.TYPED
    return codec.RAW


def _regions(regions: CallRegions | None, field: str) -> CallRegions:
    if regions is None:
        raise FailedPrecondition(f"{field}: regions can only be named inside a call")
    return regions


def _enum_label(enum_type, number: int) -> str:
    try:
        return f"{enum_type.Name(number)} ({number})"
    except ValueError:
        return str(number)
