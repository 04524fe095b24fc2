"""Backends: the small set of device operations a plan needs.

A backend owns logical devices ``0..N-1`` and implements :class:`Backend`.
``numpy`` keeps every device in host memory (the embedded default, what CI
runs); ``cupy`` maps logical devices onto GPUs with a stream per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One logical device as the daemon reports it."""

    device_type: str
    index: int
    memory_bytes: int
    physical_device: str


class Backend(Protocol):
    """What the executor asks of a backend; buffers are opaque to it.

    Every method that returns a buffer places it on the named device (or the
    device of its first operand); additions round in the operands' dtype.

    A backend whose buffers are numpy arrays in host memory sets the class
    attribute ``host_memory = True``: the executor then runs plans fused, on
    views of the inputs, and never calls its buffer methods (one without it
    runs the generic way).
    """

    name: str

    def devices(self) -> list[DeviceInfo]: ...

    def peer_access(self) -> list[list[bool]]: ...

    def upload(self, device: int, array: np.ndarray) -> Any: ...

    def download(self, buf: Any) -> np.ndarray: ...

    def write(self, dst: np.ndarray, buf: Any) -> None:
        """Copies ``buf`` into the host array ``dst`` (same dtype and shape), e.g. a
        caller's shared-memory output, without an intermediate host copy."""

    def copy(self, buf: Any, device: int) -> Any: ...

    def add(self, a: Any, b: Any) -> Any: ...

    def add_into(self, acc: Any, b: Any) -> None: ...

    def gather(self, device: int, parts: list[tuple[Any, int, int]]) -> Any: ...

    def reshape(self, buf: Any, shape: tuple[int, ...]) -> Any: ...

    def divide(self, buf: Any, n: int) -> Any: ...

    def synchronize(self) -> None: ...


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
