"""CUDA IPC for CuPy arrays: what the SDK sends instead of the bytes.

A CUDA IPC memory handle names a whole ``cudaMalloc`` allocation, not an
array inside it: :func:`export` finds the allocation that holds a CuPy array
(CuPy's memory pool carves many arrays out of one allocation), and returns its
64-byte handle with the array's offset in it. The daemon opens the handle once
per allocation (``RegisterRegion`` with ``cuda_ipc``) and reads and writes the
arrays in place.

:func:`ready_event` makes the interprocess event the SDK records on its stream
after producing the inputs; the daemon's streams wait on it before reading, so
no host synchronisation is needed between the two processes.

A handle cannot be opened by the process that made it: the daemon, or any
other process, opens it.

CuPy is imported only when these functions run; without it they raise an
``ImportError`` that names the ``gpu`` extra.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any

_NO_CUPY = "CUDA IPC needs CuPy: pip install 'xreduce[gpu]' (or the cupy-cudaXXx wheel for your CUDA)"

# CUpointer_attribute values of the CUDA driver API (cuda.h); stable since CUDA 11.
_ATTR_BUFFER_ID = 7
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12

HANDLE_BYTES = 64
"""Bytes of a ``cudaIpcMemHandle_t`` and of a ``cudaIpcEventHandle_t``."""


@dataclasses.dataclass(frozen=True)
class IpcExport:
    """Where a CuPy array lives, in terms another process can open.

    Attributes:
        mem_handle: the 64-byte ``cudaIpcMemHandle_t`` of the allocation.
        device_id: the CUDA ordinal of the array's device, in this process.
        offset: bytes from the start of the allocation to the array's first byte.
        nbytes: the array's size in bytes.
        alloc_size: the allocation's size in bytes.
        buffer_id: the driver's process-wide unique id of the allocation, never
            reused for another allocation: a key for caching registrations
            (an address may be freed and handed out again, an id is not).

    Example:
        >>> e = IpcExport(b"\\0" * 64, 0, 512, 4096, 1 << 20, 7)
        >>> e.offset + e.nbytes <= e.alloc_size
        True
    """

    mem_handle: bytes
    device_id: int
    offset: int
    nbytes: int
    alloc_size: int
    buffer_id: int


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ImportError(_NO_CUPY) from e
    return cupy


_driver_lock = threading.Lock()
_driver: Any = None


def _libcuda():
    """The CUDA driver library (already loaded by CuPy), for pointer attributes."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise RuntimeError(f"CUDA IPC: cannot load the CUDA driver library libcuda.so.1: {e}") from e
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            lib.cuPointerGetAttribute.restype = ctypes.c_int
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuGetErrorName.restype = ctypes.c_int
            _driver = lib
        return _driver


def _attribute(ptr: int, attribute: int, ctype):
    """``cuPointerGetAttribute`` for a device pointer; raises RuntimeError with the driver's error name."""
    lib = _libcuda()
    value = ctype()
    status = lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ptr)
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        label = name.value.decode() if name.value else f"CUresult {status}"
        raise RuntimeError(f"cuPointerGetAttribute({attribute}) on {ptr:#x} failed: {label}")
    return value.value


def allocation_range(ptr: int) -> tuple[int, int]:
    """The start address and size of the allocation (or IPC mapping) holding ``ptr``.

    Needs a CUDA context current on the calling thread (any CuPy or CUDA
    runtime call on the device makes one current).

    Raises:
        RuntimeError: ``ptr`` is not device memory the driver knows.

    Example:
        >>> import cupy  # doctest: +SKIP
        >>> a = cupy.zeros(10, cupy.uint8)  # doctest: +SKIP
        >>> base, size = allocation_range(a.data.ptr)  # doctest: +SKIP
        >>> base <= a.data.ptr < base + size  # doctest: +SKIP
        True
    """
    return (
        _attribute(ptr, _ATTR_RANGE_START_ADDR, ctypes.c_uint64),
        _attribute(ptr, _ATTR_RANGE_SIZE, ctypes.c_size_t),
    )


def device_ordinal(ptr: int) -> int:
    """The CUDA ordinal (in this process) of the device whose memory ``ptr`` points to.

    Example:
        >>> import cupy  # doctest: +SKIP
        >>> device_ordinal(cupy.zeros(1).data.ptr)  # doctest: +SKIP
        0
    """
    return _attribute(ptr, _ATTR_DEVICE_ORDINAL, ctypes.c_int)


_handles_lock = threading.Lock()
_handles: dict[tuple[int, int], bytes] = {}


def export(array) -> IpcExport:
    """The IPC handle of the allocation holding ``array`` and where the array sits in it.

    The handle is cached per allocation (by the driver's buffer id), so
    exporting many arrays of one pool allocation costs one
    ``cudaIpcGetMemHandle``. The array's memory must stay allocated while any
    other process has the handle open.

    Args:
        array: a C-contiguous, non-empty ``cupy.ndarray`` in memory from
            ``cudaMalloc`` (CuPy's default allocator and memory pool).

    Returns:
        An :class:`IpcExport`.

    Raises:
        ImportError: CuPy is not installed.
        TypeError: ``array`` is not a CuPy array.
        ValueError: the array is empty, not C-contiguous, or its memory cannot
            be shared over CUDA IPC (``cudaMallocAsync`` pools, managed memory).

    Example:
        >>> import cupy  # doctest: +SKIP
        >>> x = cupy.arange(1024, dtype=cupy.float32)  # doctest: +SKIP
        >>> e = export(x[256:])  # doctest: +SKIP
        >>> len(e.mem_handle), e.nbytes, e.offset - export(x).offset  # doctest: +SKIP
        (64, 3072, 1024)
    """
    cupy = _cupy()
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"export needs a cupy.ndarray; got {type(array).__module__}.{type(array).__name__}")
    if array.nbytes == 0:
        raise ValueError(f"export: an empty array has no memory to share; got shape {list(array.shape)}")
    if not array.flags.c_contiguous:
        raise ValueError("export: the array must be C-contiguous (cupy.ascontiguousarray makes a copy that is)")
    rt = cupy.cuda.runtime
    device_id = array.device.id
    ptr = array.data.ptr
    with cupy.cuda.Device(device_id):
        if rt.pointerGetAttributes(ptr).type != rt.memoryTypeDevice:  # also makes a context current
            raise ValueError("export: the array's memory is not plain device memory (managed or host memory "
                             "cannot travel over CUDA IPC)")
        try:
            capable = _attribute(ptr, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_int)
        except RuntimeError:
            capable = 1  # an older driver without the attribute: cudaIpcGetMemHandle decides below
        if not capable:
            raise ValueError("export: the array's memory cannot be shared with cudaIpcGetMemHandle (it comes "
                             "from a stream-ordered or virtual-memory allocator); use CuPy's default pool")
        base, size = allocation_range(ptr)
        buffer_id = _attribute(ptr, _ATTR_BUFFER_ID, ctypes.c_ulonglong)
        key = (device_id, buffer_id)
        with _handles_lock:
            handle = _handles.get(key)
        if handle is None:
            try:
                handle = bytes(rt.ipcGetMemHandle(base))
            except rt.CUDARuntimeError as e:
                raise ValueError(f"export: cudaIpcGetMemHandle refused the array's allocation: {e}") from e
            with _handles_lock:
                _handles[key] = handle
    return IpcExport(handle, device_id, ptr - base, int(array.nbytes), size, buffer_id)


def ready_event(device_id: int) -> tuple[Any, bytes]:
    """A new interprocess CUDA event on ``device_id`` and its 64-byte IPC handle.

    Record the event on the stream that produced the inputs (``event.record()``
    records on the current stream) before each call that reads them; the
    daemon's streams wait on its latest record. Use one event per region and
    stream: two streams recording one event would let the daemon wait on the
    wrong one.

    Args:
        device_id: the CUDA ordinal the event belongs to (the inputs' device).

    Returns:
        ``(event, handle)``: a ``cupy.cuda.Event`` made with
        ``interprocess=True, disable_timing=True``, and its handle for
        ``CudaIpcHandle.event_handle``.

    Raises:
        ImportError: CuPy is not installed.

    Example:
        >>> import cupy  # doctest: +SKIP
        >>> event, handle = ready_event(0)  # doctest: +SKIP
        >>> event.record(cupy.cuda.get_current_stream()); len(handle)  # doctest: +SKIP
        64
    """
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        handle = bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))
    return event, handle


def forget_handles() -> None:
    """Drops the cached memory handles (after freeing pool memory, say).

    Example:
        >>> forget_handles()
    """
    with _handles_lock:
        _handles.clear()
