"""Errors the engine raises; the service maps each to one gRPC status code."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base: an error with a gRPC status code and a message a person can act on."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """Bad input; the message names the field and the values received."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """An unknown device; the message lists the daemon's devices."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ServiceError):
    """Another session's region, or a session that is not open."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    """A region named by a call that has no session."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(ServiceError):
    """The operation's timeout passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(ServiceError):
    """A collective was abandoned: a participant left before it completed."""

    code = grpc.StatusCode.ABORTED


class Internal(ServiceError):
    """A daemon bug; its log has the traceback."""

    code = grpc.StatusCode.INTERNAL


class Unauthenticated(ServiceError):
    """A caller without the credentials the daemon asks for."""

    code = grpc.StatusCode.UNAUTHENTICATED
