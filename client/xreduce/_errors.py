"""The SDK's one exception family; a ``grpc.RpcError`` is translated once, here."""

from __future__ import annotations

import grpc


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


def from_rpc_error(error: grpc.RpcError, address: str) -> XReduceError:
    """The SDK exception for a failed call, keeping the status code and message.

    Example:
        >>> class Fake(grpc.RpcError):
        ...     def code(self): return grpc.StatusCode.UNAVAILABLE
        ...     def details(self): return "connection refused"
        >>> e = from_rpc_error(Fake(), "127.0.0.1:1")
        >>> str(e), e.answered
        ('xreduce daemon at 127.0.0.1:1 is unavailable: connection refused', True)
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    cls = _BY_CODE.get(code, InternalError)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"xreduce daemon at {address} is unavailable: {details}"
    err = cls(details, code)
    err.answered = True
    return err
