"""The peer level: this daemon's groups across nodes, and the coordinators it serves.

A node daemon joins a group through the group's coordinator
(:mod:`xreduced.coordinator`, at ``job_addresses[0]``; process 0's daemon serves
it), which answers with the membership of a new epoch: the nodes, node 0 first,
and each node's processes and their devices. :class:`Peers` connects the epoch's
engines (Gloo; and NCCL for node sums in GPU memory when the coordinator chose ``gloo+nccl``, which it does
when every node advertised both) and keeps a :class:`~xreduced.cluster.ClusterGroup` per group; its
collectives are :mod:`xreduced.across`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import NoReturn

import grpc
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire.devices import DeviceName

from xreduced import gloo, nccl_engine, security
from xreduced.cluster import ClusterGroup
from xreduced.config import Config
from xreduced.coordinator import Coordinator, CoordinatorServer
from xreduced.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    Unavailable,
)

log = logging.getLogger("xreduced.peers")

MAX_ENDED = 64
"""Groups whose epoch ended (failed, or every local process left) that status still shows, at most."""
MAX_REMEMBERED = 4096
"""Groups whose newest epoch a daemon remembers, so that a restarted coordinator numbers above it."""

REGISTER_RETRY_SECONDS = 0.2
"""How soon a registration the coordinator cut off (it was stopping) is sent again."""


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): the default --node-address.

    Raises:
        InvalidArgument: ``host`` cannot be resolved (a typo in the coordinator's job address).
        Unavailable: no route to it.

    Example:
        >>> route_address("127.0.0.1", 1234)
        '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
        except socket.gaierror as e:
            raise InvalidArgument(f"coordinator: cannot resolve the host of job_addresses[0] '{host}:{port}': "
                                  f"{e.strerror}; is it a typo?") from None
        except OSError as e:
            raise Unavailable(f"coordinator: no route to {host}:{port} ({e.strerror}); set --node-address") from None
        return s.getsockname()[0]


def split_address(address: str, field: str = "coordinator") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); the host must resolve.

    Raises:
        InvalidArgument: not ``host:port``, or a host that cannot be resolved (the
            coordinator's is ``job_addresses[0]``); the message names the value.

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
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InvalidArgument(f"{field}: cannot resolve the host of job_addresses[0] {address!r}: {e.strerror}; "
                              "is it a typo?") from None
    return host, int(port)


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
        self._linking: dict[str, int] = {}  # coordinator address -> joins through it in progress
        self._epochs: collections.OrderedDict[str, int] = collections.OrderedDict()
        """The newest epoch of each group this daemon took part in (the last MAX_REMEMBERED), left ones too."""
        self._watched: dict[str, set[tuple[str, int, int]]] = {}
        """Sessions through which processes joined groups: session id -> {(group, epoch, process id)}."""
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
             timeout: float, on_end: Callable[[Callable[[], None]], bool] | None = None) -> ClusterGroup:
        """Registers a process with the coordinator; returns the group's new epoch, engine connected.

        Args:
            on_end: registers a callback run when the process's JoinGroup call ends (gRPC's
                ``context.add_callback``): a call that ends while its registration waits at the coordinator
                (the process died, whatever the signal) cancels the registration there, so nothing of it
                stays behind.

        Raises:
            InvalidArgument: a malformed coordinator address. Unavailable: the coordinator cannot be
            reached. FailedPrecondition: the group spans nodes and an engine is missing.
            DeadlineExceeded: not every process registered, or the engine did not connect, in time.
        """
        host, port = split_address(coordinator)
        gid = f"{name}@{coordinator}"
        self._release()
        with self._lock:
            self._linking[coordinator] = self._linking.get(coordinator, 0) + 1
        try:
            return self._join(name, num_processes, process_id, coordinator, host, port, gid, devices, timeout,
                              on_end)
        finally:
            with self._lock:
                self._linking[coordinator] -= 1
                if not self._linking[coordinator]:
                    del self._linking[coordinator]

    def _join(self, name: str, num_processes: int, process_id: int, coordinator: str, host: str, port: int,  # noqa: PLR0913
              gid: str, devices: list[str], timeout: float, on_end=None) -> ClusterGroup:
        if process_id == 0:
            self._serve_coordinator(coordinator, gid)
        node_address = self.config.node_address or route_address(host, port)
        stub = self._stub(coordinator)
        engines = ["gloo"] if gloo.unavailable_reason() is None else []
        if nccl_engine.unavailable_reason(self.backend) is None:
            engines.append("nccl")
        with self._lock:
            last_epoch = self._epochs.get(gid, 0)
        request = pb.RegisterRequest(
            group=name, num_processes=num_processes, process_id=process_id, last_epoch=last_epoch,
            node=pb.NodeIdentity(node_id=self.node_id, address=node_address, devices=self.devices,
                                 backend=self.backend, engines=engines),
            devices=[DeviceName.parse(d).short for d in devices])
        reply = self._register(stub, request, coordinator, timeout, on_end)
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

    def _register(self, stub, request: pb.RegisterRequest, coordinator: str, timeout: float,
                  on_end=None) -> pb.RegisterResponse:
        """Registers with the coordinator within the join's ``timeout``. Process 0's daemon may not serve it
        yet, or may be stopping the last epoch's while process 0 initializes again (its own process left
        first): a registration it cut off is sent again, to the coordinator that replaces it. When the
        process's own call ends first (``on_end``), the registration is cancelled at the coordinator."""
        deadline = time.monotonic() + timeout
        ended = threading.Event()
        current: list[grpc.Future] = []

        def cancel() -> None:
            ended.set()
            for call in current:
                call.cancel()

        if on_end is not None and not on_end(cancel):
            cancel()
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            request.timeout.FromNanoseconds(int(left * 1e9))
            if ended.is_set():
                raise Aborted(f"process {request.process_id}'s join of group {request.group!r} ended (its call "
                              "was cancelled: the process is gone) before the epoch formed")
            call = stub.Register.future(request, timeout=left + 5.0, metadata=self._metadata, wait_for_ready=True)
            current[:] = [call]
            if ended.is_set():
                call.cancel()
            try:
                return call.result()
            except grpc.FutureCancelledError:
                continue  # said above
            except grpc.RpcError as e:
                if ended.is_set():
                    continue
                cut_off = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if not cut_off or deadline - time.monotonic() < REGISTER_RETRY_SECONDS:
                    self._raise(e, left + 5.0, coordinator, "register with", wait=True)
            log.info("event=register_retry coordinator=%s group=%s process=%d", coordinator, request.group,
                     request.process_id)
            ended.wait(REGISTER_RETRY_SECONDS)

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
        interval = max(reply.heartbeat_interval_seconds, 0.5)

        def beat():  # waits (bounded) for a link that is reconnecting rather than failing at once
            return stub.Heartbeat(pb.HeartbeatRequest(group=gid, epoch=epoch, node_id=self.node_id),
                                  timeout=interval, metadata=self._metadata, wait_for_ready=True).state

        def report(reason, process_ids, left=False):
            stub.ReportFailure(pb.ReportFailureRequest(group=gid, epoch=epoch, node_id=self.node_id, reason=reason,
                                                       process_ids=process_ids, left=left),
                               timeout=interval, metadata=self._metadata)

        def attend():
            return stub.Attend(pb.AttendRequest(group=gid, epoch=epoch, node_id=self.node_id), metadata=self._metadata)

        # The heartbeats start before the engine connects: a node that stops while it connects is lost too.
        count = sum(len(n.processes) for n in nodes)
        cluster = ClusterGroup(gid, count, epoch, index, nodes, None, coordinator, beat, report,
                               reply.peer_timeout_seconds, reply.heartbeat_interval_seconds,
                               hosted=coordinator in self._servers, attend=attend)
        if len(nodes) > 1:
            try:
                cluster.connect(*self._engines(reply, stub, coordinator, index, node_address, timeout))
            except ServiceError as e:
                cluster.fail(f"{cluster.describe(index)} could not connect the engine: {e}", report=True)
                cluster.close()
                raise
        with self._lock:
            self._groups[gid] = cluster
            self._epochs[gid] = epoch
            self._epochs.move_to_end(gid)
            while len(self._epochs) > MAX_REMEMBERED:
                self._epochs.popitem(last=False)
        log.info("event=group_joined group=%s epoch=%d node=%d nodes=%d engine=%s", gid, epoch, index, len(nodes),
                 reply.engine or "none")
        return cluster

    def _engines(self, reply: pb.RegisterResponse, stub, coordinator: str, index: int, node_address: str,
                 timeout: float) -> tuple[gloo.GlooEngine, nccl_engine.NcclEngine | None]:
        """The epoch's engines, connected to every node's through the coordinator's store, within ``timeout``:
        Gloo, and for ``gloo+nccl`` NCCL too."""
        gid, epoch = reply.group, reply.epoch
        wanted = reply.engine or "gloo"
        reasons = {"gloo": gloo.unavailable_reason()}
        if wanted == "gloo+nccl":
            reasons["nccl"] = nccl_engine.unavailable_reason(self.backend)
        elif wanted != "gloo":
            reasons[wanted] = f"this daemon does not know the engine {wanted!r}"
        refused = "; ".join(f"{name}: {why}" for name, why in reasons.items() if why is not None)
        if refused:
            raise FailedPrecondition(f"group {gid!r} spans {len(reply.nodes)} nodes, which needs the engine "
                                     f"{wanted}: {refused}")
        deadline = time.monotonic() + timeout

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
            host = gloo.GlooEngine(store, index, len(reply.nodes), node_address, timeout)
        except gloo.EngineError as e:
            raise Unavailable(f"group {gid!r} epoch {epoch}: {e}") from None
        if wanted != "gloo+nccl":
            return host, None
        try:  # the same bound for both: the join's
            return host, nccl_engine.NcclEngine(store, index, len(reply.nodes), node_address,
                                                max(deadline - time.monotonic(), 0.001))
        except gloo.EngineError as e:
            host.close()
            raise Unavailable(f"group {gid!r} epoch {epoch}: {e}") from None

    def leave(self, gid: str, epoch: int, process_id: int) -> None:
        """Process ``process_id`` is done with group ``gid``: once every process of this node has left, the
        daemon leaves the group (its epoch ends for every node, as a job's end ends it), and stops serving a
        coordinator and dropping a link that no group needs any more.

        Raises:
            NotFound: no such group or epoch here.
        """
        with self._lock:
            cluster = self._groups.get(gid)
            if cluster is None or cluster.epoch != epoch:
                raise NotFound(f"group: this daemon is in no group {gid!r} of epoch {epoch}")
            if process_id not in cluster.local:
                raise InvalidArgument(f"process_id: {process_id} is not one of this node's processes "
                                      f"{sorted(cluster.local)} in group {gid!r}")
            cluster.left.add(process_id)
            if cluster.left != cluster.local:
                return
        cluster.fail(f"every process of {cluster.describe(cluster.node_index)} left the group", report=True,
                     left=True)
        cluster.close()
        log.info("event=group_left group=%s epoch=%d", gid, epoch)
        self._release()

    def watch(self, session_id: str, gid: str, epoch: int, process_id: int) -> None:
        """Process ``process_id`` joined epoch ``epoch`` of group ``gid`` through session ``session_id``: if the
        session ends before the process leaves, the epoch ends (:meth:`session_ended`). A session's entries for
        epochs that are over are dropped here, so they stay few."""
        with self._lock:
            kept = {(g, e, p) for g, e, p in self._watched.get(session_id, ())
                    if (c := self._groups.get(g)) is not None and c.epoch == e and not c.failed.is_set()}
            kept.add((gid, epoch, process_id))
            self._watched[session_id] = kept

    def session_ended(self, session_id: str) -> None:
        """A session's stream ended (its process closed it, exited or was killed). Each process that joined
        a group through it and has not left fails the group's epoch everywhere, named as lost, as a lost
        node does: the others' collectives fail now with ABORTED instead of waiting for it, and no daemon
        keeps the group heartbeating for a job that is gone."""
        with self._lock:
            memberships = self._watched.pop(session_id, set())
            gone = []
            for gid, epoch, pid in sorted(memberships):
                cluster = self._groups.get(gid)
                if (cluster is not None and cluster.epoch == epoch and not cluster.failed.is_set()
                        and pid not in cluster.left):
                    gone.append((cluster, pid))
        for cluster, pid in gone:
            node = cluster.nodes[cluster.node_index]
            log.warning("event=process_gone group=%s epoch=%d process=%d", cluster.gid, cluster.epoch, pid)
            cluster.fail(f"process {pid} on {cluster.describe(cluster.node_index)} ended without leaving the group "
                         "(its session with its daemon closed: it exited or was killed)",
                         [pb.LostPeer(node_index=cluster.node_index, address=node.address, process_ids=[pid],
                                      reason="its session closed without LeaveGroup")],
                         report=True, process_ids=[pid])
            cluster.close()
        if gone:
            self._release()

    def _release(self) -> None:
        """Stops the coordinators no group needs any more, closes the links no group uses, and forgets the
        oldest ended groups beyond the last ``MAX_ENDED`` (which status still shows)."""
        with self._lock:
            ended = [gid for gid, g in self._groups.items() if g.failed.is_set()]
            for gid in ended[:max(len(ended) - MAX_ENDED, 0)]:
                del self._groups[gid]
            used = {g.coordinator for g in self._groups.values() if not g.failed.is_set()} | set(self._linking)
            idle = [a for a, server in self._servers.items() if a not in used and not server.coordinator.busy()]
            servers = [self._servers.pop(a) for a in idle]
            channels = [self._channels.pop(a)[0] for a in list(self._channels) if a not in used]
        for server in servers:  # the other nodes' streams still hear how the epoch ended
            server.stop(grace=server.coordinator.heartbeat_interval)
            log.info("event=coordinator_stopped address=%s", server.address)
        for channel in channels:
            channel.close()

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
                # Reconnect within a second after an outage (gRPC's default backoff grows to minutes): a node
                # whose link comes back must reach the coordinator before the peer timeout, or it is lost again.
                options = [("grpc.max_receive_message_length", 1 << 20), ("grpc.initial_reconnect_backoff_ms", 100),
                           ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
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
            self._raise(e, timeout, address, verb, engine_error, wait)

    @staticmethod
    def _raise(e: grpc.RpcError, timeout: float, address: str, verb: str, engine_error: bool = False,
               wait: bool = False) -> NoReturn:
        """Raises the service error a failed call to the coordinator at ``address`` stands for."""
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
                group=g.gid, epoch=g.epoch,
                state="left" if g.left == g.local else "failed" if g.failed.is_set() else "active",
                num_processes=g.num_processes, node_index=g.node_index, nodes=g.nodes,
                engine=g.engine_name, coordinator=g.hosted,
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
