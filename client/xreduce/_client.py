"""The connection to a daemon: credentials, a lazy channel, a typed method per RPC.

Resilience: the channel reconnects on its own after the daemon restarts (fast
reconnect backoff); idempotent calls (ListDevices, GetStatus, health) are
retried on UNAVAILABLE with exponential backoff (:data:`RETRY_POLICY`), except
when the failure is a TLS mismatch, which no retry heals; collectives are never
retried nor queued (no wait_for_ready), so they fail fast with an
UnavailableError naming the address.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc

from xreduce import _lane, _runtime
from xreduce._errors import InvalidArgumentError, Security, from_rpc_error, tls_hint
from xreduce._lane import Lane
from xreduce._options import ENV_TRANSPORT, ConnectionOptions, Pem, check_transport, merge
from xreduce._segments import SHM_DIR, available
from xreduce._session import Session
from xreduce._shared_memory import SharedMemory
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire.contract import SERVICE_NAME, SESSION_METADATA, method_path

DEFAULT_TIMEOUT = 600.0
"""Seconds a call may take when the caller gives no timeout: no wait is unbounded. A collective's wait is
the daemon's to end (``--collective-timeout``, default 60 s), with an error that names the missing
processes; this deadline only ends calls to a daemon that stopped answering, and stays above any collective
timeout an operator is likely to set, so that it never cuts such a wait short (docs/operations.md)."""

MAX_MESSAGE_BYTES = (1 << 31) - 1

ENV_TOKEN = "XREDUCE_TOKEN"
"""The bearer token, when ``token=`` is not given."""
ENV_TLS_CA = "XREDUCE_TLS_CA"
"""PEM file of the CA that signed the daemon's certificate; setting it turns TLS on."""
ENV_TLS_CLIENT_CERT = "XREDUCE_TLS_CLIENT_CERT"
"""PEM certificate chain this process presents (mutual TLS), with :data:`ENV_TLS_CLIENT_KEY`."""
ENV_TLS_CLIENT_KEY = "XREDUCE_TLS_CLIENT_KEY"
"""PEM private key of :data:`ENV_TLS_CLIENT_CERT`."""
ENV_TLS_SERVER_NAME = "XREDUCE_TLS_SERVER_NAME"
"""The name the daemon's certificate is checked against, instead of the address's host."""

IDEMPOTENT_METHODS = ((SERVICE_NAME, "ListDevices"), (SERVICE_NAME, "GetStatus"), ("grpc.health.v1.Health", "Check"))
"""The calls retried on UNAVAILABLE; collectives (Reduce, BatchReduce, Broadcast, JoinGroup) never are."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How idempotent calls are retried on UNAVAILABLE, as gRPC's retry policy would: the wait before
    attempt ``n + 1`` is ``initial_backoff * multiplier ** (n - 1)``, at most ``max_backoff``, give or take
    ``jitter``; all attempts within the call's timeout.

    The SDK retries rather than gRPC so that a TLS mismatch, which no retry
    heals, fails at once.

    Example:
        >>> 0.8 * 1.6 <= RETRY_POLICY.backoff(3) <= 1.2 * 1.6
        True
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 4.0
    jitter: float = 0.2

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based)."""
        base = min(self.initial_backoff * self.multiplier ** (attempt - 1), self.max_backoff)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


RETRY_POLICY = RetryPolicy()
"""Up to 5 attempts, waiting about 0.1 s, 0.4 s, 1.6 s, 2 s between them."""

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect soon after the daemon comes back: 100 ms, growing to 2 s at most (gRPC's default: 1 s to 120 s).
    # (grpc.min_reconnect_backoff_ms, the connect timeout, keeps its 20 s: a far daemon must have time to answer.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
"""Options of every SDK channel: message limits, fast reconnects."""


def _pem(value: Pem | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {os.fspath(value)}: cannot read it ({e.strerror})") from None


def _serialize(message: pb.ReduceStreamRequest | bytes) -> bytes:
    """ReduceStream's requests: messages, or chunk messages the caller encoded already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class Client:
    """A connection to one daemon, with a typed method per RPC; the channel opens on first use.

    Args:
        address: ``host:port`` or ``unix:PATH``; see :func:`xreduce.resolve_address`.
        timeout: default seconds per call (``None``: :data:`DEFAULT_TIMEOUT`).
        token: the bearer token sent with every call as ``authorization: Bearer
            <token>`` metadata (also over plaintext); default ``XREDUCE_TOKEN``,
            else none.
        root_certificates: the CA that signed the daemon's certificate, PEM
            bytes or a file path; giving it (or setting ``XREDUCE_TLS_CA`` to
            a file) turns TLS on. Without either the channel is plaintext.
        certificate_chain: this process's certificate for mutual TLS, PEM bytes
            or a path; default ``XREDUCE_TLS_CLIENT_CERT``.
        private_key: its key; default ``XREDUCE_TLS_CLIENT_KEY``.
        transport: how tensors travel: ``"auto"`` (shared memory when the
            daemon shares this host, else the wire), ``"shm"`` (shared memory,
            or an error saying why not), ``"wire"`` (bytes in the messages);
            default ``XREDUCE_TRANSPORT``, else ``"auto"``.
        options: all of the above as one :class:`xreduce.ConnectionOptions`;
            a keyword given beside it wins over its field.

    ``XREDUCE_TLS_SERVER_NAME`` overrides the name the daemon's certificate
    must carry (default: the address's host). A daemon started by
    :func:`xreduce.serve_embedded` is reached in plaintext over its private
    socket whatever the ``XREDUCE_TLS_*`` variables say.

    Idempotent calls (ListDevices, GetStatus, health) are retried while the
    daemon is unavailable (5 attempts over about 4 s); collectives fail at
    once with :class:`xreduce.UnavailableError`, and so does every call when
    the failure looks like a TLS mismatch (the message says which settings to
    check). The channel reconnects by itself after the daemon restarts: keep
    using the same client.

    Each RPC method takes the request message and returns the response
    message; ``timeout=`` bounds the call, ``session=`` names the session
    (:meth:`open_session`) whose regions the request uses. Failures raise
    :class:`xreduce.XReduceError`, keeping the status code.

    Raises:
        ValueError: ``certificate_chain`` without ``private_key`` or the reverse;
            on the first call, a PEM file that cannot be read, or only one of
            ``XREDUCE_TLS_CLIENT_CERT``/``XREDUCE_TLS_CLIENT_KEY`` (the message
            names the argument or the variable).

    Example:
        >>> with Client("127.0.0.1:1") as c:  # constructing needs no daemon
        ...     c.address
        '127.0.0.1:1'
        >>> Client("daemon.example:50551", token="s3cret", root_certificates=b"-----BEGIN CERTIFICATE-----...").tls
        True
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
        ...     c.device_names()[1], c.get_status().backend
        ('/job:localhost/replica:0/task:0/device:CPU:1', 'numpy')
    """

    def __init__(self, address: str | None = None, timeout: float | None = None, token: str | None = None,
                 root_certificates: Pem | None = None, certificate_chain: Pem | None = None,
                 private_key: Pem | None = None, transport: str | None = None, *,
                 options: ConnectionOptions | None = None):
        self._options = merge(options, address=address, timeout=timeout, token=token,
                              root_certificates=root_certificates, certificate_chain=certificate_chain,
                              private_key=private_key, transport=transport)
        self._address: str | None = None
        self.timeout = DEFAULT_TIMEOUT if self._options.timeout is None else self._options.timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CrossDeviceOpsStub | None = None
        self._devices: pb.ListDevicesResponse | None = None
        self._lane: Lane | None = None

    @property
    def options(self) -> ConnectionOptions:
        """The connection settings this client was made with (unset fields resolve on use)."""
        return self._options

    @property
    def transport(self) -> str:
        """The transport asked for: ``transport=``, else ``XREDUCE_TRANSPORT``, else ``"auto"``."""
        if self._options.transport is not None:
            return self._options.transport
        return check_transport(os.environ.get(ENV_TRANSPORT) or "auto", ENV_TRANSPORT)

    def shared_memory(self) -> SharedMemory | None:
        """The shared memory with this daemon when this call should use it, else None (the wire).

        One per process and daemon, shared by every client: each open session holds a daemon thread.

        Raises:
            xreduce.InvalidArgumentError: ``transport="shm"`` and this host has no
                POSIX shared memory, or the daemon cannot read it (the message
                says why); it is a ``ValueError`` too.
            xreduce.XReduceError: opening the session failed otherwise, e.g.
                :class:`xreduce.UnavailableError`.

        Example:
            >>> Client("127.0.0.1:1", transport="wire").shared_memory() is None
            True
        """
        mode = self.transport
        if mode == "wire":
            return None
        if not available():
            if mode == "shm":
                raise InvalidArgumentError(f"transport='shm' needs POSIX shared memory ({SHM_DIR}); this host has "
                                           "none", grpc.StatusCode.FAILED_PRECONDITION)
            return None
        runtime = _runtime.default()
        key = (self.address, self._metadata(), self.tls)
        shm = runtime.shared_memory(key, lambda: SharedMemory(self._session_client(), runtime.releases,
                                                              runtime.shared_arrays))
        if shm.usable():
            return shm
        if mode == "shm":
            raise InvalidArgumentError(f"transport='shm' but the daemon at {self.address} cannot read this host's "
                                       f"shared memory: {shm.reason or shm.last_error}",
                                       grpc.StatusCode.FAILED_PRECONDITION)
        return None

    def local_lane(self) -> Lane | None:
        """This process's local lane to the daemon (:mod:`xreduce._lane`), when small calls should take it.

        Not with the transport ``wire`` (gRPC only); otherwise when the daemon
        shares this host and offers one, and ``XREDUCE_LOCAL_LANE`` is not off.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     xreduce.Client().local_lane().address.startswith("unix:")
            ...     xreduce.Client(transport="wire").local_lane() is None
            True
            True
        """
        if self.transport == "wire" or not _lane.enabled():
            return None
        lane = self._lane
        if lane is not None and lane.usable():  # the session still lives: no lookup per call
            return lane
        shm = self.shared_memory()
        lane = self._lane = None if shm is None else shm.lane()
        return lane

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call of this client carries: the bearer token, if any.

        Example:
            >>> Client("127.0.0.1:1", token="s3cret").call_metadata()
            (('authorization', 'Bearer s3cret'),)
        """
        return self._metadata()

    def _session_client(self) -> Client:
        """A client of the same daemon with the same credentials, for the shared session."""
        return Client(options=dataclasses.replace(self._options, address=self.address, timeout=self.timeout,
                                                  transport="wire"))

    @property
    def address(self) -> str:
        """The daemon's address, resolved on first use and then fixed."""
        if self._address is None:
            self._address = _runtime.resolve_address(self._options.address)
        return self._address

    @property
    def tls(self) -> bool:
        """Whether the channel uses TLS (``root_certificates``, a client certificate or ``XREDUCE_TLS_CA``)."""
        if self._options.root_certificates is not None or self._options.certificate_chain is not None:
            return True
        return self._from_env(ENV_TLS_CA) is not None

    def _from_env(self, name: str) -> str | None:
        """A TLS variable, ignored for the embedded daemon (plaintext on its private socket)."""
        if self._options.address is None and _runtime.default().is_embedded(self.address):
            return None
        return os.environ.get(name) or None

    def _security(self) -> Security:
        """What this client offers the daemon, for the hint of a TLS mismatch."""
        tls = self.tls
        certificate = tls and (self._options.certificate_chain is not None
                               or self._from_env(ENV_TLS_CLIENT_CERT) is not None)
        return Security(tls=tls, client_certificate=certificate)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = self._options.token if self._options.token is not None else os.environ.get(ENV_TOKEN)
        return (("authorization", f"Bearer {token}"),) if token else ()

    def _credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        """TLS credentials: each argument, else its environment variable."""
        opts = self._options
        root = _pem(opts.root_certificates, "root_certificates") if opts.root_certificates is not None \
            else _pem(self._from_env(ENV_TLS_CA), ENV_TLS_CA)
        if opts.certificate_chain is not None:
            chain = _pem(opts.certificate_chain, "certificate_chain")
            key = _pem(opts.private_key, "private_key")
        else:
            chain = _pem(self._from_env(ENV_TLS_CLIENT_CERT), ENV_TLS_CLIENT_CERT)
            key = _pem(self._from_env(ENV_TLS_CLIENT_KEY), ENV_TLS_CLIENT_KEY)
            if (chain is None) != (key is None):
                raise ValueError(f"{ENV_TLS_CLIENT_CERT} and {ENV_TLS_CLIENT_KEY} go together (mutual TLS); got "
                                 f"only {ENV_TLS_CLIENT_CERT if chain is not None else ENV_TLS_CLIENT_KEY}")
        server_name = self._from_env(ENV_TLS_SERVER_NAME)
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.ssl_channel_credentials(root, key, chain), options

    def _open(self) -> grpc.Channel:
        options = list(CHANNEL_OPTIONS)
        if not self.tls:
            return grpc.insecure_channel(self.address, options=options)
        credentials, extra = self._credentials()
        return grpc.secure_channel(self.address, credentials, options=options + extra)

    def _get_channel(self) -> grpc.Channel:
        return self._get()[0]

    def _get(self) -> tuple[grpc.Channel, pb_grpc.CrossDeviceOpsStub]:
        with self._lock:
            if self._channel is None:
                self._channel = self._open()
                self._stub = pb_grpc.CrossDeviceOpsStub(self._channel)
            return self._channel, self._stub

    def _unary(self, method: str, request, timeout: float | None, session: str | None = None):
        """Calls the unary RPC ``method``; the session's id goes in the metadata when given."""
        stub = self._get()[1]
        metadata = self._metadata() + (((SESSION_METADATA, session),) if session else ())
        retried = (SERVICE_NAME, method) in IDEMPOTENT_METHODS
        return self._call(getattr(stub, method), request, timeout, metadata, retried)

    def _call(self, rpc: Callable, request, timeout: float | None, metadata, retried: bool):
        """``rpc(request)`` within ``timeout``; if ``retried``, again on UNAVAILABLE as :data:`RETRY_POLICY`
        says, unless the failure is a TLS mismatch."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return rpc(request, timeout=max(deadline - time.monotonic(), 0.0), metadata=metadata)
            except grpc.RpcError as e:
                error = e
            pause = RETRY_POLICY.backoff(attempt)
            if (not retried or error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= RETRY_POLICY.max_attempts
                    or tls_hint(error.details() or "") is not None or time.monotonic() + pause >= deadline):
                raise from_rpc_error(error, self.address, self._security()) from None
            time.sleep(pause)

    # --- one method per RPC ----------------------------------------------------------------------------------

    def list_devices(self, refresh: bool = False, timeout: float | None = None) -> pb.ListDevicesResponse:
        """The daemon's ``ListDevicesResponse`` (cached after the first call; ``refresh`` asks again).

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     [d.short_name for d in c.list_devices().devices]
            ['CPU:0', 'CPU:1']
        """
        if self._devices is None or refresh:
            self._devices = self._unary("ListDevices", pb.ListDevicesRequest(), timeout)
        return self._devices

    def get_status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        """The daemon's ``GetStatusResponse``: version, devices, limits, counters.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     status = c.get_status()
            >>> status.backend, len(status.devices), status.tls
            ('numpy', 2, False)
        """
        return self._unary("GetStatus", pb.GetStatusRequest(), timeout)

    def reduce(self, request: pb.ReduceRequest, timeout: float | None = None, *,
               session: str | None = None) -> pb.ReduceResponse:
        """Calls ``Reduce``: one value reduced to its destinations.

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.wire import codec
            >>> value = pb.DistributedValue(components=[
            ...     pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.array([i + 1]))) for i in range(2)])
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     reply = c.reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value, destinations=["CPU:0"]))
            >>> codec.decode(reply.result.components[0].tensor)
            array([3])
        """
        return self._unary("Reduce", request, timeout, session)

    def batch_reduce(self, request: pb.BatchReduceRequest, timeout: float | None = None, *,
                     session: str | None = None) -> pb.BatchReduceResponse:
        """Calls ``BatchReduce``: each pair reduced to its destinations, in one collective.

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.wire import codec
            >>> value = pb.DistributedValue(components=[
            ...     pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.full(2, i + 1.0))) for i in range(2)])
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     reply = c.batch_reduce(pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM,
            ...                                                  pairs=[pb.ReducePair(value=value)]))
            >>> codec.decode(reply.results[0].result.components[1].tensor)
            array([3., 3.])
        """
        return self._unary("BatchReduce", request, timeout, session)

    def broadcast(self, request: pb.BroadcastRequest, timeout: float | None = None, *,
                  session: str | None = None) -> pb.BroadcastResponse:
        """Calls ``Broadcast``: one tensor copied to every destination.

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.wire import codec
            >>> request = pb.BroadcastRequest(tensor=codec.encode(np.arange(2)), destinations=["CPU:0", "CPU:1"])
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     reply = c.broadcast(request)
            >>> [c.device[-5:] for c in reply.result.components]
            ['CPU:0', 'CPU:1']
        """
        return self._unary("Broadcast", request, timeout, session)

    def join_group(self, request: pb.JoinGroupRequest, timeout: float | None = None, *,
                   session: str | None = None) -> pb.JoinGroupResponse:
        """Calls ``JoinGroup``: meets the other processes of a multi-process job in the daemon. With a
        ``session``, a group across nodes ends if that session ends before this process leaves.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     joined = c.join_group(pb.JoinGroupRequest(group="solo", num_processes=1, process_id=0))
            >>> [d[-5:] for d in joined.local_devices]
            ['CPU:0', 'CPU:1']
        """
        return self._unary("JoinGroup", request, timeout, session)

    def leave_group(self, request: pb.LeaveGroupRequest, timeout: float | None = None) -> pb.LeaveGroupResponse:
        """Calls ``LeaveGroup``: this process is done with a group across nodes.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     c.leave_group(pb.LeaveGroupRequest(group="default@10.0.0.1:1234", epoch=1))
            Traceback (most recent call last):
            ...
            xreduce._errors.NotFoundError: group: this daemon is in no group 'default@10.0.0.1:1234' of epoch 1
        """
        return self._unary("LeaveGroup", request, timeout)

    def open_session(self, request: pb.OpenSessionRequest, timeout: float | None = None) -> Session:
        """Calls ``OpenSession`` and returns the :class:`~xreduce._session.Session` once the daemon answered
        (within ``timeout``); the session lasts until it is closed or the daemon stops.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2), Client() as c:
            ...     session = c.open_session(pb.OpenSessionRequest())
            ...     regions = c.list_regions(session=session.id).regions
            ...     session.close()
            >>> list(regions)
            []
        """
        responses = self._get()[1].OpenSession(request, metadata=self._metadata())
        return Session(responses, self.address, self.timeout if timeout is None else timeout, self._security())

    def register_region(self, request: pb.RegisterRegionRequest, timeout: float | None = None, *,
                        session: str | None = None) -> pb.RegisterRegionResponse:
        """Calls ``RegisterRegion``: names shared or CUDA IPC memory for the session's later calls."""
        return self._unary("RegisterRegion", request, timeout, session)

    def unregister_region(self, request: pb.UnregisterRegionRequest, timeout: float | None = None, *,
                          session: str | None = None) -> pb.UnregisterRegionResponse:
        """Calls ``UnregisterRegion``: the daemon lets go of a region of the session."""
        return self._unary("UnregisterRegion", request, timeout, session)

    def list_regions(self, timeout: float | None = None, *, session: str | None = None) -> pb.ListRegionsResponse:
        """Calls ``ListRegions``: the regions of the session (see :meth:`open_session`'s example)."""
        return self._unary("ListRegions", pb.ListRegionsRequest(), timeout, session)

    def reduce_stream(self, requests: Iterable[pb.ReduceStreamRequest | bytes],
                      timeout: float | None = None) -> Iterator[pb.ReduceStreamResponse]:
        """Calls ``ReduceStream``: sends ``requests`` (messages, or chunk messages already encoded by
        :func:`xreduce.wire.framing.chunk_message`) and yields the replies as they arrive.

        The call starts at the first ``next()``; closing the iterator cancels it.
        See :func:`xreduce._streaming.stream_batch_reduce` for the whole exchange.

        Raises:
            xreduce.XReduceError: while iterating, the daemon's error.
        """
        call = self._get_channel().stream_stream(method_path("ReduceStream"), request_serializer=_serialize,
                                                 response_deserializer=pb.ReduceStreamResponse.FromString)
        responses = call(iter(requests), timeout=self.timeout if timeout is None else timeout,
                         metadata=self._metadata())
        try:
            yield from responses
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address, self._security()) from None
        finally:
            responses.cancel()  # a no-op once the call ended; stops the stream if reading failed

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The daemon's health for ``service`` ("" is the whole daemon): ``"SERVING"``, ``"NOT_SERVING"``...

        Retried like ListDevices while the daemon is unavailable.

        Raises:
            xreduce.XReduceError: the call failed, e.g. UnavailableError or,
                with ``--auth-health true`` and no valid token, UnauthenticatedError.
        """
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        check = health_pb2_grpc.HealthStub(self._get_channel()).Check
        reply = self._call(check, health_pb2.HealthCheckRequest(service=service), timeout, self._metadata(),
                           retried=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def device_names(self) -> list[str]:
        """Canonical names of the daemon's devices, in order."""
        return [d.name for d in self.list_devices().devices]

    def close(self) -> None:
        """Closes the channel; the client reopens it if used again. (The shared-memory
        session is the process's, shared by its clients: it ends when the process exits.)"""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
