"""The transport layer: the path a call's tensors take to the daemon, its request, its results.

:func:`choose` picks one path for a :class:`~xreduce._call.ReduceCall` or
:class:`~xreduce._call.BroadcastCall`; each path builds its request, makes
the call and regroups the reply into the caller's arrays:

* :class:`CudaIpcPath`: CuPy values as CUDA IPC regions, results in a device buffer;
* :class:`SharedMemoryPath`: host arrays staged in (or already in) shared memory,
  results written by the daemon into an output segment;
* :class:`StreamPath`: a large single-process batch over ``ReduceStream``, in chunks;
* :class:`WirePath`: tensors as bytes in the ``Reduce``/``BatchReduce``/``Broadcast`` messages,
  over gRPC or, for a small call on the daemon's host, its local lane (:mod:`xreduce._lane`).

A new transport is a new class here with ``reduce`` (and ``broadcast`` if it
carries one), and a line in :func:`choose`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from google.protobuf import duration_pb2

from xreduce import _fusion, _ipc, _lane, _sparse, _stall, _streaming
from xreduce._call import Algorithm, BroadcastCall, ReduceCall
from xreduce._client import Client
from xreduce._errors import XReduceError
from xreduce._runtime import ProcessGroup
from xreduce._shared_memory import Output, SharedMemory
from xreduce._values import Mirrored
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.contract import mean_dtype
from xreduce.wire.framing import streamed_tensor
from xreduce.wire.layout import output_layout

DEADLINE_SLACK_SECONDS = 5.0
"""A call's gRPC deadline is its ``timeout_seconds`` plus this: the daemon's own deadline message comes first."""

_ALGORITHMS = {"hierarchical_copy": pb.ALGORITHM_HIERARCHICAL_COPY,
               "reduction_to_one_device": pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE,
               "nccl": pb.ALGORITHM_NCCL}


class Transport:
    """One path to the daemon. Every path reduces; :meth:`broadcast` only where it carries one."""

    def __init__(self, client: Client):
        self._client = client

    def reduce(self, call: ReduceCall) -> list[Any]:
        """One result per pair: a plain array for one destination device, else a ``Mirrored``."""
        raise NotImplementedError

    def broadcast(self, call: BroadcastCall) -> Any:
        """The tensor on every destination: a plain array for one destination device, else a ``Mirrored``."""
        raise TypeError(f"{type(self).__name__} carries no broadcast")


def choose(client: Client, call: ReduceCall | BroadcastCall) -> Transport:
    """The path for ``call``, as the client's transport (``auto``, ``shm``, ``wire``) allows.

    Shared memory when the daemon shares this host (CUDA IPC for CuPy values it
    can open); with ``auto``, a call that finds no room in ``/dev/shm`` takes
    the wire instead, and a call of host values totalling at most
    :data:`xreduce._lane.LANE_MAX_BYTES` takes the wire over the daemon's local
    lane when it offers one. On the wire, a single-process batch over
    :data:`xreduce._streaming.STREAM_THRESHOLD_BYTES` streams. A call with sparse values
    (``IndexedSlices``) takes the wire whatever the transport.

    Raises:
        xreduce.InvalidArgumentError: transport ``shm`` and no shared memory with the daemon.

    Example:
        >>> import numpy as np
        >>> from xreduce._call import Pair
        >>> from xreduce._values import PerReplica
        >>> pair = Pair(PerReplica([np.ones(2)] * 2), ("CPU:0", "CPU:1"), ("CPU:0",))
        >>> call = ReduceCall("SUM", (pair,), Algorithm("hierarchical_copy", 1))
        >>> type(choose(Client("127.0.0.1:1", transport="wire"), call)).__name__
        'WirePath'
    """
    if isinstance(call, ReduceCall) and any(_sparse.is_sparse(p.value.values) for p in call.pairs):
        return WirePath(client)  # a sparse result's size is known only once reduced: no output region to stage
    if client.transport == "auto" and _small(call):
        lane = client.local_lane()
        if lane is not None:
            return WirePath(client, lane)
    sends_tensors = isinstance(call, ReduceCall) or call.tensor is not None
    shm = client.shared_memory() if sends_tensors else None
    if shm is None:
        return _on_the_wire(client, call)
    fallback = None if client.transport == "shm" else (lambda: _on_the_wire(client, call))
    if isinstance(call, ReduceCall):
        ipc = _ipc.staging(shm, client.address, [list(p.value.values) for p in call.pairs])
        if ipc is not None:
            return CudaIpcPath(client, shm, fallback, ipc)
    return SharedMemoryPath(client, shm, fallback)


def _small(call: ReduceCall | BroadcastCall) -> bool:
    """Whether ``call`` carries host values of at most :data:`xreduce._lane.LANE_MAX_BYTES` in all, and knows
    its result's size (a broadcast's receivers do not: they take gRPC). Such a call takes the local lane; there
    the daemon's ``xreduced.lane.classify`` says which thread serves it and whether the express lane may."""
    if isinstance(call, BroadcastCall):
        arrays = [call.tensor] if call.tensor is not None else []
    else:
        arrays = [a for p in call.pairs for a in p.value.values]
    total = 0
    for a in arrays:
        if _ipc.is_cupy(a):
            return False  # CuPy values have their own path (CUDA IPC)
        nbytes = getattr(a, "nbytes", None)
        total += np.asarray(a).nbytes if nbytes is None else nbytes
    return bool(arrays) and total <= _lane.LANE_MAX_BYTES


def _on_the_wire(client: Client, call: ReduceCall | BroadcastCall) -> Transport:
    if isinstance(call, ReduceCall) and call.collective is None:
        nbytes = sum(h.array.nbytes for pair in call.pairs for h in pair.value.hosts())
        if nbytes > _streaming.STREAM_THRESHOLD_BYTES:
            return StreamPath(client)
    return WirePath(client)


@contextlib.contextmanager
def collective(client: Client, group: ProcessGroup | None) -> Iterator[pb.CollectiveSpec | None]:
    """The next collective of this process's group (None without one), its sequence number
    taken first: when something fails on this side before the daemon answers, the collective
    is abandoned for every process (they get AbortedError at once) instead of the next call
    of this process meeting the others' current one. A collective that waits long warns
    (:mod:`xreduce._stall`).

    Example:
        >>> with collective(Client("127.0.0.1:1"), None) as spec:
        ...     spec is None
        True
    """
    spec = group.next_spec() if group is not None else None
    try:
        with _stall.watch(client, spec):
            yield spec
    except BaseException as e:
        # When the daemon answered, it failed the collective for the others where it must. (A refusal of
        # an earlier call, e.g. of a region, leaves the others to their timeout; the number is spent.)
        if spec is not None and not (isinstance(e, XReduceError) and e.answered):
            # The daemon fails the collective for every process (on every node) with this reason.
            given_up = pb.CollectiveSpec()
            given_up.CopyFrom(spec)
            given_up.abort = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:1000]
            with contextlib.suppress(Exception):
                client.batch_reduce(pb.BatchReduceRequest(collective=given_up), 10.0)
        raise


# --- requests and replies -------------------------------------------------------------------------------------


def _fields(call: ReduceCall) -> dict[str, Any]:
    """The request fields besides the values: op, algorithm, timeout, collective."""
    algorithm: Algorithm = call.algorithm
    fields: dict[str, Any] = dict(
        reduce_op=pb.ReduceOp.Value(f"REDUCE_OP_{call.op}"), algorithm=_ALGORITHMS[algorithm.name],
        num_packs=algorithm.num_packs, reduce_to_device=algorithm.reduce_to_device)
    if call.timeout_seconds is not None:
        fields["timeout"] = duration_pb2.Duration()
        fields["timeout"].FromNanoseconds(int(call.timeout_seconds * 1e9))
    if call.collective is not None:
        fields["collective"] = call.collective
    return fields


def _deadline(call: ReduceCall) -> float | None:
    return None if call.timeout_seconds is None else call.timeout_seconds + DEADLINE_SLACK_SECONDS


def _send(client: Client, call: ReduceCall, values: list[pb.DistributedValue], session: str | None = None,
          lane: _lane.Lane | None = None, **output: pb.RegionSlice) -> list[pb.DistributedValue]:
    """Sends ``Reduce`` (one pair from ``reduce``) or ``BatchReduce``; the result of each pair."""
    if call.single:
        (pair,) = call.pairs
        request = pb.ReduceRequest(value=values[0], destinations=pair.destinations, **output, **_fields(call))
        return [_unary(client, lane, "Reduce", request, _deadline(call), session).result]
    request = pb.BatchReduceRequest(pairs=[pb.ReducePair(value=v, destinations=p.destinations)
                                           for v, p in zip(values, call.pairs)], **output, **_fields(call))
    return [r.result for r in _unary(client, lane, "BatchReduce", request, _deadline(call), session).results]


_CALLS = {"Reduce": Client.reduce, "BatchReduce": Client.batch_reduce, "Broadcast": Client.broadcast}


def _unary(client: Client, lane: _lane.Lane | None, method: str, request, deadline: float | None,
           session: str | None = None):
    """``method`` over the local lane when there is one (gRPC if it cannot be had), else over gRPC."""
    if lane is not None:
        try:
            return lane.call(method, request, client.timeout if deadline is None else deadline)
        except _lane.Refused:
            pass  # nothing was sent; this session uses gRPC from now on
    return _CALLS[method](client, request, deadline, session=session)


def _regroup(result: pb.DistributedValue, restore: Callable, decode: Callable = codec.decode) -> Any:
    arrays = [_sparse.result(c, restore, decode) for c in result.components]
    if len(arrays) == 1:
        return arrays[0]
    return Mirrored(arrays, devices=[c.device for c in result.components])


# --- the paths ------------------------------------------------------------------------------------------------


class WirePath(Transport):
    """Tensors as bytes in the request and reply messages, over gRPC or the daemon's local lane.

    Args:
        client: the caller's client.
        lane: the local lane to send over, or None for gRPC.
    """

    def __init__(self, client: Client, lane: _lane.Lane | None = None):
        super().__init__(client)
        self.lane = lane

    def reduce(self, call: ReduceCall) -> list[Any]:
        values = [pb.DistributedValue(components=[_sparse.component(d, h) for d, h in zip(p.devices, p.value.hosts())])
                  for p in call.pairs]
        results = _send(self._client, call, values, lane=self.lane)
        return [_regroup(r, p.value.hosts()[0].restore) for r, p in zip(results, call.pairs)]

    def broadcast(self, call: BroadcastCall) -> Any:
        request = pb.BroadcastRequest(destinations=call.destinations, source_device=call.source_device,
                                      collective=call.collective)
        if call.tensor is not None:
            request.tensor.CopyFrom(codec.encode(call.tensor))
        return _regroup(_unary(self._client, self.lane, "Broadcast", request, None).result, call.restore)


class StreamPath(Transport):
    """``ReduceStream``: large payloads in chunks, with no message size limit (single process only)."""

    def reduce(self, call: ReduceCall) -> list[Any]:
        hosts = [p.value.hosts() for p in call.pairs]
        header = pb.BatchReduceRequest(pairs=[
            pb.ReducePair(destinations=p.destinations, value=pb.DistributedValue(components=[
                pb.Component(device=d, tensor=streamed_tensor(h.array)) for d, h in zip(p.devices, hs)]))
            for p, hs in zip(call.pairs, hosts)], **_fields(call))
        results = _streaming.stream_batch_reduce(self._client, header, [[h.array for h in hs] for hs in hosts],
                                                 _deadline(call))
        out = []
        for (_, components), hs in zip(results, hosts):
            arrays = [hs[0].restore(a) for _, a in components]
            out.append(arrays[0] if len(arrays) == 1 else Mirrored(arrays, devices=[d for d, _ in components]))
        return out


class _RegionsPath(Transport):
    """Tensors as regions of a session: staged, named in the request, results written into an output region.

    Args:
        client: the caller's client.
        shm: the shared memory with the daemon (its session).
        fallback: the path to take when staging finds no room (OSError), or None to raise.
    """

    def __init__(self, client: Client, shm: SharedMemory, fallback: Callable[[], Transport] | None):
        super().__init__(client)
        self._shm = shm
        self._fallback = fallback

    def _inputs(self, call: ReduceCall) -> _Inputs:
        """What this path stages of ``call``, and with what."""
        raise NotImplementedError

    def _lane(self, session: str) -> _lane.Lane | None:
        """The session's local lane, which carries the request (it names regions: it is small), or None."""
        lane = self._client.local_lane()
        return lane if lane is not None and lane.session_id == session else None

    def _fuse(self, call: ReduceCall) -> tuple[ReduceCall, Callable[[list[Any]], list[Any]]]:
        """The call to send instead of ``call``, and what turns its results into ``call``'s (see
        :mod:`xreduce._fusion`); this path sends every pair as it is."""
        return call, _as_they_are

    def _placed(self, call: ReduceCall) -> tuple[pb.RegionSlice, Any] | None:
        """The output slice and its reader when the daemon can write ``call``'s result into ``call.out``;
        this path cannot."""
        return None

    def reduce(self, call: ReduceCall) -> list[Any]:
        given = call
        call, finish = self._fuse(call)
        inputs = self._inputs(call)

        def output() -> tuple[pb.RegionSlice, Any]:
            placed = self._placed(call) if call is given else None
            return placed or inputs.stager.output(output_layout([
                (len(p.destinations), mean_dtype(first.dtype) if call.op == "MEAN" else first.dtype,
                 tuple(first.shape)) for p, first in zip(call.pairs, inputs.firsts)]).nbytes)

        try:
            staged = _Staged.make(inputs.stager, inputs.arrays, output)
        except OSError:  # no room in /dev/shm: the wire, unless shared memory was insisted on
            if self._fallback is None:
                raise
            return self._fallback().reduce(given)
        with staged.answered():
            it = iter(staged.tensors)
            values = [pb.DistributedValue(components=[pb.Component(device=d, tensor=next(it)) for d in p.devices],
                                          fused_parts=_fusion.fused_parts(p.value)) for p in call.pairs]
            session = self._shm.session_id()
            results = _send(self._client, call, values, session, lane=self._lane(session), output=staged.output)
        return finish([_regroup(r, restore, staged.result) for r, restore in zip(results, inputs.restores)])


def _as_they_are(results: list[Any]) -> list[Any]:
    return results


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a regions path stages of a call (:meth:`_RegionsPath._inputs`)."""

    stager: Any
    """What stages them and makes the output: ``stage(arrays)`` and ``output(nbytes)``."""
    arrays: list[Any]
    """The arrays to stage, pair by pair."""
    firsts: list[Any]
    """Each pair's first array (its result's dtype and shape)."""
    restores: list[Callable]
    """Each pair's restore: a result as the caller's values were (e.g. a CuPy array, a shape)."""


@dataclasses.dataclass
class _Staged:
    """A call's inputs staged and its output made (:meth:`make`): the staged tensors, the output slice, its
    result reader, and what lets the staged inputs go (``free(failed=...)``)."""

    tensors: list[Any]
    output: pb.RegionSlice
    result: Any
    free: Callable[..., None]

    @classmethod
    def make(cls, stager: Any, arrays: list[Any], output: Callable[[], tuple[pb.RegionSlice, Any]]) -> _Staged:
        """Stages ``arrays`` with ``stager``, then makes the output (``output()``); what was staged goes again
        when that fails.

        Raises:
            OSError: no room to stage or for the output.
        """
        tensors, free = stager.stage(arrays)
        try:
            region, result = output()
        except BaseException:
            free(failed=True)
            raise
        return cls(tensors, region, result, free)

    @contextlib.contextmanager
    def answered(self) -> Iterator[None]:
        """The block sends the call and reads its answer: after it, the staged inputs go; when it raises (no
        answer: the daemon may still read the inputs and write the output), they go as failed and the output
        is abandoned (a shared-memory output segment goes now; a CUDA IPC output buffer goes back to its pool
        when its results are gone, as before)."""
        try:
            yield
        except BaseException:
            self.free(failed=True)
            if isinstance(self.result, Output):
                self.result.abandon()
            raise
        self.free()


class SharedMemoryPath(_RegionsPath):
    """Host arrays through shared memory: :func:`xreduce.shared_array` arrays as they are, others copied
    into a staging segment; results are views of an output segment (small ones copied out). A batch's small
    values are fused (:mod:`xreduce._fusion`)."""

    def _fuse(self, call: ReduceCall) -> tuple[ReduceCall, Callable[[list[Any]], list[Any]]]:
        plan = None if call.single else _fusion.groups(call.pairs)
        return (call, _as_they_are) if plan is None else _fusion.fuse(call, plan)

    def _placed(self, call: ReduceCall) -> tuple[pb.RegionSlice, Any] | None:
        if call.out is None or len(call.pairs) != 1 or len(call.pairs[0].destinations) != 1:
            return None
        return self._shm.place(call.out)

    def _inputs(self, call: ReduceCall) -> _Inputs:
        hosts = [p.value.hosts() for p in call.pairs]
        return _Inputs(self._shm, [h.array for hs in hosts for h in hs], [hs[0].array for hs in hosts],
                       [hs[0].restore for hs in hosts])

    def broadcast(self, call: BroadcastCall) -> Any:
        try:
            staged = _Staged.make(self._shm, [call.tensor], lambda: self._shm.output(
                output_layout([(len(call.destinations), call.tensor.dtype, call.tensor.shape)]).nbytes))
        except OSError:  # no room in /dev/shm: the wire, unless shared memory was insisted on
            if self._fallback is None:
                raise
            return self._fallback().broadcast(call)
        request = pb.BroadcastRequest(destinations=call.destinations, source_device=call.source_device,
                                      collective=call.collective, tensor=staged.tensors[0], output=staged.output)
        with staged.answered():
            session = self._shm.session_id()
            reply = _unary(self._client, self._lane(session), "Broadcast", request, None, session)
        return _regroup(reply.result, call.restore, staged.result)


class CudaIpcPath(_RegionsPath):
    """CuPy values as CUDA IPC regions, in place; results are CuPy arrays on the values' GPU, views of a
    device buffer. Taken when the daemon runs the cupy backend in another process (see :mod:`xreduce._ipc`)."""

    def __init__(self, client: Client, shm: SharedMemory, fallback: Callable[[], Transport] | None,
                 staging: _ipc.DeviceStaging):
        super().__init__(client, shm, fallback)
        self._staging = staging

    def _inputs(self, call: ReduceCall) -> _Inputs:
        raw = [list(p.value.values) for p in call.pairs]
        return _Inputs(self._staging, [a for values in raw for a in values], [values[0] for values in raw],
                       [(lambda a: a)] * len(call.pairs))
