"""xreduce: the client SDK of the xreduce cross-device reduction daemon.

``xreduce.distribute`` mirrors ``tf.distribute``'s cross-device API and
``xreduce.distribution`` mirrors ``keras.distribution``'s utilities;
``xreduce.wire`` holds what the SDK and the daemon agree on besides the messages.

Example:
    >>> import numpy as np
    >>> import xreduce
    >>> with xreduce.serve_embedded(virtual_devices=2):
    ...     v = xreduce.distribute.PerReplica([np.ones(2), np.ones(2)])
    ...     xreduce.distribute.HierarchicalCopyAllReduce().reduce("sum", v, v).values[0]
    array([2., 2.])
"""

from xreduce import distribute, distribution, wire
from xreduce._client import Client
from xreduce._embedded import serve_embedded
from xreduce._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    XReduceError,
)
from xreduce._options import ConnectionOptions
from xreduce._runtime import resolve_address
from xreduce._shared_arrays import shared_array
from xreduce.wire import DEFAULT_ADDRESS, SUPPORTED_DTYPES, DeviceName, canonical

__all__ = [
    "DEFAULT_ADDRESS",
    "SUPPORTED_DTYPES",
    "AbortedError",
    "CancelledError",
    "Client",
    "ConnectionOptions",
    "DeadlineExceededError",
    "DeviceName",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "XReduceError",
    "canonical",
    "distribute",
    "distribution",
    "resolve_address",
    "serve_embedded",
    "shared_array",
    "wire",
]
