"""The CUDA IPC regions this process keeps registered with its daemons, and its free output buffers.

Nothing here imports CuPy: the buffers and events are handed in by
:mod:`xreduce._ipc`, which does.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.layout import OUTPUT_ALIGNMENT

MAX_REGIONS = 64
"""CUDA IPC regions a process keeps registered per daemon session (more for a call using over half as many)."""
FREE_OUTPUTS_KEPT = 4
"""Free output buffers per GPU kept for the next calls."""
MIN_OUTPUT_BYTES = 1 << 20


@dataclasses.dataclass(eq=False)
class Region:
    """One registered allocation: its region name, the session and client it was registered with,
    its ready event, and how many calls use it now.

    Example:
        >>> Region("ipc-4242-7-0", session=None, client=None, device_id=0, event=None).busy
        0
    """

    name: str
    session: Any  # xreduce._session.Session
    client: Any  # xreduce.Client
    device_id: int
    event: Any  # cupy.cuda.Event, interprocess
    busy: int = 0


class OutputPool:
    """Free output buffers (flat ``uint8`` CuPy arrays), per GPU.

    Example:
        >>> import numpy as np  # the pool only keeps buffers: numpy arrays stand in for CuPy's here
        >>> pool = OutputPool()
        >>> pool.release(0, np.zeros(4096, np.uint8))
        >>> pool.acquire(None, 0, 1000).nbytes  # reused: no allocation, so no CuPy module is needed
        4096
    """

    def __init__(self):
        self._lock = threading.RLock()  # a finalizer may release while this thread acquires
        self._free: dict[int, list[Any]] = {}

    def acquire(self, cp, device_id: int, nbytes: int):
        """A free buffer with at least ``nbytes`` usable past :data:`OUTPUT_ALIGNMENT` bytes of slack, or a new one.

        Example:
            >>> import numpy as np  # stands in for CuPy; a new buffer would need ``cp`` (CuPy) and a GPU
            >>> pool = OutputPool()
            >>> pool.release(0, np.zeros(1024 + OUTPUT_ALIGNMENT, np.uint8))
            >>> pool.acquire(None, 0, 1024).nbytes  # fits with its slack: reused, nothing allocated
            1088
        """
        with self._lock:
            free = self._free.get(device_id, [])
            fits = [b for b in free if b.nbytes - OUTPUT_ALIGNMENT >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.nbytes)
                _drop(free, buffer)
                return buffer
        with cp.cuda.Device(device_id):
            return cp.empty(max(MIN_OUTPUT_BYTES, 1 << (nbytes - 1).bit_length()) + OUTPUT_ALIGNMENT, cp.uint8)

    def release(self, device_id: int, buffer) -> None:
        """Takes ``buffer`` back; keeps the largest :data:`FREE_OUTPUTS_KEPT` per GPU.

        Example:
            >>> import numpy as np  # stands in for CuPy arrays
            >>> pool = OutputPool()
            >>> for size in (100, 200, 300, 400, 500):
            ...     pool.release(0, np.zeros(size, np.uint8))
            >>> pool.acquire(None, 0, 1).nbytes  # the smallest, 100 bytes, was let go
            200
            >>> pool.acquire(None, 0, 300).nbytes  # not the first free one: taken by identity, not by ==
            400
        """
        with self._lock:
            free = self._free.setdefault(device_id, [])
            free.append(buffer)
            while len(free) > FREE_OUTPUTS_KEPT:
                _drop(free, min(free, key=lambda b: b.nbytes))

    def clear(self) -> None:
        """Lets every free buffer go.

        Example:
            >>> import numpy as np  # stands in for CuPy arrays
            >>> pool = OutputPool()
            >>> pool.release(0, np.zeros(4096, np.uint8)); pool.clear()
            >>> pool.acquire(None, 0, 1)  # nothing free: it allocates with ``cp``, here None instead of CuPy
            Traceback (most recent call last):
            ...
            AttributeError: 'NoneType' object has no attribute 'cuda'
        """
        with self._lock:
            self._free.clear()


class CudaRegions:
    """Registered CUDA IPC regions by (session id, driver buffer id), least recently used first,
    and the free output buffers.

    Example:
        >>> regions = CudaRegions()
        >>> region = regions.pin(("s1", 7), lambda: Region("ipc-1-7-0", None, None, 0, None))
        >>> regions.names(), region.busy
        (['ipc-1-7-0'], 1)
        >>> regions.unpin([region]); region.busy
        0
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._numbers = itertools.count()
        self._regions: collections.OrderedDict[tuple[str, int], Region] = collections.OrderedDict()
        self.outputs = OutputPool()

    def name(self, buffer_id: int) -> str:
        """A new region name for an allocation of this process.

        Example:
            >>> regions = CudaRegions()
            >>> regions.name(7), regions.name(7)
            ('ipc-...-7-0', 'ipc-...-7-1')
        """
        return f"ipc-{os.getpid()}-{buffer_id}-{next(self._numbers)}"

    def pin(self, key: tuple[str, int], register: Callable[[], Region]) -> Region:
        """The region of ``key``, registered now (``register()``) if needed, marked most recently used and busy.

        Example:
            >>> regions = CudaRegions()
            >>> first = regions.pin(("s1", 7), lambda: Region("ipc-1-7-0", None, None, 0, None))
            >>> regions.pin(("s1", 7), lambda: Region("never-made", None, None, 0, None)) is first, first.busy
            (True, 2)
        """
        with self._lock:
            region = self._regions.get(key)
            if region is None:
                region = self._regions[key] = register()
            else:
                self._regions.move_to_end(key)
            region.busy += 1
        return region

    def unpin(self, regions: Iterable[Region]) -> None:
        """The calls using ``regions`` returned: unregisters the least recently used idle regions of each
        session beyond :data:`MAX_REGIONS`, or beyond twice the regions that call used if more.

        Example:
            >>> regions = CudaRegions()
            >>> region = regions.pin(("s1", 7), lambda: Region("ipc-1-7-0", None, None, 0, None))
            >>> regions.unpin([region]); region.busy, regions.names()  # idle, and kept: one region is few
            (0, ['ipc-1-7-0'])
        """
        with self._lock:
            regions = list(regions)
            for region in regions:
                region.busy -= 1
            self._evict(max(MAX_REGIONS, 2 * len({id(r) for r in regions})))

    def _evict(self, keep: int) -> None:
        counts = collections.Counter(key[0] for key in self._regions)
        for key in list(self._regions):
            region = self._regions[key]
            if counts[key[0]] <= keep or region.busy:
                continue
            del self._regions[key]
            counts[key[0]] -= 1
            if region.session.alive.is_set():
                with contextlib.suppress(Exception):
                    region.client.unregister_region(pb.UnregisterRegionRequest(name=region.name),
                                                    session=region.session.id)

    def forget_dead(self) -> None:
        """Drops regions of ended sessions (the daemon released them) and, after a fork, the parent's.

        Example:
            >>> import threading, types
            >>> ended = types.SimpleNamespace(alive=threading.Event())  # a session whose stream ended
            >>> regions = CudaRegions()
            >>> _ = regions.pin(("s1", 7), lambda: Region("ipc-1-7-0", ended, None, 0, None))
            >>> regions.forget_dead(); regions.names()
            []
        """
        with self._lock:
            if os.getpid() != self._pid:
                self._pid = os.getpid()
                self._regions.clear()
                self.outputs.clear()
                return
            for key in [k for k, r in self._regions.items() if not r.session.alive.is_set()]:
                del self._regions[key]

    def names(self) -> list[str]:
        """Names of the registered regions, least recently used first.

        Example:
            >>> regions = CudaRegions()
            >>> for n in (1, 2, 1):
            ...     _ = regions.pin(("s1", n), lambda: Region(f"ipc-1-{n}-0", None, None, 0, None))
            >>> regions.names()
            ['ipc-1-2-0', 'ipc-1-1-0']
        """
        with self._lock:
            return [r.name for r in self._regions.values()]


def _drop(buffers: list, buffer) -> None:
    """Removes ``buffer`` itself from ``buffers``: ``list.remove`` compares arrays with ``==``, elementwise.

    Example:
        >>> import numpy as np
        >>> a, b = np.zeros(4), np.zeros(4)
        >>> free = [a, b]; _drop(free, b); free[0] is a
        True
    """
    del buffers[next(i for i, x in enumerate(buffers) if x is buffer)]
