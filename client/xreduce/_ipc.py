"""CUDA IPC staging: CuPy values reach the daemon as device memory, never through the host.

When every value of a call is a C-contiguous CuPy array on one GPU, and the
daemon runs the ``cupy`` backend in another process, :func:`staging` returns a
:class:`DeviceStaging` that :meth:`xreduce.CrossDeviceOps.reduce` and
``batch_reduce`` use instead of host shared memory:

* each CUDA allocation holding an input is registered once per session as a
  ``cuda_ipc`` region (``ipc-<pid>-<buffer id>-<n>``); tensors name slices of
  it. After each call the least recently used idle regions are unregistered
  beyond :data:`~xreduce._cuda_regions.MAX_REGIONS` per session, or beyond twice the regions that call
  used if more (a large batch, call after call, is not registered again each time);
* each region has an interprocess CUDA event, recorded on the current CuPy
  stream of the inputs' GPU before every call that uses the region: the
  daemon's streams wait on it, so work queued on that stream before the call
  (producing the inputs, reading earlier results) comes first, without a host
  synchronisation;
* results are written by the daemon into an output buffer on the inputs' GPU;
  the CuPy arrays returned are views of it, and the buffer is reused only once
  they are all gone. The daemon synchronises its streams before it replies,
  so the results are complete when the call returns.

Anything else (host arrays, mixed GPUs, non-contiguous or empty arrays,
memory CUDA IPC cannot share, a ``numpy`` daemon, a daemon embedded in this
process, which cannot open its own process's handles) takes the host
shared-memory path, as before. CuPy is imported only once a value is known to
be a CuPy array.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce import _runtime
from xreduce._cuda_regions import Region
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec, cuda_ipc
from xreduce.wire.layout import OUTPUT_ALIGNMENT


def is_cupy(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (by its type's module: CuPy is not imported).

    Example:
        >>> import numpy as np
        >>> is_cupy(np.zeros(2))
        False
    """
    return type(value).__module__.startswith("cupy")


def staging(shm, address: str, values: Sequence[Sequence[Any]]) -> DeviceStaging | None:
    """A :class:`DeviceStaging` when the values should travel as CUDA IPC regions, else None.

    Args:
        shm: the client's :class:`xreduce._shared_memory.SharedMemory` (a usable session).
        address: the daemon's address.
        values: per pair, the user's component values.

    Returns:
        None unless every value is a non-empty, C-contiguous CuPy array of a
        supported dtype, all on one GPU, in memory CUDA IPC can share; the
        daemon opens CUDA IPC handles; and it is not embedded in this process.

    Example:
        >>> import numpy as np
        >>> staging(None, "127.0.0.1:50551", [[np.zeros(2), np.ones(2)]]) is None
        True
    """
    flat = [a for pair in values for a in pair]
    if not flat or not all(is_cupy(a) for a in flat):
        return None
    import cupy  # already loaded: the values are CuPy arrays

    device_id = None
    for a in flat:
        if not isinstance(a, cupy.ndarray) or a.size == 0 or not a.flags.c_contiguous:
            return None
        if np.dtype(a.dtype).name not in codec.SUPPORTED_DTYPES:
            return None
        if device_id is None:
            device_id = a.device.id
        elif a.device.id != device_id:
            return None
    if _runtime.default().is_embedded(address):
        return None  # a process cannot open its own CUDA IPC handles
    session = shm.session()
    if not session.cuda_ipc:
        return None
    try:
        exports = {id(a): cuda_ipc.export(a) for a in flat}
    except (ValueError, RuntimeError):  # e.g. cudaMallocAsync or managed memory: the host path copies it
        return None
    return DeviceStaging(shm, session, device_id, exports)


class DeviceStaging:
    """The CUDA IPC side of one call: :meth:`stage` and :meth:`output`, as
    :class:`xreduce._shared_memory.SharedMemory` has them.

    Made by :func:`staging` for each call; the function :meth:`stage` returns
    must be called once the call returned (it lets the regions be evicted).

    Example (needs a GPU and a daemon with the cupy backend in another process):
        >>> ipc = staging(shm, address, [[x0, x1]])  # doctest: +SKIP
        >>> tensors, free = ipc.stage([x0, x1])  # doctest: +SKIP
        >>> tensors[0].region.name.startswith("ipc-")  # doctest: +SKIP
        True
    """

    def __init__(self, shm, session, device_id: int, exports: dict[int, Any]):
        import cupy

        self._cp = cupy
        self._client = shm.client
        self._session = session
        self._device_id = device_id
        self._exports = exports
        self._regions = _runtime.default().cuda_regions
        self._pinned: list[Region] = []
        self._regions.forget_dead()

    def stage(self, arrays: Sequence[Any]) -> tuple[list[pb.Tensor], Callable[..., None]]:
        """Region tensors for ``arrays`` (CuPy arrays, in place: nothing is copied).

        Returns:
            (the tensors, a function that lets the regions go once the call returned).

        Raises:
            xreduce.XReduceError: the daemon refused a registration (it cannot
                open the handle: another node, different ``CUDA_VISIBLE_DEVICES``).
        """
        tensors, used = [], {}
        try:
            for a in arrays:
                export = self._exports.get(id(a)) or cuda_ipc.export(a)
                region = self._region(export)
                used[id(region)] = region
                tensors.append(pb.Tensor(dtype=codec.dtype_enum(a.dtype), shape=a.shape, region=pb.RegionSlice(
                    name=region.name, offset=export.offset, byte_size=int(a.nbytes))))
            self._record(used.values())
        except BaseException:
            self._free()
            raise
        return tensors, self._free

    def output(self, nbytes: int) -> tuple[pb.RegionSlice, Callable[[pb.Tensor], Any]]:
        """An output slice of at least ``nbytes`` in a device buffer on the inputs' GPU.

        The buffer is reused once the call's result arrays (and the returned
        function) are gone. The results are complete when the daemon replies.

        Returns:
            (the slice to send, a function turning a reply tensor into a CuPy
            array: a view of the buffer).
        """
        cp, device_id, outputs = self._cp, self._device_id, self._regions.outputs
        buffer = outputs.acquire(cp, device_id, max(nbytes, 1))
        try:
            export = cuda_ipc.export(buffer)
            region = self._region(export)
            self._record([region])  # the daemon writes after what the stream queued (reads of earlier results)
        except BaseException:
            outputs.release(device_id, buffer)
            raise
        skip = -export.offset % OUTPUT_ALIGNMENT
        size = int(buffer.nbytes) - OUTPUT_ALIGNMENT
        start = export.offset + skip
        lease = _Lease(buffer)
        memory = cp.cuda.UnownedMemory(buffer.data.ptr + skip, size, lease, device_id)
        hold = cp.ndarray((size,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))  # views of it keep the buffer busy
        weakref.finalize(lease, outputs.release, device_id, buffer)

        def result(tensor: pb.Tensor):
            if not tensor.HasField("region"):
                with cp.cuda.Device(device_id):
                    return cp.asarray(codec.decode(tensor))
            dtype, shape = codec.spec(tensor)
            r = tensor.region
            at = r.offset - start
            if r.name != region.name or at < 0 or at + r.byte_size > size:
                raise ValueError(f"the daemon placed a result at {r.name}[{r.offset}:+{r.byte_size}], outside the "
                                 f"output buffer {region.name}[{start}:+{size}]")
            return hold[at:at + r.byte_size].view(dtype).reshape(shape)

        return pb.RegionSlice(name=region.name, offset=start, byte_size=size), result

    def _region(self, export) -> Region:
        """The registered region of ``export``'s allocation (registered now if needed), pinned for this call."""

        def register() -> Region:
            event, handle = cuda_ipc.ready_event(export.device_id)
            name = self._regions.name(export.buffer_id)
            self._client.register_region(pb.RegisterRegionRequest(
                name=name, offset=0, byte_size=export.alloc_size, cuda_ipc=pb.CudaIpcHandle(
                    mem_handle=export.mem_handle, device_id=export.device_id, event_handle=handle)),
                session=self._session.id)
            return Region(name, self._session, self._client, export.device_id, event)

        region = self._regions.pin((self._session.id, export.buffer_id), register)
        self._pinned.append(region)
        return region

    def _record(self, regions) -> None:
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            stream = cp.cuda.get_current_stream()
            for region in regions:
                region.event.record(stream)

    def _free(self, failed: bool = False) -> None:
        """Lets the call's regions go, answered or not (``failed``): they are the caller's own allocations."""
        pinned, self._pinned = self._pinned, []
        self._regions.unpin(pinned)


class _Lease:
    """Owner of one use of an output buffer: it lives as long as a result view does."""

    __slots__ = ("buffer", "__weakref__")

    def __init__(self, buffer):
        self.buffer = buffer


def registered() -> list[str]:
    """Names of the CUDA IPC regions this process keeps registered, least recently used first.

    Example:
        >>> isinstance(registered(), list)
        True
    """
    return _runtime.default().cuda_regions.names()
