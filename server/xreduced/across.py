"""Collectives across nodes: what a node daemon runs for a group whose processes are on several nodes.

A node daemon joins a group through the group's coordinator
(:mod:`xreduced.coordinator`, at ``job_addresses[0]``), which answers with the
membership of a new epoch: the nodes, node 0 first, and each node's processes
and their devices. From then on the daemon heartbeats the coordinator, and each
collective of the group runs in three steps:

1. inside the node, the processes of this node meet in the rendezvous and their
   values are summed with the node's own plan (TF's hierarchical copy);
2. across nodes, the node daemons all-reduce the node sums on the engine (Gloo),
   one collective after another in sequence order (:func:`sum_across`): with two
   nodes each element is ``node 0 + node 1``; with more, Gloo's ring adds in an
   order fixed by the number of nodes and the buffer's size; a dtype Gloo cannot
   add is all-gathered and added in node order, ``((node 0 + node 1) + node 2)``.
   In a group whose engine is ``gloo+nccl`` (every node's daemon drives GPUs and
   NCCL), the node sums of the dtypes NCCL adds stay in GPU memory and cross on
   NCCL instead (:func:`node_sums_across`): with two nodes each element is again
   ``node 0 + node 1``; with more, NCCL's ring or tree adds in an order fixed for
   a given size, node count and NCCL build (``NCCL_ALGO=Ring`` pins the
   algorithm). Every node gets the same bytes; MEAN then divides once by the
   global replica count;
3. back down, the total is copied to every destination of the node's processes
   (from GPU memory, for a total NCCL summed).

A sparse value (TF's IndexedSlices) is not added but concatenated: each node
concatenates its processes' replicas (global device order within the node), the
nodes all-gather those in node order (:func:`gather_across`), and every node
concatenates them in node order, then MEAN divides the values by the global
replica count.

Before the bytes, the nodes exchange a small header: whether each node's
processes agreed (or why not), a signature of the collective (kind, op,
options, dtypes, shapes), and its replica count. A node whose processes
disagreed, or one of whose processes sent a request its daemon rejected (an
unknown device, a bad tensor), still takes its turn in sequence order, with a
refusal and its reason (:func:`refuse_across`): that collective fails on every
node with the reason, naming the node, and the epoch goes on. Anything that
breaks the lockstep (a process that left, a timeout, a lost node, an engine
error) ends the epoch: every participant fails with ABORTED or UNAVAILABLE
naming who was lost, nobody gets a partial sum, and the processes form a new
epoch by initializing again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
from xreduce.wire import codec
from xreduce.wire.sparse import Slices, concat

from xreduced import gloo, planner
from xreduced.backends.numpy_backend import divide
from xreduced.cluster import ClusterGroup
from xreduced.collective import (
    BroadcastShare,
    Contribution,
    broadcast_shares,
    broadcast_together,
    check_broadcast_shares,
    check_shares,
    join_shares,
    tensor_dest_fields,
)
from xreduced.deadline import Deadline
from xreduced.engine import MEAN, SUM, Engine, Result, Value, is_sparse
from xreduced.errors import Aborted, InvalidArgument, ServiceError

_HEADER = 48
"""int64 words of a collective's header: status, signature, replicas, bytes, dtype, ndim, then the shape."""
_MAX_NDIM = _HEADER - 8
PIPELINE_BYTES = 4 << 20
"""Tensors larger than this cross nodes in pieces of this size (see :func:`node_sums_across`)."""
_OK, _REFUSED, _REJECTED = 0, 1, 2
"""A header's status: the node goes on; its processes disagreed (INVALID_ARGUMENT everywhere); one of its
processes' requests was rejected before the rendezvous (ABORTED everywhere, as on one node)."""
_TEXT = 1024
"""Bytes of a refusal's reason as the nodes all-gather it (longer reasons are cut)."""



def signature(*parts: object) -> int:
    """A 63-bit digest of what every node must agree on.

    Example:
        >>> signature("BatchReduce", "SUM", "float32", (4,)) == signature("BatchReduce", "SUM", "float32", (4,))
        True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def header(status: int, sig: int = 0, replicas: int = 0, nbytes: int = 0, dtype: np.dtype | None = None,
           shape: tuple[int, ...] = ()) -> np.ndarray:
    """A collective's header as the nodes all-gather it.

    Example:
        >>> h = header(_OK, 7, 4, 16, np.dtype(np.float32), (2, 2))
        >>> h[:6].tolist(), h.dtype.name
        ([0, 7, 4, 16, 3, 2], 'int64')
    """
    if len(shape) > _MAX_NDIM:
        raise InvalidArgument(f"tensor: at most {_MAX_NDIM} dimensions cross nodes; got {len(shape)}")
    h = np.zeros(_HEADER, np.int64)
    h[:6] = (status, sig, replicas, nbytes, codec.dtype_enum(dtype) if dtype is not None else 0, len(shape))
    h[8:8 + len(shape)] = shape
    return h


def reduce_across(cluster: ClusterGroup, engine: Engine, shares: Mapping[int, Contribution], what: str,
                  deadline: Deadline, sequence: int) -> dict[int, list[Result]]:
    """The node's processes' collective, reduced with every other node's (see the module's steps).

    Raises:
        InvalidArgument: this node's processes disagree, or another node's do (named), or the nodes
            sent different collectives.
        Aborted / Unavailable / DeadlineExceeded: see :meth:`ClusterGroup.exchange`.
    """
    refused: ServiceError | None = None
    joined: list = []
    try:
        check_shares(engine, shares, what)
        ref = shares[min(shares)]
        joined, _ = join_shares(engine, shares, what)
        # Everything the node's sum could refuse, refused before the nodes agree to go on.
        routes = engine.routes(SUM, joined, algorithm=ref.algorithm, num_packs=ref.num_packs,
                               dest_fields=tensor_dest_fields(len(joined)))
        templates = [v.arrays[0] for v, _ in joined]
        sig = signature(ref.kind, ref.op, ref.num_packs, ref.algorithm,
                        [(_agreed(v.arrays[0]), v.parts) for v, _ in joined])
        mine = header(_OK, sig, len(joined[0][0].devices) if joined else 0, sum(a.nbytes for a in templates))
    except InvalidArgument as e:
        refused, mine = e, header(_REFUSED)

    def work(gloo_engine, headers, timeout):
        reasons = _reasons(gloo_engine, headers, str(refused or ""), timeout)
        if reasons is not None or not _agree(headers):
            return reasons, 0
        sparse = [t for t, (v, _) in enumerate(joined) if is_sparse(v)]
        dense = [t for t in range(len(joined)) if t not in sparse]
        totals: list = [None] * len(joined)
        moved = 0
        if dense:
            sums, moved = node_sums_across(engine, gloo_engine, [joined[t] for t in dense], ref, deadline, timeout,
                                           device_engine=cluster.device_engine)
            for t, total in zip(dense, sums):
                totals[t] = total
        if sparse:
            gathered, n = gather_across(gloo_engine, [concat(joined[t][0].arrays) for t in sparse], timeout)
            for t, total in zip(sparse, gathered):
                totals[t] = total
            moved += n
        return totals, moved

    headers, totals = cluster.exchange(sequence, mine, work, deadline, what)
    if refused is not None:
        raise refused
    _check_headers(cluster, headers, what, totals)
    total_replicas = int(sum(h[2] for h in headers))
    finals = [_final(engine, t, total_replicas if ref.op == MEAN else None, joined[i]) for i, t in enumerate(totals)]
    results: dict[int, list[Result]] = {}
    for pid, c in shares.items():
        results[pid] = [_place(engine, finals[t], dests, c.out[t] if c.out is not None else None, routes[t])
                        for t, (_, dests) in enumerate(c.pairs)]
    return results


def _agreed(template: np.ndarray | Slices) -> tuple:
    """What the nodes must agree on for one tensor (a sparse one's rows are each node's own)."""
    if isinstance(template, Slices):
        dtype, rows, dense_shape = template.spec()
        return "sparse", dtype.str, rows, dense_shape
    return template.dtype.str, template.shape


def _final(engine: Engine, total, replicas: int | None, pair: tuple[Value, tuple[int, ...]]):
    """A total as the destinations get it, MEAN dividing once by ``replicas``: on the host as it is, or a
    total in device memory (NCCL's) as a buffer of the backend on the pair's first destination, divided there
    as the node's own plan divides."""
    if isinstance(total, (np.ndarray, Slices)):
        return total if replicas is None else _mean(total, replicas)
    value, dests = pair
    buf = engine.backend.upload((dests or value.devices)[0], total)
    return buf if replicas is None else engine.backend.divide(buf, replicas)


def _mean(total: np.ndarray | Slices, replicas: int) -> np.ndarray | Slices:
    if isinstance(total, Slices):
        return Slices(divide(np, total.values, replicas), total.indices, total.dense_shape)
    return divide(np, total, replicas)


def gather_across(engine: gloo.GlooEngine, parts: list[Slices], timeout: float) -> tuple[list[Slices], int]:
    """Every node's sparse ``parts`` concatenated in node order, the same on every node; returns
    (the concatenations, bytes moved).

    Two all-gathers: each node's row counts and index dtypes, then the rows and indices (int64 on the
    way), padded to the longest node's. The nodes agreed on the values' dtype and row shape (the header's
    signature). The indices stay int32 when every node's are (TF's rule, :func:`~xreduce.wire.sparse.concat`).
    """
    meta = np.array([[p.values.shape[0], p.indices.dtype == np.int64] for p in parts], np.int64)
    metas = [m.view(np.int64).reshape(len(parts), 2) for m in engine.all_gather(meta.reshape(-1).view(np.uint8),
                                                                               timeout)]
    row_bytes = [p.values.dtype.itemsize * int(np.prod(p.values.shape[1:])) for p in parts]
    sizes = [int(sum(m[i, 0] * (row_bytes[i] + 8) for i in range(len(parts)))) for m in metas]
    payload = np.zeros(max(sizes), np.uint8)
    mine = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for p in parts
                           for a in (p.values, p.indices.astype(np.int64))])
    payload[:mine.size] = mine
    received = engine.all_gather(payload, timeout)
    out = []
    offsets = [0] * len(received)
    for i, p in enumerate(parts):
        pieces = []
        for node, (m, data) in enumerate(zip(metas, received)):
            rows = int(m[i, 0])
            at = offsets[node]
            values = data[at:at + rows * row_bytes[i]].view(p.values.dtype).reshape((rows, *p.values.shape[1:]))
            at += rows * row_bytes[i]
            indices = data[at:at + rows * 8].view(np.int64)
            offsets[node] = at + rows * 8
            pieces.append(Slices(values, indices if m[i, 1] else indices.astype(np.int32), p.dense_shape))
        out.append(concat(pieces))
    return out, int(meta.nbytes * len(received) + payload.nbytes * len(received))


def node_sums_across(engine: Engine, gloo_engine: gloo.GlooEngine, joined: list, ref: Contribution,
                     deadline: Deadline, timeout: float, device_engine=None) -> tuple[list, int]:
    """Each joined value summed in the node (the node's plan), then across nodes.

    With a ``device_engine`` (NCCL: the group's engine is ``gloo+nccl``), the values of a dtype it adds are
    summed in the node straight into its device buffers, one per dtype in tensor order, which it all-reduces
    in GPU memory; their totals stay there (views of those buffers). The choice depends on the dtype alone, so
    every node makes the same one. The rest goes through the host and Gloo (:func:`sum_across`), where a
    summable tensor over :data:`PIPELINE_BYTES` goes in pieces: the node sums a piece while the previous one
    crosses the nodes. The numbers are the same either way: a piece's plan adds in the order the whole
    tensor's does. Returns (totals, bytes moved).
    """
    on_device = [t for t, (v, _) in enumerate(joined)
                 if device_engine is not None and device_engine.adds(v.arrays[0].dtype)]
    device = set(on_device)
    large = [t for t, (v, _) in enumerate(joined)  # host arrays only: a GPU's node sum crosses whole
             if t not in device and isinstance(v.arrays[0], np.ndarray) and v.arrays[0].nbytes > PIPELINE_BYTES
             and gloo.summable(v.arrays[0].dtype)]
    rest = [t for t in range(len(joined)) if t not in large]
    totals: list = [None] * len(joined)
    moved = 0
    pending = []
    for t in large:
        value, dests = joined[t]
        flats = [a.reshape(-1) for a in value.arrays]
        total = np.empty(flats[0].size, flats[0].dtype)
        step = max(PIPELINE_BYTES // total.itemsize, 1)
        for start in range(0, total.size, step):
            piece = Value(value.devices, tuple(f[start:start + step] for f in flats), value.field)
            (summed,) = engine.batch_reduce(SUM, [(piece, dests)], num_packs=1, algorithm=ref.algorithm,
                                            reduce_to=ref.reduce_to, deadline=deadline)
            view = total[start:start + step]
            np.copyto(view, engine.backend.to_host(summed.arrays[0]))
            pending.append(gloo_engine.all_reduce_start(view, timeout))
        totals[t] = total.reshape(value.arrays[0].shape)
        moved += total.nbytes
    if rest:
        buffers, views = _device_buffers(device_engine, joined, on_device)
        out = [{(joined[t][1] or joined[t][0].devices)[0]: views[t]} if t in views else None for t in rest]
        local = engine.batch_reduce(SUM, [joined[t] for t in rest], num_packs=ref.num_packs,
                                    algorithm=ref.algorithm, reduce_to=ref.reduce_to, deadline=deadline,
                                    out=out if buffers else None)
        if buffers:
            engine.backend.synchronize()  # the node sums are in the buffers before NCCL's stream reads them
            for flat in buffers:
                if flat.size:
                    device_engine.all_reduce(flat, timeout)
                moved += int(flat.nbytes)
            for t, view in views.items():
                totals[t] = view
        on_host = [(t, r) for t, r in zip(rest, local) if t not in views]
        sums, n = sum_across(gloo_engine, [np.asarray(engine.backend.to_host(r.arrays[0]), order="C")
                                           for _, r in on_host], timeout)
        for (t, _), total in zip(on_host, sums):
            totals[t] = total
        moved += n
    for work in pending:
        gloo_engine.finish(work)
    return totals, moved


def _device_buffers(device_engine, joined: list, on_device: list[int]) -> tuple[list, dict[int, object]]:
    """The device engine's flat buffers, one per dtype in order of first appearance, holding the tensors
    ``on_device`` of that dtype back to back in tensor order; and each tensor's view of its buffer."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for t in on_device:
        by_dtype.setdefault(np.dtype(joined[t][0].arrays[0].dtype), []).append(t)
    buffers, views = [], {}
    for dtype, indices in by_dtype.items():
        flat, parts = device_engine.buffers(dtype, [tuple(joined[t][0].arrays[0].shape) for t in indices])
        buffers.append(flat)
        views.update(zip(indices, parts))
    return buffers, views


def broadcast_across(cluster: ClusterGroup, engine: Engine, shares: Mapping[int, BroadcastShare], what: str,
                     deadline: Deadline, sequence: int) -> dict[int, Result]:
    """The source process's tensor to every destination of every process of every node.

    Raises:
        InvalidArgument: the processes disagree on the source, or the source sent no tensor.
        Aborted / Unavailable / DeadlineExceeded: see :meth:`ClusterGroup.exchange`.
    """
    refused: ServiceError | None = None
    array = None
    source_pid = shares[min(shares)].source_process
    try:
        check_broadcast_shares(engine, shares, what, cluster.node_of)
        if source_pid in shares:
            array = np.asarray(engine.backend.to_host(shares[source_pid].array), order="C")
            mine = header(_OK, signature("Broadcast", source_pid), 0, array.nbytes, array.dtype, array.shape)
        else:
            mine = header(_OK, signature("Broadcast", source_pid))
    except InvalidArgument as e:
        refused, mine = e, header(_REFUSED)
    root = cluster.node_of.get(source_pid, 0)

    def work(engine, headers, timeout):
        reasons = _reasons(engine, headers, str(refused or ""), timeout)
        if reasons is not None or not _agree(headers):
            return reasons, 0
        data = array.reshape(-1).view(np.uint8) if array is not None else np.empty(int(headers[root][3]), np.uint8)
        return engine.broadcast(data, root, timeout), data.nbytes

    headers, received = cluster.exchange(sequence, mine, work, deadline, what)
    if refused is not None:
        raise refused
    _check_headers(cluster, headers, what, received)
    if source_pid in shares:
        return broadcast_together(engine, shares, what, deadline)
    h = headers[root]
    dtype = codec.numpy_dtype(int(h[4]))
    received = received.view(dtype).reshape(tuple(int(x) for x in h[8:8 + int(h[5])]))
    first = min(d for share in shares.values() for d in share.destinations)
    return broadcast_shares(engine, shares, received, first, deadline)


def refuse_across(cluster: ClusterGroup, sequence: int, reason: str, what: str, deadline: Deadline) -> None:
    """This node's turn in collective ``sequence``, whose request one of its processes sent was rejected
    before the rendezvous (``reason`` says why): the other nodes' processes fail that collective with the
    reason instead of waiting for this node, and the nodes stay in step.

    Raises:
        Aborted / Unavailable / DeadlineExceeded: see :meth:`ClusterGroup.exchange`.
    """
    cluster.exchange(sequence, header(_REJECTED), lambda engine, headers, timeout: (
        _reasons(engine, headers, reason, timeout), 0), deadline, what)


def _reasons(engine: gloo.GlooEngine, headers: list[np.ndarray], mine: str, timeout: float) -> list[str] | None:
    """Every node's reason, node 0's first, when a node refused the collective (``mine`` is this node's, or
    empty); None when every node goes on. Every node sees the same headers, so all gather or none does.

    Example:
        >>> _reasons(None, [header(_OK), header(_OK)], "", 1.0) is None
        True
    """
    if all(h[0] == _OK for h in headers):
        return None
    text = np.zeros(_TEXT, np.uint8)
    raw = mine.encode()[:_TEXT]
    text[:len(raw)] = np.frombuffer(raw, np.uint8)
    return [bytes(part).rstrip(b"\0").decode(errors="replace") for part in engine.all_gather(text, timeout)]


def sum_across(engine: gloo.GlooEngine, sums: list[np.ndarray], timeout: float) -> tuple[list[np.ndarray], int]:
    """Every node's ``sums`` added together, the same bytes on every node; returns (totals, bytes moved).

    The tensors of one dtype travel as one buffer. A dtype Gloo adds (:data:`gloo.SUMMABLE`) is all-reduced
    by Gloo: with two nodes each element is ``node 0 + node 1``; with more, Gloo's ring adds in an order
    fixed by the number of nodes and the buffer's size. Other dtypes are all-gathered and added here in node
    order, ``((node 0 + node 1) + node 2) ...``.
    """
    totals: list[np.ndarray | None] = [None] * len(sums)
    moved = 0
    by_dtype: dict[np.dtype, list[int]] = {}
    for t, a in enumerate(sums):
        by_dtype.setdefault(a.dtype, []).append(t)
    for dtype, indices in by_dtype.items():
        flat = np.concatenate([sums[t].reshape(-1) for t in indices]) if len(indices) > 1 else \
            sums[indices[0]].reshape(-1).copy()
        moved += flat.nbytes
        if gloo.summable(dtype):
            total = engine.all_reduce(flat, timeout)
        else:
            parts = engine.all_gather(flat.view(np.uint8), timeout)
            total = parts[0].view(dtype).copy()
            for part in parts[1:]:  # node order: the same additions on every node
                np.add(total, part.view(dtype), out=total)
        offset = 0
        for t in indices:
            size = sums[t].size
            totals[t] = total[offset:offset + size].reshape(sums[t].shape)
            offset += size
    return totals, moved


def _agree(headers: list[np.ndarray]) -> bool:
    return len({int(h[1]) for h in headers}) == 1


def _check_headers(cluster: ClusterGroup, headers: list[np.ndarray], what: str, reasons: list[str] | None) -> None:
    """Raises the collective's failure on another node (with that node's reason), or the nodes' disagreement."""
    refused = [i for i, h in enumerate(headers) if h[0] != _OK]
    if refused:
        kind = Aborted if any(headers[i][0] == _REJECTED for i in refused) else InvalidArgument
        raise kind(f"{what} failed on " + "; ".join(
            f"{cluster.describe(i)}: {reasons[i] if reasons else 'its request was refused'}" for i in refused))
    if not _agree(headers):
        mine = int(headers[cluster.node_index][1])
        others = [i for i, h in enumerate(headers) if int(h[1]) != mine]
        raise InvalidArgument(
            f"the nodes sent different collectives for {what}: " + ", ".join(cluster.describe(i) for i in others)
            + f" disagree with {cluster.describe(cluster.node_index)} on the kind, op, num_packs, algorithm, "
            "source, or a tensor's dtype or shape")


def _place(engine: Engine, total, dests: tuple[int, ...],
           out: Mapping[int, np.ndarray] | None, route: str) -> Result:
    """The total on every destination: written straight into the caller's ``out`` arrays (from the host, or
    from device memory for a total in a buffer of the backend), else a host copy; a sparse total stays on the
    host, the same on every destination."""
    if isinstance(total, Slices):
        return Result(tuple(dests), (total,) * len(dests), planner.REDUCTION_TO_ONE_DEVICE)
    arrays = []
    for d in dests:
        if out is not None and d in out:
            engine.backend.write(out[d], total)
            arrays.append(out[d])
        elif isinstance(total, np.ndarray):
            arrays.append(np.array(total, copy=True))
        else:
            arrays.append(np.asarray(engine.backend.download(total)))
    engine.backend.synchronize()
    return Result(tuple(dests), tuple(arrays), route if route != planner.IDENTITY else planner.HIERARCHICAL_COPY)
