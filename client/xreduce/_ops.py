"""``CrossDeviceOps`` and its implementations, reproducing ``tf.distribute``'s.

The front: as TF's ``reduce`` validates, shortcuts and then calls
``reduce_implementation``, each method here raises TF's client-side errors,
takes TF's shortcuts (nothing to reduce, a value already where it goes),
resolves the device names, and hands one :class:`~xreduce._call.ReduceCall`
or :class:`~xreduce._call.BroadcastCall` to the transport layer
(:mod:`xreduce._transports`), which picks the path and builds the request.
The reduction itself runs in the daemon, whose errors arrive as
:class:`xreduce.XReduceError`.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce import _chunks, _ipc, _out, _sparse, _transports
from xreduce._arrays import check_dtype, device_of, is_tensor, to_host
from xreduce._call import Algorithm, BroadcastCall, Pair, ReduceCall
from xreduce._client import Client
from xreduce._errors import DeadlineExceededError
from xreduce._job_devices import DaemonName, job_devices, reduce_to, to_daemon
from xreduce._options import ConnectionOptions, merge
from xreduce._runtime import ProcessGroup, process_group
from xreduce._values import DistributedValues, Mirrored, PerReplica
from xreduce.wire.contract import mean_dtype
from xreduce.wire.devices import canonical

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
        raise ValueError(f"`reduce_op` must be Reduce.SUM or Reduce.MEAN; got {value!r}")


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
            also a ``bytes_per_pack`` that is not an integer, a
            ``timeout_seconds`` that is not a number > 0.

    Example:
        >>> CommunicationOptions(timeout_seconds=5).timeout_seconds
        5
    """

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO):
        if not _is_integer(bytes_per_pack):
            raise ValueError(f"Argument `bytes_per_pack` must be an integer >= 0; got {bytes_per_pack!r} of type "
                             f"{type(bytes_per_pack).__name__}")
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
        if timeout_seconds is not None and (isinstance(timeout_seconds, bool)
                                            or not isinstance(timeout_seconds, numbers.Real)):
            raise ValueError(f"Argument `timeout_seconds` must be a number > 0 or None; got {timeout_seconds!r} of "
                             f"type {type(timeout_seconds).__name__}")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"Argument `timeout_seconds` must be > 0 or None; got {timeout_seconds!r}")
        self.bytes_per_pack = int(bytes_per_pack)
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation.name})")


def _is_integer(value: Any) -> bool:
    """Python's and numpy's integers; not bools (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


MAX_NUM_PACKS = (1 << 31) - 1
"""The most packs a request can carry (the wire's ``num_packs`` is an int32)."""


def checked_num_packs(num_packs: Any, algorithm: str) -> int:
    """``num_packs`` as an int, refused with TF's message for ``algorithm`` when it is negative, and when it
    is over :data:`MAX_NUM_PACKS`.

    Example:
        >>> checked_num_packs(2, "HierarchicalCopy")
        2
        >>> checked_num_packs(2**70, "HierarchicalCopy")
        Traceback (most recent call last):
        ...
        ValueError: num_packs must be in [0, 2147483647] (0: no packing); got 1180591620717411303424
    """
    if not _is_integer(num_packs):
        raise ValueError(f"num_packs must be an integer >= 0 (0: no packing); got {num_packs!r} of type "
                         f"{type(num_packs).__name__}")
    if num_packs < 0:
        raise ValueError(f"{algorithm} requires num_packs >= 0, but {num_packs} is specified")
    if num_packs > MAX_NUM_PACKS:
        raise ValueError(f"num_packs must be in [0, {MAX_NUM_PACKS}] (0: no packing); got {num_packs}")
    return int(num_packs)


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


def _as_per_replica(value: Any, argument: str) -> DistributedValues:
    """``value`` as a distributed value, its dtypes checked; ``argument`` names it in the messages.

    A value whose components mix ``IndexedSlices`` and dense arrays is made dense, as TF adds them.
    """
    if isinstance(value, DistributedValues):
        for i, component in enumerate(value.values):
            _sparse.check_component(component, f"{argument}.values[{i}]")
        dense = _sparse.uniform(value.values)
        if dense is not None:
            out = type(value)(dense, devices=value._devices)
            out._devices = value._devices  # as they were: an array's own device stays one
            return out
        return value
    _sparse.check_component(value, argument)
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
    follows ``XREDUCE_TLS_CA`` and friends (see :class:`xreduce.Client`), or
    ``options``, a :class:`xreduce.ConnectionOptions` (keywords given win).
    Constructing one needs no running daemon. In a multi-process job each
    collective spans the group this process joined with the same daemon.

    Example:
        >>> ops = HierarchicalCopyAllReduce(num_packs=2, address="127.0.0.1:1", token="s3cret")
        >>> ops.num_packs
        2
    """

    def __init__(self, address: str | None = None, token: str | None = None, transport: str | None = None, *,
                 options: ConnectionOptions | None = None):
        self._client = Client(options=merge(options, address=address, token=token, transport=transport))

    @property
    def client(self) -> Client:
        """The connection to the daemon (opened on first use)."""
        return self._client

    def _algorithm(self) -> Algorithm:
        raise NotImplementedError(
            "CrossDeviceOps is abstract; use HierarchicalCopyAllReduce or ReductionToOneDevice"
        )

    def _accumulate(self) -> Callable | None:
        return None

    def _group(self) -> ProcessGroup | None:
        """The multi-process group this process joined with this ops' daemon, or None."""
        return process_group(self._client.address)

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None, *, out: Any = None) -> Any:
        """Reduces ``per_replica_value`` to ``destinations``.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or the string, any case.
            per_replica_value: a :class:`PerReplica`, or one array (a one-replica value);
                its components may be :class:`~xreduce.distribute.IndexedSlices`, which
                are concatenated as TF does (see :mod:`xreduce._sparse`).
            destinations: a device string, a :class:`DistributedValues` (its
                devices), or a list of device strings.
            options: :class:`CommunicationOptions`.
            out: where the result goes (not TF's; gloo's and MPI's in-place
                form): a numpy array for one destination device, else a list
                with one per destination; it may be the input itself. See
                :mod:`xreduce._out`. Values of more than 64 MiB a replica are
                reduced in chunks either way (:mod:`xreduce._chunks`).

        Returns:
            A :class:`Mirrored` over the destination devices, or a plain array
            when there is one destination device; ``IndexedSlices`` for a sparse value;
            with ``out``, the ``out`` arrays holding the result.

        Raises:
            ValueError: TF's client-side checks; a value of a dtype the daemon
                does not reduce (see ``xreduce.SUPPORTED_DTYPES``), before
                anything is sent; :class:`xreduce.XReduceError` for what the
                daemon rejects.
            xreduce.InvalidArgumentError: in a multi-process job, a device
                (of the value or a destination) that is another process's;
                the message says whose and lists this process's
                (:mod:`xreduce._job_devices`). The collective fails in every process.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded():
            ...     ops = HierarchicalCopyAllReduce()
            ...     v = PerReplica([np.array([1.0]), np.array([2.0])], devices=["CPU:0", "CPU:1"])
            ...     ops.reduce("sum", v, v).values
            (array([3.]), array([3.]))

            In place (``out``):

            >>> with xreduce.serve_embedded():
            ...     a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
            ...     v = PerReplica([a, b], devices=["CPU:0", "CPU:1"])
            ...     r = HierarchicalCopyAllReduce().reduce("sum", v, v, out=[a, b])
            >>> r.values[0] is a, a
            (True, array([4., 6.]))
        """
        op = ReduceOp.from_value(reduce_op)
        value = _as_per_replica(per_replica_value, "per_replica_value")
        validate_destinations(destinations)
        return self._batch(op, [(value, destinations)], options, single=True, outs=[out])[0]

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                     options: CommunicationOptions | None = None, *, out: Any = None) -> list[Any]:
        """Reduces each (value, destinations) pair; pairs that all-reduce over
        one device set are packed together (``num_packs``).

        A batch that mixes dense and sparse values is split as TF splits it: the
        dense ones are reduced (and packed) together, the sparse ones concatenated.
        ``out``, when given, is a list with one entry per pair, each None or
        what :meth:`reduce` takes as ``out``.

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
        pairs = [(_as_per_replica(v, f"value_destination_pairs[{i}][0]"), d)
                 for i, (v, d) in enumerate(_check_pairs(value_destination_pairs))]
        for _, d in pairs:
            validate_destinations(d)
        if out is not None and (isinstance(out, np.ndarray) or not isinstance(out, Sequence)
                                or len(out) != len(pairs)):
            raise ValueError(f"out must be a list with one entry (None or the pair's arrays) per pair, "
                             f"{len(pairs)}; got {_out.describe(out)}")
        return self._batch(op, pairs, options, single=False, outs=list(out) if out is not None else None)

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
        if tensor is not None:
            check_dtype(tensor, "tensor")
        group = self._group()
        names = self._local_names(group)
        dests = tuple(self._destination_names(destinations, names))
        restore, array, source_device = _writable_numpy, None, ""
        source = group is None or group.process_id == 0
        if source or tensor is not None:
            host = to_host(tensor)
            restore = host.restore
            if source:
                array = host.array
                source_device = DaemonName(canonical(host.device)) if host.device else names[0]
        with _transports.collective(self._client, group) as spec:
            wire = tuple(to_daemon(d, group, _field("destinations", destinations, i)) for i, d in enumerate(dests))
            if source_device:
                source_device = to_daemon(source_device, group, "tensor.device")
            call = BroadcastCall(array, restore, source_device, wire, spec)
            result = _transports.choose(self._client, call).broadcast(call)
        return _relabel(result, dict(zip(wire, dests)))

    def _local_names(self, group: ProcessGroup | None) -> Sequence[str]:
        """This process's devices: all the daemon's, or its share in a multi-process job (the job's names).

        Fetched only if a value or destination needs them: a collective whose
        devices are all named fails fast when the daemon is down.
        """
        return _Lazy(lambda: job_devices(group).mine if group is not None else self._client.device_names())

    def _destination_names(self, destinations: Any, names: Sequence[str]) -> list[str]:
        """The destinations as the caller named them, canonical (an array's own device as a ``DaemonName``)."""
        if isinstance(destinations, DistributedValues):
            return list(destinations._resolve_devices(names))
        if isinstance(destinations, str):
            return [canonical(destinations)]
        if is_tensor(destinations):
            device = device_of(destinations)
            return [DaemonName(canonical(device)) if device else names[0]]
        return [canonical(d) for d in destinations]

    def _batch(self, op: ReduceOp, pairs: list[tuple[DistributedValues, Any]],
               options: CommunicationOptions | None, single: bool, outs: list[Any] | None = None) -> list[Any]:
        options = options or CommunicationOptions()
        group = self._group()
        if not pairs and group is None:
            return []
        names = self._local_names(group)
        given = tuple(Pair(value, tuple(value._resolve_devices(names)), tuple(self._destination_names(dest, names)))
                      for value, dest in pairs)
        fields = [_pair_fields(dest, k, single) for k, (_, dest) in enumerate(pairs)]
        outs = outs if outs is not None and any(o is not None for o in outs) else None

        def check() -> list[list[np.ndarray] | None]:
            if outs is None:
                return [None] * len(given)
            return [_out.checked(o, p, op.value, "out" if single else f"out[{k}]")
                    for k, (o, p) in enumerate(zip(outs, given))]

        if group is not None:
            if self._accumulate() is not None:
                raise ValueError("accumulation_fn runs in one process; it cannot reduce across the processes "
                                 f"of group {group.group!r}")
            return self._send(op, given, fields, options, group, single, check)
        wire = tuple(_to_daemon(p, f, None) for p, f in zip(given, fields))
        accumulate = self._accumulate()
        if accumulate is not None:
            arrays = check()
            return [_out.written(r, a) for r, a in
                    zip(self._accumulated_batch(op, accumulate, given, wire, fields, options, single), arrays)]
        # TF's shortcut: one replica whose destinations are its own device (never across processes).
        first = set(wire[0].devices) if wire else set()
        if len(first) == 1 and all(set(p.devices) == set(p.destinations) == first for p in wire):
            arrays = check()
            return [_out.written(_regroup_local(p.value), a) for p, a in zip(wire, arrays)]
        return self._send(op, given, fields, options, None, single, check)

    def _send(self, op: ReduceOp, given: tuple[Pair, ...], fields: list[tuple[str, str]],
              options: CommunicationOptions, group: ProcessGroup | None, single: bool,
              check: Callable[[], list[list[np.ndarray] | None]] | None = None) -> list[Any]:
        """The pairs as the caller named them reduced: their devices mapped to the daemon's names inside the
        collective (a refused name or ``out``, checked by ``check``, fails it for every process), the results
        named as the caller named them and written into the ``out`` arrays ``check`` returns. Host values of
        more than :func:`xreduce._chunks.chunk_bytes` a replica go in chunks (:meth:`_chunked`)."""
        check = check or (lambda: [None] * len(given))
        if self._cut(given):
            return self._chunked(op, given, fields, options, group, check)
        arrays: list[list[np.ndarray] | None] = []

        def checked() -> np.ndarray | None:
            arrays.extend(check())
            return arrays[0][0] if len(arrays) == 1 and arrays[0] is not None and len(arrays[0]) == 1 else None

        results = self._send_once(op, given, fields, options.timeout_seconds, group, single, checked)
        return [_out.written(r, a) for r, a in zip(results, arrays)]

    def _cut(self, given: tuple[Pair, ...]) -> bool:
        """Whether ``given`` goes in chunks (:func:`_chunked_call`); a subclass that knows nothing is staged
        (``xreduce.torch``: tensors in shared memory, reduced in place) sends it whole."""
        return _chunked_call(given, self._algorithm())

    def _send_once(self, op: ReduceOp, given: tuple[Pair, ...], fields: list[tuple[str, str]],
                   timeout: float | None, group: ProcessGroup | None, single: bool,
                   check: Callable[[], np.ndarray | None] | None = None) -> list[Any]:
        """One collective of ``given``: ``check`` runs first inside it (what it raises fails every process) and
        returns where the daemon may write a one-pair call's result (:attr:`xreduce._call.ReduceCall.out`)."""
        algorithm = self._algorithm()
        with _transports.collective(self._client, group) as spec:
            out = check() if check is not None else None
            wire = tuple(_to_daemon(p, f, group) for p, f in zip(given, fields))
            if algorithm.reduce_to_device:
                algorithm = dataclasses.replace(algorithm, reduce_to_device=reduce_to(algorithm.reduce_to_device,
                                                                                        group))
            call = ReduceCall(op.value, wire, algorithm, timeout, spec, single, out)
            results = _transports.choose(self._client, call).reduce(call)
        return [_relabel(r, dict(zip(w.destinations, p.destinations))) for r, w, p in zip(results, wire, given)]

    def _chunked(self, op: ReduceOp, given: tuple[Pair, ...], fields: list[tuple[str, str]],
                 options: CommunicationOptions, group: ProcessGroup | None,
                 check: Callable[[], list[list[np.ndarray] | None]]) -> list[Any]:
        """``given`` reduced in chunks of at most :func:`xreduce._chunks.chunk_bytes` a replica, one collective
        each, the results copied into arrays allocated once (or the ``out`` arrays); in a job, after the
        processes agreed on the chunks."""
        deadline = None if options.timeout_seconds is None else time.monotonic() + options.timeout_seconds
        most = _chunks.chunk_bytes()
        arrays: list[list[np.ndarray] | None] = []

        def checked() -> None:
            arrays.extend(check())

        if group is not None:
            replicas = self._agree(op, given, fields, most, group, _left(deadline, options), checked)
            most = _chunks.per_replica(most, -(-replicas // group.num_processes))
        else:
            checked()
            most = _chunks.per_replica(most, len(given[0].devices))
        owned = [a is None for a in arrays]  # result arrays this call allocates (given back in the caller's type)
        for k, p in enumerate(given):
            if arrays[k] is None:
                first = p.value.hosts()[0].array
                arrays[k] = [np.empty(first.shape, _out.result_dtype(op.value, first.dtype)) for _ in p.destinations]
        flats = [[_chunks.flat(h.array) for h in p.value.hosts()] for p in given]
        chunks = _chunks.plan([(f[0].size, f[0].itemsize) for f in flats], most)
        devices: list[tuple[str, ...] | None] = [None] * len(given)  # per pair, its results' devices

        def send(n: int, chunk: list[_chunks.Piece], numbered: Callable[[], None]) -> list[Any]:
            pieces = tuple(Pair(PerReplica([f[a:b] for f in flats[k]], devices=list(given[k].devices)),
                                given[k].devices, given[k].destinations) for k, a, b in chunk)
            (k, a, b) = chunk[0]

            def out() -> np.ndarray | None:
                numbered()
                return arrays[k][0].reshape(-1)[a:b] if len(chunk) == 1 and len(arrays[k]) == 1 else None

            return self._send_once(op, pieces, [fields[k] for k, _, _ in chunk], _left(deadline, options, n,
                                   len(chunks)), group, len(pieces) == 1 and len(given) == 1, out)

        def copy_out(chunk: list[_chunks.Piece], results: list[Any]) -> None:
            for (k, a, b), r in zip(chunk, results):
                devices[k] = _out.devices_of(r)  # not r: a view of an output segment keeps it from its pool
                for dest, v in zip(arrays[k], r.values if isinstance(r, Mirrored) else (r,)):
                    _out.copy_into(dest.reshape(-1)[a:b], np.asarray(v).reshape(-1))

        _chunks.pipelined(chunks, send, copy_out)
        restores = [p.value.hosts()[0].restore if mine else _as_is for p, mine in zip(given, owned)]
        return [_out.like(d, [restore(x) for x in a]) for d, a, restore in zip(devices, arrays, restores)]

    def _agree(self, op: ReduceOp, given: tuple[Pair, ...], fields: list[tuple[str, str]], most: int,
               group: ProcessGroup, timeout: float | None, check: Callable[[], None]) -> int:
        """Every process of ``group`` checks that the others cut the same chunks (:func:`xreduce._chunks.agreed`)
        before the first one; a mismatch raises the same ``ValueError`` in each.

        Returns:
            The number of replicas of the job."""
        first = given[0]
        mine = _chunks.signature(op.value, given, most)
        value = PerReplica(list(_chunks.agreement(mine, len(first.devices))), devices=list(first.devices))
        pair = Pair(value, first.devices, first.devices)
        (total,) = self._send_once(ReduceOp.SUM, (pair,), [(fields[0][0], fields[0][0])], timeout, group, True,
                                   check)
        total = total.values[0] if isinstance(total, Mirrored) else total
        replicas = _chunks.agreed(np.asarray(total))
        if replicas is None:
            shapes = [(tuple(h.shape), h.dtype.name) for h in (p.value.hosts()[0].array for p in given)]
            raise ValueError(f"the processes of group {group.group!r} reduce different values: this process's "
                             f"{op.value} of {shapes} (over {_chunks.chunk_bytes()} bytes a replica, so in chunks) "
                             "does not match another process's; every process must pass the same shapes and dtypes "
                             "(and the same XREDUCE_CHUNK_BYTES)")
        return replicas

    def _accumulated_batch(self, op: ReduceOp, accumulate: Callable, given: tuple[Pair, ...], wire: tuple[Pair, ...],
                           fields: list[tuple[str, str]], options: CommunicationOptions, single: bool) -> list[Any]:
        """Dense pairs through ``accumulation_fn``; sparse ones concatenated by the daemon, as TF's
        ``aggregate_tensors_or_indexed_slices`` ignores ``accumulation_fn`` for them."""
        sparse = [i for i, p in enumerate(given) if _sparse.is_sparse(p.value.values)]
        concatenated = iter(self._send(op, tuple(given[i] for i in sparse), [fields[i] for i in sparse], options, None,
                                       single) if sparse else ())
        return [next(concatenated) if i in sparse else self._accumulated(op, accumulate, w, p)
                for i, (w, p) in enumerate(zip(wire, given))]

    def _accumulated(self, op: ReduceOp, accumulate: Callable, pair: Pair, given: Pair) -> Any:
        """``accumulation_fn`` over host copies of the value, here; the total broadcast to the destinations."""
        hosts = pair.value.hosts()
        total = np.asarray(accumulate([h.array for h in hosts]))
        if op is ReduceOp.MEAN:
            total = _mean(total, len(hosts))
        call = BroadcastCall(total, hosts[0].restore, pair.destinations[0], pair.destinations)
        result = _transports.choose(self._client, call).broadcast(call)
        return _relabel(result, dict(zip(pair.destinations, given.destinations)))

    def close(self) -> None:
        """Closes the connection to the daemon."""
        self._client.close()


def _chunked_call(given: tuple[Pair, ...], algorithm: Algorithm) -> bool:
    """Whether ``given`` goes in chunks: dense host values (no CuPy) of more than
    :func:`xreduce._chunks.chunk_bytes` a replica, reduced by an algorithm that sums in the same order
    whatever the packing (not NCCL's). A packed batch of mixed dtypes goes whole, for the daemon to refuse
    as it refuses it unchunked."""
    if algorithm.name == "nccl" or not given:
        return False
    for p in given:
        if _sparse.is_sparse(p.value.values) or any(_ipc.is_cupy(v) for v in p.value.values):
            return False
    most = _chunks.chunk_bytes()
    try:
        if algorithm.num_packs and len({p.value.hosts()[0].array.dtype for p in given}) > 1:
            return False
        return _chunks.replica_bytes(given) > most
    except ValueError:
        return False  # a bad value: the call fails inside its collective, for every process


def _left(deadline: float | None, options: CommunicationOptions, done: int = 0, chunks: int = 1) -> float | None:
    """Seconds left of ``options.timeout_seconds`` (None: no bound).

    Raises:
        xreduce.DeadlineExceededError: none left, after ``done`` of ``chunks`` chunks.
    """
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"options.timeout_seconds {options.timeout_seconds} passed after {done} of "
                                    f"{chunks} chunks of the reduce")
    return left


def _as_is(a: np.ndarray) -> np.ndarray:
    return a


def _pair_fields(destinations: Any, k: int, single: bool) -> tuple[str, str]:
    """How the messages name pair ``k``'s value devices and destinations (a ``str.format`` of the index)."""
    value = "per_replica_value" if single else f"value_destination_pairs[{k}][0]"
    dests = "destinations" if single else f"value_destination_pairs[{k}][1]"
    return f"{value}.devices[{{}}]", _field(dests, destinations, None)


def _field(name: str, destinations: Any, i: int | None) -> str:
    """``name`` of destination ``i`` (``{}`` for it when None): the string itself, or its ``[i]``."""
    if isinstance(destinations, str) or is_tensor(destinations):
        return name
    if isinstance(destinations, DistributedValues):
        name += ".devices"
    return f"{name}[{'{}' if i is None else i}]"


def _to_daemon(pair: Pair, fields: tuple[str, str], group: ProcessGroup | None) -> Pair:
    """``pair`` with every device named as this process's daemon names it (see :mod:`xreduce._job_devices`)."""
    value, dests = fields
    return Pair(pair.value, tuple(to_daemon(d, group, value.format(i)) for i, d in enumerate(pair.devices)),
                tuple(to_daemon(d, group, dests.format(i)) for i, d in enumerate(pair.destinations)))


def _relabel(result: Any, names: dict[str, str]) -> Any:
    """A result over several devices named as the caller named its destinations (``names``: the daemon's
    name -> the caller's)."""
    if not isinstance(result, DistributedValues) or all(names.get(d, d) == d for d in result.devices):
        return result
    out = Mirrored(result.values, devices=[names.get(d, d) for d in result.devices])
    out._devices = tuple(names.get(d, d) for d in result.devices)  # an array's own device stays one
    return out


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    f = mean_dtype(total.dtype).type
    return (total.astype(f) if total.dtype.kind in "iu" else total) / f(n)


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
    if isinstance(host, _sparse.HostSlices):
        return _sparse.copy(host)
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
        options: the connection settings as one :class:`xreduce.ConnectionOptions`.

    Raises:
        ValueError: ``num_packs`` < 0, with TF's message; ``num_packs`` not an
            integer (TF accepts it and fails on use).

    Example:
        >>> HierarchicalCopyAllReduce(num_packs=-1)
        Traceback (most recent call last):
        ...
        ValueError: HierarchicalCopy requires num_packs >= 0, but -1 is specified
        >>> ops = HierarchicalCopyAllReduce(address="10.0.0.5:50551", token="s3cret")  # a remote daemon
        >>> import xreduce
        >>> remote = xreduce.ConnectionOptions(address="10.0.0.5:50551", token="s3cret", transport="wire")
        >>> HierarchicalCopyAllReduce(num_packs=2, options=remote).client.address
        '10.0.0.5:50551'
    """

    def __init__(self, num_packs: int = 1, address: str | None = None, token: str | None = None,
                 transport: str | None = None, *, options: ConnectionOptions | None = None):
        self.num_packs = checked_num_packs(num_packs, "HierarchicalCopy")
        super().__init__(address, token, transport, options=options)

    def _algorithm(self) -> Algorithm:
        return Algorithm("hierarchical_copy", num_packs=self.num_packs)


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
        options: the connection settings as one :class:`xreduce.ConnectionOptions`.

    Example:
        >>> ReductionToOneDevice(reduce_to_device="gpu:1").reduce_to_device
        '/job:localhost/replica:0/task:0/device:GPU:1'
        >>> ops = ReductionToOneDevice(address="unix:/run/xreduce.sock", token="s3cret")
    """

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None,
                 address: str | None = None, token: str | None = None, transport: str | None = None, *,
                 options: ConnectionOptions | None = None):
        super().__init__(address, token, transport, options=options)
        self.reduce_to_device = canonical(reduce_to_device) if reduce_to_device is not None else None
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise ValueError(f"accumulation_fn must be callable; got {accumulation_fn!r}")
        self.accumulation_fn = accumulation_fn

    def _algorithm(self) -> Algorithm:
        return Algorithm("reduction_to_one_device", reduce_to_device=self.reduce_to_device or "")

    def _accumulate(self) -> Callable | None:
        return self.accumulation_fn
