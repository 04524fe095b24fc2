"""The local lane: small calls of processes on this host, over a unix socket beside gRPC.

A 4-byte all-reduce costs little to compute and much to carry: through gRPC's
Python server each call crosses several threads. The lane carries the same
request and response messages (framed by :mod:`xreduce.wire.lane`) over a unix
socket, one call at a time per connection (a caller may send its next calls
before a reply: they wait, up to :data:`QUEUED_MAX_BYTES`, and are served in
order), all connections served by one thread asleep in ``epoll``: no polling,
no CPU while idle.

Every call still goes through the daemon's :class:`~xreduced.pipeline.CallPipeline`
(token gate, size limit, admission, matching, reduction, metrics, the call
log): the daemon stays the one place that matches and reduces; the lane only
replaces gRPC's transport. A connection proves itself with the id of a live
session (a secret the daemon gave over the authenticated ``OpenSession``
stream), and its calls carry the metadata its hello gave (the bearer token).

The lane is at ``PATH.lane`` beside a daemon's unix socket (same permissions),
or at an abstract socket name for a daemon on TCP; ``OpenSession`` tells
callers on this host where (``OpenSessionResponse.local_lane``).

Why one thread: a small collective's work is all Python, and Python that
moves between cores costs more CPU than Python that stays (the interpreter's
state follows it). With a thread per connection, each woken where its caller
runs, the processes of one all-reduce had the daemon's Python on every core.
Now a call that joins a collective before the others arrive leaves a
:class:`~xreduced.deferred.Deferred` with the rendezvous and the thread serves
the next connection; the arrival that completes the collective reduces and
sends every waiting caller its reply. Calls that may block long (naming
GPU regions or more than :data:`INLINE_REGION_BYTES` of shared memory, across
nodes, broadcasts) run on worker threads (:meth:`LocalLane._serve`). A caller
whose connection ends while its call waits leaves the collective at once, as a
cancelled gRPC call does.

A small call of a request shape the daemon has validated before goes to the
express lane first (:mod:`xreduced.express`): the lane's thread holds it there
until its collective is complete and answers every caller at once; whatever
the express lane hands back is served here as if it had just come.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import grpc
from xreduce.wire import lane as frames
from xreduce.wire.contract import SESSION_METADATA, method_path

from xreduced import repeated
from xreduced.deferred import Deferred
from xreduced.errors import PermissionDenied
from xreduced.express import Express
from xreduced.pipeline import CallPipeline
from xreduced.prepared import shape_of
from xreduced.regions import RegionTable
from xreduced.repeated import Repeat, Repeats

log = logging.getLogger("xreduced.lane")

MAX_PATH_BYTES = 107
"""The longest path a unix socket address holds (``sun_path`` less its terminator)."""
HELLO_TIMEOUT_SECONDS = 5.0
"""How long a new connection has to send its hello."""
SEND_TIMEOUT_SECONDS = 10.0
"""How long a reply may wait for room in its socket (its caller reads it at once) before the connection is
given up."""
RECV_BYTES = 1 << 16
"""Bytes asked of one ``recv`` by the lane's thread."""
QUEUED_MAX_BYTES = 1 << 20
"""Bytes a connection may send while its call is in progress (its next calls, served in order once it ends: a
caller sends the requests of a call made in phases back to back); a connection that sends more is dropped."""
INLINE_MAX_BYTES = 1 << 20
"""The largest request the lane's thread serves itself; larger ones go to a worker."""
INLINE_REGION_BYTES = 4 << 20
"""The most bytes of host shared-memory regions (inputs and output) a call the lane's thread serves itself may
name: reducing them takes about a millisecond, a wait the lane's other callers barely see; larger ones go to a
worker."""
INLINE_REPEAT_BYTES = 16 << 20
"""The same for a kept repeat (:mod:`xreduced.repeated`): its reduction is bound to views of its regions, so it is
the arithmetic alone, on this thread and the executor's above 8 MiB of inputs: 16 MiB of regions (a 1 M-parameter
model's step on 2 devices) take about 0.6 ms on two cores, and a hand-over to a worker and back added 0.1-0.2 ms."""


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


class LaneConnection:
    """One connection's state that outlives its calls: whether its caller has hung up, and the call it is in.

    The lane's thread sees the caller hang up (the socket reads empty) and tells the call at once.

    Example:
        >>> connection = LaneConnection()
        >>> connection.hung_up(); connection.gone
        True
    """

    def __init__(self, sock: socket.socket | None = None):
        self.gone = False
        self.context: LaneContext | None = None
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        """Sends a reply frame (from whichever thread answers the call); False if the connection has
        gone."""
        with self._send_lock:
            if self._sock is None:
                return False
            try:
                self._sock.sendall(data)
            except OSError:  # gone, or not reading (a timeout): a partial frame, so end the connection
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                return False
            return True

    def close(self) -> None:
        """Closes the socket (never in the middle of another thread's :meth:`send`)."""
        with self._send_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

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
                 connection: LaneConnection, defers: bool = False):
        self._peer = peer
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._connection = connection
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.answered = False
        self.defers = defers
        """Whether the call may wait in a collective without its thread (:mod:`xreduced.deferred`): the
        lane's own thread serves it."""
        self.keeps_repeats = False
        """Whether the service may keep a :class:`~xreduced.repeated.Repeat` of this call (in :attr:`repeat`)
        for the lane to serve its repeats."""
        self.repeat = None
        """The :class:`~xreduced.repeated.Repeat` the service kept of this call, if any."""

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


class Wakeup:
    """A pipe that wakes the lane's thread from any thread: its ``epoll`` waits on :attr:`fd`.

    Example:
        >>> wakeup = Wakeup()
        >>> wakeup.wake(); wakeup.wake()
        >>> os.read(wakeup.fd, 16)
        b'xx'
        >>> wakeup.close()
    """

    def __init__(self):
        self.fd, self._write = os.pipe()
        """The end the lane's thread waits on."""
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        """Wakes the lane's thread (from any thread)."""
        with contextlib.suppress(OSError):  # full: the loop is awake already
            os.write(self._write, b"x")

    def clear(self) -> None:
        """The lane's thread, woken: the wake-ups are read."""
        with contextlib.suppress(OSError):
            os.read(self.fd, 4096)

    def close(self) -> None:
        """Closes both ends (the lane, once its thread has ended); again: nothing."""
        fds, self.fd, self._write = (self.fd, self._write), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class LocalLane:
    """The lane's socket and its connections, served through ``pipeline`` by one thread.

    One thread (``xreduced-lane``) waits in ``epoll`` on every connection and
    serves what arrives: a small call with its tensors in the message or in
    host shared-memory regions, in a group on this node, runs right there
    (:func:`_inline`); a call that waits in a collective leaves a
    :class:`~xreduced.deferred.Deferred` and the thread goes on; the arrival
    that completes the collective answers every waiting caller. Any other call
    (one naming GPU regions or large ones, whose reduction may be long; a group
    across nodes; a broadcast) runs on a worker thread,
    blocking there as a gRPC call would. A connection that ends is seen by the
    same thread: its call, if one waits, leaves its collective at once.

    Args:
        address: ``unix:PATH`` or ``unix-abstract:NAME`` (:func:`lane_address`).
        pipeline: the daemon's call pipeline.
        handlers: the service's own handlers of :data:`xreduce.wire.lane.METHODS`, by method name.
        regions: the session table (a connection's session must be open).
        max_connections: connections served at once; more are refused (their callers use gRPC).
        protect: called with a socket file's path once it is bound (its permissions).
        express: the express lane for small calls of known shapes, or None (``--lane-express-hold 0``).
        repeat: serves a kept repeat (:meth:`xreduced.service.CrossDeviceOpsService.repeat`), or None: every call
            takes the full path.
        wakeup: wakes the lane's thread from other threads; the express lane's (:class:`Wakeup`), or a new one.
            The lane closes it.

    Example:
        >>> from xreduced.admission import Admission
        >>> from xreduced.metrics import Stats
        >>> lane = LocalLane("unix-abstract:xreduce-lane-doc", CallPipeline(Stats(), Admission()), {},
        ...                  RegionTable(), 4).start()
        >>> lane.address
        'unix-abstract:xreduce-lane-doc'
        >>> lane.close()
    """

    def __init__(self, address: str, pipeline: CallPipeline, handlers: Mapping[str, grpc.RpcMethodHandler],  # noqa: PLR0913
                 regions: RegionTable, max_connections: int, protect: Callable[[str], None] | None = None,
                 express: Express | None = None, wakeup: Wakeup | None = None,
                 repeat: Callable[[Repeat, str, float | None], None] | None = None):
        self.address = address
        self._pipeline = pipeline
        self._handlers = handlers
        self._regions = regions
        self._max_connections = max_connections
        self._protect = protect
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, _Connection | None] = {}
        """Every connection open (None until its hello is through)."""
        self._listener: socket.socket | None = None
        self._closed = False
        self._calls = 0
        self._express_calls = 0
        self._selector = selectors.DefaultSelector()
        self._wakeup = wakeup or Wakeup()
        self._selector.register(self._wakeup.fd, selectors.EVENT_READ, None)
        self._greeted: list[_Connection] = []
        self._resumed: list[_Connection] = []  # connections whose call ended off the loop with more calls queued
        self._workers = concurrent.futures.ThreadPoolExecutor(max(max_connections, 1),
                                                              thread_name_prefix="xreduced-lane-call")
        self._loop_thread: threading.Thread | None = None
        self._waiting: dict[_Connection, Deferred] = {}
        """The calls served by the loop that wait in a collective (deferred)."""
        self.express = express
        """The express lane (:mod:`xreduced.express`), or None."""
        self._repeat_run = repeat
        self._repeat_calls = 0

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
        threading.Thread(target=self._accept, name="xreduced-lane-accept", daemon=True).start()
        self._loop_thread = threading.Thread(target=self._loop, name="xreduced-lane", daemon=True)
        self._loop_thread.start()
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
        self._wake()
        if self._loop_thread is not None:
            self._loop_thread.join(5)
        self._workers.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> tuple[int, int]:
        """(connections open now, calls served since the start)."""
        with self._lock:
            return len(self._connections), self._calls

    def repeat_calls(self) -> int:
        """Calls served as kept repeats (:mod:`xreduced.repeated`) since the start; they count in :meth:`counts`
        too."""
        with self._lock:
            return self._repeat_calls

    def express_counts(self) -> tuple[int, int]:
        """(calls the express lane answered since the start, which count in :meth:`counts` too; calls it holds
        now)."""
        with self._lock:
            answered = self._express_calls
        return answered, 0 if self.express is None else self.express.held()

    def _wake(self) -> None:
        self._wakeup.wake()

    # --- connections ---------------------------------------------------------------------------------------

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
                    self._connections[conn] = None
            if refused:
                with contextlib.suppress(OSError):
                    conn.sendall(frames.reply(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], True, (
                        f"local lane: {self._max_connections} connections are open, the most it serves; "
                        "this caller uses gRPC").encode()))
                conn.close()
                continue
            # The hello may take a while to come: a thread of its own, then the loop serves the connection.
            threading.Thread(target=self._greet, args=(conn,), name="xreduced-lane-hello", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        reader = frames.FrameReader(conn)
        try:
            handlers, metadata = self._hello(conn, reader, peer)
        except (OSError, frames.FrameError) as e:
            log.debug("event=lane_dropped peer=%s reason=%r", peer, str(e))
            handlers = metadata = None
        with self._lock:
            keep = handlers is not None and not self._closed
            if keep:
                conn.settimeout(SEND_TIMEOUT_SECONDS)  # the loop reads only what has arrived; replies wait this long
                connection = _Connection(conn, peer, metadata, handlers, reader.leftover)
                self._connections[conn] = connection
                self._greeted.append(connection)
            else:
                self._connections.pop(conn, None)
        if keep:
            log.debug("event=lane_open peer=%s", peer)
            self._wake()
        else:
            conn.close()

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
        metadata = tuple(m for m in metadata if m[0] != SESSION_METADATA) + ((SESSION_METADATA, session),)
        handlers = {}
        for name, handler in self._handlers.items():
            details = SimpleNamespace(method=method_path(name), invocation_metadata=metadata)
            handlers[name] = self._pipeline.intercept_service(lambda _, h=handler: h, details)
        conn.sendall(frames.reply(0, False, b""))
        return handlers, metadata

    def _drop(self, connection: _Connection, reason: str = "") -> None:
        """Ends a connection: its waiting call (if any) leaves its collective; then the socket closes."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(connection.sock)
        connection.gone = True
        if self.express is not None:  # a call held there goes to the full path, which sees its caller gone
            self._hand_over(self.express.hung_up(connection))
        connection.hung_up()
        with self._lock:
            self._connections.pop(connection.sock, None)
        connection.close()
        log.debug("event=lane_close peer=%s%s", connection.peer, f" reason={reason!r}" if reason else "")

    # --- the loop ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._turn()
            except OSError:  # the selector, closed under it
                if self._closed:
                    break
                log.exception("event=lane_internal_error")
                time.sleep(0.05)
            except Exception:  # a bug: the lane goes on serving
                log.exception("event=lane_internal_error")
                time.sleep(0.05)
        for connection in [c for c in list(self._connections.values()) if c is not None]:
            self._drop(connection, "the lane closed")
        with contextlib.suppress(OSError):
            self._selector.close()
        self._wakeup.close()

    def _turn(self) -> None:
        """One wait in ``epoll`` and what came: new connections, calls, hang-ups; then the waiting calls due
        (and the express lane's). The turn's calls are counted and logged at its end, once their replies are
        sent."""
        wake = min((d.wake_at() for d in self._waiting.values()), default=math.inf)
        if self.express is not None:
            wake = min(wake, self.express.wake_at())
        timeout = None if wake == math.inf else min(max(wake - time.monotonic(), 0.0), 3600.0)
        events = self._selector.select(timeout)
        with self._pipeline.records_held() as ended:
            try:
                self._handle(events)
            finally:
                self._pipeline.record(ended)

    def _handle(self, events) -> None:
        waiting = self._waiting
        for key, _ in events:
            if key.data is None:
                self._take_greeted()
                continue
            connection: _Connection = key.data
            try:
                data = connection.sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError, TimeoutError):
                continue
            except OSError as e:
                self._drop(connection, str(e))
                continue
            if not data:
                self._drop(connection)
                continue
            connection.arrived(data)
            self._serve_or_drop(connection)
        now = time.monotonic()
        if self.express is not None:
            self._hand_over(self.express.due(now))
        for connection, deferred in list(waiting.items()):
            if deferred.done:
                del waiting[connection]
            elif deferred.wake_at() <= now:
                try:
                    deferred.wake(now)
                except Exception:  # a bug: the lane goes on serving
                    log.exception("event=lane_internal_error peer=%s", connection.peer)

    def _take_greeted(self) -> None:
        self._wakeup.clear()
        if self.express is not None:
            self._hand_over(self.express.handed_over())
        with self._lock:
            greeted, self._greeted = self._greeted, []
            resumed, self._resumed = self._resumed, []
        for connection in resumed:
            if not connection.gone and connection.queued():
                self._serve_or_drop(connection)
        for connection in greeted:
            try:
                self._selector.register(connection.sock, selectors.EVENT_READ, connection)
            except (OSError, ValueError, KeyError) as e:  # closed meanwhile
                self._drop(connection, str(e))
                continue
            if connection.queued():
                self._serve_or_drop(connection)

    def _serve_or_drop(self, connection: _Connection) -> None:
        """:meth:`_serve`, noting a call left waiting; a connection that breaks the protocol (or meets a bug)
        is dropped, and the lane goes on serving the others."""
        try:
            self._serve(connection)
        except frames.FrameError as e:  # garbage: not a lane client
            self._drop(connection, str(e))
            return
        except Exception:  # a bug
            log.exception("event=lane_internal_error peer=%s", connection.peer)
            self._drop(connection, "internal error")
            return
        if connection.busy and (queued := connection.queued()) > QUEUED_MAX_BYTES:
            self._drop(connection, f"{queued} bytes of calls came while its call was in progress; "
                                   f"at most {QUEUED_MAX_BYTES} wait")
            return
        self._note_waiting(connection)

    def _resume(self, connection: _Connection) -> None:
        """After a call's reply (from any thread): calls that came meanwhile are served by the loop."""
        if not connection.gone and connection.queued():
            with self._lock:
                self._resumed.append(connection)
            self._wake()

    def _note_waiting(self, connection: _Connection) -> None:
        deferred = connection.waiting
        if deferred is not None:
            self._waiting[connection] = deferred

    def _serve(self, connection: _Connection) -> None:
        """Serves the calls whose frames have all arrived, in order, one at a time: those that come while a call is
        in progress wait for its end (:meth:`_resume`)."""
        while (body := connection.next_call()) is not None:
            try:
                method, timeout, request = frames.read_request(body)
            except frames.FrameError as e:
                connection.send(frames.reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], True, str(e).encode()))
                continue
            if method != "Broadcast" and (kept := connection.repeats.get(request)) is not None:
                if kept[0].region_bytes <= INLINE_REPEAT_BYTES:
                    if self._repeat(connection, method, timeout, request, *kept):
                        continue
                elif not self._closed:  # a long reduction: a worker's, as the full path's would be
                    connection.start_call()
                    self._workers.submit(self._repeat_or_call, connection, method, timeout, request, kept)
                    continue
            handler = connection.handlers.get(method)
            if handler is None:
                connection.send(frames.reply(grpc.StatusCode.UNIMPLEMENTED.value[0], True,
                                             f"local lane: {method} is not served here".encode()))
                continue
            incoming = handler.request_deserializer(request)
            connection.start_call()
            path = classify(method, incoming, self._host_region_bytes(connection))
            if path.repeat_key is not None:
                request = path.repeat_key  # a group's repeats differ in the sequence alone
                held = connection.group_repeats.get(request) if path.express and self.express is not None else None
                if held is not None and held[0].region_bytes <= INLINE_REGION_BYTES and self._express(
                        connection, method, incoming, timeout, request,
                        repeated.Held(held[0], held[1], connection.session_id)):
                    continue
            if not path.inline:
                if not self._closed:
                    self._workers.submit(self._call, connection, method, handler, incoming, timeout, defers=False,
                                         request=request)
                continue
            if path.express and path.shape is not None and self.express is not None and self._express(
                    connection, method, incoming, timeout, path.shape):
                continue
            self._call(connection, method, handler, incoming, timeout, defers=True, request=request)

    def _host_region_bytes(self, connection: _Connection) -> Callable[[list], int | None]:
        """What :func:`_inline` asks of a call's region slices: their bytes when every one names a host
        (``shm``) region of the connection's session, else None."""

        def host_bytes(slices: list) -> int | None:
            session = self._regions.session(connection.session_id)
            if session is None:
                return None
            total = 0
            for s in slices:
                region = session.regions.get(s.name)
                if region is None or region.kind != "shm":
                    return None
                total += s.byte_size
            return total

        return host_bytes

    def _repeat(self, connection: _Connection, method: str, timeout: float | None, request: bytes, repeat: Repeat,
                reply: bytes) -> bool:
        """Serves a call whose request the connection sent before, byte for byte (:mod:`xreduced.repeated`): the
        kept repeat runs and the kept reply goes back. False, with nothing sent, when the full path is to serve it
        (the daemon drains, the budget refuses, a region changed, anything raised: the repeat is then
        forgotten)."""
        call = self._pipeline.begin_repeat(method_path(method), len(request), repeat.held)
        if call is None:
            return False
        try:
            self._repeat_run(repeat, connection.session_id, timeout)
        except Exception as e:  # the full path answers, with its error if it is one
            connection.repeats.forget(request)
            self._pipeline.end_express(call, None)
            log.debug("event=repeat_forgotten peer=%s method=%s reason=%r", connection.peer, method, str(e))
            return False
        with self._lock:
            self._calls += 1
            self._repeat_calls += 1
        connection.end_call()  # before the reply goes: its caller's next call may follow at once
        connection.send(frames.reply(0, False, reply))
        self._pipeline.end_express(call, len(reply))
        return True

    def _repeat_or_call(self, connection: _Connection, method: str, timeout: float | None, request: bytes,
                        kept: tuple[Repeat, bytes]) -> None:
        """A worker's: a kept repeat of more than :data:`INLINE_REPEAT_BYTES`, or the full path when it cannot
        serve it."""
        if self._repeat(connection, method, timeout, request, *kept):
            self._resume(connection)
            return
        handler = connection.handlers[method]
        self._call(connection, method, handler, handler.request_deserializer(request), timeout, defers=False,
                   request=request)

    def _express(self, connection: _Connection, method: str, incoming, timeout: float | None, key: bytes,
                 held: repeated.Held | None = None) -> bool:
        """Offers the call to the express lane under ``key`` (its shape; ``held``: as a group's repeat): False
        when the full path is to serve it; else the replies it completed are sent and the calls it handed over
        served."""
        taken = self.express.offer(connection, method, incoming, timeout, time.monotonic(), key, held)
        if taken is None:
            return False
        replies, handed = taken
        for arrival, data in replies:
            with self._lock:
                self._calls += 1
                self._express_calls += 1
            arrival.connection.end_call()  # before the reply goes: its caller's next call may follow at once
            arrival.connection.send(frames.reply(0, False, data))
            self.express.answered(arrival, len(data))
            self._resume(arrival.connection)
        self._hand_over(handed)
        return True

    def _hand_over(self, arrivals) -> None:
        """Serves calls the express lane handed over through the full path, with what is left of their timeouts
        (a caller that has gone is seen gone: its collective fails as a cancelled call's does)."""
        now = time.monotonic()
        for arrival in arrivals:
            connection = arrival.connection
            self._call(connection, arrival.method, connection.handlers[arrival.method], arrival.incoming,
                       arrival.remaining(now), defers=True)
            self._note_waiting(connection)

    def _call(self, connection: _Connection, method: str, handler, incoming, timeout: float,
              defers: bool, request: bytes | None = None) -> None:
        """One call through the pipeline; its reply is sent now, or by whoever resolves its deferred. A call given
        its ``request`` bytes may leave a repeat to keep (:mod:`xreduced.repeated`)."""
        context = connection.context = LaneContext(connection.peer, connection.metadata, timeout, connection,
                                                   defers=defers)
        context.keeps_repeats = request is not None and self._repeat_run is not None
        try:
            data = handler.unary_unary(incoming, context)
        except Exception as e:
            self._answer(connection, context, method, None, e)
        else:
            repeats = connection.group_repeats if _collective(incoming) else connection.repeats
            if context.repeat is not None and isinstance(data, bytes):
                repeats.keep(request, context.repeat, data)
            if isinstance(data, Deferred):
                connection.waiting = data

                def done(value, error):
                    if error is None and context.repeat is not None and isinstance(value, bytes):
                        repeats.keep(request, context.repeat, value)
                    self._answer(connection, context, method, value, error)

                data.on_done(done)
            else:
                self._answer(connection, context, method, data, None)

    def _answer(self, connection: _Connection, context: LaneContext, method: str, data: bytes | None,
                error: BaseException | None) -> None:
        """Sends a call's reply (from the thread that has it); the caller may have gone."""
        frame = frames.reply(0, False, data) if error is None else _reply_frame(error, context, connection.peer,
                                                                                  method)
        connection.context = None
        connection.waiting = None
        context.end()
        with self._lock:
            self._calls += 1
        connection.end_call()  # before the reply goes: its caller's next call may follow at once
        connection.send(frame)
        self._resume(connection)


class _Connection(LaneConnection):
    """A greeted connection as the loop serves it: its socket, its caller, what has arrived, its call.

    Example:
        >>> a, b = socket.socketpair()
        >>> c = _Connection(a, "peer", (), {}, b"")
        >>> c.arrived(frames.request("Reduce", None, b"x")); c.start_call(); c.next_call() is None, c.queued()
        (True, 14)
        >>> c.end_call(); len(c.next_call())  # the frame's body: the method, the timeout, the request
        10
        >>> a.close(); b.close()
    """

    def __init__(self, sock: socket.socket, peer: str, metadata, handlers, leftover: bytes):
        super().__init__(sock)
        self.sock = sock
        self.peer = peer
        self.metadata = metadata
        self.session_id = dict(metadata).get(SESSION_METADATA)
        """The session the hello proved."""
        self.handlers = handlers
        self.buffer = frames.FrameBuffer(leftover)
        """What has arrived: whole frames and a partial one (the lane's thread adds, :meth:`arrived`)."""
        self.busy = False
        """A call of this connection is in progress (calls that come meanwhile wait in :attr:`buffer`): set by the
        lane's thread (:meth:`start_call`), cleared by whichever thread answers the call (:meth:`end_call`)."""
        self._state = threading.Lock()  # guards busy and buffer between those threads
        self.waiting: Deferred | None = None
        """The call that waits in a collective, deferred."""
        self.repeats = Repeats()
        """The requests this connection sent that the lane serves again as kept repeats."""
        self.group_repeats = Repeats()
        """The collectives this connection sent that the express lane serves again as kept repeats, under their
        bytes but for the sequence number (:func:`xreduced.repeated.collective_key`)."""

    def arrived(self, data: bytes) -> None:
        """Adds bytes that came (the lane's thread)."""
        with self._state:
            self.buffer.push(data)

    def next_call(self) -> bytes | None:
        """The next whole frame that came, or None: none has, or a call is in progress (it waits its turn)."""
        with self._state:
            return None if self.busy else self.buffer.pop()

    def queued(self) -> int:
        """Bytes that came and wait to be served."""
        with self._state:
            return len(self.buffer)

    def start_call(self) -> None:
        """A call that is not answered at once begins (the lane's thread)."""
        with self._state:
            self.busy = True

    def end_call(self) -> None:
        """The call in progress is answered (whichever thread has the reply, before it sends it: the caller's next
        call may follow at once; calls that came meanwhile are served after, :meth:`LocalLane._resume`)."""
        with self._state:
            self.busy = False


@dataclasses.dataclass(frozen=True)
class Path:
    """How the lane serves a call that is not a kept repeat (:func:`classify`).

    Example:
        >>> Path(inline=True).express
        False
    """

    inline: bool
    """The lane's thread serves it (:func:`_inline`); else a worker, as it may block long."""
    express: bool = False
    """A collective of several processes on this node, in sequence or named: the express lane may hold it."""
    shape: bytes | None = None
    """Its request's shape, tensors in the message (:func:`xreduced.prepared.shape_of`): the express lane takes
    it when the shape was validated before."""
    repeat_key: bytes | None = None
    """A group's call with an ``output`` region: the key its repeat is kept under
    (:func:`xreduced.repeated.collective_key`); the express lane holds it as that repeat when the connection
    keeps one."""


def classify(method: str, incoming, host_bytes: Callable[[list], int | None]) -> Path:
    """The one place that says how the lane serves a call that is not a kept repeat: on its own thread or a
    worker's, and whether the express lane may take it (a shape, or a group's repeat). ``host_bytes`` as for
    :func:`_inline`. The SDK's ``_transports._small`` mirrors the first part: which calls take the lane at all.

    Example:
        >>> from xreduce.v1 import xreduce_pb2 as pb
        >>> m = pb.BatchReduceRequest(collective=pb.CollectiveSpec(group="g", num_processes=2, sequence=1))
        >>> path = classify("BatchReduce", SimpleNamespace(size=m.ByteSize(), message=m), lambda slices: 0)
        >>> path.inline, path.express, path.shape is not None, path.repeat_key
        (True, True, True, None)
    """
    message = getattr(incoming, "message", None)
    spec = message.collective if method != "Broadcast" and message is not None and \
        message.HasField("collective") else None
    express = spec is not None and spec.num_processes >= 2 and spec.sequence >= 0
    inline = _inline(method, incoming, host_bytes)
    if spec is not None and message.HasField("output"):
        return Path(inline, express, repeat_key=repeated.collective_key(message))
    return Path(inline, express and inline, shape_of(message, incoming.size) if express and inline else None)


def _inline(method: str, incoming, host_bytes: Callable[[list], int | None]) -> bool:
    """Whether the lane's thread serves this call itself: a reduction in a group on this node (epoch 0), its
    message at most :data:`INLINE_MAX_BYTES`, the regions it names (inputs and output) host shared memory of
    at most :data:`INLINE_REGION_BYTES` in all (``host_bytes`` of the slices: their bytes, None when one is not
    such a region of the caller's session). Others may block long: a worker serves them."""
    message = getattr(incoming, "message", None)
    if method not in ("Reduce", "BatchReduce") or message is None or incoming.size > INLINE_MAX_BYTES:
        return False
    if message.HasField("collective") and message.collective.epoch:
        return False
    values = [message.value] if method == "Reduce" else [p.value for p in message.pairs]
    slices = [c.tensor.region for v in values for c in v.components if c.tensor.HasField("region")]
    if message.HasField("output"):
        slices.append(message.output)
    if not slices:
        return True
    nbytes = host_bytes(slices)
    return nbytes is not None and nbytes <= INLINE_REGION_BYTES


def _collective(incoming) -> bool:
    """Whether a call's request names a collective."""
    message = getattr(incoming, "message", None)
    return message is not None and message.HasField("collective")


def _reply_frame(error: BaseException, context: LaneContext, peer: str, method: str) -> bytes:
    """The reply frame of a call that ended with ``error``: its status, or INTERNAL for a lane bug."""
    if isinstance(error, LaneAbort):
        return frames.reply(error.code.value[0], context.answered, error.message.encode())
    # The pipeline answers every error; this is a bug in the lane itself.
    log.error("event=lane_internal_error peer=%s method=%s", peer, method, exc_info=error)
    return frames.reply(grpc.StatusCode.INTERNAL.value[0], True,
                        f"internal error in {method}; see the daemon's log".encode())


def _peer(conn: socket.socket) -> str:
    """``unix:lane pid=N``: the caller's process, from the socket's credentials."""
    try:
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"unix:lane pid={pid}"
    except (OSError, AttributeError):
        return "unix:lane"
