"""Errors the engine raises; the service maps each to one gRPC status code."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Self

import grpc


class ServiceError(Exception):
    """Base: an error with a gRPC status code and a message a person can act on; ``process_ids``: the
    processes of a group it is about (those a collective waited for, the one that left), else empty.

    Example:
        >>> ServiceError("the engine broke").code.name
        'INTERNAL'
        >>> Aborted("process 1 left", process_ids=[1]).process_ids
        (1,)
    """

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", *, process_ids: Iterable[int] = ()):
        super().__init__(message)
        self.process_ids = tuple(process_ids)

    def copy(self, message: str | None = None) -> Self:
        """A new error of the same class with the same fields (``process_ids``, a subclass's own) and no
        traceback; ``message`` replaces the message. One error raised in several threads would keep every
        thread's frames alive: each raises a copy.

        Example:
            >>> e = Aborted("process 1 left", process_ids=[1]).copy("collective 3 was aborted: process 1 left")
            >>> type(e).__name__, str(e), e.process_ids
            ('Aborted', 'collective 3 was aborted: process 1 left', (1,))
        """
        error = type(self).__new__(type(self))
        error.__dict__.update(self.__dict__)
        error.args = (str(self) if message is None else message,)
        return error


class InvalidArgument(ServiceError):
    """Bad input; the message names the field and the values received.

    Example:
        >>> InvalidArgument("shape: dimensions must be >= 0; got [-1]").code.name
        'INVALID_ARGUMENT'
    """

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """An unknown device; the message lists the daemon's devices.

    Example:
        >>> NotFound("destinations[0]: no device 'GPU:9' on this daemon").code.name
        'NOT_FOUND'
    """

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ServiceError):
    """Another session's region, or a session that is not open.

    Example:
        >>> PermissionDenied("name: session abc... is not open").code.name
        'PERMISSION_DENIED'
    """

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    """A region named by a call that has no session.

    Example:
        >>> FailedPrecondition("output: regions can only be named inside a call").code.name
        'FAILED_PRECONDITION'
    """

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(ServiceError):
    """The operation's timeout passed.

    Example:
        >>> DeadlineExceeded("timed out after 5 s while reducing").code.name
        'DEADLINE_EXCEEDED'
    """

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(ServiceError):
    """A collective was abandoned: a participant left before it completed.

    Example:
        >>> Aborted('collective 0 in group "g" was aborted: process 1 left').code.name
        'ABORTED'
    """

    code = grpc.StatusCode.ABORTED


class Internal(ServiceError):
    """A daemon bug; its log has the traceback.

    Example:
        >>> Internal("internal error in Reduce").code.name
        'INTERNAL'
    """

    code = grpc.StatusCode.INTERNAL


class Unauthenticated(ServiceError):
    """A caller without the credentials the daemon asks for.

    Example:
        >>> Unauthenticated("/x.Y/Z needs a valid bearer token").code.name
        'UNAUTHENTICATED'
    """

    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(ServiceError):
    """Something the call needs cannot be reached: a group's coordinator, a node of the group.

    Example:
        >>> Unavailable("cannot register with the coordinator at 10.0.0.1:1234").code.name
        'UNAVAILABLE'
    """

    code = grpc.StatusCode.UNAVAILABLE
