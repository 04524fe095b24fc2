"""GPU backend: logical devices on CUDA GPUs through CuPy.

Logical device ``i`` lives on GPU ``i % num_gpus`` with its own non-blocking
stream, so ``--virtual-devices 8`` on one GPU gives eight devices with their
own allocations (one GPU standing in for a DGX-1). Every buffer carries the
event recorded after the operation that produced it; an operation on another
stream first waits on its operands' events. Copies between GPUs are peer
copies (``cudaMemcpyPeerAsync``), never through the host.

bfloat16 is held as uint16 bits and added through float32 with
round-to-nearest-even, which is what ml_dtypes does on the host (CuPy before 14
has no bfloat16 dtype; from 14 on a bfloat16 CuPy array is taken as its bits).

CUDA IPC: :meth:`CupyBackend.open_ipc` maps another process's device memory
(an :class:`IpcRegion`); :meth:`CupyBackend.upload` accepts CuPy views of it
(copied onto the logical device's GPU after the stream waits on the caller's
IPC event) and :meth:`CupyBackend.write` copies results into it. That part
lives in :mod:`xreduced.backends.cupy_ipc`; its public names are re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from xreduce.wire.contract import mean_dtype

from xreduced.backends import Backend, DeviceInfo, exact_f32
from xreduced.backends.cupy_ipc import _BF16, DeviceBits, IpcMixin, IpcRegion, device_view
from xreduced.backends.numpy_backend import divide

__all__ = ["CupyBackend", "DeviceBits", "IpcRegion", "device_view", "unavailable_reason"]

_EXACT = ("float32", "complex64")
# cudaErrorPeerAccessAlreadyEnabled; CuPy 14 no longer exports the runtime's error codes.
_PEER_ACCESS_ALREADY_ENABLED = 704


def unavailable_reason() -> str | None:
    """Why the GPU backend cannot run here, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'xreduce[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU is visible"
        (cupy.ones(1) + 1).get()  # a kernel launch: catches a missing NVRTC too
    except Exception as e:  # CUDA driver, runtime or compiler missing or broken
        return f"CUDA is not usable: {e}"
    return None


@dataclasses.dataclass
class _Buf:
    array: Any  # cupy.ndarray (uint16 bits for bfloat16)
    device: int
    event: Any
    dtype: np.dtype  # the logical dtype


class CupyBackend(IpcMixin, Backend):
    """Logical devices on GPUs; see the module docstring.

    Example (needs a GPU):
        >>> b = CupyBackend(2)  # doctest: +SKIP
        >>> b.download(b.add(b.upload(0, np.ones(2)), b.upload(1, np.ones(2))))  # doctest: +SKIP
        array([2., 2.])
    """

    name = "cupy"
    cuda_ipc = True

    def __init__(self, virtual_devices: int | None = None):
        import cupy

        self._cp = cupy
        self._num_gpus = cupy.cuda.runtime.getDeviceCount()
        n = virtual_devices or self._num_gpus
        if n < 1:
            raise ValueError(f"virtual_devices must be >= 1; got virtual_devices={n}")
        self._gpu = [i % self._num_gpus for i in range(n)]
        self._streams = []
        for g in self._gpu:
            with cupy.cuda.Device(g):
                self._streams.append(cupy.cuda.Stream(non_blocking=True))
        for a in range(self._num_gpus):
            for b in range(self._num_gpus):
                if a != b and cupy.cuda.runtime.deviceCanAccessPeer(a, b):
                    with cupy.cuda.Device(a):
                        try:
                            cupy.cuda.runtime.deviceEnablePeerAccess(b)
                        except cupy.cuda.runtime.CUDARuntimeError as e:
                            if e.status != _PEER_ACCESS_ALREADY_ENABLED:
                                raise
        self._init_ipc()
        self._nccl = None  # NCCL cliques, made on the first NCCL all-reduce

    def devices(self) -> list[DeviceInfo]:
        per_gpu = [self._gpu.count(g) for g in range(self._num_gpus)]
        out = []
        for i, g in enumerate(self._gpu):
            props = self._cp.cuda.runtime.getDeviceProperties(g)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            out.append(DeviceInfo("GPU", i, props["totalGlobalMem"] // per_gpu[g], f"cuda:{g} {name}"))
        return out

    def peer_access(self) -> list[list[bool]]:
        rt = self._cp.cuda.runtime
        return [
            [i != j and (a == b or bool(rt.deviceCanAccessPeer(a, b))) for j, b in enumerate(self._gpu)]
            for i, a in enumerate(self._gpu)
        ]

    def _on(self, device: int):
        return self._cp.cuda.Device(self._gpu[device]), self._streams[device]

    def _done(self, array, device: int, dtype: np.dtype) -> _Buf:
        # An event belongs to the device current when it is made: make it on the buffer's GPU.
        with self._cp.cuda.Device(self._gpu[device]):
            event = self._cp.cuda.Event(disable_timing=True)
            event.record(self._streams[device])
        return _Buf(array, device, event, dtype)

    def _wait(self, device: int, *bufs: _Buf) -> None:
        for b in bufs:
            if b.device != device:
                self._streams[device].wait_event(b.event)

    def upload(self, device: int, array) -> _Buf:
        """Copies ``array`` onto logical device ``device``.

        ``array`` is a numpy array (host to device), or a CuPy array or
        :class:`DeviceBits` on any GPU (device to device, a peer copy across
        GPUs). A view of an :class:`IpcRegion` is read only after the
        caller's IPC event: the device's stream waits on it first.
        """
        if isinstance(array, DeviceBits) or isinstance(array, self._cp.ndarray):
            return self._upload_device(device, array)
        dev, stream = self._on(device)
        host = np.asarray(array, order="C")
        bits = host.view(np.uint16) if host.dtype.name == _BF16 else host
        with dev, stream:
            out = self._cp.empty(bits.shape, bits.dtype)
            out.set(bits, stream=stream)
        return self._done(out, device, host.dtype)

    def _upload_device(self, device: int, array) -> _Buf:
        bits, dtype = self._device_bits(array, "upload")
        dev, stream = self._on(device)
        with dev, stream:
            self._wait_region(bits, stream)
            out = self._cp.empty(bits.shape, bits.dtype)
            self._copy_bytes(out, self._gpu[device], bits, bits.device.id, stream)
        return self._done(out, device, dtype)

    def _device_bits(self, array, what: str):
        """``(bits, dtype)``: a C-contiguous CuPy array of CuPy's dtype and the logical dtype."""
        if isinstance(array, DeviceBits):
            bits, dtype = array.bits, array.dtype
        elif array.dtype.name == _BF16:  # CuPy 14's bfloat16
            bits, dtype = array.view(self._cp.uint16), array.dtype
        else:
            bits, dtype = array, array.dtype
        if not bits.flags.c_contiguous:
            raise ValueError(f"{what}: a device array must be C-contiguous; got strides {bits.strides}")
        return bits, np.dtype(dtype)

    def _copy_bytes(self, dst, dst_gpu: int, src, src_gpu: int, stream) -> None:
        """Enqueues a copy of ``src``'s bytes into ``dst`` (both C-contiguous) on ``stream``."""
        nbytes = src.nbytes
        if not nbytes:
            return
        if src_gpu == dst_gpu:
            dst.data.copy_from_device_async(src.data, nbytes, stream)
        else:
            self._cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst_gpu, src.data.ptr, src_gpu, nbytes, stream.ptr)

    def write(self, dst, buf) -> None:
        """Copies a result into ``dst``; complete once :meth:`synchronize` returns.

        Args:
            dst: a numpy array (host memory, e.g. shared memory: the device
                copies straight into it), or a CuPy array or :class:`DeviceBits`
                (e.g. a view of an :class:`IpcRegion`: a device-to-device copy).
            buf: a buffer of this backend, or an array as :meth:`upload` takes.

        Raises:
            ValueError: ``dst`` and ``buf`` differ in dtype or size, or ``dst``
                is a non-contiguous device array.

        Example (needs a GPU):
            >>> b = CupyBackend(2)  # doctest: +SKIP
            >>> out = np.empty(2, np.float32)  # doctest: +SKIP
            >>> b.write(out, b.upload(1, np.ones(2, np.float32))); b.synchronize(); out  # doctest: +SKIP
            array([1., 1.], dtype=float32)
        """
        device_dst = self.is_device_array(dst)
        if not isinstance(buf, _Buf):  # e.g. an input returned as is (one replica)
            if not device_dst and isinstance(buf, np.ndarray):
                _check_same(dst.dtype, dst.size, buf.dtype, buf.size)
                np.copyto(dst, buf.reshape(dst.shape))
                return
            gpu = dst.device.id if device_dst else buf.device.id
            buf = self.upload(self._gpu.index(gpu) if gpu in self._gpu else 0, buf)
        dev, stream = self._on(buf.device)
        if device_dst:
            bits, dtype = self._device_bits(dst, "write")
            _check_same(dtype, bits.size, buf.dtype, buf.array.size)
            with dev, stream:
                self._wait_region(bits, stream)
                self._copy_bytes(bits, bits.device.id, buf.array, self._gpu[buf.device], stream)
            return
        _check_same(dst.dtype, dst.size, buf.dtype, buf.array.size)
        host = dst.view(np.uint16) if dst.dtype.name == _BF16 else dst
        src = buf.array.reshape(host.shape)
        with dev, stream:
            if host.flags.c_contiguous:
                src.get(stream=stream, out=host)  # blocking: done on return
            else:
                host[...] = src.get(stream=stream)

    def is_device_array(self, array) -> bool:
        """Whether ``array`` is a CuPy array or a :class:`DeviceBits` (e.g. a view of an :class:`IpcRegion`)."""
        return isinstance(array, DeviceBits) or isinstance(array, self._cp.ndarray)

    def to_host(self, array) -> np.ndarray:
        """``array`` as a numpy array: a device array (CuPy or :class:`DeviceBits`) copied from its GPU."""
        if isinstance(array, DeviceBits):
            return array.bits.get().view(array.dtype)
        if isinstance(array, self._cp.ndarray):
            return array.get()
        return np.asarray(array)

    def download(self, buf: _Buf) -> np.ndarray:
        dev, stream = self._on(buf.device)
        with dev, stream:
            host = buf.array.get(stream=stream)
        stream.synchronize()
        return host.view(buf.dtype) if buf.dtype.name == _BF16 else host

    def copy(self, buf: _Buf, device: int) -> _Buf:
        dev, stream = self._on(device)
        self._wait(device, buf)
        with dev, stream:
            out = self._cp.empty_like(buf.array)
            nbytes = buf.array.nbytes
            if nbytes:
                src_gpu, dst_gpu = self._gpu[buf.device], self._gpu[device]
                if src_gpu == dst_gpu:
                    out.data.copy_from_device_async(buf.array.data, nbytes, stream)
                else:
                    self._cp.cuda.runtime.memcpyPeerAsync(
                        out.data.ptr, dst_gpu, buf.array.data.ptr, src_gpu, nbytes, stream.ptr
                    )
        done = self._done(out, device, buf.dtype)
        if buf.device != device:
            # CuPy's pool hands a freed block back to the stream that allocated it: the source
            # stream must not reuse the source's memory before this copy has read it.
            self._streams[buf.device].wait_event(done.event)
        return done

    def add(self, a: _Buf, b: _Buf) -> _Buf:
        dev, stream = self._on(a.device)
        self._wait(a.device, a, b)
        with dev, stream:
            out = self._sum(a, b.array, None)
        return self._done(out, a.device, a.dtype)

    def add_into(self, acc: _Buf, b: _Buf) -> None:
        dev, stream = self._on(acc.device)
        self._wait(acc.device, b)
        with dev, stream:
            self._sum(acc, b.array, acc.array)
            acc.event.record(stream)

    def _sum(self, a: _Buf, b, out):
        cp = self._cp
        if a.dtype.name in _EXACT:  # CuPy's own float32 kernels flush subnormals (exact_f32)
            return exact_f32.add(cp, a.array, b, out)
        if a.dtype.name != _BF16:
            return cp.add(a.array, b, out=out, dtype=a.array.dtype)
        x, y = _bf16_to_f32(cp, a.array), _bf16_to_f32(cp, b)
        # ml_dtypes' NaN: canonical, with the sign of the NaN operand (y's first), else negative (inf - inf).
        nan_sign = cp.where(cp.isnan(y), cp.signbit(y), cp.where(cp.isnan(x), cp.signbit(x), True))
        bits = _f32_to_bf16(cp, exact_f32.add(cp, x, y), nan_sign)
        if out is None:
            return bits
        out[...] = bits
        return out

    def gather(self, device: int, parts: list[tuple[_Buf, int, int]]) -> _Buf:
        dev, stream = self._on(device)
        self._wait(device, *(p[0] for p in parts))
        with dev, stream:
            pieces = [buf.array.reshape(-1)[start:stop] for buf, start, stop in parts]
            out = pieces[0] if len(pieces) == 1 else self._cp.concatenate(pieces)
        return self._done(out, device, parts[0][0].dtype)

    def reshape(self, buf: _Buf, shape: tuple[int, ...]) -> _Buf:
        return _Buf(buf.array.reshape(shape), buf.device, buf.event, buf.dtype)

    def divide(self, buf: _Buf, n: int) -> _Buf:
        dev, stream = self._on(buf.device)
        with dev, stream:
            if buf.dtype.name == _BF16:
                x = _bf16_to_f32(self._cp, buf.array)
                out = _f32_to_bf16(self._cp, exact_f32.divide(self._cp, x, n), self._cp.signbit(x))
            elif buf.dtype.name in _EXACT:
                out = exact_f32.divide(self._cp, buf.array, n)
            else:
                out = divide(self._cp, buf.array, n)
        return self._done(out, buf.device, mean_dtype(buf.dtype))

    def synchronize(self) -> None:
        for stream in self._streams:
            stream.synchronize()

    def nccl_refusal(self, devices: Sequence[int], dtype: np.dtype | None = None) -> str | None:
        """Why NCCL cannot sum ``dtype`` over ``devices``: devices that share a GPU, a CuPy without
        NCCL, or a dtype NCCL does not add."""
        from xreduced.backends.nccl import nccl_type

        seen: dict[int, int] = {}
        for d in devices:
            gpu = self._gpu[d]
            if gpu in seen:
                return (f"NCCL needs one GPU per device, but GPU:{seen[gpu]} and GPU:{d} are logical devices on one "
                        f"GPU (cuda:{gpu})")
            seen[gpu] = d
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            return f"this daemon's CuPy has no NCCL ({e})"
        if not nccl.available:
            return "this daemon's CuPy was built without NCCL"
        if dtype is not None:
            try:
                nccl_type(nccl, dtype)
            except ValueError as e:
                return str(e).removeprefix("algorithm: ")
        return None

    def nccl_all_reduce(self, bufs: list[_Buf]) -> list[_Buf]:
        """The sum of ``bufs`` (one per logical device, each on a GPU of its own) on each of their
        devices, by NCCL (:mod:`xreduced.backends.nccl`); the inputs are left as they were.

        Raises:
            ValueError: devices that share a GPU, or a dtype NCCL does not add.
        """
        from xreduced.backends.nccl import Cliques, check_distinct

        gpus = [self._gpu[b.device] for b in bufs]
        check_distinct(gpus)
        if self._nccl is None:
            self._nccl = Cliques()
        outs = []
        for b in bufs:
            dev, stream = self._on(b.device)
            with dev, stream:
                outs.append(b.array.copy())
        self._nccl.all_reduce(outs, gpus, [self._streams[b.device] for b in bufs])
        return [self._done(out, b.device, b.dtype) for out, b in zip(outs, bufs)]


def _check_same(dst_dtype, dst_size: int, src_dtype, src_size: int) -> None:
    if np.dtype(dst_dtype) != np.dtype(src_dtype) or dst_size != src_size:
        raise ValueError(f"write: the destination is {np.dtype(dst_dtype).name} x {dst_size} but the result is "
                         f"{np.dtype(src_dtype).name} x {src_size}")


def _bf16_to_f32(cp, bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def _f32_to_bf16(cp, values, nan_negative):
    """Round-to-nearest-even from float32 to bfloat16 bits; a NaN becomes ml_dtypes'
    canonical quiet NaN (0x7FC0, or 0xFFC0 where ``nan_negative``)."""
    u = values.view(cp.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan_bits = cp.where(nan_negative, cp.uint32(0xFFC0), cp.uint32(0x7FC0))
    return cp.where(cp.isnan(values), nan_bits, rounded).astype(cp.uint16)
