"""Backends: the small set of device operations a plan needs.

A backend owns logical devices ``0..N-1`` and implements :class:`Backend`.
``numpy`` keeps every device in host memory (the embedded default, what CI
runs); ``cupy`` maps logical devices onto GPUs with a stream per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One logical device as the daemon reports it.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> NumpyBackend(2).devices()[1]
        DeviceInfo(device_type='CPU', index=1, memory_bytes=..., physical_device='host')
    """

    device_type: str
    index: int
    memory_bytes: int
    physical_device: str


class DeviceRegion(Protocol):
    """Another process's device memory, mapped by :meth:`Backend.open_ipc`.

    The CuPy backend's maps GPU memory; any object with these members serves.

    Example:
        >>> class HostRegion:  # the same contract over host memory
        ...     array = np.arange(8, dtype=np.uint8)
        ...     def view(self, offset, dtype, shape): return self.array[offset:].view(dtype).reshape(shape)
        ...     def close(self): pass
        >>> region: DeviceRegion = HostRegion()
        >>> region.view(4, np.dtype(np.uint16), (2,)), region.close()
        (array([1284, 1798], dtype=uint16), None)
    """

    array: Any
    """The region's bytes: a 1-D ``uint8`` device array."""

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        """The bytes from ``offset`` as a C-order device array of ``dtype`` and ``shape``, which the
        backend's ``upload`` and ``write`` take.

        Raises:
            ValueError: the region holds too few bytes from ``offset``.

        Example:
            See the class example, which views 2 ``uint16`` from byte 4.
        """

    def close(self) -> None:
        """Unmaps the region; views of it must not be used afterwards.

        Example:
            See the class example, which closes its region.
        """


class Backend(Protocol):
    """What the executor, the engine and the service ask of a backend; buffers are opaque to them.

    Every method that returns a buffer places it on the named device (or the
    device of its first operand); additions round in the operands' dtype.

    Optional capabilities have defaults here, which a backend gets by naming
    ``Backend`` among its bases: no CUDA IPC (:attr:`cuda_ipc`), no device
    arrays of its own (:meth:`is_device_array`), results read back with
    ``numpy.asarray`` (:meth:`to_host`), no NCCL (:meth:`nccl_refusal`, :meth:`nccl_all_reduce`). A
    backend whose buffers are numpy arrays in host memory also derives from :class:`HostMemory`.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> b = NumpyBackend(1)
        >>> b.cuda_ipc, b.is_device_array(np.zeros(1)), b.to_host(np.ones(1))
        (False, False, array([1.]))
    """

    name: str

    cuda_ipc: ClassVar[bool] = False
    """Whether :meth:`open_ipc` maps CUDA IPC handles; without it, it is never called."""

    def devices(self) -> list[DeviceInfo]:
        """The logical devices ``0..N-1``, in order.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> [d.index for d in NumpyBackend(2).devices()]
            [0, 1]
        """

    def peer_access(self) -> list[list[bool]]:
        """Whether device ``i`` reaches device ``j`` directly, per pair (never itself).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(2).peer_access()
            [[False, True], [True, False]]
        """

    def upload(self, device: int, array: np.ndarray) -> Any:
        """A buffer on ``device`` holding a copy of ``array``.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(2).upload(1, np.arange(3.0))
            array([0., 1., 2.])
        """

    def download(self, buf: Any) -> np.ndarray:
        """A buffer's contents as a host array.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> b.download(b.upload(0, np.arange(2)))
            array([0, 1])
        """

    def write(self, dst: Any, buf: Any) -> None:
        """Copies ``buf`` (a buffer, or an array as ``upload`` takes) into ``dst`` (same dtype and
        size): a host array, e.g. a caller's shared-memory output, without an intermediate host copy,
        or one of this backend's device arrays.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> dst = np.zeros(2)
            >>> NumpyBackend(1).write(dst, np.arange(2.0)); dst
            array([0., 1.])
        """

    def copy(self, buf: Any, device: int) -> Any:
        """A copy of ``buf`` on ``device``.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(2)
            >>> b.copy(b.upload(0, np.ones(2)), 1)
            array([1., 1.])
        """

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` in ``a``'s dtype, a new buffer on ``a``'s device.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> b.add(b.upload(0, np.array([1, 2], np.float16)), b.upload(0, np.array([3, 4], np.float16)))
            array([4., 6.], dtype=float16)
        """

    def add_into(self, acc: Any, b: Any) -> None:
        """``acc += b``, in place.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> acc = b.upload(0, np.ones(2))
            >>> b.add_into(acc, b.upload(0, np.ones(2))); acc
            array([2., 2.])
        """

    def gather(self, device: int, parts: list[tuple[Any, int, int]]) -> Any:
        """The flat elements ``[start, stop)`` of each ``(buffer, start, stop)``, joined in order on ``device``.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> x = b.upload(0, np.arange(4))
            >>> b.gather(0, [(x, 2, 4), (x, 0, 1)])
            array([2, 3, 0])
        """

    def reshape(self, buf: Any, shape: tuple[int, ...]) -> Any:
        """``buf`` with ``shape`` (same elements, same device).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> b.reshape(b.upload(0, np.arange(4)), (2, 2)).shape
            (2, 2)
        """

    def divide(self, buf: Any, n: int) -> Any:
        """MEAN's ``buf / n``: integers are promoted to a float dtype first.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> b = NumpyBackend(1)
            >>> b.divide(b.upload(0, np.array([3], np.int32)), 2)
            array([1.5])
        """

    def synchronize(self) -> None:
        """Waits until every device's queued work is done.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(1).synchronize()  # host arrays: nothing is ever queued
        """

    def is_device_array(self, array: Any) -> bool:
        """Whether ``array`` is device memory this backend reads and writes in place (e.g. a view of
        a caller's CUDA IPC region), which may stand where a numpy array does; default: none is.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(1).is_device_array(np.zeros(2))
            False
        """
        return False

    def to_host(self, array: Any) -> np.ndarray:
        """A result array as a numpy array (a device array is copied to the host); default:
        ``numpy.asarray``.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(1).to_host([1, 2])
            array([1, 2])
        """
        return np.asarray(array)

    def open_ipc(self, mem_handle: bytes, device_id: int, offset: int, byte_size: int,
                 event_handle: bytes = b"") -> DeviceRegion:
        """Maps ``byte_size`` bytes at ``offset`` of another process's device memory (a 64-byte
        ``cudaIpcMemHandle_t``), on a backend with :attr:`cuda_ipc`.

        Raises:
            ValueError: a bad handle, device, offset or size, naming the request field; by
                default, always (the backend cannot open CUDA IPC handles).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(1).open_ipc(bytes(64), 0, 0, 16)
            Traceback (most recent call last):
            ...
            ValueError: cuda_ipc: the numpy backend cannot open CUDA IPC handles
        """
        raise ValueError(f"cuda_ipc: the {self.name} backend cannot open CUDA IPC handles")

    def nccl_refusal(self, devices: Sequence[int], dtype: np.dtype | None = None) -> str | None:
        """Why NCCL cannot sum values of ``dtype`` (None: any) over ``devices``, or None when it can;
        default: never (no NCCL here).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(2).nccl_refusal([0, 1])
            "NCCL runs on GPUs, but the numpy backend's devices are host memory"
        """
        return f"NCCL runs on GPUs, but the {self.name} backend's devices are host memory"

    def nccl_all_reduce(self, bufs: list[Any]) -> list[Any]:
        """The sum of ``bufs`` (one per device, each on a GPU of its own) on each of their devices,
        by NCCL, on a backend of real GPUs (the cupy backend's is :mod:`xreduced.backends.nccl`).

        Raises:
            ValueError: by default, always (no NCCL on this backend), naming the backend.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> NumpyBackend(2).nccl_all_reduce([np.ones(1), np.ones(1)])
            Traceback (most recent call last):
            ...
            ValueError: algorithm: NCCL runs on GPUs, but the numpy backend's devices are host memory
        """
        raise ValueError(f"algorithm: {self.nccl_refusal(range(len(bufs)))}")


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
