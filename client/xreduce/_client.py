"""The connection to a daemon: address resolution, credentials, a lazy channel, typed calls.

Resilience lives in the channel: it reconnects on its own after the daemon
restarts (fast reconnect backoff), idempotent calls (ListDevices, GetStatus,
health) are retried on UNAVAILABLE with exponential backoff through the gRPC
service config, and collectives are never retried nor queued (no
wait_for_ready), so they fail fast with an UnavailableError naming the address.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading

import grpc

from xreduce import _shm
from xreduce._errors import from_rpc_error
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire.contract import DEFAULT_ADDRESS, SERVICE_NAME

DEFAULT_TIMEOUT = 600.0
"""Seconds a call may take when the caller gives no timeout: no wait is unbounded."""

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

RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 4,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
"""Up to 5 attempts, waiting about 0.1 s, 0.4 s, 1.6 s, 2 s between them (gRPC adds jitter)."""

SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": service, "method": method} for service, method in IDEMPOTENT_METHODS],
        "retryPolicy": RETRY_POLICY,
    }],
})
"""The gRPC service config of every SDK channel."""

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
    # Reconnect soon after the daemon comes back: 100 ms, growing to 2 s at most (gRPC's default: 1 s to 120 s).
    # (grpc.min_reconnect_backoff_ms, the connect timeout, keeps its 20 s: a far daemon must have time to answer.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
"""Options of every SDK channel: message limits, retries, fast reconnects."""

def _check_transport(value: str, name: str) -> str:
    if value not in _shm.TRANSPORTS:
        raise ValueError(f"{name} must be one of {', '.join(_shm.TRANSPORTS)}; got {value!r}")
    return value


_embedded_address: list[str] = []  # set by serve_embedded(), innermost last
_lock = threading.Lock()


@dataclasses.dataclass
class ProcessGroup:
    """This process's place in a multi-process job, as the daemon's JoinGroup gave it.

    Every collective call of the SDK in this process takes the next sequence
    number, so the k-th collective of every process meets the others' k-th.

    Example:
        >>> pg = ProcessGroup("train", 2, 1, ("/cpu:1",), ("/cpu:0", "/cpu:1"))
        >>> [pg.next_spec().sequence for _ in range(2)]
        [0, 1]
    """

    group: str
    num_processes: int
    process_id: int
    local_devices: tuple[str, ...]
    global_devices: tuple[str, ...]
    _counter: itertools.count = dataclasses.field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def next_spec(self) -> pb.CollectiveSpec:
        """The ``CollectiveSpec`` of this process's next collective."""
        with self._lock:
            sequence = next(self._counter)
        return pb.CollectiveSpec(group=self.group, num_processes=self.num_processes,
                                 process_id=self.process_id, sequence=sequence)


_process_group: list[ProcessGroup] = []


def process_group() -> ProcessGroup | None:
    """The multi-process job this process joined (``xreduce.distribution.initialize``), or None."""
    return _process_group[0] if _process_group else None


def set_process_group(group: ProcessGroup | None) -> None:
    """Installs (or, with None, removes) this process's multi-process job."""
    _process_group[:] = [group] if group is not None else []


def resolve_address(address: str | None = None) -> str:
    """Where the SDK finds its daemon.

    An explicit ``address`` wins, then a running :func:`xreduce.serve_embedded`,
    then ``XREDUCE_ADDRESS``, then :data:`DEFAULT_ADDRESS`. ``unix:PATH`` works.

    Example:
        >>> resolve_address("unix:/tmp/x.sock")
        'unix:/tmp/x.sock'
    """
    if address:
        return address
    if _embedded_address:
        return _embedded_address[-1]
    return os.environ.get("XREDUCE_ADDRESS") or DEFAULT_ADDRESS


Pem = bytes | str | os.PathLike
"""PEM data as bytes, or the path of a PEM file."""


def _pem(value: Pem | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {os.fspath(value)}: cannot read it ({e.strerror})") from None


def _env_pem(name: str) -> bytes | None:
    path = os.environ.get(name)
    return _pem(path, name) if path else None


class Client:
    """A connection to one daemon; the channel opens on first use.

    Args:
        address: ``host:port`` or ``unix:PATH``; see :func:`resolve_address`.
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

    ``XREDUCE_TLS_SERVER_NAME`` overrides the name the daemon's certificate
    must carry (default: the address's host). A daemon started by
    :func:`xreduce.serve_embedded` is reached in plaintext over its private
    socket whatever the ``XREDUCE_TLS_*`` variables say.

    Idempotent calls (ListDevices, GetStatus, health) are retried while the
    daemon is unavailable (5 attempts over about 4 s); collectives fail at
    once with :class:`xreduce.UnavailableError`. The channel reconnects by
    itself after the daemon restarts: keep using the same client.

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
    """

    def __init__(self, address: str | None = None, timeout: float | None = None, token: str | None = None,
                 root_certificates: Pem | None = None, certificate_chain: Pem | None = None,
                 private_key: Pem | None = None, transport: str | None = None):
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together (mutual TLS); got only "
                             + ("certificate_chain" if private_key is None else "private_key"))
        self._explicit = address
        self._address: str | None = None
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._token = token
        self._root_certificates = root_certificates
        self._certificate_chain = certificate_chain
        self._private_key = private_key
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CrossDeviceOpsStub | None = None
        self._devices: pb.ListDevicesResponse | None = None
        self._transport = transport
        if transport is not None:
            _check_transport(transport, "transport")

    @property
    def transport(self) -> str:
        """The transport asked for: ``transport=``, else ``XREDUCE_TRANSPORT``, else ``"auto"``."""
        if self._transport is not None:
            return self._transport
        return _check_transport(os.environ.get(_shm.ENV_TRANSPORT) or "auto", _shm.ENV_TRANSPORT)

    def shared_memory(self) -> _shm.Transport | None:
        """The shared-memory transport when this call should use it, else None (the wire).

        Raises:
            xreduce.XReduceError: ``transport="shm"`` and the daemon cannot
                read this host's shared memory (the message says why).
        """
        mode = self.transport
        if mode == "wire":
            return None
        if not _shm.available():
            if mode == "shm":
                raise ValueError(f"transport='shm' needs POSIX shared memory ({_shm.SHM_DIR}); this host has none")
            return None
        # One session per process and daemon, shared by every client: each open session holds a daemon thread.
        key = (os.getpid(), self.address, self._metadata(), self.tls)
        transport = _shm.transport_for(key, self._clone)
        if transport.usable():
            return transport
        if mode == "shm":
            raise ValueError(f"transport='shm' but the daemon at {self.address} cannot read this host's shared "
                             f"memory: {transport.reason or transport.last_error}")
        return None

    def _clone(self) -> Client:
        """A client of the same daemon with the same credentials, for the shared session."""
        return Client(self.address, self.timeout, self._token, self._root_certificates, self._certificate_chain,
                      self._private_key, transport="wire")

    def _open_session(self) -> _shm.Session:
        try:
            return _shm.Session(self._get_stub(), self._metadata(), self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    def _call_with(self, method: str, request, metadata: tuple, timeout: float | None = None):
        rpc = getattr(self._get_stub(), method)
        try:
            return rpc(request, timeout=self.timeout if timeout is None else timeout,
                       metadata=self._metadata() + tuple(metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    @property
    def address(self) -> str:
        """The daemon's address, resolved on first use and then fixed."""
        if self._address is None:
            self._address = resolve_address(self._explicit)
        return self._address

    @property
    def tls(self) -> bool:
        """Whether the channel uses TLS (``root_certificates``, a client certificate or ``XREDUCE_TLS_CA``)."""
        if self._root_certificates is not None or self._certificate_chain is not None:
            return True
        return self._from_env(ENV_TLS_CA) is not None

    def _from_env(self, name: str) -> str | None:
        """A TLS variable, ignored for the embedded daemon (plaintext on its private socket)."""
        if self._explicit is None and self.address in _embedded_address:
            return None
        return os.environ.get(name) or None

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = self._token if self._token is not None else os.environ.get(ENV_TOKEN)
        return (("authorization", f"Bearer {token}"),) if token else ()

    def _credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        """TLS credentials: each argument, else its environment variable."""
        root = _pem(self._root_certificates, "root_certificates") if self._root_certificates is not None \
            else _pem(self._from_env(ENV_TLS_CA), ENV_TLS_CA)
        if self._certificate_chain is not None:
            chain = _pem(self._certificate_chain, "certificate_chain")
            key = _pem(self._private_key, "private_key")
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
        with _lock:
            if self._channel is None:
                self._channel = self._open()
                self._stub = pb_grpc.CrossDeviceOpsStub(self._channel)
            return self._channel

    def _get_stub(self) -> pb_grpc.CrossDeviceOpsStub:
        self._get_channel()
        return self._stub

    def call(self, method: str, request, timeout: float | None = None, metadata: tuple = ()):
        """Calls RPC ``method`` (with extra ``metadata``); failures raise :class:`xreduce.XReduceError`."""
        return self._call_with(method, request, metadata, timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The daemon's health for ``service`` ("" is the whole daemon): ``"SERVING"``, ``"NOT_SERVING"``...

        Retried like ListDevices while the daemon is unavailable.

        Raises:
            xreduce.XReduceError: the call failed, e.g. UnavailableError or,
                with ``--auth-health true`` and no valid token, UnauthenticatedError.
        """
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        check = health_pb2_grpc.HealthStub(self._get_channel()).Check
        try:
            reply = check(health_pb2.HealthCheckRequest(service=service),
                          timeout=self.timeout if timeout is None else timeout, metadata=self._metadata())
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def list_devices(self, refresh: bool = False) -> pb.ListDevicesResponse:
        """The daemon's ``ListDevicesResponse`` (cached after the first call)."""
        if self._devices is None or refresh:
            self._devices = self.call("ListDevices", pb.ListDevicesRequest())
        return self._devices

    def device_names(self) -> list[str]:
        """Canonical names of the daemon's devices, in order."""
        return [d.name for d in self.list_devices().devices]

    def close(self) -> None:
        """Closes the channel; the client reopens it if used again. (The shared-memory
        session is the process's, shared by its clients: it ends when the process exits.)"""
        with _lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
