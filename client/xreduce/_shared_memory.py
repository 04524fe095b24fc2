"""Shared memory with a daemon on the same host: no tensor bytes on the wire.

The SDK opens a session with the daemon (``OpenSession``) and proves that the
two share memory: it writes a random nonce into a small POSIX shared-memory
object and the daemon reads it back. From then on a call names *regions*:

* arrays made by :func:`xreduce.shared_array` are already in shared memory and
  are sent without any copy;
* other arrays are copied into a staging segment that is reused call after call;
* results are written by the daemon into an output segment; the arrays the
  SDK returns are views of it, and the segment is reused only once they are
  all gone.

Segments are registered once per session and unregistered when they are
freed; when the session ends (the client closes, or its process dies) the
daemon releases them all.

A call that fails gives back all it took: its dtypes are checked before a
byte is staged, and the segments staged for it are unlinked instead of
reused, since the daemon may still be reading or writing them (a call that
timed out); they are unregistered in the background.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
import numpy as np

from xreduce._errors import XReduceError
from xreduce._fusion import Fused
from xreduce._lane import Lane
from xreduce._segments import Releases, Segment, SegmentPool, SharedArrays
from xreduce._session import Session
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.layout import OUTPUT_ALIGNMENT

COPY_RESULTS_UP_TO = 64 << 10
"""Results up to this size are copied out of the output segment; larger ones are views of it."""
UNREGISTER_TIMEOUT_SECONDS = 10.0
"""A bound on ``UnregisterRegion``, which runs in the background and must not hold it up for long."""


class SessionCalls(Protocol):
    """The calls of :class:`xreduce.Client` that shared memory makes."""

    def open_session(self, request: pb.OpenSessionRequest) -> Session:
        """Opens a session."""

    def register_region(self, request: pb.RegisterRegionRequest, *, session: str) -> object:
        """Registers a region under the session."""

    def unregister_region(self, request: pb.UnregisterRegionRequest, *, session: str) -> object:
        """Releases a region of the session."""

    @property
    def address(self) -> str:
        """The daemon's address."""

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (the bearer token)."""


class SharedMemory:
    """This process's shared memory with one daemon: the session, the regions registered under it,
    the staging and output segments.

    One per process and daemon (the SDK runtime keeps them), shared by every
    client of that daemon: each open session holds a daemon thread.

    Args:
        client: a client of the daemon, used for the session and region calls only.
        releases: where finalizers queue the return of output segments.
        arrays: the :func:`xreduce.shared_array` segments, sent as they are.

    Example:
        >>> import xreduce
        >>> from xreduce import _runtime
        >>> from xreduce._segments import available
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     runtime = _runtime.Runtime()
        ...     shm = SharedMemory(xreduce.Client(transport="wire"), runtime.releases, runtime.shared_arrays)
        ...     shm.usable() == available()
        ...     shm.close()
        True
    """

    def __init__(self, client: SessionCalls, releases: Releases, arrays: SharedArrays):
        self.client = client
        self._releases = releases
        self._arrays = arrays
        self._lock = threading.Lock()
        self._session: Session | None = None
        self.reason: str | None = None
        """Why the daemon cannot use this host's shared memory, once known."""
        self.last_error: str | None = None
        """Why the last attempt to open a session failed, when it failed for the time being."""
        self._registered: set[str] = set()
        self._registering = threading.Lock()  # one RegisterRegion per name, whatever the threads
        self._staging = SegmentPool(self._drop, "xrs")
        self._outputs = SegmentPool(self._drop, "xro")
        self._lane: Lane | None = None

    def lane(self) -> Lane | None:
        """The live session's local lane (:mod:`xreduce._lane`), or None: the daemon offers none, or a
        connection to it could not be had (this session then uses gRPC)."""
        session = self.session()
        with self._lock:
            lane = self._lane
            if lane is None or lane.session_id != session.id:
                if lane is not None:
                    lane.close()
                lane = self._lane = Lane(session.local_lane, session.id, self.client.call_metadata(),
                                         self.client.address, session.alive) if session.local_lane else None
        return lane if lane is not None and lane.usable() else None

    def session(self) -> Session:
        """The live session, opened (again) if needed."""
        with self._lock:
            if self._session is None or not self._session.alive.is_set():
                self._registered.clear()  # a new session: every segment is registered again on use
                self._session = self._open()
            return self._session

    def _open(self) -> Session:
        """A new session, with the probe that shows whether the daemon reads our memory."""
        probe = Segment(4096, prefix="xrp")
        nonce = secrets.token_bytes(32)
        probe.base[:32] = np.frombuffer(nonce, np.uint8)
        try:
            return self.client.open_session(pb.OpenSessionRequest(probe_shm_key=probe.name, probe_nonce=nonce))
        finally:
            probe.unlink()

    def session_id(self) -> str:
        """The id of the live session, which calls naming its regions carry."""
        return self.session().id

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

    def _register(self, name: str, size: int) -> None:
        with self._registering:
            if name in self._registered:
                return
            self.client.register_region(pb.RegisterRegionRequest(name=name, shm_key=name, offset=0, byte_size=size),
                                        session=self.session_id())
            self._registered.add(name)

    def _acquire(self, pool: SegmentPool, nbytes: int) -> Segment:
        seg = pool.acquire(nbytes)
        if seg.name not in self._registered:
            try:
                self._register(seg.name, seg.size)
            except BaseException:
                self._discard(seg)
                raise
        return seg

    def _drop(self, seg: Segment) -> None:
        with contextlib.suppress(Exception):
            self._unregister(seg.name)
        seg.unlink()

    def _discard(self, seg: Segment) -> None:
        """Unlinks a segment of a failed call now, and unregisters it in the background (no RPC on the
        way out of a call that failed: the daemon may be the reason)."""
        seg.unlink()
        self._releases.later_remote(self.forget, seg.name)

    def _unregister(self, name: str) -> None:
        with self._registering:
            if name not in self._registered:
                return
            self._registered.discard(name)
        with self._lock:
            session = self._session
        if session is None or not session.alive.is_set():
            return  # the session ended, and the daemon released its regions with it
        self.client.unregister_region(pb.UnregisterRegionRequest(name=name), UNREGISTER_TIMEOUT_SECONDS,
                                      session=session.id)

    def forget(self, name: str) -> None:
        """A shared_array segment was freed: release it in the daemon."""
        with contextlib.suppress(Exception):
            self._unregister(name)

    def stage(self, arrays: Sequence[np.ndarray | Fused]) -> tuple[list[pb.Tensor], Callable[..., None]]:
        """Region tensors for ``arrays``: shared arrays as they are, others copied into staging. A
        :class:`~xreduce._fusion.Fused` value is one flat tensor: where its parts lie back to back in one
        shared segment, else its parts copied back to back.

        Returns:
            (the tensors, ``free(failed=False)``: frees the staging space once the call returned;
            ``failed=True`` when it returned no answer, so that the space is never reused).

        Raises:
            xreduce.wire.codec.CodecError: a dtype the daemon does not reduce (nothing is staged).
            OSError: no room in ``/dev/shm`` for the staging segment.
        """
        dtypes = [codec.dtype_enum(a.dtype) for a in arrays]
        self._releases.drain()
        placed: list[tuple[str, int, int] | None] = []
        need = 0
        for a in arrays:
            where = self._located(a)
            if where is None:
                need += -need % OUTPUT_ALIGNMENT + a.nbytes
            placed.append(where)
        if None not in placed:
            return [_region_tensor(a, dtype, where) for a, dtype, where in zip(arrays, dtypes, placed)], _nothing
        seg = self._acquire(self._staging, max(need, 1))
        try:
            tensors, at = [], 0
            for a, dtype, where in zip(arrays, dtypes, placed):
                if where is None:
                    at += -at % OUTPUT_ALIGNMENT
                    piece = at
                    for part in a.parts if isinstance(a, Fused) else (a,):
                        seg.base[piece:piece + part.nbytes].view(part.dtype).reshape(part.shape)[...] = part
                        piece += part.nbytes
                    where = (seg.name, at, seg.size)
                    at += a.nbytes
                tensors.append(_region_tensor(a, dtype, where))
        except BaseException:
            self._discard(seg)
            raise

        def free(failed: bool = False) -> None:
            if failed:
                self._discard(seg)
            else:
                self._staging.release(seg)

        return tensors, free

    def _located(self, a: np.ndarray | Fused) -> tuple[str, int, int] | None:
        """Where ``a`` lies in a shared_array segment (registered with the daemon now if it was not), else None."""
        where = self._find(a)
        if where is not None and where[0] not in self._registered:
            self._arrays.add_user(where[0], self)
            self._register(where[0], where[2])
        return where

    def adopt(self, array: np.ndarray) -> None:
        """Registers the :func:`xreduce.shared_array` segment of ``array`` now, if this process's session with
        the daemon is open: the daemon maps it at once, not at the first call that sends it. Never raises (that
        call reports what went wrong)."""
        with self._lock:
            session = self._session
        if session is None or not session.alive.is_set():
            return
        with contextlib.suppress(Exception):
            self._located(array)

    def place(self, array: np.ndarray) -> tuple[pb.RegionSlice, Placed] | None:
        """An output slice that is ``array`` itself, when it lies in a :func:`xreduce.shared_array` segment at
        a multiple of :data:`~xreduce.wire.layout.OUTPUT_ALIGNMENT`: the daemon then writes the result there,
        and nothing is copied; else None.

        Example:
            >>> import xreduce
            >>> from xreduce import _runtime
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     runtime = _runtime.Runtime()
            ...     shm = SharedMemory(xreduce.Client(transport="wire"), runtime.releases, runtime.shared_arrays)
            ...     shm.place(np.zeros(4)) is None, shm.place(runtime.shared_arrays.allocate(4, "float32"))[0].offset
            ...     shm.close()
            (True, 0)
        """
        if not array.flags.c_contiguous or not array.flags.writeable:
            return None
        where = self._located(array)
        if where is None or where[1] % OUTPUT_ALIGNMENT:
            return None
        output = pb.RegionSlice(name=where[0], offset=where[1], byte_size=array.nbytes)
        return output, Placed(array, output)

    def _find(self, a: np.ndarray | Fused) -> tuple[str, int, int] | None:
        """Where ``a`` lies in a shared_array segment (a fused value: all its parts back to back), else None."""
        if not isinstance(a, Fused):
            return self._arrays.find(a)
        parts = [p for p in a.parts if p.nbytes]
        spans = [self._arrays.find(p) for p in parts]
        if not spans or None in spans:
            return None
        name, start, size = spans[0]
        at = start
        for (n, offset, _), part in zip(spans, parts):
            if n != name or offset != at:
                return None
            at += part.nbytes
        return name, start, size

    def output(self, nbytes: int) -> tuple[pb.RegionSlice, Output]:
        """An output slice of at least ``nbytes``; the segment is reused once
        the call's result arrays (and the returned function) are gone, and only
        if the daemon's answer placed results in it: without one, the daemon
        may still write there, and the segment is unlinked instead.

        Returns:
            (the slice to send, the :class:`Output` that turns a reply tensor
            into an array, a view of the segment, or abandons the segment when
            the call got no answer).

        Raises:
            OSError: no room in ``/dev/shm`` for the output segment.
        """
        self._releases.drain()
        seg = self._acquire(self._outputs, max(nbytes, 1))
        hold = np.frombuffer(seg.mm, np.uint8, seg.size)  # views of it keep the segment busy
        answered = [False]  # set once the daemon's answer is read: it is done with the segment
        finalizer = weakref.finalize(hold, self._releases.later, self._give_back_output, seg, answered)
        return pb.RegionSlice(name=seg.name, offset=0, byte_size=seg.size), Output(seg, hold, answered, finalizer,
                                                                                    self._discard)

    def segment(self, nbytes: int, output: bool) -> Segment:
        """A staging (or, with ``output``, an output) segment of at least ``nbytes``, registered in the session,
        for a caller that keeps it from call to call (:mod:`xreduce._prepared`); :meth:`give_back` returns it.

        Raises:
            OSError: no room in ``/dev/shm``.
        """
        self._releases.drain()
        return self._acquire(self._outputs if output else self._staging, nbytes)

    def later(self, fn: Callable, *args) -> None:
        """Runs ``fn(*args)`` at the next call, not now: what a finalizer hands over."""
        self._releases.later(fn, *args)

    def give_back(self, seg: Segment, output: bool, failed: bool) -> None:
        """Returns a segment of :meth:`segment` for reuse; ``failed`` (a call that got no answer, the daemon may
        still use it): unlinked instead."""
        if failed:
            self._discard(seg)
        else:
            (self._outputs if output else self._staging).release(seg)

    def _give_back_output(self, seg: Segment, answered: list[bool]) -> None:
        if answered[0]:
            self._outputs.release(seg)
        elif seg.pid == os.getpid():  # not a forked child's copy: the segment is its parent's
            self._discard(seg)

    def close(self) -> None:
        """Ends the session (the daemon releases every region) and unlinks this client's segments."""
        with self._lock:
            session, self._session = self._session, None
            lane, self._lane = self._lane, None
            self._registered.clear()
        if lane is not None:
            lane.close()
        self._staging.close()
        self._outputs.close()
        if session is not None:
            session.close()


class Output:
    """A call's output segment: reads the results the daemon placed there, or lets the segment go at once
    when the call got no answer (rather than when the garbage collector finds it: a failed call's frames
    often sit in reference cycles with its exception).

    Example:
        >>> import weakref
        >>> from xreduce._segments import Segment
        >>> seg, gone = Segment(64, prefix="xdoc"), []
        >>> hold = np.frombuffer(seg.mm, np.uint8, seg.size)
        >>> out = Output(seg, hold, [False], weakref.finalize(hold, print, "finalized"), gone.append)
        >>> out.abandon(); [s.name for s in gone] == [seg.name]
        True
        >>> seg.unlink()
    """

    def __init__(self, seg: Segment, hold: np.ndarray, answered: list[bool], finalizer: weakref.finalize,
                 discard: Callable[[Segment], None]):
        self._seg, self._hold, self._answered = seg, hold, answered
        self._finalizer, self._discard = finalizer, discard

    def __call__(self, tensor: pb.Tensor) -> np.ndarray:
        """The result ``tensor`` names: a view of the segment (small ones copied out), or decoded bytes."""
        self._answered[0] = True
        if not tensor.HasField("region"):
            return codec.decode(tensor)
        dtype, shape = codec.spec(tensor)
        r, seg = tensor.region, self._seg
        if r.name != seg.name or r.offset + r.byte_size > seg.size:
            raise ValueError(f"the daemon placed a result at {r.name}[{r.offset}:+{r.byte_size}], outside the "
                             f"output segment {seg.name} of {seg.size} bytes")
        view = self._hold[r.offset:r.offset + r.byte_size].view(dtype).reshape(shape)
        # A small result kept for long (a loss per step) must not pin a whole segment: copy it.
        return view.copy() if r.byte_size <= COPY_RESULTS_UP_TO else view

    def abandon(self) -> None:
        """The call got no answer: the daemon may still write here, so the segment is never reused."""
        if self._finalizer.detach() is not None and self._seg.pid == os.getpid():
            self._discard(self._seg)


class Placed:
    """A result the daemon writes into the caller's own array (:meth:`SharedMemory.place`): the reply names
    the array's slice, and the result is the array.

    Example:
        >>> a = np.zeros(2, np.float32)
        >>> slice_ = pb.RegionSlice(name="x", offset=0, byte_size=8)
        >>> t = pb.Tensor(dtype=codec.dtype_enum(a.dtype), shape=[2], region=slice_)
        >>> Placed(a, slice_)(t) is a
        True
    """

    def __init__(self, array: np.ndarray, output: pb.RegionSlice):
        self._array, self._output = array, output

    def __call__(self, tensor: pb.Tensor) -> np.ndarray:
        """The array, when ``tensor`` names its slice; else what the daemon sent, decoded."""
        if not tensor.HasField("region"):
            return codec.decode(tensor)
        r, o = tensor.region, self._output
        dtype, shape = codec.spec(tensor)
        if (r.name, r.offset, r.byte_size) != (o.name, o.offset, o.byte_size) or dtype != self._array.dtype:
            raise ValueError(f"the daemon placed a result at {r.name}[{r.offset}:+{r.byte_size}], not in the "
                             f"caller's array at {o.name}[{o.offset}:+{o.byte_size}]")
        return self._array if self._array.shape == tuple(shape) else self._array.reshape(shape)


def _region_tensor(array: np.ndarray | Fused, dtype: int, where: tuple[str, int, int]) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=array.shape, region=pb.RegionSlice(name=where[0], offset=where[1],
                                                                            byte_size=array.nbytes))


def _nothing(failed: bool = False) -> None:
    """What frees a call's staging space when it staged none."""
