"""CUDA IPC for the GPU backend: another process's device memory, mapped and viewed.

:class:`IpcMixin` gives :class:`~xreduced.backends.cupy_backend.CupyBackend` its
:meth:`~IpcMixin.open_ipc`, which maps a ``cudaIpcMemHandle_t`` from another
process as an :class:`IpcRegion`. :func:`device_view` views a region's bytes as
a typed array (a :class:`DeviceBits` where CuPy lacks the dtype); the backend's
``upload`` and ``write`` take those views.

Example (needs a GPU and a handle from another process):
    >>> region = CupyBackend(8).open_ipc(handle, 0, 0, 64)  # doctest: +SKIP
    >>> device_view(region.array[:24], np.float32, (2, 3)).shape  # doctest: +SKIP
    (2, 3)
    >>> region.close()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from xreduced.backends import Backend

_BF16 = "bfloat16"
_LOG = logging.getLogger(__name__)
_IPC_HANDLE_BYTES = 64


class IpcMixin:
    """The CUDA IPC methods of :class:`~xreduced.backends.cupy_backend.CupyBackend`.

    They use the backend's ``_cp`` (the cupy module) and ``_num_gpus``;
    ``_init_ipc`` makes the state they share.

    Example (needs a GPU and a handle from another process):
        >>> region = CupyBackend(8).open_ipc(handle, 0, 0, 4096)  # doctest: +SKIP
        >>> region.close()  # doctest: +SKIP
    """

    def _init_ipc(self) -> None:
        """Makes the IPC state; the backend's ``__init__`` calls it."""
        self._ipc_lock = threading.Lock()
        self._opened: dict[tuple[bytes, int], list] = {}  # (handle, device) -> [ptr, size, refs]
        self._regions: dict[int, IpcRegion] = {}  # id(region memory) -> region

    def _wait_region(self, array, stream) -> None:
        """Makes ``stream`` wait on the IPC event of the region ``array`` views, if any."""
        mem = array.data.mem
        with self._ipc_lock:
            region = self._regions.get(id(mem))
        if region is not None and region._mem is mem:
            region.wait(stream)

    def open_ipc(self, mem_handle: bytes, device_id: int, offset: int, byte_size: int,
                 event_handle: bytes = b"") -> IpcRegion:
        """Maps another process's device memory: ``byte_size`` bytes at ``offset``.

        A handle opened again (another region of the same allocation) shares
        the first mapping; the allocation is unmapped when its last region
        closes.

        Args:
            mem_handle: a 64-byte ``cudaIpcMemHandle_t`` from another process.
            device_id: the CUDA device the memory is on (this process's ordinal).
            offset: bytes from the start of the allocation to the region.
            byte_size: the region's size (positive).
            event_handle: empty, or a 64-byte ``cudaIpcEventHandle_t`` of an
                interprocess event the caller records after writing inputs.

        Returns:
            An :class:`IpcRegion`; :meth:`IpcRegion.close` it when done.

        Raises:
            ValueError: a bad handle, device, offset or size, or CUDA could not
                map the memory; the message names the request field
                (``cuda_ipc.mem_handle``, ``cuda_ipc.device_id``, ``offset``, ...).

        Example (needs a GPU and a handle from another process):
            >>> region = CupyBackend(8).open_ipc(handle, 0, 0, 4096)  # doctest: +SKIP
            >>> region.array.shape  # doctest: +SKIP
            (4096,)
        """
        cp = self._cp
        rt = cp.cuda.runtime
        mem_handle, event_handle = bytes(mem_handle), bytes(event_handle or b"")
        if len(mem_handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"cuda_ipc.mem_handle: must be {_IPC_HANDLE_BYTES} bytes (a cudaIpcMemHandle_t); "
                             f"got {len(mem_handle)} bytes")
        if event_handle and len(event_handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"cuda_ipc.event_handle: must be empty or {_IPC_HANDLE_BYTES} bytes "
                             f"(a cudaIpcEventHandle_t); got {len(event_handle)} bytes")
        if not 0 <= device_id < self._num_gpus:
            raise ValueError(f"cuda_ipc.device_id: must be a CUDA device of the daemon, in [0, {self._num_gpus}); "
                             f"got device_id={device_id}")
        if offset < 0:
            raise ValueError(f"offset: must be >= 0; got offset={offset}")
        if byte_size <= 0:
            raise ValueError(f"byte_size: must be positive; got byte_size={byte_size}")
        key = (mem_handle, device_id)
        with cp.cuda.Device(device_id):
            base, size = self._map(key)
            event_ptr = 0
            try:
                if size is not None and offset + byte_size > size:
                    raise ValueError(f"byte_size: offset + byte_size = {offset} + {byte_size} runs past the end of "
                                     f"the shared allocation ({size} bytes)")
                if event_handle:
                    try:
                        event_ptr = rt.ipcOpenEventHandle(event_handle)
                    except rt.CUDARuntimeError as e:
                        raise ValueError(f"cuda_ipc.event_handle: CUDA could not open it: {e} (it must come from "
                                         "cudaIpcGetEventHandle of an event made with interprocess=True and "
                                         "disable_timing=True, in another process)") from e
            except BaseException:
                self._unmap(key)
                raise
        region = IpcRegion(self, key, base + offset, byte_size, event_ptr)
        with self._ipc_lock:
            self._regions[id(region._mem)] = region
        return region

    def _map(self, key: tuple[bytes, int]) -> tuple[int, int | None]:
        """Opens (or shares) the mapping of ``key``; returns its base and size (None: unknown)."""
        from xreduce.wire import cuda_ipc

        rt = self._cp.cuda.runtime
        handle, device_id = key
        with self._ipc_lock:
            entry = self._opened.get(key)
            if entry is not None:
                entry[2] += 1
                return entry[0], entry[1]
            try:
                ptr = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
            except rt.CUDARuntimeError as e:
                raise ValueError(f"cuda_ipc.mem_handle: CUDA could not open it on device {device_id}: {e} (a handle "
                                 "comes from cudaIpcGetMemHandle in another process on this node, for memory it "
                                 "has not freed)") from e
            try:
                on = rt.pointerGetAttributes(ptr).device
                if on != device_id:
                    raise ValueError(f"cuda_ipc.device_id: the memory is on CUDA device {on} of the daemon; got "
                                     f"device_id={device_id} (do the caller and the daemon see the same devices? "
                                     "compare their CUDA_VISIBLE_DEVICES)")
                try:
                    start, length = cuda_ipc.allocation_range(ptr)
                    size = start + length - ptr
                except RuntimeError as e:
                    _LOG.warning("event=ipc_size_unknown error=%r: region bounds are not checked", str(e))
                    size = None
            except BaseException:
                rt.ipcCloseMemHandle(ptr)
                raise
            self._opened[key] = [ptr, size, 1]
            return ptr, size

    def _unmap(self, key: tuple[bytes, int]) -> None:
        rt = self._cp.cuda.runtime
        with self._ipc_lock:
            entry = self._opened[key]
            entry[2] -= 1
            if entry[2] > 0:
                return
            del self._opened[key]
            with self._cp.cuda.Device(key[1]):
                rt.ipcCloseMemHandle(entry[0])


class IpcRegion:
    """Device memory of another process, mapped by :meth:`CupyBackend.open_ipc`.

    Attributes:
        array: the region's bytes, a 1-D ``uint8`` CuPy array on the GPU the
            memory is on; views of it (``array[a:b].view(dtype).reshape(shape)``)
            go to :meth:`CupyBackend.upload` and :meth:`CupyBackend.write`.
        device_id: that GPU's CUDA ordinal.

    Example (needs a GPU and a handle from another process):
        >>> region = backend.open_ipc(handle, 0, 0, 16, event)  # doctest: +SKIP
        >>> region.wait(None, timeout=10); region.array[:4].view("float32").get()  # doctest: +SKIP
        array([1.], dtype=float32)
        >>> region.close()  # doctest: +SKIP
    """

    def __init__(self, backend: Backend, key: tuple[bytes, int], ptr: int, byte_size: int, event_ptr: int):
        cp = backend._cp
        self._backend = backend
        self._key = key
        self.device_id = key[1]
        self._event = event_ptr
        self._closed = False
        self._lock = threading.Lock()
        # The memory object keeps this region alive while views of it exist.
        self._mem = cp.cuda.UnownedMemory(ptr, byte_size, self, self.device_id)
        self.array = cp.ndarray((byte_size,), cp.uint8, cp.cuda.MemoryPointer(self._mem, 0))

    def view(self, offset: int, dtype, shape: tuple[int, ...]):
        """The region's bytes from ``offset`` as ``dtype`` and ``shape`` (see :func:`device_view`).

        Raises:
            ValueError: the region holds too few bytes from ``offset``.

        Example (needs a GPU and a handle from another process):
            >>> region.view(64, np.float32, (2, 3)).shape  # doctest: +SKIP
            (2, 3)
        """
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return device_view(self.array[offset:offset + nbytes], dtype, shape)

    @property
    def has_event(self) -> bool:
        """Whether the caller gave an IPC event to wait on."""
        return bool(self._event)

    def wait(self, stream=None, timeout: float | None = 300.0) -> None:
        """Orders later reads after the caller's latest record of its IPC event.

        Args:
            stream: a ``cupy.cuda.Stream`` (or raw stream pointer) whose later
                work waits on the GPU; None waits on the host, polling.
            timeout: with ``stream=None``, seconds before giving up.

        Raises:
            TimeoutError: with ``stream=None``, the event did not complete in time.
            ValueError: the region is closed.
        """
        if not self._event:
            return
        if self._closed:
            raise ValueError("the CUDA IPC region is closed")
        rt = self._backend._cp.cuda.runtime
        if stream is not None:
            rt.streamWaitEvent(stream if isinstance(stream, int) else stream.ptr, self._event, 0)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = rt.eventQuery(self._event)
            if status == 0:
                return
            if status != 600:  # cudaErrorNotReady
                rt.check_status(status)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the caller's CUDA IPC event did not complete within {timeout:g} s")
            time.sleep(0.0002)

    def close(self) -> None:
        """Unmaps the region (after the backend's queued work); idempotent.

        Views of :attr:`array` must not be used afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        backend = self._backend
        backend.synchronize()  # nothing queued may still read or write the mapping
        with backend._ipc_lock:
            backend._regions.pop(id(self._mem), None)
        try:
            if self._event:
                with backend._cp.cuda.Device(self.device_id):
                    backend._cp.cuda.runtime.eventDestroy(self._event)
        finally:
            backend._unmap(self._key)


@dataclasses.dataclass(frozen=True)
class DeviceBits:
    """A device array of a dtype the installed CuPy lacks (bfloat16 before CuPy 14).

    ``bits`` holds the items as unsigned integers of the same size; ``dtype``
    is the logical dtype. It has what the engine asks of an input array.

    Example:
        >>> b = DeviceBits(np.zeros((2, 3), np.uint16), np.dtype(np.float16))
        >>> b.shape, b.size, b.nbytes, b.dtype.name
        ((2, 3), 6, 12, 'float16')
    """

    bits: Any
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def size(self) -> int:
        return int(self.bits.size)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    @property
    def device(self):
        return self.bits.device

    def reshape(self, *shape) -> DeviceBits:
        return DeviceBits(self.bits.reshape(*shape), self.dtype)


def device_view(data, dtype, shape):
    """A C-order view of the 1-D ``uint8`` CuPy array ``data`` as ``dtype`` and ``shape``.

    A CuPy array where CuPy has the dtype; a :class:`DeviceBits` otherwise
    (bfloat16 before CuPy 14). Both go to :meth:`CupyBackend.upload` and
    :meth:`CupyBackend.write`.

    Raises:
        ValueError: ``data``'s size is not the shape's size in bytes.

    Example (needs a GPU):
        >>> device_view(region.array[64:88], np.float32, (2, 3)).shape  # doctest: +SKIP
        (2, 3)
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    count = int(np.prod(shape, dtype=np.int64))
    if data.size != count * dtype.itemsize:
        raise ValueError(f"{data.size} bytes cannot hold {dtype.name}{list(shape)} ({count * dtype.itemsize} bytes)")
    if dtype.name == _BF16:
        try:
            return data.view(dtype).reshape(shape)
        except (TypeError, ValueError, NotImplementedError):  # CuPy before 14
            return DeviceBits(data.view(np.uint16).reshape(shape), dtype)
    return data.view(dtype).reshape(shape)
