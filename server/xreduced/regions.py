"""Sessions and the memory regions they register: the zero-copy local transport.

A client opens a session (the ``OpenSession`` stream) and registers regions of
its memory under names of its own: POSIX shared-memory objects, or CUDA IPC
memory handles when the backend is CuPy. Requests then name ``(region,
offset, byte_size)`` instead of carrying bytes, and the daemon reads inputs
from, and writes results into, the caller's memory.

Rules the table enforces:

* a call can only name regions of its own session (the ``x-xreduce-session``
  metadata), so one client never reaches another's memory;
* every slice is checked against its region's size before any byte is read;
* a region a call is using stays mapped until that call ends, even if it is
  unregistered meanwhile (it is released after the call);
* closing a session (the client closed its stream, disconnected, or died)
  releases every region it registered;
* the shared memory mapped, over every session, stays within the daemon's
  budget (:class:`~xreduced.oom.MappedBytes`, ``--max-mapped-bytes``): a region
  over it is refused before its object is even opened, and an unmapped region's
  bytes go back to it.

The daemon opens shared-memory objects with its own permissions, by a plain
name (no ``/`` inside): run it as the user of the training processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from xreduce.wire.contract import SESSION_METADATA

from xreduced.backends import DeviceRegion
from xreduced.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ServiceError
from xreduced.oom import MappedBytes

log = logging.getLogger("xreduced.regions")

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory objects live on Linux."""

MAX_REGIONS_PER_SESSION = 4096
MAX_NAME_CHARS = 255
_KEY = re.compile(r"^/?[A-Za-z0-9._-]{1,250}$")


class SessionsExhausted(ServiceError):
    """No session can be opened now."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclasses.dataclass(eq=False)
class Region:
    """One registered region; ``view(offset, dtype, shape)`` gives its bytes from
    ``offset`` as an array (numpy over a mapping, or the backend's device array
    over an opened IPC handle)."""

    name: str
    kind: str
    key: str
    offset: int
    byte_size: int
    view: Callable[[int, np.dtype, tuple[int, ...]], Any]
    closer: Any = None
    check: Any = None
    in_use: int = 0
    unregistered: bool = False
    holders: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet, repr=False)
    """Objects that keep views of the region between calls (a kept repeat's bound reduction): each one's
    ``drop()`` is called when it closes, before it is unmapped (:meth:`hold`)."""

    def hold(self, holder) -> None:
        """Has ``holder.drop()`` called (its views let go) when the region closes; ``holder`` is weakly held.

        Example:
            >>> class Views:
            ...     def drop(self): print("dropped")
            >>> region, views = Region("r", "shm", "k", 0, 4, view=None), Views()
            >>> region.hold(views); region.close()
            dropped
        """
        self.holders.add(holder)

    def close(self) -> None:
        """Unmaps the region (numpy views of it must be gone: its holders drop theirs first)."""
        for holder in list(self.holders):
            holder.drop()
        self.holders.clear()
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer()


@dataclasses.dataclass(eq=False)
class Session:
    """A client's session: its id and regions; ``closed`` ends its stream."""

    id: str
    regions: dict[str, Region] = dataclasses.field(default_factory=dict)
    closed: threading.Event = dataclasses.field(default_factory=threading.Event)


def open_shm(key: str, offset: int, byte_size: int, field: str = "shm_key") -> tuple[np.ndarray, Any, Any]:
    """Maps ``byte_size`` bytes at ``offset`` of the shared-memory object ``key``.

    Returns:
        (a flat uint8 array over the bytes, a function that unmaps them, a function that
        raises InvalidArgument if the object has shrunk since).

    Raises:
        InvalidArgument: a bad name, a missing object, a range past its end.
        PermissionDenied: not a regular object of the daemon's user (a symlink, another user's).

    Example:
        >>> try:
        ...     open_shm("../etc/passwd", 0, 1)
        ... except InvalidArgument as e:
        ...     print(str(e)[:53])
        shm_key: must be a shared-memory object name (letters
    """
    if not _KEY.match(key) or key.strip("/") in (".", ".."):
        raise InvalidArgument(f"{field}: must be a shared-memory object name (letters, digits, '.', '_', '-'; "
                              f"at most 250); got {key!r}")
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        # No symlinks, no FIFOs: only a shared-memory object, and only one of the daemon's own user.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidArgument(f"{field}: no shared-memory object {key!r} on the daemon's host (a daemon on "
                              "another host or in another IPC namespace cannot map it)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionDenied(f"{field}: {key!r} is a symbolic link, not a shared-memory object") from None
        raise InvalidArgument(f"{field}: cannot open shared-memory object {key!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise PermissionDenied(f"{field}: {key!r} is not a shared-memory object of the daemon's user "
                                   f"(uid {os.geteuid()}); run the daemon as the training processes' user")
        size = st.st_size
        if offset + byte_size > size:
            raise InvalidArgument(f"offset + byte_size: {offset} + {byte_size} = {offset + byte_size} bytes, but "
                                  f"shared-memory object {key!r} holds {size}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        # Populated now, in one pass: faulting the pages in one by one at the first call's reads and writes
        # costs 0.2-0.5 s per GiB more, a slowness the first call would show (docs/transports.md).
        mm = mmap.mmap(fd, offset + byte_size - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       offset=start)
    except BaseException:
        os.close(fd)
        raise
    flat = np.frombuffer(mm, np.uint8, byte_size, offset - start)

    def close() -> None:
        nonlocal flat
        flat = None
        with contextlib.suppress(BufferError):  # a stray view: the mapping goes with it
            mm.close()
        with contextlib.suppress(OSError):
            os.close(fd)

    def check() -> None:
        # A client that shrinks its object would make the next read fault (SIGBUS): look before each use.
        # (This narrows the window; it cannot close it. A client of the daemon's own user could kill it anyway.)
        if os.fstat(fd).st_size < offset + byte_size:
            raise InvalidArgument(f"{field}: shared-memory object {key!r} shrank below offset + byte_size "
                                  f"{offset + byte_size} after it was registered")

    return flat, close, check


def probe_shm(key: str, nonce: bytes, mapped: MappedBytes | None = None) -> str | None:
    """Why the client's probe object cannot be read here, or None when it holds ``nonce``; while it is
    mapped, its bytes count in ``mapped``.

    Example:
        >>> probe_shm("no-such-object-xyz", b"1234") is not None
        True
    """
    if not nonce:
        return "no probe was sent"
    mapped = MappedBytes(None) if mapped is None else mapped
    try:
        mapped.reserve(len(nonce), f"the probe {key!r}")
    except ServiceError as e:
        return str(e)
    try:
        flat, close, _ = open_shm(key, 0, len(nonce), "probe_shm_key")
    except ServiceError as e:
        mapped.release(len(nonce))
        return str(e)
    try:
        if flat.tobytes() != nonce:
            return f"probe_shm_key: {key!r} does not hold the probe's bytes (another host's object of that name?)"
        return None
    finally:
        del flat
        close()
        mapped.release(len(nonce))


def _host_view(flat: np.ndarray, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes of a mapping from ``offset`` as a numpy array of ``dtype`` and ``shape``.

    Example:
        >>> _host_view(np.arange(8, dtype=np.uint8), 4, np.dtype(np.uint16), (2,)).tolist()
        [1284, 1798]
    """
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset:offset + nbytes].view(dtype).reshape(shape)


class RegionTable:
    """Every open session and its regions.

    ``ipc_opener`` (a backend's :meth:`~xreduced.backends.Backend.open_ipc`) opens CUDA IPC
    handles; without it such registrations are refused. ``mapped`` is the budget of the shared
    memory mapped (none by default); CUDA IPC regions are GPU memory and do not count in it.

    Example:
        >>> table = RegionTable()
        >>> s = table.open_session()
        >>> table.list(s.id)
        []
        >>> table.close_session(s.id)
    """

    def __init__(self, ipc_opener: Callable[..., DeviceRegion] | None = None,
                 max_regions_per_session: int = MAX_REGIONS_PER_SESSION,
                 max_sessions: int | None = None, mapped: MappedBytes | None = None):
        self._lock = threading.Lock()
        self.mapped = MappedBytes(None) if mapped is None else mapped
        """The shared memory mapped now, within the daemon's budget."""
        self.max_sessions = max_sessions
        self._closing = False
        self._sessions: dict[str, Session] = {}
        self._ipc_opener = ipc_opener
        self.max_regions_per_session = max_regions_per_session
        self._end_listeners: list[Callable[[str], None]] = []

    @property
    def cuda_ipc(self) -> bool:
        """Whether CUDA IPC handles can be registered."""
        return self._ipc_opener is not None

    def counts(self) -> tuple[int, int]:
        """(open sessions, registered regions)."""
        with self._lock:
            return len(self._sessions), sum(len(s.regions) for s in self._sessions.values())

    def open_session(self) -> Session:
        """A new session with an unguessable id.

        Raises:
            SessionsExhausted: the daemon is stopping, or ``max_sessions`` are open (each
                holds one of the daemon's threads); the SDK then uses the wire.
        """
        session = Session(secrets.token_urlsafe(24))
        with self._lock:
            if self._closing:
                raise SessionsExhausted("the daemon is stopping; it opens no new session")
            if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
                raise SessionsExhausted(
                    f"{len(self._sessions)} sessions are open, the most this daemon serves (--workers / 2: each "
                    "holds a serving thread); use the wire transport, or raise --workers")
            self._sessions[session.id] = session
        return session

    def session(self, session_id: str) -> Session | None:
        """The open session ``session_id``, or None.

        Example:
            >>> table = RegionTable()
            >>> s = table.open_session()
            >>> table.session(s.id) is s, table.session("nope")
            (True, None)
        """
        with self._lock:
            return self._sessions.get(session_id)

    def close_session(self, session_id: str) -> None:
        """Releases every region of the session (those in use, once their calls end)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return
            regions = list(session.regions.values())
            session.regions.clear()
            session.closed.set()
        for region in regions:
            self._release(region)

    def on_session_end(self, listener: Callable[[str], None]) -> None:
        """Calls ``listener(session_id)`` whenever a session's stream ends while the daemon runs (its client
        closed it, disconnected, or died), after its regions are released.

        Example:
            >>> table = RegionTable()
            >>> table.on_session_end(lambda session_id: print("ended", session_id == s.id))
            >>> s = table.open_session()
            >>> table.session_ended(s.id)
            ended True
            >>> table.session_ended(s.id)  # once
        """
        with self._lock:
            self._end_listeners.append(listener)

    def session_ended(self, session_id: str) -> None:
        """A session's stream ended: its regions are released, unless the daemon is
        stopping (calls still in flight may use them; :meth:`close_all` releases them), and
        the :meth:`on_session_end` listeners learn it (once)."""
        with self._lock:
            if self._closing or session_id not in self._sessions:
                return
            listeners = list(self._end_listeners)
        self.close_session(session_id)
        for listener in listeners:
            try:
                listener(session_id)
            except Exception:  # a bug in one listener: the others still learn it
                log.exception("event=session_end_listener_error session=%s...", session_id[:8])

    def end_streams(self) -> None:
        """The daemon is stopping: no new session, and every session's stream ends now;
        the regions stay until :meth:`close_all`."""
        with self._lock:
            self._closing = True
            sessions = list(self._sessions.values())
        for session in sessions:
            session.closed.set()

    def close_all(self) -> None:
        """Closes every session, and opens no new one (the daemon is stopping): their streams end."""
        with self._lock:
            self._closing = True
            ids = list(self._sessions)
        for session_id in ids:
            self.close_session(session_id)

    def _session(self, session_id: str | None, field: str) -> Session:
        if not session_id:
            raise FailedPrecondition(f"{field}: regions belong to a session; send the {SESSION_METADATA!r} "
                                     "metadata that OpenSession returned; got none")
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise PermissionDenied(f"{field}: session {session_id[:8]}... is not open (it was closed, or the "
                                   "daemon restarted); open a new session and register the regions again")
        return session

    def register(self, session_id: str | None, name: str, kind: str, key: str, offset: int, byte_size: int,
                 cuda_ipc=None) -> Region:
        """Maps a region of the caller's and files it under ``name`` in the session.

        Raises:
            InvalidArgument: a bad name, size or offset, an object that cannot be opened.
            PermissionDenied: the session is not open.
            LimitExceeded: shared memory over the budget (``--max-mapped-bytes``); nothing was opened.
        """
        session = self._session(session_id, "name")
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidArgument(f"name: a region needs a name of 1 to {MAX_NAME_CHARS} characters; got {name!r}")
        if byte_size <= 0:
            raise InvalidArgument(f"byte_size: must be positive; got {byte_size}")
        if offset < 0:
            raise InvalidArgument(f"offset: must be >= 0; got {offset}")
        with self._lock:
            if name in session.regions:
                raise InvalidArgument(f"name: region {name!r} is already registered in this session; "
                                      "unregister it first")
            if len(session.regions) >= self.max_regions_per_session:
                raise InvalidArgument(f"name: this session already has {len(session.regions)} regions, the most "
                                      "a session may register")
        check = None
        if kind == "shm":
            flat, closer, check = self._map(name, key, offset, byte_size)
            view = functools.partial(_host_view, flat)
        elif kind == "cuda_ipc":
            if self._ipc_opener is None:
                raise InvalidArgument("cuda_ipc: this daemon cannot open CUDA IPC handles (its backend is not "
                                      "cupy); register shared memory instead")
            try:
                opened = self._ipc_opener(bytes(cuda_ipc.mem_handle), cuda_ipc.device_id, offset, byte_size,
                                          bytes(cuda_ipc.event_handle))
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
            view, closer = opened.view, opened.close
            key = f"cuda:{cuda_ipc.device_id}"
        else:
            raise InvalidArgument(f"source: set shm_key or cuda_ipc; got {kind or 'neither'}")
        region = Region(name, kind, key, offset, byte_size, view, closer, check)
        with self._lock:
            if session.closed.is_set() or name in session.regions:
                region.close()
                raise InvalidArgument(f"name: region {name!r} was registered meanwhile, or the session closed")
            session.regions[name] = region
        return region

    def _map(self, name: str, key: str, offset: int, byte_size: int) -> tuple[np.ndarray, Any, Any]:
        """:func:`open_shm` within the budget: counted before the object is opened, given back when the
        mapping fails or, through the closer it returns, when the region is unmapped."""
        what = f"region {name!r}" + ("" if key.lstrip("/") == name else f" (shared-memory object {key!r})")
        self.mapped.reserve(byte_size, what)
        try:
            flat, unmap, check = open_shm(key, offset, byte_size)
        except BaseException:
            self.mapped.release(byte_size)
            raise

        def closer() -> None:  # once: Region.close drops it after the first call
            unmap()
            self.mapped.release(byte_size)

        return flat, closer, check

    def probe(self, key: str, nonce: bytes) -> str | None:
        """:func:`probe_shm`, its mapping counted in the budget while it lasts.

        Example:
            >>> RegionTable(mapped=MappedBytes(8)).probe("xrt-probe", b"0123456789abcdef")[:60]
            "max-mapped-bytes: the probe 'xrt-probe' of 16 bytes (16 B) w"
        """
        return probe_shm(key, nonce, self.mapped)

    def unregister(self, session_id: str | None, name: str) -> int:
        """Releases one region (every region with an empty name); returns how many.

        Raises:
            NotFound: no region of that name in the session.
        """
        session = self._session(session_id, "name")
        with self._lock:
            if name:
                region = session.regions.pop(name, None)
                if region is None:
                    raise NotFound(f"name: no region {name!r} in this session; it has "
                                   f"{sorted(session.regions) or 'none'}")
                regions = [region]
            else:
                regions = list(session.regions.values())
                session.regions.clear()
        for region in regions:
            self._release(region)
        return len(regions)

    def list(self, session_id: str | None) -> list[Region]:
        """The session's regions, by name."""
        session = self._session(session_id, "session")
        with self._lock:
            return [session.regions[n] for n in sorted(session.regions)]

    def _release(self, region: Region) -> None:
        with self._lock:
            region.unregistered = True
            busy = region.in_use > 0
        if not busy:
            region.close()

    def for_call(self, session_id: str | None) -> CallRegions:
        """The regions a call of session ``session_id`` may name; :meth:`CallRegions.release` them when it ends.

        Example:
            >>> table = RegionTable()
            >>> regions = table.for_call(None)
            >>> regions.view("x", 0, 4, np.dtype(np.float32), (1,), "tensor.region")
            Traceback (most recent call last):
            ...
            xreduced.errors.FailedPrecondition: tensor.region: regions belong to a session; send the
            'x-xreduce-session' metadata that OpenSession returned; got none
            >>> regions.release()
        """
        return CallRegions(self, session_id)

    def pin_named(self, session_id: str | None, names: list[str]) -> list[Region] | None:
        """The session's regions of these names, pinned (unmapped only once :meth:`unpin` has released them), or
        None, with nothing pinned, when the session or one of them is gone: a kept repeat
        (:mod:`xreduced.repeated`) then takes the full path, which says what is wrong.

        Example:
            >>> table = RegionTable()
            >>> table.pin_named(table.open_session().id, ["x"]) is None
            True
        """
        with self._lock:
            session = self._sessions.get(session_id) if session_id is not None else None
            if session is None or session.closed.is_set():
                return None
            regions = [session.regions.get(name) for name in names]
            if None in regions:
                return None
            for region in regions:
                region.in_use += 1
        return regions

    def unpin(self, regions: list[Region]) -> None:
        """Releases regions :meth:`pin_named` pinned."""
        self._unpin(regions)

    def _pin(self, session_id: str | None, name: str, offset: int, byte_size: int, field: str) -> Region:
        session = self._session(session_id, field)
        with self._lock:
            region = session.regions.get(name)
            if region is None:
                if any(name in s.regions for s in self._sessions.values() if s is not session):
                    raise PermissionDenied(f"{field}.name: region {name!r} belongs to another session; a client can "
                                           "only name regions it registered")
                raise NotFound(f"{field}.name: no region {name!r} is registered in this session; it has "
                               f"{sorted(session.regions) or 'none'}")
            if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
                raise InvalidArgument(f"{field}: offset {offset} + byte_size {byte_size} is outside region {name!r} "
                                      f"of {region.byte_size} bytes")
            region.in_use += 1
        return region

    def _unpin(self, regions: list[Region]) -> None:
        closing = []
        with self._lock:
            for region in regions:
                region.in_use -= 1
                if region.in_use == 0 and region.unregistered:
                    closing.append(region)
        for region in closing:
            region.close()


class CallRegions:
    """The regions one call may name: its session's. Each one it names stays
    mapped until :meth:`release`, even if it is unregistered meanwhile."""

    def __init__(self, table: RegionTable, session_id: str | None):
        self.session_id = session_id
        self._table = table
        self._pinned: list[Region] = []
        self._checked: set[int] = set()  # the regions whose size this call has looked at

    def view(self, name: str, offset: int, byte_size: int, dtype: np.dtype, shape: tuple[int, ...],
             field: str) -> Any:
        """The bytes ``[offset, offset + byte_size)`` of the session's region ``name`` as an
        array of ``dtype`` and ``shape`` (numpy, or the backend's device array), pinned until
        :meth:`release`.

        Raises:
            FailedPrecondition: no session; PermissionDenied: another session's
            region or a closed session; NotFound: no such region;
            InvalidArgument: a range outside the region.
            ValueError: numpy cannot make an array of ``shape``.
        """
        region = self._table._pin(self.session_id, name, offset, byte_size, field)
        self._pinned.append(region)
        # Once per region and call: a batch names one region for many tensors.
        if region.check is not None and id(region) not in self._checked:
            region.check()
            self._checked.add(id(region))
        return region.view(offset, dtype, shape)

    def pinned(self) -> dict[str, Region]:
        """The regions this call has named so far, by name."""
        return {region.name: region for region in self._pinned}

    def release(self) -> None:
        """The call ended: the regions it named may be unmapped."""
        pinned, self._pinned = self._pinned, []
        self._table._unpin(pinned)


def session_of(context) -> str | None:
    """The ``x-xreduce-session`` metadata of a call, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA:
            return value
    return None
