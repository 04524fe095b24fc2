"""The peer level: groups whose processes are on several nodes.

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
   Every node gets the same bytes; MEAN then divides once by the global replica
   count;
3. back down, the total is copied to every destination of the node's processes.

Before the bytes, the nodes exchange a small header: whether each node's
processes agreed (or why not), a signature of the collective (kind, op,
options, dtypes, shapes), and its replica count; a node whose processes
disagreed makes the collective fail everywhere, naming it. Anything that breaks
the lockstep (a process that left, a timeout, a lost node, an engine error)
ends the epoch: every participant fails with ABORTED or UNAVAILABLE naming who
was lost, nobody gets a partial sum, and the processes form a new epoch by
initializing again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire.devices import DeviceName

from xreduced import gloo, planner, security
from xreduced.backends.numpy_backend import divide
from xreduced.collective import (
    BroadcastShare,
    Contribution,
    broadcast_together,
    check_out_devices,
    check_shares,
    join_shares,
    share_of,
)
from xreduced.config import Config
from xreduced.coordinator import Coordinator, CoordinatorServer
from xreduced.engine import MEAN, SUM, Engine, Result, Value
from xreduced.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from xreduced.executor import Deadline

log = logging.getLogger("xreduced.peers")

_HEADER = 48
"""int64 words of a collective's header: status, signature, replicas, bytes, dtype, ndim, then the shape."""
_MAX_NDIM = _HEADER - 8
PIPELINE_BYTES = 4 << 20
"""Tensors larger than this cross nodes in pieces of this size (see :func:`node_sums_across`)."""
_OK, _REFUSED = 0, 1


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): the default --node-address.

    Example:
        >>> route_address("127.0.0.1", 1234)
        '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
        except OSError as e:
            raise Unavailable(f"coordinator: no route to {host}:{port} ({e.strerror}); set --node-address") from None
        return s.getsockname()[0]


def split_address(address: str, field: str = "coordinator") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port).

    Example:
        >>> split_address("10.0.0.1:1234")
        ('10.0.0.1', 1234)
        >>> split_address("10.0.0.1")
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: coordinator: must be host:port; got '10.0.0.1'
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{field}: must be host:port; got {address!r}")
    return host.strip("[]"), int(port)


# --- what the nodes exchange ---------------------------------------------------------------------------------


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


@dataclasses.dataclass
class _Stats:
    collectives: int = 0
    bytes: int = 0
    seconds: float = 0.0


class ClusterGroup:
    """One epoch of a group across nodes, as this node daemon takes part in it.

    Args:
        gid: the group's id (``name@coordinator``); epoch: the membership's epoch.
        node_index: this node in ``nodes``; nodes: node 0 first.
        engine: the engine among the nodes, or None for a group on one node.
        beat: sends one heartbeat; returns the coordinator's :class:`pb.EpochState`.
        report: ends the epoch at the coordinator: ``report(reason, process_ids)``.
        attend: opens the attendance stream (``Peers.Attend``): the epoch's end arrives on it at once.
    """

    def __init__(self, gid: str, num_processes: int, epoch: int, node_index: int, nodes: list[pb.ClusterNode],
                 engine: gloo.GlooEngine | None, coordinator: str, beat: Callable[[], pb.EpochState],
                 report: Callable[[str, list[int]], None], peer_timeout: float, heartbeat_interval: float,
                 hosted: bool, attend: Callable[[], Any] | None = None):
        self.gid, self.num_processes, self.epoch = gid, num_processes, epoch
        self.node_index, self.nodes = node_index, nodes
        self.engine = engine
        self.coordinator = coordinator
        self.hosted = hosted
        self.local = frozenset(p.process_id for p in nodes[node_index].processes)
        self.node_of = {p.process_id: n.index for n in nodes for p in n.processes}
        self.peer_timeout, self.heartbeat_interval = peer_timeout, heartbeat_interval
        self.stats = _Stats()
        self.lost: list[pb.LostPeer] = []
        self.reason = ""
        self.failed = threading.Event()
        self._beat, self._report = beat, report
        self._lock = threading.Condition()
        self._next = 0  # the next sequence number to enter the engine
        self._lane = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xreduced-engine")
        self._closed = threading.Event()
        self._heart = threading.Thread(target=self._heartbeats, name="xreduced-heartbeat", daemon=True)
        self._heart.start()
        self._stream = attend() if attend is not None and len(nodes) > 1 else None
        if self._stream is not None:
            threading.Thread(target=self._attend, name="xreduced-attend", daemon=True).start()

    @property
    def spans_nodes(self) -> bool:
        """Whether the group has more than one node."""
        return len(self.nodes) > 1

    def describe(self, index: int) -> str:
        """``node 1 (10.0.0.2, processes [1])``."""
        node = self.nodes[index]
        return f"node {index} ({node.address}, processes {[p.process_id for p in node.processes]})"

    # --- failure ---------------------------------------------------------------------------------------------

    def fail(self, reason: str, lost: list[pb.LostPeer] = (), report: bool = False,
             process_ids: list[int] = ()) -> None:
        """Ends this epoch here (and, with ``report``, at the coordinator, so every node learns)."""
        with self._lock:
            if self.failed.is_set():
                return
            self.reason, self.lost = reason, list(lost)
            self.failed.set()
            self._lock.notify_all()
        log.warning("event=group_failed group=%s epoch=%d reason=%r", self.gid, self.epoch, reason)
        if self.engine is not None:
            self.engine.close()  # unblocks an engine call waiting on a peer that will not come
        if report:
            with contextlib.suppress(Exception):  # the coordinator may be what was lost
                self._report(reason, list(process_ids))

    def error(self) -> ServiceError:
        """The error every collective of this failed epoch gets."""
        again = "; call xreduce.distribution.shutdown() and initialize() again on every process for a new epoch"
        text = f'group "{self.gid}" epoch {self.epoch} is over: {self.reason}{again}'
        lost_coordinator = any(p.node_index == 0 for p in self.lost) and not self.hosted
        return Unavailable(text) if lost_coordinator else Aborted(text)

    def check(self, epoch: int, label: str) -> None:
        """Refuses a collective of another epoch, or of this epoch once it has failed."""
        if epoch != self.epoch:
            raise Aborted(f"{label} names epoch {epoch} but the group is at epoch {self.epoch}; initialize again")
        if self.failed.is_set():
            raise self.error()

    def _heartbeats(self) -> None:
        last_ok = time.monotonic()
        while not self._closed.wait(self.heartbeat_interval) and not self.failed.is_set():
            try:
                state = self._beat()
            except grpc.RpcError as e:
                silent = time.monotonic() - last_ok
                if silent > self.peer_timeout:
                    self.fail(f"the coordinator at {self.coordinator}, {self.describe(0)}, did not answer "
                              f"for {silent:.1f} s ({e.code().name})",
                              [pb.LostPeer(node_index=0, address=self.nodes[0].address,
                                           process_ids=[p.process_id for p in self.nodes[0].processes],
                                           reason=f"no answer for {silent:.1f} s")])
                continue
            last_ok = time.monotonic()
            if not state.ok:
                self.fail(state.reason or f"epoch {self.epoch} is over", list(state.lost))

    def _attend(self) -> None:
        try:
            for reply in self._stream:
                if not reply.state.ok:
                    self.fail(reply.state.reason or f"epoch {self.epoch} is over", list(reply.state.lost))
                    return
        except grpc.RpcError:
            pass  # closed here, or the coordinator is gone: the heartbeats tell which, within the peer timeout

    def close(self) -> None:
        """Stops the heartbeats, the attendance stream and the engine; waits for nothing."""
        self._closed.set()
        if self._stream is not None:
            self._stream.cancel()
        if self.engine is not None:
            self.engine.close()
        self._lane.shutdown(wait=False, cancel_futures=True)

    # --- the engine, in sequence order -----------------------------------------------------------------------

    def entered(self, sequence: int | None) -> bool:
        """Whether collective ``sequence`` has entered the engine (so the nodes are still in step)."""
        with self._lock:
            return sequence is not None and self._next > sequence

    def exchange(self, sequence: int, mine: np.ndarray, work: Callable, deadline: Deadline, label: str):
        """All-gathers the headers, then runs ``work(engine, headers, timeout)`` (which moves the bytes and
        returns ``(result, bytes moved)``); collective ``sequence`` enters the engine after ``sequence - 1``.

        Returns:
            (headers, result): every node's header, node 0's first, and what ``work`` returned.

        Raises:
            Aborted / Unavailable: the epoch failed meanwhile (naming who was lost).
            DeadlineExceeded: ``deadline`` passed first; the epoch is over.
        """
        with self._lock:
            while self._next < sequence and not self.failed.is_set():
                left = deadline.remaining()
                if left is not None and left <= 0:
                    break
                self._lock.wait(min(left, 1.0) if left is not None else 1.0)
            if self.failed.is_set():
                raise self.error()
            if self._next != sequence:
                self.fail(f"{label} found collective {self._next} still before it after its deadline", report=True)
                raise self.error()
            self._next += 1
            self._lock.notify_all()
            future = self._lane.submit(self._run, mine, work, deadline)
        start = time.perf_counter()
        while True:
            try:
                headers, result, moved = future.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                left = deadline.remaining()
                if self.failed.is_set():
                    raise self.error() from None
                if left is not None and left <= 0:
                    self.fail(f"{label} did not cross the nodes within its deadline", report=True)
                    raise DeadlineExceeded(f"{label} timed out in the exchange between nodes; "
                                           f"{self.error()}") from None
            except gloo.EngineError as e:
                raise self._engine_failed(label, e) from None
            except ServiceError as e:  # e.g. the deadline, in the node's work: the others would wait for this node
                self.fail(f"{label} failed on {self.describe(self.node_index)}: {e}", report=True)
                raise
            except Exception:  # a bug: the others must not wait for this node
                log.exception("event=exchange_error group=%s", self.gid)
                self.fail(f"{label} failed on {self.describe(self.node_index)} (a daemon error; see its log)",
                          report=True)
                raise self.error() from None
        with self._lock:
            self.stats.collectives += 1
            self.stats.bytes += moved + headers[0].nbytes * len(headers)
            self.stats.seconds += time.perf_counter() - start
        return headers, result

    def _run(self, mine: np.ndarray, work: Callable, deadline: Deadline):
        headers = self.engine.all_gather(mine.view(np.uint8), self._timeout(deadline))
        headers = [h.view(np.int64) for h in headers]
        result, moved = work(self.engine, headers, self._timeout(deadline))
        return headers, result, moved

    def _timeout(self, deadline: Deadline) -> float:
        left = deadline.remaining()
        return max(left, 0.001) if left is not None else 3600.0

    def _engine_failed(self, label: str, e: gloo.EngineError) -> ServiceError:
        """An engine error: wait (bounded) for the coordinator to say who was lost, then end the epoch."""
        self.failed.wait(self.peer_timeout + 2 * self.heartbeat_interval)
        if not self.failed.is_set():
            self.fail(f"the engine failed on {self.describe(self.node_index)} during {label}: {e}", report=True)
        return self.error()


# --- the collectives ---------------------------------------------------------------------------------------


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
                               dest_fields=[f"destinations of tensor {t}" for t in range(len(joined))])
        templates = [v.arrays[0] for v, _ in joined]
        sig = signature(ref.kind, ref.op, ref.num_packs, ref.algorithm, [(a.dtype.str, a.shape) for a in templates])
        mine = header(_OK, sig, len(joined[0][0].devices) if joined else 0, sum(a.nbytes for a in templates))
    except InvalidArgument as e:
        refused, mine = e, header(_REFUSED)

    def work(gloo_engine, headers, timeout):
        if not (all(h[0] == _OK for h in headers) and _agree(headers)):
            return None, 0
        return node_sums_across(engine, gloo_engine, joined, ref, deadline, timeout)

    headers, totals = cluster.exchange(sequence, mine, work, deadline, what)
    if refused is not None:
        raise refused
    _check_headers(cluster, headers, what)
    total_replicas = int(sum(h[2] for h in headers))
    finals = [divide(np, t, total_replicas) if ref.op == MEAN else t for t in totals]
    results: dict[int, list[Result]] = {}
    for pid, c in shares.items():
        results[pid] = [_place(engine, finals[t], dests, c.out[t] if c.out is not None else None, routes[t])
                        for t, (_, dests) in enumerate(c.pairs)]
    return results


def node_sums_across(engine: Engine, gloo_engine: gloo.GlooEngine, joined: list, ref: Contribution,
                     deadline: Deadline, timeout: float) -> tuple[list[np.ndarray], int]:
    """Each joined value summed in the node (the node's plan), then across nodes (:func:`sum_across`).

    A summable tensor over :data:`PIPELINE_BYTES` goes in pieces: the node sums a piece while the previous
    one crosses the nodes. The numbers are the same either way: a piece's plan adds in the order the
    whole tensor's does. Returns (totals on the host, bytes moved).
    """
    large = [t for t, (v, _) in enumerate(joined)
             if v.arrays[0].nbytes > PIPELINE_BYTES and gloo.summable(v.arrays[0].dtype)]
    rest = [t for t in range(len(joined)) if t not in large]
    totals: list[np.ndarray | None] = [None] * len(joined)
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
        local = engine.batch_reduce(SUM, [joined[t] for t in rest], num_packs=ref.num_packs,
                                    algorithm=ref.algorithm, reduce_to=ref.reduce_to, deadline=deadline)
        sums, n = sum_across(gloo_engine, [np.ascontiguousarray(engine.backend.to_host(r.arrays[0]))
                                           for r in local], timeout)
        for t, total in zip(rest, sums):
            totals[t] = total
        moved += n
    for work in pending:
        gloo_engine.finish(work)
    return totals, moved


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
        for pid, share in sorted(shares.items()):
            if share.source_process != source_pid:
                raise InvalidArgument(f"process {pid} sent source_process={share.source_process} but process "
                                      f"{min(shares)} sent source_process={source_pid} for {what}")
            check_out_devices(engine, share.out, share.destinations, f"process {pid}'s out for {what}")
        if source_pid not in cluster.node_of:
            raise InvalidArgument(f"source_process={source_pid} is not a process of {what}")
        if source_pid in shares:
            array = shares[source_pid].array
            if array is None:
                raise InvalidArgument(f"process {source_pid} is the source of {what} but sent no tensor")
            array = np.ascontiguousarray(engine.backend.to_host(array))
            mine = header(_OK, signature("Broadcast", source_pid), 0, array.nbytes, array.dtype, array.shape)
        else:
            mine = header(_OK, signature("Broadcast", source_pid))
    except InvalidArgument as e:
        refused, mine = e, header(_REFUSED)
    root = cluster.node_of.get(source_pid, 0)

    def work(engine, headers, timeout):
        if not (all(h[0] == _OK for h in headers) and _agree(headers)):
            return None, 0
        data = array.reshape(-1).view(np.uint8) if array is not None else np.empty(int(headers[root][3]), np.uint8)
        return engine.broadcast(data, root, timeout), data.nbytes

    headers, received = cluster.exchange(sequence, mine, work, deadline, what)
    if refused is not None:
        raise refused
    _check_headers(cluster, headers, what)
    if source_pid in shares:
        return broadcast_together(engine, shares, what, deadline)
    h = headers[root]
    dtype = codec.numpy_dtype(int(h[4]))
    received = received.view(dtype).reshape(tuple(int(x) for x in h[8:8 + int(h[5])]))
    out: dict[int, np.ndarray] = {}
    for share in shares.values():
        for d, target in (share.out or {}).items():
            out.setdefault(d, target)
    dests = sorted({d for share in shares.values() for d in share.destinations})
    result = engine.broadcast(received, dests[0], dests, deadline, out=out or None)
    return {pid: share_of(engine, result, share.destinations, share.out) for pid, share in shares.items()}


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


def _check_headers(cluster: ClusterGroup, headers: list[np.ndarray], what: str) -> None:
    refused = [i for i, h in enumerate(headers) if h[0] != _OK]
    if refused:
        raise InvalidArgument(
            f"{what} failed on " + ", ".join(cluster.describe(i) for i in refused)
            + ": its processes disagreed or sent a bad request (that node's processes got the details)")
    if not _agree(headers):
        mine = int(headers[cluster.node_index][1])
        others = [i for i, h in enumerate(headers) if int(h[1]) != mine]
        raise InvalidArgument(
            f"the nodes sent different collectives for {what}: " + ", ".join(cluster.describe(i) for i in others)
            + f" disagree with {cluster.describe(cluster.node_index)} on the kind, op, num_packs, algorithm, "
            "source, or a tensor's dtype or shape")


def _place(engine: Engine, total: np.ndarray, dests: tuple[int, ...], out: Mapping[int, np.ndarray] | None,
           route: str) -> Result:
    """The total on every destination: written straight into the caller's ``out`` arrays, else uploaded."""
    arrays = []
    for d in dests:
        if out is not None and d in out:
            engine.backend.write(out[d], total)
            arrays.append(out[d])
        else:
            arrays.append(engine.backend.upload(d, total))
    engine.backend.synchronize()
    return Result(tuple(dests), tuple(arrays), route if route != planner.IDENTITY else planner.HIERARCHICAL_COPY)


# --- the node daemon's groups --------------------------------------------------------------------------------


class Peers:
    """This daemon's groups across nodes, the coordinators it serves, and its links to coordinators.

    Args:
        config: the daemon's settings (node address, timeouts, TLS and token for the links).
        devices: this daemon's devices, short names, in order.
        backend: its backend's name.

    Example:
        >>> peers = Peers(Config(), ["CPU:0"], "numpy")
        >>> peers.lookup("default@127.0.0.1:1234") is None, len(peers.node_id)
        (True, 32)
        >>> peers.close()
    """

    def __init__(self, config: Config, devices: list[str], backend: str):
        self.config = config
        self.devices = list(devices)
        self.backend = backend
        self.node_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._groups: dict[str, ClusterGroup] = {}
        self._joining: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._servers: dict[str, CoordinatorServer] = {}
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PeersStub]] = {}
        token = security.load_token(config)
        self._metadata = (("authorization", "Bearer " + token.decode()),) if token else ()

    def lookup(self, gid: str) -> ClusterGroup | None:
        """The current epoch of group ``gid`` on this daemon, or None."""
        with self._lock:
            return self._groups.get(gid)

    def groups(self) -> list[ClusterGroup]:
        """Every group this daemon is in (its newest epoch each)."""
        with self._lock:
            return list(self._groups.values())

    def join(self, name: str, num_processes: int, process_id: int, coordinator: str, devices: list[str],
             timeout: float) -> ClusterGroup:
        """Registers a process with the coordinator; returns the group's new epoch, engine connected.

        Raises:
            InvalidArgument: a malformed coordinator address. Unavailable: the coordinator cannot be
            reached. FailedPrecondition: the group spans nodes and an engine is missing.
            DeadlineExceeded: not every process registered, or the engine did not connect, in time.
        """
        host, port = split_address(coordinator)
        gid = f"{name}@{coordinator}"
        if process_id == 0:
            self._serve_coordinator(coordinator, gid)
        node_address = self.config.node_address or route_address(host, port)
        stub = self._stub(coordinator)
        engines = ["gloo"] if gloo.unavailable_reason() is None else []
        request = pb.RegisterRequest(
            group=name, num_processes=num_processes, process_id=process_id,
            node=pb.NodeIdentity(node_id=self.node_id, address=node_address, devices=self.devices,
                                 backend=self.backend, engines=engines),
            devices=[DeviceName.parse(d).short for d in devices])
        request.timeout.FromNanoseconds(int(timeout * 1e9))
        # Process 0's daemon may not serve the coordinator yet: wait for it, within the join's timeout.
        reply = self._call(stub.Register, request, timeout + 5.0, coordinator, "register with", wait=True)
        with self._lock:
            key = (reply.group, reply.epoch)
            future = self._joining.get(key)
            first = future is None
            if first:
                future = self._joining[key] = concurrent.futures.Future()
        if first:
            try:
                future.set_result(self._install(reply, coordinator, stub, node_address, timeout))
            except BaseException as e:
                future.set_exception(e)
            finally:
                with self._lock:
                    self._joining.pop(key, None)
        try:
            return future.result(timeout=timeout + 5.0)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"the engine of group {reply.group!r} did not connect within {timeout:.3g}s") \
                from None

    def _install(self, reply: pb.RegisterResponse, coordinator: str, stub, node_address: str,
                 timeout: float) -> ClusterGroup:
        nodes = list(reply.nodes)
        index = next(n.index for n in nodes if n.node_id == self.node_id)
        gid, epoch = reply.group, reply.epoch
        with self._lock:
            old = self._groups.pop(gid, None)
        if old is not None:
            old.fail(f"epoch {epoch} replaced it")
            old.close()
        engine = None
        if len(nodes) > 1:
            if reply.engine != "gloo" or gloo.unavailable_reason() is not None:
                raise FailedPrecondition(f"group {gid!r} spans {len(nodes)} nodes, which needs the engine "
                                         f"{reply.engine or 'gloo'}: {gloo.unavailable_reason()}")

            def store_call(method, request, seconds=timeout):
                return self._call(method, request, seconds + 5.0, coordinator, "reach", engine_error=True)

            def set_(key, value):
                store_call(stub.StoreSet, pb.StoreSetRequest(group=gid, epoch=epoch, key=key, value=value))

            def get(key, seconds):
                request = pb.StoreGetRequest(group=gid, epoch=epoch, key=key)
                request.timeout.FromNanoseconds(int(seconds * 1e9))
                return store_call(stub.StoreGet, request, seconds).value

            def add(key, amount):
                return store_call(stub.StoreAdd, pb.StoreAddRequest(group=gid, epoch=epoch, key=key,
                                                                    amount=amount)).value

            store = (set_, get, add)
            try:
                engine = gloo.GlooEngine(store, index, len(nodes), node_address, timeout)
            except gloo.EngineError as e:
                raise Unavailable(f"group {gid!r} epoch {epoch}: {e}") from None

        def beat():
            return stub.Heartbeat(pb.HeartbeatRequest(group=gid, epoch=epoch, node_id=self.node_id),
                                  timeout=max(reply.heartbeat_interval_seconds, 0.5), metadata=self._metadata).state

        def report(reason, process_ids):
            stub.ReportFailure(pb.ReportFailureRequest(group=gid, epoch=epoch, node_id=self.node_id, reason=reason,
                                                       process_ids=process_ids),
                               timeout=max(reply.heartbeat_interval_seconds, 0.5), metadata=self._metadata)

        def attend():
            return stub.Attend(pb.AttendRequest(group=gid, epoch=epoch, node_id=self.node_id), metadata=self._metadata)

        count = sum(len(n.processes) for n in nodes)
        cluster = ClusterGroup(gid, count, epoch, index, nodes, engine, coordinator, beat, report,
                               reply.peer_timeout_seconds, reply.heartbeat_interval_seconds,
                               hosted=coordinator in self._servers, attend=attend)
        with self._lock:
            self._groups[gid] = cluster
        log.info("event=group_joined group=%s epoch=%d node=%d nodes=%d engine=%s", gid, epoch, index, len(nodes),
                 reply.engine or "none")
        return cluster

    def _serve_coordinator(self, address: str, gid: str) -> None:
        with self._lock:
            if address in self._servers:
                return
            coordinator = Coordinator(lambda name: f"{name}@{address}", self.config.peer_timeout,
                                      self.config.heartbeat_interval)
            try:
                self._servers[address] = CoordinatorServer(address, coordinator, self.config)
            except RuntimeError as e:
                coordinator.close()
                raise FailedPrecondition(f"coordinator: {e}") from None

    def _stub(self, address: str) -> pb_grpc.PeersStub:
        with self._lock:
            if address not in self._channels:
                c = self.config
                options = [("grpc.max_receive_message_length", 1 << 20)]
                if c.tls_cert:
                    root = _read(c.tls_client_ca or c.tls_cert)
                    creds = grpc.ssl_channel_credentials(
                        root_certificates=root, private_key=_read(c.tls_key) if c.tls_client_ca else None,
                        certificate_chain=_read(c.tls_cert) if c.tls_client_ca else None)
                    channel = grpc.secure_channel(address, creds, options)
                else:
                    channel = grpc.insecure_channel(address, options)
                self._channels[address] = (channel, pb_grpc.PeersStub(channel))
            return self._channels[address][1]

    def _call(self, method, request, timeout: float, address: str, verb: str, engine_error: bool = False,
              wait: bool = False):
        try:
            return method(request, timeout=timeout, metadata=self._metadata, wait_for_ready=wait)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if wait and code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
                raise DeadlineExceeded(
                    f"the coordinator at {address} (job_addresses[0]) did not answer within {timeout:.3g}s: is "
                    "process 0 running, its daemon on that host, and the port open?") from None
            if engine_error:
                raise gloo.EngineError(f"the coordinator's store at {address}: {code.name}: {details}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(details) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(details or f"the coordinator at {address} did not answer in time") from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(details) from None
            raise Unavailable(f"cannot {verb} the coordinator at {address} (job_addresses[0]): {code.name}: "
                              f"{details}") from None

    def status(self) -> list[pb.GroupStatus]:
        """Every group's status, for ``GetStatus``."""
        out = []
        for g in self.groups():
            out.append(pb.GroupStatus(
                group=g.gid, epoch=g.epoch, state="failed" if g.failed.is_set() else "active",
                num_processes=g.num_processes, node_index=g.node_index, nodes=g.nodes,
                engine=g.engine.name if g.engine is not None else "", coordinator=g.hosted,
                cross_node_collectives=g.stats.collectives, cross_node_bytes=g.stats.bytes,
                cross_node_seconds=g.stats.seconds, lost=g.lost, reason=g.reason))
        return out

    def close(self) -> None:
        """Leaves every group, stops the coordinators it serves, closes its links."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            servers, self._servers = list(self._servers.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for g in groups:
            g.close()
        for s in servers:
            s.stop()
        for channel, _ in channels:
            channel.close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
