"""The local lane: small calls of processes on this host, over a unix socket beside gRPC.

A 4-byte all-reduce costs little to compute and much to carry: through gRPC's
Python server each call crosses several threads. The lane carries the same
request and response messages (framed by :mod:`xreduce.wire.lane`) over a unix
socket, one call at a time per connection, each connection served by its own
thread that sleeps in ``recv`` between calls: no polling, no CPU while idle.

Every call still goes through the daemon's :class:`~xreduced.pipeline.CallPipeline`
(token gate, size limit, admission, matching, reduction, metrics, the call
log): the daemon stays the one place that matches and reduces; the lane only
replaces gRPC's transport. A connection proves itself with the id of a live
session (a secret the daemon gave over the authenticated ``OpenSession``
stream), and its calls carry the metadata its hello gave (the bearer token).

The lane is at ``PATH.lane`` beside a daemon's unix socket (same permissions),
or at an abstract socket name for a daemon on TCP; ``OpenSession`` tells
callers on this host where (``OpenSessionResponse.local_lane``).

A caller whose connection ends while its call waits for the other processes
of a collective leaves the collective at once, as a cancelled gRPC call does
(:class:`HangupWatch`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import grpc
from xreduce.wire import lane as frames
from xreduce.wire.contract import SESSION_METADATA, method_path

from xreduced.errors import PermissionDenied
from xreduced.pipeline import CallPipeline
from xreduced.regions import RegionTable

log = logging.getLogger("xreduced.lane")

MAX_PATH_BYTES = 107
"""The longest path a unix socket address holds (``sun_path`` less its terminator)."""
HELLO_TIMEOUT_SECONDS = 5.0
"""How long a new connection has to send its hello."""


def lane_address(listen: str) -> str:
    """Where the lane of a daemon listening on ``listen`` goes: beside its unix socket, else abstract.

    Example:
        >>> lane_address("unix:/run/xreduce.sock")
        'unix:/run/xreduce.sock.lane'
        >>> lane_address("127.0.0.1:50551").startswith("unix-abstract:xreduce-lane-")
        True
    """
    if listen.startswith("unix:"):
        path = listen[len("unix:"):].removeprefix("//") + ".lane"
        if len(os.fsencode(path)) <= MAX_PATH_BYTES:
            return "unix:" + path
    return f"{frames.ABSTRACT_PREFIX}xreduce-lane-{os.getpid()}-{secrets.token_hex(6)}"


class LaneAbort(Exception):
    """How a lane call ends with a status (:meth:`LaneContext.abort`, as gRPC's ``context.abort`` raises)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class HangupWatch:
    """Runs a callback when a connection's peer hangs up, from one thread asleep in ``epoll``.

    Each lane connection is watched from its hello until it closes: a call that
    waits in a collective learns at once that its caller left (what gRPC's
    ``add_callback`` is for), and no call pays to be watched.

    Example:
        >>> watch = HangupWatch()
        >>> a, b = socket.socketpair()
        >>> gone = threading.Event()
        >>> watch.watch(a.fileno(), gone.set)
        >>> b.close(); gone.wait(5)
        True
        >>> watch.close()
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._epoll: select.epoll | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once if ``fd``'s peer hangs up before :meth:`unwatch`."""
        with self._lock:
            if self._closed:
                return
            if self._epoll is None:
                self._epoll = select.epoll()
                self._wake_r, self._wake_w = os.pipe()
                self._epoll.register(self._wake_r, select.EPOLLIN)
                self._thread = threading.Thread(target=self._run, name="xreduced-lane-watch", daemon=True)
                self._thread.start()
            self._callbacks[fd] = callback
            self._epoll.register(fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)

    def unwatch(self, fd: int) -> None:
        """Stops watching ``fd`` (nothing if it is not watched, or its callback ran)."""
        with self._lock:
            if self._callbacks.pop(fd, None) is not None and self._epoll is not None:
                with contextlib.suppress(OSError):
                    self._epoll.unregister(fd)

    def _run(self) -> None:
        epoll = self._epoll  # close() clears the attribute; this thread keeps polling the object it closes
        while True:
            try:
                events = epoll.poll()
            except InterruptedError:
                continue
            except (OSError, ValueError):  # closed
                return
            fired = []
            with self._lock:
                if self._closed:
                    return
                for fd, _ in events:
                    if fd == self._wake_r:
                        continue
                    callback = self._callbacks.pop(fd, None)
                    with contextlib.suppress(OSError):
                        epoll.unregister(fd)
                    if callback is not None:
                        fired.append(callback)
            for callback in fired:
                try:
                    callback()
                except Exception:  # a bug in a callback must not stop the watch
                    log.exception("event=lane_hangup_callback_failed")

    def close(self) -> None:
        """Stops the thread; callbacks not yet run never run."""
        with self._lock:
            self._closed = True
            self._callbacks.clear()
            epoll, self._epoll = self._epoll, None
        if epoll is None:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class LaneConnection:
    """One connection's state that outlives its calls: whether its caller has hung up, and the call it is in.

    Watched by the :class:`HangupWatch` from its hello until it closes, so that a call pays nothing to be
    told its caller left.

    Example:
        >>> connection = LaneConnection()
        >>> connection.hung_up(); connection.gone
        True
    """

    def __init__(self):
        self.gone = False
        self.context: LaneContext | None = None

    def hung_up(self) -> None:
        """The caller's end closed: the call it is in (if any) learns it now."""
        self.gone = True
        context = self.context
        if context is not None:
            context.hung_up()


class LaneContext:
    """What a handler sees of a lane call: the part of gRPC's ``ServicerContext`` the daemon uses.

    Example:
        >>> context = LaneContext("unix:lane pid=7", (("x-xreduce-session", "s"),), 2.0, LaneConnection())
        >>> context.peer(), context.is_active(), 0 < context.time_remaining() <= 2.0
        ('unix:lane pid=7', True, True)
    """

    def __init__(self, peer: str, metadata: tuple[tuple[str, str], ...], timeout: float | None,
                 connection: LaneConnection):
        self._peer = peer
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._connection = connection
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.answered = False

    def peer(self) -> str:
        """``unix:lane pid=N``: a local caller (what the region checks look for)."""
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The hello's metadata: the session, the bearer token."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left of the caller's timeout, or None without one."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def is_active(self) -> bool:
        """False once the caller's connection has ended."""
        return not self._connection.gone

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs ``callback`` if the caller hangs up before the call ends, or when it ends (as gRPC does);
        False (and never runs it) when the caller has already gone."""
        with self._lock:
            if self._connection.gone:
                return False
            self._callbacks.append(callback)
        return True

    def hung_up(self) -> None:
        """The caller left: run the callbacks now."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def end(self) -> None:
        """The call has ended: run the callbacks left."""
        self.hung_up()

    def code(self) -> None:
        """No status is set but by :meth:`abort`."""
        return None

    def set_trailing_metadata(self, metadata) -> None:
        """The pipeline marks errors it answers itself; the reply frame carries that."""
        self.answered = True

    def abort(self, code: grpc.StatusCode, message: str):
        """Ends the call with ``code``: raises :class:`LaneAbort`."""
        raise LaneAbort(code, message)


class LocalLane:
    """The lane's socket, its connections (a thread each) and their calls, served through ``pipeline``.

    Args:
        address: ``unix:PATH`` or ``unix-abstract:NAME`` (:func:`lane_address`).
        pipeline: the daemon's call pipeline.
        handlers: the service's own handlers of :data:`xreduce.wire.lane.METHODS`, by method name.
        regions: the session table (a connection's session must be open).
        max_connections: connections served at once; more are refused (their callers use gRPC).
        protect: called with a socket file's path once it is bound (its permissions).

    Example:
        >>> from xreduced.admission import Admission
        >>> from xreduced.metrics import Stats
        >>> lane = LocalLane("unix-abstract:xreduce-lane-doc", CallPipeline(Stats(), Admission()), {},
        ...                  RegionTable(), 4).start()
        >>> lane.address
        'unix-abstract:xreduce-lane-doc'
        >>> lane.close()
    """

    def __init__(self, address: str, pipeline: CallPipeline, handlers: Mapping[str, grpc.RpcMethodHandler],
                 regions: RegionTable, max_connections: int, protect: Callable[[str], None] | None = None):
        self.address = address
        self._pipeline = pipeline
        self._handlers = handlers
        self._regions = regions
        self._max_connections = max_connections
        self._protect = protect
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False
        self._calls = 0
        self.watch = HangupWatch()

    def start(self) -> LocalLane:
        """Binds and starts accepting.

        Raises:
            RuntimeError: the address cannot be bound.
        """
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = frames.socket_address(self.address)
        try:
            if isinstance(target, str) and os.path.exists(target):
                os.unlink(target)  # a stale lane of a daemon that died at this path
            listener.bind(target)
            if isinstance(target, str) and self._protect is not None:
                self._protect(target)
            listener.listen(64)
        except OSError as e:
            listener.close()
            raise RuntimeError(f"local lane: cannot listen on {self.address!r}: {e.strerror or e}") from None
        self._listener = listener
        threading.Thread(target=self._accept, name="xreduced-lane", daemon=True).start()
        log.info("event=lane address=%s", self.address)
        return self

    def close(self) -> None:
        """Stops accepting and ends every connection (after the pipeline drained: no call is in flight)."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            connections = list(self._connections)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            target = frames.socket_address(self.address)
            if isinstance(target, str):
                with contextlib.suppress(OSError):
                    os.unlink(target)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.watch.close()

    def counts(self) -> tuple[int, int]:
        """(connections open now, calls served since the start)."""
        with self._lock:
            return len(self._connections), self._calls

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. EMFILE: give the descriptors a moment
                continue
            with self._lock:
                refused = self._closed or len(self._connections) >= self._max_connections
                if not refused:
                    self._connections.add(conn)
            if refused:
                with contextlib.suppress(OSError):
                    conn.sendall(frames.reply(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], True, (
                        f"local lane: {self._max_connections} connections are open, the most it serves; "
                        "this caller uses gRPC").encode()))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="xreduced-lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        watched = False
        try:
            reader = frames.FrameReader(conn)
            handlers, metadata = self._hello(conn, reader, peer)
            if handlers is None:
                return
            log.debug("event=lane_open peer=%s", peer)
            connection = LaneConnection()
            self.watch.watch(conn.fileno(), connection.hung_up)
            watched = True
            while True:
                body = reader.read()
                if body is None:
                    break
                reply = self._call(connection, peer, metadata, handlers, body)
                with self._lock:
                    self._calls += 1
                conn.sendall(reply)
        except (OSError, frames.FrameError) as e:  # the caller left mid-frame, or sent garbage: drop it
            log.debug("event=lane_dropped peer=%s reason=%r", peer, str(e))
        finally:
            if watched:
                self.watch.unwatch(conn.fileno())  # before the descriptor can be reused
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            log.debug("event=lane_close peer=%s", peer)

    def _hello(self, conn: socket.socket, reader: frames.FrameReader, peer: str):
        """The connection's wrapped handlers and metadata, or (None, None) after refusing it."""
        conn.settimeout(HELLO_TIMEOUT_SECONDS)
        try:
            body = reader.read()
            if body is None:
                return None, None
            session, metadata = frames.read_hello(body)
            if self._regions.session(session) is None:
                raise PermissionDenied(f"session: {session[:8]}... is not open (it was closed, or the daemon "
                                       "restarted); open a new session")
        except (frames.FrameError, PermissionDenied) as e:
            code = e.code if isinstance(e, PermissionDenied) else grpc.StatusCode.INVALID_ARGUMENT
            log.info("event=lane_refused peer=%s reason=%r", peer, str(e))
            conn.sendall(frames.reply(code.value[0], True, str(e).encode()))
            return None, None
        conn.settimeout(None)  # between calls a connection sleeps in recv: no wake-ups while idle
        metadata = tuple(m for m in metadata if m[0] != SESSION_METADATA) + ((SESSION_METADATA, session),)
        handlers = {}
        for name, handler in self._handlers.items():
            details = SimpleNamespace(method=method_path(name), invocation_metadata=metadata)
            handlers[name] = self._pipeline.intercept_service(lambda _, h=handler: h, details)
        conn.sendall(frames.reply(0, False, b""))
        return handlers, metadata

    def _call(self, connection: LaneConnection, peer: str, metadata, handlers, body: bytes) -> bytes:
        """One call through the pipeline; its reply frame."""
        try:
            method, timeout, request = frames.read_request(body)
        except frames.FrameError as e:
            return frames.reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], True, str(e).encode())
        handler = handlers.get(method)
        if handler is None:
            return frames.reply(grpc.StatusCode.UNIMPLEMENTED.value[0], True,
                                f"local lane: {method} is not served here".encode())
        context = connection.context = LaneContext(peer, metadata, timeout, connection)
        try:
            data = handler.unary_unary(handler.request_deserializer(request), context)
            return frames.reply(0, False, data)
        except LaneAbort as e:
            return frames.reply(e.code.value[0], context.answered, e.message.encode())
        except Exception:  # the pipeline answers every error; this is a bug in the lane itself
            log.exception("event=lane_internal_error peer=%s method=%s", peer, method)
            return frames.reply(grpc.StatusCode.INTERNAL.value[0], True,
                                f"internal error in {method}; see the daemon's log".encode())
        finally:
            connection.context = None
            context.end()


def _peer(conn: socket.socket) -> str:
    """``unix:lane pid=N``: the caller's process, from the socket's credentials."""
    try:
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"unix:lane pid={pid}"
    except (OSError, AttributeError):
        return "unix:lane"
