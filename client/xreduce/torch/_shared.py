"""Tensors the group reduces again and again (DDP's gradient buckets) moved into shared memory, once.

A CPU tensor's memory is private to its process: the SDK copies it into a staging segment the daemon reads,
and the result back out. A tensor reduced once, that is the price. DDP reduces the same bucket buffers every
step, so from the second time a storage of at least :data:`MIN_BYTES` is seen, its data is moved into a POSIX
shared-memory object with torch's own ``share_memory_`` mechanism (``_share_filename_cpu_``: the same storage,
every view of it keeps working) and the object is added to the SDK's shared arrays
(:meth:`xreduce._segments.SharedArrays.add_external`): from then on the daemon reads the bucket where it lies and
writes the sum there, and nothing is copied. At most :data:`MAX_BYTES` are held so; the storages least recently
reduced are let go first (the daemon unmaps them; torch frees them with their last tensor).
"""

from __future__ import annotations

import collections
import os

import torch

from xreduce import _runtime

MIN_BYTES = 1 << 20
"""Smaller tensors are copied: a copy costs less than a region."""
MAX_BYTES = 2 << 30
"""The most bytes of storages this group keeps in shared memory."""
SEEN = 64
"""How many storages seen once are remembered (a storage seen twice is moved)."""
SHM_DIR = "/dev/shm"


class _Held:
    """Keeps a moved storage alive while the daemon may map it; its end lets the daemon unmap it."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage


class SharedStorages:
    """The storages one group has moved into shared memory, by their data pointer.

    Example:
        >>> shared = SharedStorages()
        >>> t = torch.zeros(MIN_BYTES // 4)
        >>> shared.share(t), shared.share(t), t.is_shared()
        (False, True, True)
    """

    def __init__(self):
        self._held: collections.OrderedDict[int, _Held] = collections.OrderedDict()
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._bytes = 0
        self._broken = False

    def share(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a contiguous CPU tensor) now lies in shared memory the SDK sends without a copy."""
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if self._broken or nbytes < MIN_BYTES or nbytes > MAX_BYTES:
            return False
        if ptr in self._held:
            self._held.move_to_end(ptr)
            return True
        if ptr not in self._seen:
            self._seen[ptr] = None
            while len(self._seen) > SEEN:
                self._seen.popitem(last=False)
            return False
        del self._seen[ptr]
        try:
            _, name, _ = storage._share_filename_cpu_()  # moves the data; the storage (and its views) follow
            name = name.decode().lstrip("/")
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        except (RuntimeError, OSError):
            self._broken = True  # no torch_shm_manager, no /dev/shm: copy as before
            return False
        held, start = _Held(storage), storage.data_ptr() - (size - nbytes)  # the object's header comes first
        _runtime.default().shared_arrays.add_external(name, start, size, held)
        self._held[storage.data_ptr()] = held
        self._bytes += nbytes
        while self._bytes > MAX_BYTES:
            _, gone = self._held.popitem(last=False)
            self._bytes -= gone.storage.nbytes()
        return True

    def clear(self) -> None:
        """Lets every storage go (the group's end)."""
        self._held.clear()
        self._seen.clear()
        self._bytes = 0
