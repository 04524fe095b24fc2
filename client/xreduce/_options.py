"""How the SDK reaches a daemon: one object for the connection settings."""

from __future__ import annotations

import dataclasses
import os

from xreduce.wire.addresses import check_address

ENV_TRANSPORT = "XREDUCE_TRANSPORT"
"""``auto`` (shared memory when the daemon shares this host, else the wire), ``shm`` or ``wire``."""
TRANSPORTS = ("auto", "shm", "wire")

Pem = bytes | str | os.PathLike
"""PEM data as bytes, or the path of a PEM file."""


def check_transport(value: str, name: str) -> str:
    """``value`` if it names a transport, else a ValueError naming ``name`` (an argument or a variable).

    Example:
        >>> check_transport("udp", "transport")
        Traceback (most recent call last):
        ...
        ValueError: transport must be one of auto, shm, wire; got 'udp'
    """
    if value not in TRANSPORTS:
        raise ValueError(f"{name} must be one of {', '.join(TRANSPORTS)}; got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ConnectionOptions:
    """Where a daemon is and how to talk to it, for :class:`xreduce.Client` and the cross-device ops.

    Every field left ``None`` takes its default when the connection is used,
    as :class:`xreduce.Client` documents: the address from
    :func:`xreduce.resolve_address`, the token and TLS files from the
    ``XREDUCE_*`` variables, the transport from ``XREDUCE_TRANSPORT``.

    Attributes:
        address: ``host:port`` or ``unix:PATH`` (gRPC's ``dns:``, ``ipv4:`` and
            ``ipv6:`` targets are passed as given).
        timeout: default seconds per call.
        token: the bearer token sent with every call.
        root_certificates: the CA of the daemon's certificate (PEM bytes or a
            file path); turns TLS on.
        certificate_chain: this process's certificate for mutual TLS.
        private_key: the key of ``certificate_chain``.
        transport: ``"auto"``, ``"shm"`` or ``"wire"``.

    Raises:
        ValueError: ``certificate_chain`` without ``private_key`` or the
            reverse; a transport that is not one of :data:`TRANSPORTS`; an
            address that is not ``host:port`` (port 1..65535) or ``unix:PATH``.

    Example:
        >>> import dataclasses, xreduce
        >>> remote = ConnectionOptions(address="10.0.0.5:50551", token="s3cret", timeout=30)
        >>> xreduce.Client(options=remote).address
        '10.0.0.5:50551'
        >>> dataclasses.replace(remote, transport="wire").transport
        'wire'
    """

    address: str | None = None
    timeout: float | None = None
    token: str | None = None
    root_certificates: Pem | None = None
    certificate_chain: Pem | None = None
    private_key: Pem | None = None
    transport: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key go together (mutual TLS); got only "
                             + ("certificate_chain" if self.private_key is None else "private_key"))
        if self.transport is not None:
            check_transport(self.transport, "transport")
        if self.address:
            check_address(self.address, "address")


def merge(options: ConnectionOptions | None, **given) -> ConnectionOptions:
    """``options`` (default: every field unset) with each keyword that is not None put in its place.

    The keyword arguments of ``Client(...)`` and the cross-device ops go
    through here, so a keyword given beside ``options=`` wins.

    Example:
        >>> merged = merge(ConnectionOptions(address="127.0.0.1:1", token="a"), token="b", timeout=None)
        >>> merged.address, merged.token, merged.timeout
        ('127.0.0.1:1', 'b', None)
    """
    given = {name: value for name, value in given.items() if value is not None}
    if options is None:
        return ConnectionOptions(**given)
    return dataclasses.replace(options, **given) if given else options
