"""Shared memory with a daemon on the same host: no tensor bytes on the wire.

The SDK opens a session with the daemon (``OpenSession``) and proves that the
two share memory: it writes a random nonce into a small POSIX shared-memory
object and the daemon reads it back. From then on a call names *regions*:

* arrays made by :func:`shared_array` are already in shared memory and are
  sent without any copy;
* other arrays are copied into a staging segment that is reused call after call;
* results are written by the daemon into an output segment; the arrays the
  SDK returns are views of it, and the segment is reused only once they are
  all gone.

Segments are registered once per session and unregistered when they are
freed; when the session ends (the client closes, or its process dies) the
daemon releases them all. The resource tracker of ``multiprocessing`` unlinks
the segments of a process that dies without cleaning up.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import math
import mmap
import os
import queue
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker

import grpc
import numpy as np

from xreduce._errors import XReduceError
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.contract import SESSION_METADATA
from xreduce.wire.layout import OUTPUT_ALIGNMENT

SHM_DIR = "/dev/shm"
ENV_TRANSPORT = "XREDUCE_TRANSPORT"
"""``auto`` (shared memory when the daemon shares this host, else the wire), ``shm`` or ``wire``."""
TRANSPORTS = ("auto", "shm", "wire")
MIN_SEGMENT_BYTES = 1 << 20
FREE_SEGMENTS_KEPT = 4
COPY_RESULTS_UP_TO = 64 << 10
"""Results up to this size are copied out of the output segment; larger ones are views of it."""
"""Free staging/output segments a client keeps mapped for the next calls."""


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
    """

    def __init__(self, size: int, prefix: str):
        self.pid = os.getpid()
        self.name = f"{prefix}-{self.pid}-{secrets.token_hex(8)}"
        self.size = size
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: on a full /dev/shm this raises ENOSPC, where a write into an
            # unreserved page would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, self.name))
            raise
        finally:
            os.close(fd)
        # Unlinked by the tracker if this process dies before unlink() runs.
        resource_tracker.register("/" + self.name, "shared_memory")
        self.base = np.frombuffer(self.mm, np.uint8)
        self.address = self.base.__array_interface__["data"][0]

    def unlink(self) -> None:
        """Removes the name (mappings, the daemon's too, stay valid until unmapped)."""
        unlink(self.name)


def unlink(name: str) -> None:
    """Removes a segment's name and stops tracking it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")


# Work that finalizers hand over: they may run inside any allocation (the garbage collector), maybe
# while this thread holds one of the locks below, so they only put it here (SimpleQueue.put is safe
# there), and it runs outside every lock: in a background thread, and at the start of the next call.
_pending: queue.SimpleQueue = queue.SimpleQueue()
_worker: list[tuple[int, threading.Thread] | None] = [None]


def _later(fn: Callable, *args) -> None:
    _pending.put((fn, args))


def _run_pending() -> None:
    while True:
        fn, args = _pending.get()
        with contextlib.suppress(Exception):
            fn(*args)


def drain() -> None:
    """Runs the work finalizers handed over (unlinking freed segments, returning output
    segments), and makes sure this process's background thread runs later work."""
    worker = _worker[0]
    if worker is None or worker[0] != os.getpid():
        thread = threading.Thread(target=_run_pending, name="xreduce-shm-release", daemon=True)
        thread.start()
        _worker[0] = (os.getpid(), thread)
    while True:
        try:
            fn, args = _pending.get_nowait()
        except queue.Empty:
            return
        with contextlib.suppress(Exception):
            fn(*args)


# Segments of shared_array(), by address, so that any array can be traced to its segment.
_registry_lock = threading.Lock()
_starts: list[int] = []
_entries: dict[int, tuple[str, int, weakref.ref]] = {}
_users: dict[str, weakref.WeakSet] = {}  # segment name -> transports that registered it


def shared_array(shape: int | Sequence[int], dtype=np.float32) -> np.ndarray:
    """A zero-filled numpy array in POSIX shared memory: the SDK sends it to a
    daemon on the same host without copying a byte.

    The memory is freed when the array and every view of it are gone.

    Args:
        shape: as for ``numpy.zeros``.
        dtype: any dtype the daemon reduces (see ``xreduce.SUPPORTED_DTYPES``).

    Raises:
        OSError: no shared memory on this host (``/dev/shm``), or not enough room in it (ENOSPC).

    Example:
        >>> import xreduce
        >>> x = xreduce.shared_array((2, 3), "float32")
        >>> x[:] = 1.5
        >>> x.sum(), x.dtype
        (np.float32(9.0), dtype('float32'))
    """
    drain()
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    seg = Segment(max(nbytes, 1), prefix="xra")
    array = seg.base[:nbytes].view(dtype).reshape(shape)
    with _registry_lock:
        bisect.insort(_starts, seg.address)
        _entries[seg.address] = (seg.name, seg.size, weakref.ref(seg.base))
        _users[seg.name] = weakref.WeakSet()
    weakref.finalize(seg.base, _later, _forget, seg.pid, seg.address, seg.name)
    return array


def _forget(pid: int, address: int, name: str) -> None:
    """The last view of a shared_array segment is gone: unregister it everywhere, unlink it.
    (Not in a forked child: the segment is its parent's.)"""
    if os.getpid() != pid:
        return
    with _registry_lock:
        i = bisect.bisect_left(_starts, address)
        if i < len(_starts) and _starts[i] == address:
            del _starts[i]
        _entries.pop(address, None)
        users = list(_users.pop(name, ()))
    for transport in users:
        transport.forget(name)
    unlink(name)


def find(array: np.ndarray) -> tuple[str, int, int] | None:
    """The (segment name, byte offset, segment size) of a C-contiguous array
    inside a :func:`shared_array` segment, else None.

    Example:
        >>> x = shared_array(8, "int32")
        >>> find(x[2:])[1:]
        (8, 32)
        >>> find(np.zeros(8)) is None
        True
    """
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    ptr = array.__array_interface__["data"][0]
    with _registry_lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        name, size, ref = _entries[_starts[i]]
        start = _starts[i]
    if ref() is None or ptr + array.nbytes > start + size:
        return None
    return name, ptr - start, size


class _Pool:
    """Reusable segments (staging or output) of one client; at most
    :data:`FREE_SEGMENTS_KEPT` stay mapped while free."""

    def __init__(self, drop: Callable[[Segment], None], prefix: str):
        self._drop = drop
        self._prefix = prefix
        self._free: list[Segment] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, nbytes: int) -> Segment:
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
        return Segment(max(MIN_SEGMENT_BYTES, 1 << max(nbytes - 1, 1).bit_length()), self._prefix)

    def release(self, seg: Segment) -> None:
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
        for s in drop:
            self._drop(s)

    def close(self) -> None:
        with self._lock:
            free, self._free, self._closed = self._free, [], True
        for s in free:
            s.unlink()


class Session:
    """One ``OpenSession`` stream: its id, and whether the daemon shares our memory.

    The stream is watched by a thread: when it ends (the daemon stopped or
    restarted) the session is dead and the next call opens a new one.
    """

    def __init__(self, stub, metadata: tuple, timeout: float):
        probe = Segment(4096, prefix="xrp")
        nonce = secrets.token_bytes(32)
        probe.base[:32] = np.frombuffer(nonce, np.uint8)
        try:
            self._call = stub.OpenSession(
                pb.OpenSessionRequest(probe_shm_key=probe.name, probe_nonce=nonce), metadata=metadata)
            timer = threading.Timer(timeout, self._call.cancel)  # no unbounded wait for the first message
            timer.start()
            try:
                first = next(self._call)
            finally:
                timer.cancel()
        finally:
            probe.unlink()
        self.id = first.session_id
        self.shared_memory = first.shared_memory
        self.error = first.shared_memory_error
        self.cuda_ipc = first.cuda_ipc
        self.alive = threading.Event()
        self.alive.set()
        threading.Thread(target=self._watch, name="xreduce-session", daemon=True).start()

    def _watch(self) -> None:
        with contextlib.suppress(Exception):
            for _ in self._call:
                pass
        self.alive.clear()

    def close(self) -> None:
        """Ends the stream: the daemon releases every region of the session."""
        self.alive.clear()
        self._call.cancel()


class Transport:
    """The shared-memory side of one :class:`xreduce.Client`.

    Args:
        call: ``call(method, request, metadata)`` of the client (raises XReduceError).
        open_session: returns a new :class:`Session`.
    """

    def __init__(self, call: Callable, open_session: Callable[[], Session]):
        self._call = call
        self._open_session = open_session
        self._lock = threading.Lock()
        self._session: Session | None = None
        self.reason: str | None = None
        """Why the daemon cannot use this host's shared memory, once known."""
        self.last_error: str | None = None
        """Why the last attempt to open a session failed, when it failed for the time being."""
        self._registered: set[str] = set()
        self._registering = threading.Lock()  # one RegisterRegion per name, whatever the threads
        self._staging = _Pool(self._drop, "xrs")
        self._outputs = _Pool(self._drop, "xro")

    def session(self) -> Session:
        """The live session, opened (again) if needed."""
        with self._lock:
            if self._session is None or not self._session.alive.is_set():
                self._registered.clear()  # a new session: every segment is registered again on use
                self._session = self._open_session()
            return self._session

    def usable(self) -> bool:
        """Whether the daemon reads this host's shared memory; when it does
        not, the session is closed and :attr:`reason` says why."""
        if self.reason is not None:
            return False
        try:
            session = self.session()
        except XReduceError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:  # a daemon from before sessions: the wire, for good
                self.reason = str(e)
                return False
            if e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED):
                self.last_error = str(e)
                return False  # no session now (too many, or the daemon is stopping): the wire, this time
            raise
        if session.shared_memory:
            return True
        self.reason = session.error or "the daemon did not say why"
        with self._lock:
            self._session = None
        session.close()
        return False

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((SESSION_METADATA, self.session().id),)

    def _register(self, name: str, size: int) -> None:
        with self._registering:
            if name in self._registered:
                return
            self._call("RegisterRegion", pb.RegisterRegionRequest(name=name, shm_key=name, offset=0,
                                                                  byte_size=size), self.metadata())
            self._registered.add(name)

    def _acquire(self, pool: _Pool, nbytes: int) -> Segment:
        seg = pool.acquire(nbytes)
        if seg.name not in self._registered:
            try:
                self._register(seg.name, seg.size)
            except BaseException:
                pool.release(seg)
                raise
        return seg

    def _drop(self, seg: Segment) -> None:
        with contextlib.suppress(Exception):
            self._unregister(seg.name)
        seg.unlink()

    def _unregister(self, name: str) -> None:
        with self._registering:
            if name not in self._registered:
                return
            self._registered.discard(name)
        self._call("UnregisterRegion", pb.UnregisterRegionRequest(name=name), self.metadata())

    def forget(self, name: str) -> None:
        """A shared_array segment was freed: release it in the daemon."""
        with contextlib.suppress(Exception):
            self._unregister(name)

    def stage(self, arrays: Sequence[np.ndarray]) -> tuple[list[pb.Tensor], Callable[[], None]]:
        """Region tensors for ``arrays``: shared arrays as they are, others copied into staging.

        Returns:
            (the tensors, a function that frees the staging space once the call returned).
        """
        from xreduce.wire import codec

        drain()
        placed: list[tuple[str, int, int] | None] = []
        need = 0
        for a in arrays:
            where = find(a)
            if where is not None and where[0] not in self._registered:
                with _registry_lock:
                    users = _users.get(where[0])
                    if users is not None:
                        users.add(self)
                self._register(where[0], where[2])
            if where is None:
                need += -need % OUTPUT_ALIGNMENT + a.nbytes
            placed.append(where)
        seg = self._acquire(self._staging, max(need, 1)) if None in placed else None
        tensors, at = [], 0
        for a, where in zip(arrays, placed):
            if where is None:
                at += -at % OUTPUT_ALIGNMENT
                seg.base[at:at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
                where = (seg.name, at, seg.size)
                at += a.nbytes
            tensors.append(pb.Tensor(dtype=codec.dtype_enum(a.dtype), shape=a.shape, region=pb.RegionSlice(
                name=where[0], offset=where[1], byte_size=a.nbytes)))
        return tensors, (lambda: self._staging.release(seg)) if seg is not None else (lambda: None)

    def output(self, nbytes: int) -> tuple[pb.RegionSlice, Callable[[pb.Tensor], np.ndarray]]:
        """An output slice of at least ``nbytes``; the segment is reused once
        the call's result arrays (and the returned function) are gone.

        Returns:
            (the slice to send, a function turning a reply tensor into an array:
            a view of the segment).
        """
        from xreduce.wire import codec

        drain()
        seg = self._acquire(self._outputs, max(nbytes, 1))
        hold = np.frombuffer(seg.mm, np.uint8, seg.size)  # views of it keep the segment busy
        weakref.finalize(hold, _later, self._outputs.release, seg)

        def result(tensor: pb.Tensor) -> np.ndarray:
            if not tensor.HasField("region"):
                return codec.decode(tensor)
            dtype, shape = codec.spec(tensor)
            r = tensor.region
            if r.name != seg.name or r.offset + r.byte_size > seg.size:
                raise ValueError(f"the daemon placed a result at {r.name}[{r.offset}:+{r.byte_size}], outside the "
                                 f"output segment {seg.name} of {seg.size} bytes")
            view = hold[r.offset:r.offset + r.byte_size].view(dtype).reshape(shape)
            # A small result kept for long (a loss per step) must not pin a whole segment: copy it.
            return view.copy() if r.byte_size <= COPY_RESULTS_UP_TO else view

        return pb.RegionSlice(name=seg.name, offset=0, byte_size=seg.size), result

    def close(self) -> None:
        """Ends the session (the daemon releases every region) and unlinks this client's segments."""
        with self._lock:
            session, self._session = self._session, None
            self._registered.clear()
        self._staging.close()
        self._outputs.close()
        if session is not None:
            session.close()


_transports: dict[tuple, Transport] = {}
_transports_lock = threading.Lock()


def transport_for(key: tuple, make_client: Callable) -> Transport:
    """The process's transport for one daemon and set of credentials (``key``), made on first use
    with a client of its own (``make_client()``)."""
    with _transports_lock:
        transport = _transports.get(key)
        if transport is None:
            client = make_client()
            transport = _transports[key] = Transport(client._call_with, client._open_session)
        return transport


@atexit.register
def close_all() -> None:
    """Ends every session of this process and unlinks its segments (also run at exit)."""
    drain()
    with _transports_lock:
        transports = [t for key, t in _transports.items() if key[0] == os.getpid()]
        _transports.clear()
    for transport in transports:
        with contextlib.suppress(Exception):
            transport.close()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's sessions; its parent's segments are not its to free."""
    global _transports_lock, _registry_lock, _pending
    _transports.clear()
    _pending = queue.SimpleQueue()
    _worker[0] = None
    _transports_lock = threading.Lock()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
