"""The SDK's one exception family; a ``grpc.RpcError`` is translated once, here.

A connection that fails the way a TLS mismatch makes it fail gets a hint
naming the settings to check on both sides (:func:`tls_hint`).
"""

from __future__ import annotations

import dataclasses

import grpc

from xreduce.wire.contract import ANSWERED_METADATA


class XReduceError(Exception):
    """Base of every error the daemon reports; ``code`` is the gRPC status.

    Example:
        >>> try:
        ...     raise NotFoundError("no device 'CPU:9'", grpc.StatusCode.NOT_FOUND)
        ... except XReduceError as e:
        ...     print(e.code.name, e)
        NOT_FOUND no device 'CPU:9'
    """

    answered = False
    """True when the daemon answered the call with this error; False when the SDK refused it before."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgumentError(XReduceError, ValueError):
    """INVALID_ARGUMENT: bad input; the message names the field and the values."""


class NotFoundError(XReduceError, LookupError):
    """NOT_FOUND: an unknown device; the message lists the daemon's devices."""


class DeadlineExceededError(XReduceError, TimeoutError):
    """DEADLINE_EXCEEDED: the call or the collective ran out of time."""


class UnavailableError(XReduceError, ConnectionError):
    """UNAVAILABLE: the daemon cannot be reached or is shutting down."""

    tls_mismatch = False
    """True when the connection failed as a TLS mismatch makes it fail (the message says which settings to
    check; see :func:`tls_hint`)."""


class ResourceExhaustedError(XReduceError):
    """RESOURCE_EXHAUSTED: over a configured limit (message size, memory)."""


class AbortedError(XReduceError):
    """ABORTED: a collective was abandoned, e.g. a participant disconnected."""


class UnauthenticatedError(XReduceError):
    """UNAUTHENTICATED: missing or invalid credentials."""


class PermissionDeniedError(XReduceError):
    """PERMISSION_DENIED: credentials do not allow this call."""


class CancelledError(XReduceError):
    """CANCELLED: the call was cancelled."""


class InternalError(XReduceError):
    """INTERNAL or UNKNOWN: a daemon bug; its log says more."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


@dataclasses.dataclass(frozen=True)
class Security:
    """What this side of a connection offered: TLS, and a client certificate with it.

    Example:
        >>> Security(tls=True).client_certificate
        False
    """

    tls: bool
    client_certificate: bool = False


_SETTINGS = ("check XREDUCE_TLS_CA, XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY (root_certificates=, "
             "certificate_chain=, private_key=) against the daemon's --tls-cert, --tls-key and --tls-client-ca")
_CLIENT_CERT = "XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY (certificate_chain=, private_key=)"


def _closed_hint(security: Security | None) -> str:
    """The daemon closed the connection before any call: what a TLS daemon does to a plaintext client
    and, after the handshake, a mutual-TLS daemon to a client without a certificate it accepts."""
    if security is None:
        return ("the daemon closed the connection before any call, as a TLS daemon does to a plaintext client "
                f"and a mutual-TLS daemon to a client without a certificate it accepts; {_SETTINGS}")
    if not security.tls:
        return ("this client speaks plaintext to a daemon that serves TLS (--tls-cert), which closed the "
                "connection; set XREDUCE_TLS_CA (root_certificates=) to the CA file that signed the daemon's "
                f"certificate, and with mutual TLS (--tls-client-ca) also {_CLIENT_CERT}")
    if not security.client_certificate:
        return ("the daemon closed the connection after the TLS handshake, as a daemon with mutual TLS "
                "(--tls-client-ca) does to a client without a certificate; set XREDUCE_TLS_CLIENT_CERT and "
                "XREDUCE_TLS_CLIENT_KEY (certificate_chain=, private_key=) to a certificate signed by that CA")
    return ("the daemon closed the connection after the TLS handshake, as a daemon with mutual TLS does to a client "
            "certificate its --tls-client-ca did not sign; check that XREDUCE_TLS_CLIENT_CERT (certificate_chain=) "
            "is signed by that CA")


_HANDSHAKE_HINTS = (
    ("WRONG_VERSION_NUMBER", "this client speaks TLS but the daemon answered in plaintext, as it does without "
     "--tls-cert; unset XREDUCE_TLS_CA, XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY (and root_certificates=, "
     "certificate_chain=, private_key=), or start the daemon with --tls-cert and --tls-key"),
    ("CERTIFICATE_VERIFY_FAILED", "this client does not trust the daemon's certificate; set XREDUCE_TLS_CA "
     "(root_certificates=) to the CA file that signed the daemon's --tls-cert (without it the system's CAs are "
     "used)"),
    ("Hostname Verification", "the daemon's certificate does not carry the name this client checks (the "
     "address's host, or XREDUCE_TLS_SERVER_NAME); connect by a name the certificate carries, or set "
     "XREDUCE_TLS_SERVER_NAME to one"),
)
"""Markers of gRPC's TLS handshake failures, and what each means here."""

_CLOSED_ENDINGS = ("Socket closed", "Connection reset by peer (104)")
"""How gRPC's details end when a connection was accepted and then dropped before the handshake."""

_HANDSHAKE_MARKERS = ("Tls handshake failed", "Handshake read failed", "Handshake write failed", "SSL_ERROR",
                      "TSI_", "Hostname Verification")


def tls_hint(details: str, security: Security | None = None) -> str | None:
    """What a failed connection's gRPC details say about TLS, in words, or None when they say nothing of it.

    A TLS daemon closes a plaintext client's connection at once (gRPC says
    ``Socket closed`` while connecting, or ``Connection reset by peer`` when
    the close found the client's first bytes unread), a mutual-TLS daemon closes it after
    the handshake when the client has no certificate it accepts; a TLS client
    meeting a plaintext daemon, or a certificate it does not trust, fails the
    handshake itself. None of these heals by retrying.

    Args:
        details: the failed call's ``details()``.
        security: what this side offered, to say which settings to change;
            None when unknown (every setting is named).

    Example:
        >>> tls_hint("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
        ...          Security(tls=True))[:62]
        'the daemon closed the connection after the TLS handshake, as a'
        >>> tls_hint("failed to connect to all addresses; last error: ...: Connection refused") is None
        True
    """
    if "failed to connect" in details and details.endswith(_CLOSED_ENDINGS):
        return _closed_hint(security)
    if not any(marker in details for marker in _HANDSHAKE_MARKERS):
        return None
    for marker, hint in _HANDSHAKE_HINTS:
        if marker in details:
            return hint
    return f"the TLS handshake failed; {_SETTINGS}"


def _from_daemon(error: grpc.RpcError) -> bool:
    """Whether the daemon answered the error itself (see ``ANSWERED_METADATA``)."""
    try:
        return any(k == ANSWERED_METADATA for k, _ in error.trailing_metadata() or ())
    except (AttributeError, TypeError):
        return False


def from_rpc_error(error: grpc.RpcError, address: str, security: Security | None = None) -> XReduceError:
    """The SDK exception for a failed call, keeping the status code and message.

    A daemon that cannot be reached is named by its address; when the
    failure looks like a TLS mismatch the message says so and which settings
    to check (``security``: what this side offered; see :func:`tls_hint`).

    Example:
        >>> class Fake(grpc.RpcError):
        ...     def code(self): return grpc.StatusCode.UNAVAILABLE
        ...     def details(self): return "connection refused"
        >>> e = from_rpc_error(Fake(), "127.0.0.1:1")
        >>> str(e), e.answered, e.tls_mismatch
        ('xreduce daemon at 127.0.0.1:1 is unavailable: connection refused', True, False)
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    hint = None
    if code == grpc.StatusCode.UNAVAILABLE and not _from_daemon(error):
        hint = tls_hint(details, security)
        details = (f"xreduce daemon at {address} is unavailable: {details}" if hint is None else
                   f"xreduce daemon at {address} is unavailable, probably a TLS mismatch: {hint} (gRPC: {details})")
    err = answered(code, details)
    if hint is not None:
        err.tls_mismatch = True
    return err


def answered(code: grpc.StatusCode, message: str) -> XReduceError:
    """The SDK exception for status ``code`` with ``message`` from the daemon (``answered`` True), over
    gRPC or the local lane.

    Example:
        >>> e = answered(grpc.StatusCode.NOT_FOUND, "no device 'CPU:9'")
        >>> type(e).__name__, e.answered
        ('NotFoundError', True)
    """
    err = _BY_CODE.get(code, InternalError)(message, code)
    err.answered = True
    return err
