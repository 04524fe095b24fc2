"""The daemon's addresses, as the daemon listens on them and the SDK dials them: their forms and checks.

An address is ``host:port`` (an IPv6 host in brackets: ``[::1]:50551``),
``unix:PATH`` or ``unix-abstract:NAME``; the SDK also passes gRPC's own
target forms (``dns:``, ``ipv4:``, ``ipv6:``) through as given. A host is an
IP address or a host name.

Example:
    >>> check_address("127.0.0.1:50551", "address")
    '127.0.0.1:50551'
    >>> check_address("localhost", "XREDUCE_ADDRESS")
    Traceback (most recent call last):
    ...
    ValueError: XREDUCE_ADDRESS must be host:port or unix:PATH; got 'localhost' (no port)
"""

from __future__ import annotations

import ipaddress
import re

UNIX_SCHEMES = ("unix:", "unix-abstract:")
"""Unix socket addresses: a path, or a name in the abstract namespace (Linux)."""

GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:")
"""gRPC's target forms the SDK dials as given (a daemon listens on ``host:port`` or a unix socket)."""

_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def host_problem(host: str) -> str | None:
    """What is wrong with ``host`` as an IP address or a host name, in words; None when nothing is.

    A name made of digits and dots only must be an IPv4 address; underscores are
    allowed in names (container and service names have them).

    Example:
        >>> host_problem("10.0.0.1"), host_problem("node-1.cluster.local"), host_problem("::1")
        (None, None, None)
        >>> host_problem("999.1.1.1"), host_problem("a..b")
        ('not an IPv4 address', 'not a host name')
    """
    if not host:
        return "no host"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):
        return "not an IPv4 address"
    if ":" in host:
        return "not an IPv6 address"
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return "not a host name"
    return None


def address_problem(address: str, *, listen: bool = False) -> str | None:
    """What is wrong with ``address`` as a daemon's address, in words; None when nothing is.

    Args:
        address: ``host:port``, ``unix:PATH`` or ``unix-abstract:NAME``; when
            dialing (not ``listen``), also one of :data:`GRPC_SCHEMES`' forms.
        listen: the daemon's own address: port 0 (a free port) is allowed, and
            gRPC's target forms are not.

    Example:
        >>> address_problem("127.0.0.1:99999", listen=True)
        'port 99999 is not in 0..65535; 0 picks a free port'
        >>> address_problem("[::1]:50551"), address_problem("unix:/run/xreduce/xreduced.sock")
        (None, None)
    """
    for scheme in UNIX_SCHEMES:
        if address.startswith(scheme):
            return None if address[len(scheme):] else ("no path" if scheme == "unix:" else "no name")
    if not listen and address.startswith(GRPC_SCHEMES):
        return None
    host, colon, port = address.rpartition(":")
    if not colon or not port:
        return "no port"
    if host.startswith("[") and host.endswith("]"):
        if ":" not in host or host_problem(host[1:-1]) is not None:
            return f"host {host!r} is not an IPv6 address in brackets"
        host = host[1:-1]
    elif ":" in host:
        return "an IPv6 host goes in brackets, as in [::1]:50551"
    if not port.isdigit():
        return f"port {port!r} is not a number"
    low = 0 if listen else 1
    if not low <= int(port) <= 65535:
        return f"port {int(port)} is not in {low}..65535" + ("; 0 picks a free port" if listen else "")
    if not host:
        return "no host" + ("; 0.0.0.0 is every interface" if listen else "")
    problem = host_problem(host)
    return None if problem is None else f"host {host!r} is {problem}"


def check_address(address: str, name: str, *, listen: bool = False) -> str:
    """``address`` if it is a well-formed daemon address (see :func:`address_problem`), else a ValueError
    naming ``name`` (a flag, a variable or an argument), the value and what is wrong.

    Raises:
        ValueError: ``"NAME must be host:port or unix:PATH; got 'VALUE' (WHY)"``.

    Example:
        >>> check_address("127.0.0.1:0", "--listen", listen=True)
        '127.0.0.1:0'
        >>> check_address("127.0.0.1:0", "address")
        Traceback (most recent call last):
        ...
        ValueError: address must be host:port or unix:PATH; got '127.0.0.1:0' (port 0 is not in 1..65535)
    """
    problem = address_problem(address, listen=listen) if address else None
    if not address or problem is not None:
        why = f" ({problem})" if problem else ""
        raise ValueError(f"{name} must be host:port or unix:PATH; got {address!r}{why}")
    return address


def check_host(host: str, name: str) -> str:
    """``host`` if it is an IP address or a host name (see :func:`host_problem`), else a ValueError naming
    ``name``, the value and what is wrong; a port is refused (the engines pick theirs).

    Raises:
        ValueError: ``"NAME must be an IP address or a host name, without a port; got 'VALUE' (WHY)"``.

    Example:
        >>> check_host("10.0.0.1", "--node-address")
        '10.0.0.1'
        >>> check_host("999.1.1.1", "--node-address")
        Traceback (most recent call last):
        ...
        ValueError: --node-address must be an IP address or a host name, without a port; got '999.1.1.1' (...)
    """
    problem = host_problem(host)
    if problem is None:
        return host
    before, colon, port = host.rpartition(":")
    if colon and port.isdigit() and host_problem(before.removeprefix("[").removesuffix("]")) is None:
        problem = "a port: the engines pick theirs"
    raise ValueError(f"{name} must be an IP address or a host name, without a port; got {host!r} ({problem})")
