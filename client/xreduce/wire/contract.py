"""Names and rules the daemon and the SDK must agree on, beyond the messages themselves.

The service and method names come from the generated descriptor, so they
cannot drift from ``protos/``; the rest (the session metadata key, the default
address, the MEAN promotion rule) is not in the proto and is written here once.

Example:
    >>> method_path("ReduceStream")
    '/xreduce.v1.CrossDeviceOps/ReduceStream'
"""

from __future__ import annotations

import numpy as np

from xreduce.v1 import xreduce_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["CrossDeviceOps"]

SERVICE_NAME: str = _SERVICE.full_name
"""The service's full name, ``xreduce.v1.CrossDeviceOps`` (as gRPC's service config and health checks name it)."""

METHOD_PREFIX = f"/{SERVICE_NAME}/"
"""What every full method path starts with; metrics and call logs label calls by the full path."""

METHODS: tuple[str, ...] = tuple(m.name for m in _SERVICE.methods)
"""The service's RPC names, in the proto's order."""

SESSION_METADATA = "x-xreduce-session"
"""The call metadata key that carries a session id: calls naming regions send it, the daemon checks it."""

ANSWERED_METADATA = "x-xreduce-answered"
"""A trailing metadata key the daemon sets on every error it answers itself: an UNAVAILABLE carrying it
means something behind the daemon (a group's coordinator, a node) is unreachable, not the daemon."""

DEFAULT_ADDRESS = "127.0.0.1:50551"
"""Where the daemon listens, and the SDK looks last, when nothing else is said."""


def method_path(method: str) -> str:
    """The full path of one of the service's RPCs, as gRPC calls it.

    Args:
        method: the RPC's name, e.g. ``"BatchReduce"``.

    Raises:
        ValueError: ``method`` is not an RPC of the service.

    Example:
        >>> method_path("Reduce")
        '/xreduce.v1.CrossDeviceOps/Reduce'
    """
    if method not in _SERVICE.methods_by_name:
        raise ValueError(f"method: {SERVICE_NAME} has no RPC {method!r}; it has {', '.join(METHODS)}")
    return METHOD_PREFIX + method


def mean_dtype(dtype: np.dtype | str | type) -> np.dtype:
    """The dtype of a MEAN result for inputs of ``dtype``: integers are promoted as TF does.

    Integers of up to 2 bytes give float32, wider ones float64; every other
    dtype stays as it is. The daemon computes MEAN results in this dtype and
    the SDK sizes output regions and computes client-side means with it.

    Example:
        >>> mean_dtype(np.int16).name, mean_dtype("uint32").name, mean_dtype(np.float16).name
        ('float32', 'float64', 'float16')
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.dtype(np.float32 if dtype.itemsize <= 2 else np.float64)
    return dtype
