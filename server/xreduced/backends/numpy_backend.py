"""Host "virtual devices": every logical device is host memory.

Through the backend's operations, copies between devices are real copies, so
the plan's data movement happens as it would between GPUs, and the numbers are
those of the GPU path. The executor runs plans on this backend fused instead
(:class:`~xreduced.backends.HostMemory`): the same additions on views of the inputs, without the copies.
"""

from __future__ import annotations

import os

import numpy as np
from xreduce.wire.contract import mean_dtype

from xreduced.backends import Backend, DeviceInfo, HostMemory, dgx1_peer_matrix


class NumpyBackend(HostMemory, Backend):
    """Host memory backend with ``num_devices`` logical CPU devices.

    Example:
        >>> b = NumpyBackend(2)
        >>> x = b.upload(0, np.array([1, 2], np.float32))
        >>> b.download(b.add(x, b.copy(x, 1)))
        array([2., 4.], dtype=float32)
    """

    name = "numpy"

    def __init__(self, num_devices: int = 8):
        if num_devices < 1:
            raise ValueError(f"virtual_devices must be >= 1; got virtual_devices={num_devices}")
        self._n = num_devices

    def devices(self) -> list[DeviceInfo]:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // self._n
        except (ValueError, OSError):
            memory = 0
        return [DeviceInfo("CPU", i, memory, "host") for i in range(self._n)]

    def peer_access(self) -> list[list[bool]]:
        return dgx1_peer_matrix(self._n)

    def upload(self, device: int, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True, order="C")

    def download(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def write(self, dst: np.ndarray, buf: np.ndarray) -> None:
        np.copyto(dst, buf)

    def copy(self, buf: np.ndarray, device: int) -> np.ndarray:
        return buf.copy()

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.add(a, b, dtype=a.dtype)

    def add_into(self, acc: np.ndarray, b: np.ndarray) -> None:
        np.add(acc, b, out=acc, dtype=acc.dtype)

    def gather(self, device: int, parts: list[tuple[np.ndarray, int, int]]) -> np.ndarray:
        if len(parts) == 1:
            buf, start, stop = parts[0]
            return buf.reshape(-1)[start:stop]
        return np.concatenate([buf.reshape(-1)[start:stop] for buf, start, stop in parts])

    def reshape(self, buf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return buf.reshape(shape)

    def divide(self, buf: np.ndarray, n: int) -> np.ndarray:
        return divide(np, buf, n)

    def synchronize(self) -> None:
        return None


def divide(xp, x, n: int):
    """MEAN's division, shared by the numpy and cupy backends: integers are
    promoted first, complex parts are divided separately (complex division does
    not match TF), floats divide in their own dtype.

    Example:
        >>> divide(np, np.array([3], np.int32), 2)
        array([1.5])
    """
    out_dtype = mean_dtype(x.dtype)
    if x.dtype.kind in "iu":
        return x.astype(out_dtype) / out_dtype.type(n)
    if x.dtype.kind == "c":
        out = xp.empty(x.shape, x.dtype)
        out.real = x.real / x.real.dtype.type(n)
        out.imag = x.imag / x.imag.dtype.type(n)
        return out
    return (x / x.dtype.type(n)).astype(x.dtype, copy=False)
