"""GPU backend: logical devices on CUDA GPUs through CuPy.

Logical device ``i`` lives on GPU ``i % num_gpus`` with its own non-blocking
stream, so ``--virtual-devices 8`` on one GPU gives eight devices with their
own allocations (one GPU standing in for a DGX-1). Every buffer carries the
event recorded after the operation that produced it; an operation on another
stream first waits on its operands' events. Copies between GPUs are peer
copies (``cudaMemcpyPeerAsync``), never through the host.

bfloat16 has no CuPy dtype: it is held as uint16 bits and added through
float32 with round-to-nearest-even, which is what ml_dtypes does on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from xreduced.backends import DeviceInfo, mean_dtype
from xreduced.backends.numpy_backend import divide

_BF16 = "bfloat16"


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


class CupyBackend:
    """Logical devices on GPUs; see the module docstring.

    Example (needs a GPU):
        >>> b = CupyBackend(2)  # doctest: +SKIP
        >>> b.download(b.add(b.upload(0, np.ones(2)), b.upload(1, np.ones(2))))  # doctest: +SKIP
        array([2., 2.])
    """

    name = "cupy"

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
                            if e.status != cupy.cuda.runtime.errorPeerAccessAlreadyEnabled:
                                raise

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

    def upload(self, device: int, array: np.ndarray) -> _Buf:
        dev, stream = self._on(device)
        host = np.asarray(array, order="C")
        bits = host.view(np.uint16) if host.dtype.name == _BF16 else host
        with dev, stream:
            out = self._cp.empty(bits.shape, bits.dtype)
            out.set(bits, stream=stream)
        return self._done(out, device, host.dtype)

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
        if a.dtype.name != _BF16:
            return cp.add(a.array, b, out=out, dtype=a.array.dtype)
        x, y = _bf16_to_f32(cp, a.array), _bf16_to_f32(cp, b)
        # ml_dtypes' NaN: canonical, with the sign of the NaN operand (y's first), else negative (inf - inf).
        nan_sign = cp.where(cp.isnan(y), cp.signbit(y), cp.where(cp.isnan(x), cp.signbit(x), True))
        bits = _f32_to_bf16(cp, x + y, nan_sign)
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
                out = _f32_to_bf16(self._cp, x / np.float32(n), self._cp.signbit(x))
            else:
                out = divide(self._cp, buf.array, n)
        return self._done(out, buf.device, mean_dtype(buf.dtype))

    def synchronize(self) -> None:
        for stream in self._streams:
            stream.synchronize()


def _bf16_to_f32(cp, bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def _f32_to_bf16(cp, values, nan_negative):
    """Round-to-nearest-even from float32 to bfloat16 bits; a NaN becomes ml_dtypes'
    canonical quiet NaN (0x7FC0, or 0xFFC0 where ``nan_negative``)."""
    u = values.view(cp.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan_bits = cp.where(nan_negative, cp.uint32(0xFFC0), cp.uint32(0x7FC0))
    return cp.where(cp.isnan(values), nan_bits, rounded).astype(cp.uint16)
