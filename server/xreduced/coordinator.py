"""The coordinator of groups that span nodes: membership, epochs, heartbeats, the engine's store.

Process 0's daemon serves the ``Peers`` service at the job's coordinator address
(``job_addresses[0]``, as the Keras and JAX coordinators are). Every node daemon
registers its processes here; when all ``num_processes`` have registered, the
membership is fixed under a new **epoch**, and each node daemon heartbeats the
coordinator until the epoch ends. An epoch ends, for everyone, when a node is
silent for ``--peer-timeout`` seconds, when a node reports a failure (a process
left, the engine failed), or when a process registers again (a new epoch forms).
Anything that names an older epoch is refused.

A group that spans nodes gets the engine ``gloo``, or ``gloo+nccl`` when every node
can drive both (node sums in GPU memory then cross on NCCL, :mod:`xreduced.nccl_engine`).
The store holds what the engines' ranks exchange to connect (Gloo's addresses,
NCCL's unique id), per group and epoch, and is dropped with the epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire.contract import METHOD_PREFIX
from xreduce.wire.devices import DeviceName

from xreduced import security
from xreduced.collective import assign_devices
from xreduced.config import Config
from xreduced.errors import Aborted, DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument, ServiceError

log = logging.getLogger("xreduced.coordinator")

MAX_STORE_KEYS = 4096
"""Keys one epoch's store holds at most (Gloo sets a few per node, NCCL one)."""
MAX_STORE_VALUE = 1 << 16
"""Bytes of one store value at most."""


@dataclasses.dataclass
class _Registration:
    process_id: int
    node: pb.NodeIdentity
    devices: tuple[str, ...]
    last_epoch: int = 0
    withdrawn: bool = False
    """Its Register call ended before the epoch formed (see :meth:`Coordinator.register`)."""


@dataclasses.dataclass
class _Epoch:
    number: int
    nodes: list[pb.ClusterNode]
    node_of: dict[str, int]  # node_id -> index
    engine: str
    last_beat: dict[int, float]
    """Node index -> when it last beat (from the epoch's forming on)."""
    ok: bool = True
    reason: str = ""
    left: bool = False
    """It ended because every process of a node left (a job's end), not by a failure."""
    lost: list[pb.LostPeer] = dataclasses.field(default_factory=list)
    store: dict[str, bytes] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Group:
    name: str
    num_processes: int
    epoch: _Epoch | None = None
    round: dict[int, _Registration] = dataclasses.field(default_factory=dict)
    formed: threading.Event = dataclasses.field(default_factory=threading.Event)
    round_error: ServiceError | None = None
    last_epoch: int = 0


def _check_registration(request: pb.RegisterRequest) -> None:
    """Raises ``InvalidArgument`` naming the field of a ``Register`` request that cannot be served.

    Example:
        >>> _check_registration(pb.RegisterRequest(group="g", num_processes=2, process_id=2))
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: process_id: must be in [0, num_processes); got process_id=2, num_processes=2
    """
    count, pid = request.num_processes, request.process_id
    if not request.group:
        raise InvalidArgument("group: a group name is required; got ''")
    if count < 1 or not 0 <= pid < count:
        raise InvalidArgument(f"process_id: must be in [0, num_processes); got process_id={pid}, "
                              f"num_processes={count}")
    if not request.node.node_id or not request.node.address:
        raise InvalidArgument("node: node_id and address are required")


class Coordinator:
    """The membership of every group this coordinator serves; thread-safe; every wait bounded.

    Args:
        group_id: how the group's id is made from its name (``name@coordinator``).
        peer_timeout: seconds a node may go without a heartbeat.
        heartbeat_interval: what the nodes are told to beat at.

    Example:
        >>> c = Coordinator(lambda name: name + "@here", peer_timeout=5.0, heartbeat_interval=1.0)
        >>> node = pb.NodeIdentity(node_id="n0", address="127.0.0.1", devices=["CPU:0", "CPU:1"],
        ...                        backend="numpy", engines=["gloo"])
        >>> reply = c.register(pb.RegisterRequest(group="g", num_processes=1, process_id=0, node=node), 1.0)
        >>> reply.epoch, reply.group, [list(p.devices) for p in reply.nodes[0].processes]
        (1, 'g@here', [['CPU:0', 'CPU:1']])
        >>> c.heartbeat("g@here", 1, "n0").ok
        True
        >>> c.report_failure("g@here", 1, "n0", "process 0 left", [0]).reason
        'node 0 (127.0.0.1) reported: process 0 left'
        >>> c.heartbeat("g@here", 1, "n0").ok
        False
    """

    def __init__(self, group_id, peer_timeout: float, heartbeat_interval: float):
        self._group_id = group_id
        self.peer_timeout = peer_timeout
        self.heartbeat_interval = heartbeat_interval
        self._lock = threading.Condition()
        self._groups: dict[str, _Group] = {}
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="xreduced-coordinator", daemon=True)
        self._watchdog.start()

    # --- membership ------------------------------------------------------------------------------------------

    def register(self, request: pb.RegisterRequest, timeout: float,
                 on_end: Callable[[Callable[[], None]], bool] | None = None) -> pb.RegisterResponse:
        """Adds a process to the group's forming epoch; waits until all have registered.

        Args:
            on_end: registers a callback run when the Register call ends (gRPC's ``context.add_callback``;
                False: it has ended already). A call that ends before the epoch forms (its process died
                while it joined, and its daemon cancelled the call) withdraws its registration, so the
                restarted process registers again at once.

        Raises:
            InvalidArgument: a bad field, a num_processes that disagrees, a process registered twice.
            DeadlineExceeded: not every process registered within ``timeout``; names who is missing.
            Aborted: the call ended (was cancelled) before the epoch formed.
        """
        _check_registration(request)
        count, pid = request.num_processes, request.process_id
        gid = self._group_id(request.group)
        with self._lock:
            group = self._groups.get(gid)
            if group is None or group.num_processes != count and not group.round:
                group = self._groups[gid] = _Group(gid, count, last_epoch=group.last_epoch if group else 0)
            if count != group.num_processes:
                raise InvalidArgument(f"num_processes: process {pid} says {count} but the processes registering "
                                      f"for group {gid!r} said {group.num_processes}")
            if group.epoch is not None and group.epoch.ok:
                self._end(group.epoch, f"process {pid} registered again: a new epoch is forming", [])
            if pid in group.round:
                raise InvalidArgument(f"process_id: process {pid} registered twice for the next epoch of group "
                                      f"{gid!r}; each process_id must be used by one process")
            if not group.round:
                group.formed = threading.Event()
                group.round_error = None
            mine = group.round[pid] = _Registration(pid, request.node, tuple(request.devices),
                                                    request.last_epoch)
            formed = group.formed
            log.info("event=registered group=%s process=%d registered=%d num_processes=%d", gid, pid,
                     len(group.round), count)
            if len(group.round) == count:
                self._close_round(group)

        def withdraw() -> None:
            with self._lock:
                if not formed.is_set() and group.round.get(pid) is mine:
                    del group.round[pid]
                    log.info("event=registration_withdrawn group=%s process=%d registered=%d", gid, pid,
                             len(group.round))
                mine.withdrawn = True
                self._lock.notify_all()

        if on_end is not None and not on_end(withdraw):
            withdraw()
        with self._lock:
            self._lock.wait_for(lambda: formed.is_set() or mine.withdrawn, timeout)
            if not formed.is_set():
                missing = [p for p in range(count) if p not in group.round][:10]
                if group.round.get(pid) is mine:
                    del group.round[pid]
                if mine.withdrawn:
                    raise Aborted(f"the join of process {pid} of group {gid!r} ended before the epoch formed")
                raise DeadlineExceeded(
                    f"the join of group {gid!r} timed out after {timeout:.3g}s waiting for process(es) "
                    f"{missing} to register with the coordinator; registered: {sorted(group.round)}",
                    process_ids=missing)
            if group.round_error is not None:
                raise group.round_error.copy()
            epoch = group.epoch
            return pb.RegisterResponse(epoch=epoch.number, group=gid, nodes=epoch.nodes, engine=epoch.engine,
                                       peer_timeout_seconds=self.peer_timeout,
                                       heartbeat_interval_seconds=self.heartbeat_interval)

    def _close_round(self, group: _Group) -> None:
        """With the lock held, every process has registered: the epoch forms (or the error each one gets), and
        the registrations wait no more."""
        try:
            group.epoch = self._form(group)
        except ServiceError as e:
            group.round_error = e
        except Exception:  # a bug: the others must not wait for nothing
            log.exception("event=epoch_error group=%s", group.name)
            group.round_error = Internal(f"forming group {group.name!r} failed in the coordinator; see its log")
        group.round = {}
        group.formed.set()
        self._lock.notify_all()

    def _form(self, group: _Group) -> _Epoch:
        """With the lock held: the nodes of a complete round, node 0 hosting process 0."""
        by_node: dict[str, list[_Registration]] = {}
        for pid in sorted(group.round):
            reg = group.round[pid]
            by_node.setdefault(reg.node.node_id, []).append(reg)
        nodes = []
        for index, regs in enumerate(by_node.values()):
            node = regs[0].node
            labels = list(node.devices)
            requested = {}  # by the process's rank on its node: blocks are split in that order
            for rank, reg in enumerate(regs):
                requested[rank] = tuple(_device_index(labels, d, reg.process_id) for d in reg.devices)
            what = f"the join of group {group.name!r} on node {index} ({node.address})"
            by_rank = assign_devices(requested, len(labels), labels.__getitem__, what)
            assigned = {reg.process_id: by_rank[rank] for rank, reg in enumerate(regs)}
            nodes.append(pb.ClusterNode(
                index=index, node_id=node.node_id, address=node.address, backend=node.backend,
                processes=[pb.ProcessDevices(process_id=p, devices=[labels[d] for d in devs])
                           for p, devs in sorted(assigned.items())]))
        engine = ""
        if len(nodes) > 1:
            without = [n.index for n, regs in zip(nodes, by_node.values()) if "gloo" not in regs[0].node.engines]
            if without:
                raise FailedPrecondition(
                    f"group {group.name!r} spans {len(nodes)} nodes, which needs the cross-node engine, but "
                    f"node(s) {without} ({', '.join(nodes[i].address for i in without)}) cannot drive Gloo: "
                    "pip install 'xreduce[cluster]' (torch) on every node")
            every = [set(regs[0].node.engines) for regs in by_node.values()]
            engine = "gloo+nccl" if all("nccl" in e for e in every) else "gloo"
        # Above any epoch a node has seen: this coordinator may have restarted since.
        group.last_epoch = max(group.last_epoch, *(r.last_epoch for r in group.round.values())) + 1
        now = time.monotonic()  # every node beats from the moment it hears of the epoch, before its engine connects
        epoch = _Epoch(group.last_epoch, nodes, {n.node_id: n.index for n in nodes}, engine,
                       {n.index: now for n in nodes})
        log.info("event=epoch_formed group=%s epoch=%d nodes=%d processes=%d engine=%s", group.name,
                 epoch.number, len(nodes), group.num_processes, engine or "none")
        return epoch

    # --- heartbeats and failures -----------------------------------------------------------------------------

    def heartbeat(self, gid: str, epoch: int, node_id: str) -> pb.EpochState:
        """Records that ``node_id`` is alive in ``epoch``; says whether the epoch stands."""
        with self._lock:
            group, current = self._epoch(gid, epoch)
            if current is not None and current.ok and node_id in current.node_of:
                current.last_beat[current.node_of[node_id]] = time.monotonic()
            return self._state(group, current, epoch)

    def attend(self, gid: str, epoch: int, node_id: str, active) -> Iterator[pb.EpochState]:
        """The epoch's state now, then once more when it ends; while ``active()`` (the stream is open).

        A stream that closes while the epoch stands (``left``) means the node's daemon is gone.
        """
        with self._lock:
            group, current = self._epoch(gid, epoch)
            state = self._state(group, current, epoch)
        yield state  # never under the lock: sending may wait on the network, and every node's heartbeat on the lock
        with self._lock:
            while current is not None and current.ok and active() and not self._closed.is_set():
                self._lock.wait(self.heartbeat_interval)
            if current is None or current.ok:
                return
            state = self._state(group, current, epoch)
        yield state

    def left(self, gid: str, epoch: int, node_id: str) -> None:
        """A node's attendance stream closed: if its epoch still stands, the node is lost."""
        with self._lock:
            _, current = self._epoch(gid, epoch)
            if current is None or not current.ok or node_id not in current.node_of:
                return
            node = current.nodes[current.node_of[node_id]]
            reason = "its daemon's connection to the coordinator closed (the daemon stopped or died)"
            self._end(current, f"lost node {node.index} ({node.address}, processes "
                      f"{[p.process_id for p in node.processes]}): {reason}", [_lost(node, reason)])

    def report_failure(self, gid: str, epoch: int, node_id: str, reason: str,
                       process_ids: list[int], left: bool = False) -> pb.EpochState:
        """Ends ``epoch`` because a node found a failure (the processes named are lost), or, with ``left``,
        because every process of the node left the group (a job's end)."""
        with self._lock:
            group, current = self._epoch(gid, epoch)
            if current is not None and current.ok:
                index = current.node_of.get(node_id)
                who = f"node {index} ({current.nodes[index].address})" if index is not None else f"node {node_id}"
                lost = [pb.LostPeer(node_index=index if index is not None else -1,
                                    address=current.nodes[index].address if index is not None else "",
                                    process_ids=process_ids, reason=reason)] if process_ids else []
                self._end(current, f"{who} reported: {reason}", lost, left=left)
            return self._state(group, current, epoch)

    def _epoch(self, gid: str, epoch: int) -> tuple[_Group | None, _Epoch | None]:
        group = self._groups.get(gid)
        current = group.epoch if group is not None else None
        return group, current if current is not None and current.number == epoch else None

    def _state(self, group: _Group | None, current: _Epoch | None, epoch: int) -> pb.EpochState:
        newest = group.last_epoch if group is not None else 0
        if current is None:
            return pb.EpochState(ok=False, epoch=newest, reason=(
                f"epoch {epoch} is over: the group is at epoch {newest}" if newest else "the coordinator does not "
                "know this group (it may have restarted): initialize again"))
        return pb.EpochState(ok=current.ok, epoch=newest, lost=current.lost, reason=current.reason,
                             left=current.left)

    def _end(self, epoch: _Epoch, reason: str, lost: list[pb.LostPeer], left: bool = False) -> None:
        """With the lock held: the epoch is over for everyone; ``left``: a job's end (logged at INFO), not a
        failure."""
        if not epoch.ok:
            return
        epoch.ok, epoch.reason, epoch.lost, epoch.left = False, reason, list(lost), left
        epoch.store.clear()
        self._lock.notify_all()
        if left:
            log.info("event=epoch_ended epoch=%d reason=%r", epoch.number, reason)
        else:
            log.warning("event=epoch_failed epoch=%d reason=%r lost=%s", epoch.number, reason,
                        ",".join(f"node{p.node_index}" for p in lost) or "none")

    def _watch(self) -> None:
        """Ends every epoch a node has gone silent in for ``peer_timeout`` seconds."""
        while not self._closed.wait(min(self.heartbeat_interval, self.peer_timeout) / 2):
            now = time.monotonic()
            with self._lock:
                for group in self._groups.values():
                    epoch = group.epoch
                    if epoch is None or not epoch.ok or len(epoch.nodes) < 2:
                        continue
                    silent = [i for i, t in epoch.last_beat.items() if now - t > self.peer_timeout]
                    if silent:
                        lost = [_lost(epoch.nodes[i], f"no heartbeat for {now - epoch.last_beat[i]:.1f} s")
                                for i in silent]
                        self._end(epoch, "lost " + ", ".join(
                            f"node {i} ({epoch.nodes[i].address}, processes "
                            f"{[p.process_id for p in epoch.nodes[i].processes]})" for i in silent)
                            + f": no heartbeat for more than {self.peer_timeout:g} s", lost)

    # --- the engine's store ----------------------------------------------------------------------------------

    def store_set(self, gid: str, epoch: int, key: str, value: bytes) -> None:
        """Sets ``key`` in the epoch's store.

        Raises:
            InvalidArgument: too many keys, or a value too large.
            Aborted: the epoch is over.
        """
        if len(value) > MAX_STORE_VALUE:
            raise InvalidArgument(f"value: at most {MAX_STORE_VALUE} bytes; got {len(value)} for key {key!r}")
        with self._lock:
            store = self._store(gid, epoch)
            if key not in store and len(store) >= MAX_STORE_KEYS:
                raise InvalidArgument(f"key: the store of epoch {epoch} holds {MAX_STORE_KEYS} keys at most")
            store[key] = bytes(value)
            self._lock.notify_all()

    def store_get(self, gid: str, epoch: int, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting at most ``timeout`` s for it to be set.

        Raises:
            DeadlineExceeded: not set in time. Aborted: the epoch is over.
        """
        end = time.monotonic() + timeout
        with self._lock:
            while True:
                store = self._store(gid, epoch)
                if key in store:
                    return store[key]
                left = end - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"key {key!r} of epoch {epoch} was not set within {timeout:.3g}s")
                self._lock.wait(min(left, 1.0))

    def store_add(self, gid: str, epoch: int, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer at ``key`` (0 when unset); returns the sum."""
        with self._lock:
            store = self._store(gid, epoch)
            try:
                value = int(store.get(key, b"0")) + amount
            except ValueError:
                raise InvalidArgument(f"key: {key!r} does not hold an integer") from None
            store[key] = str(value).encode()
            self._lock.notify_all()
            return value

    def _store(self, gid: str, epoch: int) -> dict[str, bytes]:
        group, current = self._epoch(gid, epoch)
        if current is None or not current.ok:
            raise Aborted(self._state(group, current, epoch).reason or f"epoch {epoch} is over")
        return current.store

    # --- status ----------------------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether any group here has an epoch standing or a membership forming."""
        with self._lock:
            return any(g.round or (g.epoch is not None and g.epoch.ok) for g in self._groups.values())

    def hosts(self, gid: str) -> bool:
        """Whether this coordinator serves group ``gid``."""
        with self._lock:
            return gid in self._groups

    def close(self) -> None:
        """Stops the watchdog."""
        self._closed.set()


def _device_index(labels: list[str], name: str, pid: int) -> int:
    try:
        short = DeviceName.parse(name).short
    except ValueError as e:
        raise InvalidArgument(f"devices: process {pid}: {e}") from None
    if short not in labels:
        raise InvalidArgument(f"devices: process {pid} asked for {name!r}, which its node does not have; its "
                              f"devices are {', '.join(labels)}")
    return labels.index(short)


def _lost(node: pb.ClusterNode, reason: str) -> pb.LostPeer:
    return pb.LostPeer(node_index=node.index, address=node.address,
                       process_ids=[p.process_id for p in node.processes], reason=reason)


class PeersService(pb_grpc.PeersServicer):
    """``xreduce.v1.Peers`` over a :class:`Coordinator`; errors become their status codes.

    Example:
        >>> c = Coordinator(lambda name: name, 5.0, 1.0)
        >>> from types import SimpleNamespace
        >>> context = SimpleNamespace(time_remaining=lambda: None)
        >>> PeersService(c, 60.0).Heartbeat(pb.HeartbeatRequest(group="g", epoch=1, node_id="n"), context).state.ok
        False
    """

    def __init__(self, coordinator: Coordinator, default_timeout: float):
        self.coordinator = coordinator
        self.default_timeout = default_timeout

    def _timeout(self, request, context) -> float:
        wanted = request.timeout.ToTimedelta().total_seconds() if request.HasField("timeout") else \
            self.default_timeout
        remaining = context.time_remaining()
        return max(0.0, min(wanted, remaining) if remaining is not None else wanted)

    def Register(self, request, context):
        return _answer(context, lambda: self.coordinator.register(request, self._timeout(request, context),
                                                                  getattr(context, "add_callback", None)))

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(state=self.coordinator.heartbeat(request.group, request.epoch, request.node_id))

    def Attend(self, request, context):
        left = threading.Event()

        def gone():
            left.set()
            self.coordinator.left(request.group, request.epoch, request.node_id)

        context.add_callback(gone)
        for state in self.coordinator.attend(request.group, request.epoch, request.node_id,
                                             lambda: not left.is_set() and context.is_active()):
            yield pb.AttendResponse(state=state)
        left.set()  # the epoch ended first: the stream closing now is no loss

    def ReportFailure(self, request, context):
        return pb.ReportFailureResponse(state=self.coordinator.report_failure(
            request.group, request.epoch, request.node_id, request.reason, list(request.process_ids),
            request.left))

    def StoreSet(self, request, context):
        return _answer(context, lambda: self.coordinator.store_set(
            request.group, request.epoch, request.key, request.value) or pb.StoreSetResponse())

    def StoreGet(self, request, context):
        return _answer(context, lambda: pb.StoreGetResponse(value=self.coordinator.store_get(
            request.group, request.epoch, request.key, self._timeout(request, context))))

    def StoreAdd(self, request, context):
        return _answer(context, lambda: pb.StoreAddResponse(value=self.coordinator.store_add(
            request.group, request.epoch, request.key, request.amount)))


def _answer(context, handler):
    try:
        return handler()
    except ServiceError as e:
        if hasattr(context, "abort"):
            context.abort(e.code, str(e))
        raise


class _TokenGate(grpc.ServerInterceptor):
    """Refuses Peers calls without the daemon's bearer token (UNAUTHENTICATED), as the main server does."""

    def __init__(self, check: security.TokenCheck):
        self._check = check

    def intercept_service(self, continuation, handler_call_details):
        refusal = self._check.refusal(handler_call_details.method, handler_call_details.invocation_metadata)
        if refusal is None:
            return continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        return grpc.unary_unary_rpc_method_handler(refuse)


class _NotADaemon(grpc.GenericRpcHandler):
    """Answers a ``CrossDeviceOps`` call that reached the coordinator's port (a process whose XREDUCE_ADDRESS is
    the job's first address) with what to do, instead of gRPC's bare "Method not found!"."""

    def __init__(self, address: str):
        self._message = (f"{address} is the coordinator of groups across nodes (the job's first address), not an "
                         "xreduce daemon: point XREDUCE_ADDRESS at this node's daemon (its --listen address)")

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(METHOD_PREFIX):
            return None
        found = pb.DESCRIPTOR.services_by_name["CrossDeviceOps"].methods_by_name.get(method[len(METHOD_PREFIX):])
        if found is None:
            return None

        def refuse(request, context):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._message)

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(found.client_streaming, found.server_streaming)]
        return make(refuse)


class CoordinatorServer:
    """A gRPC server for the ``Peers`` service at the coordinator address, with the daemon's TLS and token.

    Raises:
        RuntimeError: the address cannot be bound (e.g. it is not an address of this machine).

    Example:
        >>> server = CoordinatorServer("127.0.0.1:0", Coordinator(str, 5.0, 1.0), Config())
        >>> server.port > 0
        True
        >>> server.stop()
    """

    def __init__(self, address: str, coordinator: Coordinator, config: Config):
        self.address = address
        self.coordinator = coordinator
        check = security.token_check(config)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=128, thread_name_prefix="xreduced-peers"),
                                   interceptors=[_TokenGate(check)] if check is not None else [],
                                   options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_PeersServicer_to_server(PeersService(coordinator, config.collective_timeout), self._server)
        self._server.add_generic_rpc_handlers((_NotADaemon(address),))
        credentials = security.server_credentials(config)
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(address)
            else:
                self.port = self._server.add_secure_port(address, credentials)
        except RuntimeError as e:
            raise RuntimeError(f"cannot serve the coordinator at {address!r} ({e}); the coordinator address is "
                               "job_addresses[0]: process 0's daemon must be on that host and the port free") from None
        self._server.start()
        log.info("event=coordinator_serving address=%s", address)

    def stop(self, grace: float | None = None) -> None:
        """Stops serving: new calls are refused at once (and the address is free again); with ``grace``, the
        calls in flight have that many seconds to finish, so an attendance stream still delivers the end of
        the epoch that made the coordinator idle. Returns at once either way."""
        self.coordinator.close()
        self._server.stop(grace)
