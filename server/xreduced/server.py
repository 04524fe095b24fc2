"""Building, starting and stopping the daemon's gRPC server.

Teardown order matters: health turns NOT_SERVING first (so load balancers and
probes stop sending), then the call pipeline refuses new calls and lets
in-flight ones finish within the grace period, and only then does the server
close its connections. gRPC closes a connection as soon as its last call has
handed its reply to the kernel; a caller still reading a large reply would then
lose its tail (the socket is reset when the caller's next flow-control frame
arrives), so replies that left while draining get :data:`FLUSH_SECONDS` to
reach their callers first.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import lane as lane_frames
from xreduce.wire.contract import SERVICE_NAME

from xreduced import security
from xreduced.admission import Admission
from xreduced.backends import Backend
from xreduced.config import Config
from xreduced.decode import CollectiveKey
from xreduced.devices import DeviceTable
from xreduced.engine import Engine
from xreduced.express import Express
from xreduced.lane import LocalLane, Wakeup, lane_address
from xreduced.metrics import MetricsServer, Stats
from xreduced.oom import MappedBytes
from xreduced.pipeline import CallPipeline
from xreduced.prepared import PreparedCalls
from xreduced.regions import RegionTable
from xreduced.rendezvous import Rendezvous
from xreduced.service import CrossDeviceOpsService, default_peers

log = logging.getLogger("xreduced")

FLUSH_SECONDS = 1.0
"""How long replies sent while the daemon drains have to reach their callers (within the grace)."""


def make_backend(config: Config) -> Backend:
    """The backend the configuration asks for; ``auto`` prefers GPUs.

    Raises:
        RuntimeError: ``cupy`` was asked for and CuPy or a GPU is missing.
    """
    if config.backend in ("auto", "cupy"):
        from xreduced.backends import cupy_backend

        reason = cupy_backend.unavailable_reason()
        if reason is None:
            return cupy_backend.CupyBackend(config.virtual_devices)
        if config.backend == "cupy":
            raise RuntimeError(f"--backend cupy: {reason}")
        log.info("event=backend_fallback backend=numpy reason=%r", reason)
    from xreduced.backends.numpy_backend import NumpyBackend

    return NumpyBackend(config.virtual_devices or 8)


def in_use(listen: str) -> bool:
    """Whether every address ``host:port`` resolves to is taken by a listening socket, so gRPC could bind
    none (it serves when it binds one of them). A unix socket and port 0 are never in use here.

    Checked before gRPC binds, which would print its own error line from its core, before the daemon's.

    Example:
        >>> import socket
        >>> with socket.socket() as taken:
        ...     taken.bind(("127.0.0.1", 0)); taken.listen()
        ...     in_use(f"127.0.0.1:{taken.getsockname()[1]}")
        True
        >>> in_use("127.0.0.1:0"), in_use("unix:/run/xreduce/xreduced.sock")
        (False, False)
    """
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix") or not port.isdigit() or int(port) == 0:
        return False
    try:
        found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # gRPC says what is wrong with the host
    taken = 0
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port some closed connection still holds (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                taken += e.errno == errno.EADDRINUSE
    return bool(found) and taken == len(found)


class Daemon:
    """One running daemon: its server, health service and bound address.

    Example:
        >>> d = Daemon(Config(listen="127.0.0.1:0", virtual_devices=2)).start()
        >>> d.address.startswith("127.0.0.1:")
        True
        >>> d.stop()
    """

    def __init__(self, config: Config, backend: Backend | None = None):
        self.config = config
        self.backend = backend or make_backend(config)
        self.address: str | None = None
        self.metrics: MetricsServer | None = None
        self.lane: LocalLane | None = None
        """The local lane, once started (it needs the bound address)."""
        self.health = health.HealthServicer()
        self._stopped = threading.Event()
        # Every part is built here and handed to those that use it (Daemon.stop says who shuts each down).
        # Two pairs need each other: the rendezvous tells the express lane of a collective that came by the
        # full path, and the express lane reduces through the service, which meets in the rendezvous; the
        # service reports the local lane, which serves the service's calls. The part built first gets a
        # function that asks the other once both exist.
        engine = Engine(self.backend)
        devices = DeviceTable(self.backend.devices())
        self.admission = Admission.from_config(config)
        self.prepared = PreparedCalls()
        self.mapped = MappedBytes.from_config(config)
        """The shared memory the daemon maps, within ``--max-mapped-bytes`` (:mod:`xreduced.oom`)."""
        self.regions = RegionTable(ipc_opener=self.backend.open_ipc if self.backend.cuda_ipc else None,
                                   max_sessions=max(1, config.workers // 2), mapped=self.mapped)
        self.peers = default_peers(config, devices, self.backend.name)
        self.stats = Stats(inflight=lambda: self.admission.inflight.value,
                           collectives_waiting=lambda: self.service.collectives_waiting(), mapped=self.mapped)
        self.express: Express | None = None
        """The express lane (:mod:`xreduced.express`), with a local lane and a ``--lane-express-hold``."""
        expressing = config.local_lane and config.lane_express_hold > 0
        self.rendezvous = Rendezvous(report_after=config.stall_warning_seconds,
                                     arriving=(lambda key: self.express.claim(key)) if expressing else None,
                                     failing=(lambda group: self.express.claim_group(group)) if expressing else None)
        self.service = CrossDeviceOpsService(
            engine, self.backend.name, config.collective_timeout, self.rendezvous, config, self.regions,
            devices=devices, prepared=self.prepared, admission=self.admission, stats=self.stats, peers=self.peers,
            held_elsewhere=(lambda: self.express.collectives()) if expressing else lambda: 0,
            lane=lambda: self.lane)
        self.pipeline = CallPipeline(self.stats, self.admission, self.regions, self.service.refused,
                                     gate=security.token_check(config))
        self._wakeup = Wakeup() if config.local_lane else None
        """Wakes the local lane's thread: the express lane's calls handed over, the lane closing."""
        if expressing:
            service, rendezvous, peers = self.service, self.rendezvous, self.peers

            def busy(key: CollectiveKey, group: str) -> bool:
                return rendezvous.knows(key) or peers.lookup(group) is not None

            self.express = Express(known=self.prepared.get, reduce=service.express, busy=busy,
                                   begin=self.pipeline.begin_express, end=self.pipeline.end_express,
                                   hold=config.lane_express_hold, wake=self._wakeup.wake)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="xreduced"),
            interceptors=[self.pipeline],
            options=options,
        )
        pb_grpc.add_CrossDeviceOpsServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )

    def start(self) -> Daemon:
        """Binds, starts serving and marks health SERVING.

        Raises:
            RuntimeError: the address cannot be bound, or a credentials file read.
        """
        listen = self.config.listen
        credentials = security.server_credentials(self.config)
        if in_use(listen):
            host = listen.rpartition(":")[0]
            raise RuntimeError(f"cannot listen on {listen!r}: the address is already in use; pick another --listen, "
                               f"or --listen {host}:0 for a free port")
        try:
            with security.private_files():
                if credentials is None:
                    port = self.server.add_insecure_port(listen)
                else:
                    port = self.server.add_secure_port(listen, credentials)
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {listen!r}: {e}") from None
        if listen.startswith("unix:"):
            security.protect_socket(listen[len("unix:"):].removeprefix("//"), self.config)
            self.address = listen
        else:
            host = listen.rsplit(":", 1)[0]
            self.address = f"{host}:{port}"
        try:
            if self.config.local_lane:
                self._start_lane()
            if self.config.metrics_listen:
                self.metrics = MetricsServer(self.config.metrics_listen, self.stats.registry)
                log.info("event=metrics address=%s", self.metrics.address)
        except RuntimeError:
            if self.lane is not None:
                self.lane.close()
            self.server.stop(None)
            raise
        # SERVING before the first call can arrive: no health check sees NOT_FOUND.
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server.start()
        log.info("%s", self.serving_line())
        return self

    def _start_lane(self) -> None:
        """The local lane (:mod:`xreduced.lane`), its calls served through the same pipeline."""
        requests = {"Reduce": (pb.ReduceRequest, self.service.Reduce),
                    "BatchReduce": (pb.BatchReduceRequest, self.service.BatchReduce),
                    "Broadcast": (pb.BroadcastRequest, self.service.Broadcast)}
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=message.FromString, response_serializer=lambda r: r.SerializeToString())
            for name, (message, behavior) in requests.items()}
        assert set(handlers) == set(lane_frames.METHODS)
        # From here on the service offers the lane to sessions and reports it (none can call before the
        # server starts).
        self.lane = LocalLane(lane_address(self.address), self.pipeline, handlers, self.regions,
                              max_connections=self.config.workers,
                              protect=lambda path: security.protect_socket(path, self.config), express=self.express,
                              wakeup=self._wakeup, repeat=self.service.repeat)
        with security.private_files():  # a socket file is never more open than 0600, even for a moment
            self.lane.start()
        self.stats.watch_lane(self.lane.counts, self.lane.express_counts, self.lane.repeat_calls)

    def serving_line(self) -> str:
        """The ``event=serving`` log line: the bound address, the backend and the devices."""
        devices = self.service.devices
        return (f"event=serving address={self.address} backend={self.backend.name} devices={len(devices)} "
                f"names={devices.listing().replace(' ', '')}")

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, then refuse new calls and give in-flight ones ``grace`` seconds; then each part that
        holds threads, sockets or memory is shut down here. The others (the rendezvous, the express lane,
        the admission, the prepared shapes, the counters) hold nothing once no call is in flight."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.grace_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        log.info("event=stopping grace_seconds=%g", grace)
        # Sessions are open streams: end them, or every stop would wait out the whole grace; their
        # regions stay mapped for the calls still in flight, and go when those are done.
        self.regions.end_streams()
        answered = self.pipeline.drain(grace)  # refuses new calls from now on
        if answered:
            time.sleep(max(0.0, min(FLUSH_SECONDS, deadline - time.monotonic())))
        log.debug("event=drained answered=%s", answered)
        if self.lane is not None:
            self.lane.close()  # its thread closes the wakeup as it ends
        elif self._wakeup is not None:
            self._wakeup.close()
        # Calls still in flight at the end of the grace are cancelled.
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        self.regions.close_all()
        self.peers.close()
        if self.metrics is not None:
            self.metrics.stop()
        log.info("event=stopped")

    def wait(self) -> None:
        """Blocks until the server has stopped."""
        self.server.wait_for_termination()
