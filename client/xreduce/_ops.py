"""``CrossDeviceOps`` and its implementations, reproducing ``tf.distribute``'s.

Client-side validation raises TF's error types and messages; the reduction
itself runs in the daemon, whose errors arrive as :class:`xreduce.XReduceError`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from google.protobuf import duration_pb2

from xreduce import _ipc, _shm, _streaming
from xreduce._arrays import device_of, is_tensor, to_host
from xreduce._client import Client, process_group
from xreduce._errors import XReduceError
from xreduce._values import DistributedValues, Mirrored, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.contract import mean_dtype
from xreduce.wire.devices import canonical
from xreduce.wire.framing import streamed_tensor
from xreduce.wire.layout import output_layout

_DEST_TYPE_ERROR = (
    "destinations must be one of a `DistributedValues` object, a tf.Variable object, or a device string."
)


class ReduceOp(enum.Enum):
    """How replicas are combined: ``SUM`` or ``MEAN`` (TF's ``tf.distribute.ReduceOp``).

    Example:
        >>> ReduceOp.from_value("mean")
        <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: Any) -> ReduceOp:
        """A ``ReduceOp`` from itself or a string in any case.

        Raises:
            ValueError: anything else (TF silently sums on its all-reduce path).
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"`reduce_op` must be Reduce.SUM or Reduce.MEAN.; got {value!r}")


class CommunicationImplementation(enum.Enum):
    """TF's collective implementation hint; accepted and recorded, the daemon
    always runs its own algorithm.

    Example:
        >>> CommunicationImplementation("nccl".upper())
        <CommunicationImplementation.NCCL: 'NCCL'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Per-call options (TF's ``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: TF's collective packing hint; validated, not used by
            hierarchical copy (which packs by ``num_packs``).
        timeout_seconds: bound on the call; becomes its gRPC deadline and the
            daemon's operation timeout.
        implementation: a :class:`CommunicationImplementation` or its name.

    Raises:
        ValueError: as TF: negative ``bytes_per_pack``, an unknown implementation;
            also a non-positive ``timeout_seconds``.

    Example:
        >>> CommunicationOptions(timeout_seconds=5).timeout_seconds
        5
    """

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO):
        if bytes_per_pack < 0:
            raise ValueError(f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack}.")
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation(implementation.upper())
            except ValueError:
                raise ValueError(
                    f"Argument `implementation` must be one of AUTO, RING, NCCL; got {implementation!r}"
                ) from None
        if not isinstance(implementation, CommunicationImplementation):
            raise ValueError(
                "Argument `implementation` must be instance of "
                "`tf.distribute.experimental.CommunicationImplementation`."
            )
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"Argument `timeout_seconds` must be > 0 or None; got {timeout_seconds!r}")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation.name})")


def validate_destinations(destinations: Any) -> None:
    """TF's destination checks, plus (beyond TF) a list or tuple of device strings.

    An array is accepted, as TF accepts a tensor: its device (a host array's
    is this process's first device).

    Raises:
        ValueError: TF's messages for a wrong type or an empty destination.

    Example:
        >>> validate_destinations("")
        Traceback (most recent call last):
        ...
        ValueError: destinations can not be empty
    """
    if is_tensor(destinations):
        return
    if isinstance(destinations, (list, tuple)):
        if not all(isinstance(d, str) for d in destinations):
            raise ValueError(_DEST_TYPE_ERROR)
    elif not isinstance(destinations, (DistributedValues, str)):
        raise ValueError(_DEST_TYPE_ERROR)
    if not isinstance(destinations, DistributedValues) and (
        not destinations or any(not d for d in destinations if isinstance(destinations, (list, tuple)))
    ):
        raise ValueError("destinations can not be empty")


def _as_per_replica(value: Any) -> DistributedValues:
    if isinstance(value, DistributedValues):
        return value
    return PerReplica((value,))


def _check_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    """TF's ``_normalize_value_destination_pairs`` checks, with TF's messages."""
    pairs = list(pairs)
    for pair in pairs:
        if not isinstance(pair, tuple):
            raise ValueError("Each element of `value_destination_pairs` should be a tuple.")
        if len(pair) != 2:
            raise ValueError("Each element of `value_destination_pairs` should be a tuple of size 2.")
    return pairs


class CrossDeviceOps:
    """Base class of cross-device reduction (TF's ``tf.distribute.CrossDeviceOps``).

    Use :class:`HierarchicalCopyAllReduce` or :class:`ReductionToOneDevice`;
    both talk to the daemon at ``address`` (else ``XREDUCE_ADDRESS``, else the
    default), sending ``token`` (else ``XREDUCE_TOKEN``) with every call; TLS
    follows ``XREDUCE_TLS_CA`` and friends (see :class:`xreduce.Client`).
    Constructing one needs no running daemon.

    Example:
        >>> ops = HierarchicalCopyAllReduce(num_packs=2, address="127.0.0.1:1", token="s3cret")
        >>> ops.num_packs
        2
    """

    def __init__(self, address: str | None = None, token: str | None = None, transport: str | None = None):
        self._client = Client(address, token=token, transport=transport)

    @property
    def client(self) -> Client:
        """The connection to the daemon (opened on first use)."""
        return self._client

    def _algorithm(self) -> dict:
        raise NotImplementedError(
            "CrossDeviceOps is abstract; use HierarchicalCopyAllReduce or ReductionToOneDevice"
        )

    def _accumulate(self) -> Callable | None:
        return None

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None) -> Any:
        """Reduces ``per_replica_value`` to ``destinations``.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or the string, any case.
            per_replica_value: a :class:`PerReplica`, or one array (a one-replica value).
            destinations: a device string, a :class:`DistributedValues` (its
                devices), or a list of device strings.
            options: :class:`CommunicationOptions`.

        Returns:
            A :class:`Mirrored` over the destination devices, or a plain array
            when there is one destination device.

        Raises:
            ValueError: TF's client-side checks; :class:`xreduce.XReduceError`
                for what the daemon rejects.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded():
            ...     ops = HierarchicalCopyAllReduce()
            ...     v = PerReplica([np.array([1.0]), np.array([2.0])], devices=["CPU:0", "CPU:1"])
            ...     ops.reduce("sum", v, v).values
            (array([3.]), array([3.]))
        """
        op = ReduceOp.from_value(reduce_op)
        value = _as_per_replica(per_replica_value)
        validate_destinations(destinations)
        return self._batch(op, [(value, destinations)], options, single=True)[0]

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                     options: CommunicationOptions | None = None) -> list[Any]:
        """Reduces each (value, destinations) pair; pairs that all-reduce over
        one device set are packed together (``num_packs``).

        Returns:
            A list with one result per pair (as :meth:`reduce` returns them);
            ``[]`` for an empty batch (TF raises IndexError).

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded():
            ...     v = PerReplica([np.array([1, 2]), np.array([3, 4])], devices=["CPU:0", "CPU:1"])
            ...     HierarchicalCopyAllReduce().batch_reduce("mean", [(v, v)])[0].values[0]
            array([2., 3.])
        """
        op = ReduceOp.from_value(reduce_op)
        pairs = [(_as_per_replica(v), d) for v, d in _check_pairs(value_destination_pairs)]
        for _, d in pairs:
            validate_destinations(d)
        return self._batch(op, pairs, options, single=False)

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every destination device.

        In a multi-process job every process calls it; process 0's tensor is
        sent to every process's destinations (the others may pass ``None``).

        Returns:
            A :class:`Mirrored`, or a plain array for one destination device.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded():
            ...     HierarchicalCopyAllReduce().broadcast(np.arange(2), ["CPU:1", "CPU:2"]).devices[1]
            '/job:localhost/replica:0/task:0/device:CPU:2'
        """
        validate_destinations(destinations)
        group = process_group()
        names = self._local_names()
        dests = self._destination_names(destinations, names)
        request = pb.BroadcastRequest(destinations=dests)
        restore = _writable_numpy
        source = group is None or group.process_id == 0
        if source or tensor is not None:
            host = to_host(tensor)
            restore = host.restore
            if source:
                request.source_device = canonical(host.device) if host.device else names[0]
        with _collective(self._client, group) as spec:
            if spec is not None:
                request.collective.CopyFrom(spec)
            shm = self._client.shared_memory() if source else None
            free, result, metadata = (lambda: None), codec.decode, ()
            try:
                if shm is not None:
                    try:
                        (staged,), free = shm.stage([host.array])
                        output, result = shm.output(
                            output_layout([(len(dests), host.array.dtype, host.array.shape)]).nbytes)
                    except OSError:  # no room in /dev/shm: the wire, unless shared memory was insisted on
                        if self._client.transport == "shm":
                            raise
                        shm = None
                if shm is not None:
                    request.tensor.CopyFrom(staged)
                    request.output.CopyFrom(output)
                    metadata = shm.metadata()
                elif source:
                    request.tensor.CopyFrom(codec.encode(host.array))
                reply = self._client.call("Broadcast", request, None, metadata)
            finally:
                free()
        return _regroup(reply.result, restore, result)

    def _local_names(self) -> Sequence[str]:
        """Fetched only if a value or destination needs them: a collective whose
        devices are all named fails fast when the daemon is down."""
        return _Lazy(self._fetch_local_names)

    def _fetch_local_names(self) -> Sequence[str]:
        """This process's devices: all the daemon's, or its share in a multi-process job."""
        group = process_group()
        return group.local_devices if group is not None else self._client.device_names()

    def _destination_names(self, destinations: Any, names: Sequence[str]) -> list[str]:
        if isinstance(destinations, DistributedValues):
            return list(destinations._resolve_devices(names))
        if isinstance(destinations, str):
            return [canonical(destinations)]
        if is_tensor(destinations):
            device = device_of(destinations)
            return [canonical(device) if device else names[0]]
        return [canonical(d) for d in destinations]

    def _batch(self, op: ReduceOp, pairs, options, single: bool) -> list[Any]:
        options = options or CommunicationOptions()
        group = process_group()
        if not pairs and group is None:
            return []
        names = self._local_names()
        wire = []
        for value, dest in pairs:
            devices = value._resolve_devices(names)
            wire.append((value, devices, self._destination_names(dest, names)))
        accumulate = self._accumulate()
        if accumulate is not None:
            if group is not None:
                raise ValueError("accumulation_fn runs in one process; it cannot reduce across the processes "
                                 f"of group {group.group!r}")
            return [self._accumulated(op, accumulate, v, d) for v, _, d in wire]
        # TF's shortcut: one replica whose destinations are its own device (never across processes).
        first = set(wire[0][1]) if wire else set()
        if group is None and len(first) == 1 and all(set(devs) == set(dests) == first for _, devs, dests in wire):
            return [_regroup_local(v) for v, _, _ in wire]
        fields = dict(self._algorithm(), reduce_op=pb.ReduceOp.Value(f"REDUCE_OP_{op.value}"))
        timeout = None
        if options.timeout_seconds is not None:
            fields["timeout"] = duration_pb2.Duration()
            fields["timeout"].FromNanoseconds(int(options.timeout_seconds * 1e9))
            timeout = options.timeout_seconds + 5.0  # the daemon's own deadline message comes first
        with _collective(self._client, group) as spec:
            if spec is not None:
                fields["collective"] = spec
            return self._batch_to_daemon(op, wire, fields, single, timeout, group)

    def _batch_to_daemon(self, op: ReduceOp, wire, fields: dict, single: bool, timeout: float | None,
                         group) -> list[Any]:
        shm = self._client.shared_memory()
        if shm is not None:
            try:
                return self._batch_shm(shm, op, wire, fields, single, timeout)
            except OSError:  # no room in /dev/shm: the wire, unless shared memory was insisted on
                if self._client.transport == "shm":
                    raise
        if group is None:
            hosts = [v.hosts() for v, _, _ in wire]
            if sum(h.array.nbytes for hs in hosts for h in hs) > _streaming.STREAM_THRESHOLD_BYTES:
                return self._batch_streamed(hosts, wire, fields, timeout)
        values = [_encode_value(v, devs) for v, devs, _ in wire]
        if single:
            (value, _, dests), = wire
            request = pb.ReduceRequest(value=values[0], destinations=dests, **fields)
            reply = self._client.call("Reduce", request, timeout)
            return [_regroup(reply.result, value.hosts()[0].restore)]
        request = pb.BatchReduceRequest(
            pairs=[pb.ReducePair(value=m, destinations=d) for m, (_, _, d) in zip(values, wire)], **fields
        )
        reply = self._client.call("BatchReduce", request, timeout)
        return [_regroup(r.result, v.hosts()[0].restore) for r, (v, _, _) in zip(reply.results, wire)]

    def _batch_streamed(self, hosts, wire, fields: dict, timeout: float | None) -> list[Any]:
        """``_batch`` over ``ReduceStream``: large payloads in chunks, with no message limit."""
        header = pb.BatchReduceRequest(pairs=[
            pb.ReducePair(destinations=dests, value=pb.DistributedValue(components=[
                pb.Component(device=d, tensor=streamed_tensor(h.array)) for d, h in zip(devs, hs)]))
            for (_, devs, dests), hs in zip(wire, hosts)], **fields)
        results = _streaming.stream_batch_reduce(self._client, header, [[h.array for h in hs] for hs in hosts],
                                                 timeout)
        out = []
        for (_, components), hs in zip(results, hosts):
            arrays = [hs[0].restore(a) for _, a in components]
            out.append(arrays[0] if len(arrays) == 1 else Mirrored(arrays, devices=[d for d, _ in components]))
        return out

    def _batch_shm(self, shm: _shm.Transport, op: ReduceOp, wire, fields: dict, single: bool,
                   timeout: float | None) -> list[Any]:
        """``_batch`` through shared memory: regions in, results written into an output region.

        CuPy values travel as CUDA IPC regions instead when the daemon can open them
        (its backend is cupy, and it is not embedded in this process); the results
        are then CuPy arrays on the first value's GPU.
        """
        raw = [list(v._values) for v, _, _ in wire]
        ipc = _ipc.staging(shm, self._client.address, raw)
        if ipc is not None:
            arrays = [a for values in raw for a in values]
            restores = [(lambda a: a)] * len(wire)
            stage, make_output = ipc.stage, ipc.output
        else:
            hosts = [v.hosts() for v, _, _ in wire]
            arrays = [h.array for hs in hosts for h in hs]
            restores = [hs[0].restore for hs in hosts]
            stage, make_output = shm.stage, shm.output
        firsts = [values[0] for values in raw] if ipc is not None else [hs[0].array for hs in hosts]
        tensors, free = stage(arrays)
        try:
            it = iter(tensors)
            values = [pb.DistributedValue(components=[pb.Component(device=d, tensor=next(it)) for d in devs])
                      for (_, devs, _) in wire]
            output, result = make_output(output_layout([
                (len(dests), mean_dtype(first.dtype) if op is ReduceOp.MEAN else first.dtype, tuple(first.shape))
                for (_, _, dests), first in zip(wire, firsts)
            ]).nbytes)
            metadata = shm.metadata()
            if single:
                (_, _, dests), = wire
                request = pb.ReduceRequest(value=values[0], destinations=dests, output=output, **fields)
                replies = [self._client.call("Reduce", request, timeout, metadata).result]
            else:
                request = pb.BatchReduceRequest(pairs=[pb.ReducePair(value=m, destinations=d)
                                                       for m, (_, _, d) in zip(values, wire)], output=output, **fields)
                replies = [r.result for r in self._client.call("BatchReduce", request, timeout, metadata).results]
        finally:
            free()
        return [_regroup(r, restore, result) for r, restore in zip(replies, restores)]

    def _accumulated(self, op: ReduceOp, accumulate: Callable, value: DistributedValues,
                     dests: list[str]) -> Any:
        arrays = [h.array for h in value.hosts()]
        total = np.asarray(accumulate(arrays))
        if op is ReduceOp.MEAN:
            total = _mean(total, len(arrays))
        reply = self._client.call("Broadcast", pb.BroadcastRequest(
            tensor=codec.encode(total), source_device=dests[0], destinations=dests))
        return _regroup(reply.result, value.hosts()[0].restore)

    def close(self) -> None:
        """Closes the connection to the daemon."""
        self._client.close()


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    f = mean_dtype(total.dtype).type
    return (total.astype(f) if total.dtype.kind in "iu" else total) / f(n)


def _encode_value(value: DistributedValues, devices: Sequence[str]) -> pb.DistributedValue:
    return pb.DistributedValue(components=[
        pb.Component(device=d, tensor=codec.encode(h.array)) for d, h in zip(devices, value.hosts())
    ])


@contextlib.contextmanager
def _collective(client: Client, group):
    """The next collective of this process's group (None without one), its sequence number
    taken first: when something fails on this side before the daemon answers, the collective
    is abandoned for every process (they get AbortedError at once) instead of the next call
    of this process meeting the others' current one."""
    spec = group.next_spec() if group is not None else None
    try:
        yield spec
    except XReduceError:
        # The daemon answered: it failed the collective for the others where it must. (A refusal before
        # the collective call, e.g. of a region, leaves the others to their timeout; the number is spent.)
        raise
    except BaseException:
        if spec is not None:
            # A request the daemon rejects (no reduce op) fails the collective for every process.
            with contextlib.suppress(Exception):
                client.call("BatchReduce", pb.BatchReduceRequest(collective=spec), 10.0)
        raise


def _regroup(result: pb.DistributedValue, restore: Callable, decode: Callable = codec.decode) -> Any:
    arrays = [restore(decode(c.tensor)) for c in result.components]
    if len(arrays) == 1:
        return arrays[0]
    return Mirrored(arrays, devices=[c.device for c in result.components])


class _Lazy(Sequence):
    """A sequence computed on first use."""

    def __init__(self, fetch: Callable[[], Sequence[str]]):
        self._fetch = fetch
        self._items: tuple[str, ...] | None = None

    def _get(self) -> tuple[str, ...]:
        if self._items is None:
            self._items = tuple(self._fetch())
        return self._items

    def __getitem__(self, index):
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())


def _writable_numpy(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


def _regroup_local(value: DistributedValues) -> Any:
    host = value.hosts()[0]
    return host.restore(np.array(host.array, copy=True))


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """TF's hierarchical copy all-reduce, run by the daemon.

    Args:
        num_packs: the batch is flattened, concatenated and split into this many
            packs, each reduced around its own pair of main devices; 0 disables
            packing. Never changes the numbers.
        address: the daemon; see :func:`xreduce.resolve_address`.
        token: the daemon's bearer token (``--auth-token-file``); default
            ``XREDUCE_TOKEN``, else none.
        transport: ``"auto"``, ``"shm"`` or ``"wire"``; see :class:`xreduce.Client`.

    Raises:
        ValueError: ``num_packs`` < 0, with TF's message.

    Example:
        >>> HierarchicalCopyAllReduce(num_packs=-1)
        Traceback (most recent call last):
        ...
        ValueError: HierarchicalCopy requires num_packs >= 0, but -1 is specified
        >>> ops = HierarchicalCopyAllReduce(address="10.0.0.5:50551", token="s3cret")  # a remote daemon
    """

    def __init__(self, num_packs: int = 1, address: str | None = None, token: str | None = None,
                 transport: str | None = None):
        if num_packs < 0:
            raise ValueError(f"HierarchicalCopy requires num_packs >= 0, but {num_packs} is specified")
        super().__init__(address, token, transport)
        self.num_packs = num_packs

    def _algorithm(self) -> dict:
        return {"algorithm": pb.ALGORITHM_HIERARCHICAL_COPY, "num_packs": self.num_packs}


class ReductionToOneDevice(CrossDeviceOps):
    """TF's reduction to one device: sum on one device, copy to every destination.

    Args:
        reduce_to_device: where to sum (any device-name form); default the
            first destination.
        accumulation_fn: ``fn(list_of_arrays) -> array``; when given it runs in
            this process on host copies of the values (the daemon cannot run
            Python), then the result is broadcast to the destinations.
        address: the daemon.
        token: the daemon's bearer token; default ``XREDUCE_TOKEN``, else none.
        transport: ``"auto"``, ``"shm"`` or ``"wire"``; see :class:`xreduce.Client`.

    Example:
        >>> ReductionToOneDevice(reduce_to_device="gpu:1").reduce_to_device
        '/job:localhost/replica:0/task:0/device:GPU:1'
        >>> ops = ReductionToOneDevice(address="unix:/run/xreduce.sock", token="s3cret")
    """

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None,
                 address: str | None = None, token: str | None = None, transport: str | None = None):
        super().__init__(address, token, transport)
        self.reduce_to_device = canonical(reduce_to_device) if reduce_to_device is not None else None
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise ValueError(f"accumulation_fn must be callable; got {accumulation_fn!r}")
        self.accumulation_fn = accumulation_fn

    def _algorithm(self) -> dict:
        return {"algorithm": pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE,
                "reduce_to_device": self.reduce_to_device or ""}

    def _accumulate(self) -> Callable | None:
        return self.accumulation_fn
