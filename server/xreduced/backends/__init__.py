"""Backends: the small set of device operations a plan needs.

A backend owns logical devices ``0..N-1`` and implements :class:`Backend`.
``numpy`` keeps every device in host memory (the embedded default, what CI
runs); ``cupy`` maps logical devices onto GPUs with a stream per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One logical device as the daemon reports it."""

    device_type: str
    index: int
    memory_bytes: int
    physical_device: str


class DeviceRegion(Protocol):
    """Another process's device memory, mapped by :meth:`Backend.open_ipc`."""

    array: Any
    """The region's bytes: a 1-D ``uint8`` device array."""

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        """The bytes from ``offset`` as a C-order device array of ``dtype`` and ``shape``, which the
        backend's ``upload`` and ``write`` take.

        Raises:
            ValueError: the region holds too few bytes from ``offset``.
        """

    def close(self) -> None:
        """Unmaps the region; views of it must not be used afterwards."""


class Backend(Protocol):
    """What the executor, the engine and the service ask of a backend; buffers are opaque to them.

    Every method that returns a buffer places it on the named device (or the
    device of its first operand); additions round in the operands' dtype.

    Optional capabilities have defaults here, which a backend gets by naming
    ``Backend`` among its bases: no CUDA IPC (:attr:`cuda_ipc`), no device
    arrays of its own (:meth:`is_device_array`), results read back with
    ``numpy.asarray`` (:meth:`to_host`). A backend whose buffers are numpy
    arrays in host memory also derives from :class:`HostMemory`.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> b = NumpyBackend(1)
        >>> b.cuda_ipc, b.is_device_array(np.zeros(1)), b.to_host(np.ones(1))
        (False, False, array([1.]))
    """

    name: str

    cuda_ipc: ClassVar[bool] = False
    """Whether :meth:`open_ipc` maps CUDA IPC handles; without it, it is never called."""

    def devices(self) -> list[DeviceInfo]: ...

    def peer_access(self) -> list[list[bool]]: ...

    def upload(self, device: int, array: np.ndarray) -> Any: ...

    def download(self, buf: Any) -> np.ndarray: ...

    def write(self, dst: Any, buf: Any) -> None:
        """Copies ``buf`` (a buffer, or an array as ``upload`` takes) into ``dst`` (same dtype and
        size): a host array, e.g. a caller's shared-memory output, without an intermediate host copy,
        or one of this backend's device arrays."""

    def copy(self, buf: Any, device: int) -> Any: ...

    def add(self, a: Any, b: Any) -> Any: ...

    def add_into(self, acc: Any, b: Any) -> None: ...

    def gather(self, device: int, parts: list[tuple[Any, int, int]]) -> Any: ...

    def reshape(self, buf: Any, shape: tuple[int, ...]) -> Any: ...

    def divide(self, buf: Any, n: int) -> Any: ...

    def synchronize(self) -> None: ...

    def is_device_array(self, array: Any) -> bool:
        """Whether ``array`` is device memory this backend reads and writes in place (e.g. a view of
        a caller's CUDA IPC region), which may stand where a numpy array does; default: none is."""
        return False

    def to_host(self, array: Any) -> np.ndarray:
        """A result array as a numpy array (a device array is copied to the host); default:
        ``numpy.asarray``."""
        return np.asarray(array)

    def open_ipc(self, mem_handle: bytes, device_id: int, offset: int, byte_size: int,
                 event_handle: bytes = b"") -> DeviceRegion:
        """Maps ``byte_size`` bytes at ``offset`` of another process's device memory (a 64-byte
        ``cudaIpcMemHandle_t``), on a backend with :attr:`cuda_ipc`.

        Raises:
            ValueError: a bad handle, device, offset or size, naming the request field; by
                default, always (the backend cannot open CUDA IPC handles).
        """
        raise ValueError(f"cuda_ipc: the {self.name} backend cannot open CUDA IPC handles")


class HostMemory:
    """The base of backends whose buffers are numpy arrays in host memory: the
    executor runs their plans fused, on views of the inputs, and never calls
    their buffer methods.

    A base class rather than an attribute: a wrapper that forwards attributes
    to such a backend is not one, and runs the generic way (it sees every
    upload and download).

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> isinstance(NumpyBackend(1), HostMemory)
        True
    """


def dgx1_peer_matrix(n: int) -> list[list[bool]]:
    """Peer access of ``n`` devices shaped like a DGX-1: two fully connected
    halves, plus the link from device ``i`` to ``i + n//2`` across them.

    Example:
        >>> [int(x) for x in dgx1_peer_matrix(4)[0]]
        [0, 1, 1, 0]
    """
    half = n // 2
    side = [0 if i < half else 1 for i in range(n)]
    return [
        [i != j and (side[i] == side[j] or abs(i - j) == half) for j in range(n)]
        for i in range(n)
    ]
