"""POSIX shared-memory segments of this process: making, pooling, tracing and releasing them.

A segment is a file in ``/dev/shm`` mapped into this process. The daemon maps
the same file when the SDK registers it as a region, so the bytes never travel.
This process's :class:`~xreduce._reaper.Reaper` unlinks the segments of a
process that ends without cleaning up.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import mmap
import os
import queue
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from xreduce._reaper import Reaper
from xreduce.wire import codec

SHM_DIR = "/dev/shm"
MIN_SEGMENT_BYTES = 1 << 20
FREE_SEGMENTS_KEPT = 4
"""Free staging/output segments a client keeps mapped for the next calls (per pool)."""
FREE_BYTES_KEPT = 256 << 20
"""Bytes of free segments a pool keeps, at most: the largest go first, so that a big call's segments are
returned to the system once it is done (a chunked reduce needs ``IN_FLIGHT`` x 64 MiB per pool)."""

_reaper = Reaper(SHM_DIR)


def reaper() -> Reaper:
    """The reaper of this process's segments: what it has not unlinked yet.

    Example:
        >>> seg = Segment(4096, "xrdoc")
        >>> seg.name in reaper().names()
        True
        >>> seg.unlink()
        >>> seg.name in reaper().names()
        False
    """
    return _reaper


def available() -> bool:
    """Whether POSIX shared memory can be made here (Linux's ``/dev/shm``).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class Segment:
    """A POSIX shared-memory object of this process, mapped.

    ``base`` is a flat uint8 array over the whole mapping; arrays handed out are views of it.

    Example:
        >>> seg = Segment(4096, "xrdoc")
        >>> seg.base.size, seg.name.startswith(f"xrdoc-{os.getpid()}-")
        (4096, True)
        >>> seg.unlink()
    """

    def __init__(self, size: int, prefix: str):
        self.pid = os.getpid()
        self.name = f"{prefix}-{self.pid}-{secrets.token_hex(8)}"
        self.size = size
        _reaper.add(self.name)  # first: a process killed from here on leaves nothing behind
        try:
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except BaseException:
            _reaper.remove(self.name)
            raise
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: on a full /dev/shm this raises ENOSPC, where a write into an
            # unreserved page would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            unlink(self.name)
            raise
        finally:
            os.close(fd)
        self.base = np.frombuffer(self.mm, np.uint8)
        self.address = self.base.__array_interface__["data"][0]

    def unlink(self) -> None:
        """Removes the name (mappings, the daemon's too, stay valid until unmapped)."""
        unlink(self.name)


def unlink(name: str) -> None:
    """Removes a segment's name and stops tracking it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    _reaper.remove(name)


class _Lane:
    """Queued work and the background thread that runs it."""

    def __init__(self, name: str):
        self.name = name
        self.pending: collections.deque = collections.deque()
        self.wake: queue.SimpleQueue = queue.SimpleQueue()  # one token per queued work: the worker wakes up
        self.worker: tuple[int, threading.Thread] | None = None
        self.running = threading.Lock()  # held while the background thread works, so that pausing waits

    def later(self, fn: Callable, args: tuple) -> None:
        self.pending.append((fn, args))
        self.wake.put(None)

    def run_queued(self) -> None:
        while True:
            try:
                fn, args = self.pending.popleft()
            except IndexError:
                return
            with contextlib.suppress(Exception):
                fn(*args)

    def start(self) -> None:
        """Makes sure this process has the lane's background thread."""
        worker = self.worker
        if worker is None or worker[0] != os.getpid():
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()
            self.worker = (os.getpid(), thread)

    def _run(self) -> None:
        while True:
            self.wake.get()
            with self.running:
                self.run_queued()


class Releases:
    """Work that finalizers hand over (unlinking freed segments, returning output segments, telling the
    daemon a region is gone).

    Finalizers may run inside any allocation (the garbage collector), maybe
    while this thread holds a lock of the SDK, so they only queue their work
    here (``deque.append`` and ``SimpleQueue.put`` take no lock); it runs
    outside every lock, in background threads. Local work (:meth:`later`:
    unlinking, returning segments to their pool) also runs at the start of the
    next call (:meth:`drain`); calls to a daemon (:meth:`later_remote`) run in
    a lane of their own, so that a daemon that is slow to answer (stopped,
    unreachable: each call waits up to its bound) never holds up this process's
    segments.

    Example:
        >>> done = []
        >>> releases = Releases()
        >>> releases.later(done.append, 1)
        >>> releases.drain()
        >>> done
        [1]
    """

    def __init__(self):
        self._local = _Lane("xreduce-shm-release")
        self._remote = _Lane("xreduce-shm-unregister")

    def later(self, fn: Callable, *args) -> None:
        """Queues ``fn(*args)``, local work."""
        self._local.later(fn, args)

    def later_remote(self, fn: Callable, *args) -> None:
        """Queues ``fn(*args)``, a call to a daemon; it runs in the background only (started by :meth:`drain`).

        Example:
            >>> import threading
            >>> done = threading.Event()
            >>> releases = Releases()
            >>> releases.later_remote(done.set); releases.drain()
            >>> done.wait(10)
            True
        """
        self._remote.later(fn, args)

    def run_queued(self) -> None:
        """Runs the queued work in this thread, local then remote, and starts nothing (at exit no thread may
        start).

        Example:
            >>> releases = Releases()
            >>> releases.later_remote(print, "unregistered"); releases.later(print, "unlinked")
            >>> releases.run_queued()
            unlinked
            unregistered
        """
        self._local.run_queued()
        self._remote.run_queued()

    def drain(self) -> None:
        """Runs the queued local work, and makes sure this process's background threads run later work.

        Example:
            >>> Releases().drain()
        """
        self._local.start()
        self._remote.start()
        self._local.run_queued()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block, the background threads run nothing (what they were running finishes first);
        :meth:`drain` and :meth:`run_queued` still run the queued work, in the caller's thread.

        Example:
            >>> releases = Releases()
            >>> releases.drain()  # the background threads run
            >>> with releases.paused():
            ...     releases.later(print, "released")
            ...     releases.run_queued()
            released
        """
        with self._local.running, self._remote.running:
            yield

    def after_fork_in_child(self) -> None:
        """A forked child has no worker threads, and queues or locks another thread may have held.

        Example:
            >>> Releases().after_fork_in_child()
        """
        self._local = _Lane(self._local.name)
        self._remote = _Lane(self._remote.name)


class SegmentUser(Protocol):
    """What registered a :class:`SharedArrays` segment with a daemon, told when the segment is freed."""

    def forget(self, name: str) -> None:
        """Releases ``name`` in the daemon."""


class SharedArrays:
    """The segments of :func:`xreduce.shared_array`, by address, so that any array can be traced to its segment.

    Args:
        releases: where the finalizer of a freed segment queues its release.

    Example:
        >>> arrays = SharedArrays(Releases())
        >>> x = arrays.allocate(8, "int32")
        >>> arrays.find(x[2:])[1:]
        (8, 32)
        >>> arrays.find(np.zeros(8)) is None
        True
    """

    def __init__(self, releases: Releases):
        self._releases = releases
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._entries: dict[int, tuple[str, int, weakref.ref]] = {}
        self._users: dict[str, weakref.WeakSet] = {}  # segment name -> what registered it

    def allocate(self, shape: int | Sequence[int], dtype) -> np.ndarray:
        """A zero-filled array in a new segment, freed (and released everywhere) with its last view.

        Raises:
            ValueError: a dimension that is not a whole number >= 0, or a dtype the daemon does not
                reduce; nothing is made.
        """
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"shape: every dimension must be a whole number >= 0; got {shape!r}")
        codec.dtype_enum(dtype, "dtype")
        self._releases.drain()
        dims, dtype = tuple(int(d) for d in dims), np.dtype(dtype)
        nbytes = math.prod(dims) * dtype.itemsize
        seg = Segment(max(nbytes, 1), prefix="xra")
        array = seg.base[:nbytes].view(dtype).reshape(dims)
        with self._lock:
            bisect.insort(self._starts, seg.address)
            self._entries[seg.address] = (seg.name, seg.size, weakref.ref(seg.base))
            self._users[seg.name] = weakref.WeakSet()
        weakref.finalize(seg.base, self._releases.later, self._forget, seg.pid, seg.address, seg.name)
        return array

    def add_external(self, name: str, start: int, size: int, owner: object) -> None:
        """Arrays inside another allocator's shared-memory object (``/dev/shm/<name>``, mapped in this process at
        address ``start`` for ``size`` bytes while ``owner`` lives) are found as a :func:`shared_array`'s are: the
        SDK sends them, and the daemon writes results into them, without a copy. Never unlinked here; when
        ``owner`` goes, every daemon that mapped the object is told to let it go (``xreduce.torch`` adds
        torch's shared storages this way).

        Example:
            >>> arrays, seg = SharedArrays(Releases()), Segment(4096, "xrdoc")
            >>> arrays.add_external(seg.name, seg.address, seg.size, seg)
            >>> arrays.find(seg.base[64:128].view(np.float32))[1:]
            (64, 4096)
            >>> seg.unlink()
        """
        with self._lock:
            bisect.insort(self._starts, start)
            self._entries[start] = (name, size, weakref.ref(owner))
            self._users[name] = weakref.WeakSet()
        weakref.finalize(owner, self._releases.later, self._forget, os.getpid(), start, name, False)

    def _forget(self, pid: int, address: int, name: str, owned: bool = True) -> None:
        """The last view of a segment is gone: unlink it (when this process made it), and unregister it
        everywhere (in the background). (Not in a forked child: the segment is its parent's.)"""
        if os.getpid() != pid:
            return
        with self._lock:
            i = bisect.bisect_left(self._starts, address)
            if i < len(self._starts) and self._starts[i] == address:
                del self._starts[i]
            self._entries.pop(address, None)
            users = list(self._users.pop(name, ()))
        if owned:
            unlink(name)
        for user in users:
            self._releases.later_remote(user.forget, name)

    def find(self, array: np.ndarray) -> tuple[str, int, int] | None:
        """The (segment name, byte offset, segment size) of a C-contiguous array in one of the segments, else None."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        ptr = array.__array_interface__["data"][0]
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            name, size, ref = self._entries[self._starts[i]]
            start = self._starts[i]
        if ref() is None or ptr + array.nbytes > start + size:
            return None
        return name, ptr - start, size

    def add_user(self, name: str, user: SegmentUser) -> None:
        """Records that ``user`` registered segment ``name``: it is told when the segment is freed."""
        with self._lock:
            users = self._users.get(name)
            if users is not None:
                users.add(user)

    def after_fork_in_child(self) -> None:
        """The segments stay mapped in a forked child; a lock another thread held does not carry over."""
        self._lock = threading.Lock()


class SegmentPool:
    """Reusable segments (staging or output) of one daemon's shared memory; at most
    :data:`FREE_SEGMENTS_KEPT` of at most :data:`FREE_BYTES_KEPT` in all stay mapped while free.

    Args:
        drop: called with each segment the pool lets go of.
        prefix: the name prefix of the segments it makes.

    Example:
        >>> pool = SegmentPool(lambda seg: seg.unlink(), "xrdoc")
        >>> seg = pool.acquire(100)
        >>> seg.size
        1048576
        >>> pool.release(seg)
        >>> pool.acquire(10) is seg
        True
        >>> pool.release(seg); pool.close()
    """

    def __init__(self, drop: Callable[[Segment], None], prefix: str):
        self._drop = drop
        self._prefix = prefix
        self._free: list[Segment] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, nbytes: int) -> Segment:
        """The smallest free segment of at least ``nbytes``, or a new one (a power of two, 1 MiB at least)."""
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
        return Segment(max(MIN_SEGMENT_BYTES, 1 << max(nbytes - 1, 1).bit_length()), self._prefix)

    def release(self, seg: Segment) -> None:
        """Takes ``seg`` back for reuse; drops the smallest free ones beyond :data:`FREE_SEGMENTS_KEPT`, then
        the largest beyond :data:`FREE_BYTES_KEPT`."""
        if seg.pid != os.getpid():  # a forked child's copy: the segment is its parent's
            return
        with self._lock:
            drop = []
            if self._closed:
                drop.append(seg)
            else:
                self._free.append(seg)
            while len(self._free) > FREE_SEGMENTS_KEPT:
                smallest = min(self._free, key=lambda s: s.size)
                self._free.remove(smallest)
                drop.append(smallest)
            while sum(s.size for s in self._free) > FREE_BYTES_KEPT:
                largest = max(self._free, key=lambda s: s.size)
                self._free.remove(largest)
                drop.append(largest)
        for s in drop:
            self._drop(s)

    def close(self) -> None:
        """Unlinks the free segments; segments released later are dropped."""
        with self._lock:
            free, self._free, self._closed = self._free, [], True
        for s in free:
            s.unlink()
