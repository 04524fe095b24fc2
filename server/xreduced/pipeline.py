"""The call pipeline: what every call goes through around its handler, unary or streaming alike.

One interceptor, in this order:

1. the call gets a request id and a :class:`Call`, the one per-call context
   (:func:`current_call` finds it while the handler runs);
2. the gate (the bearer token, :mod:`xreduced.security`) refuses callers
   without credentials;
3. a unary request over ``--max-request-bytes`` is refused before it is parsed,
   and a request (or streamed message) that does not parse is INVALID_ARGUMENT
   naming the method, where gRPC would answer INTERNAL;
4. a unary call of the service is admitted: its working set is reserved in the
   in-flight budget (:class:`~xreduced.admission.Admission`) until its reply is
   serialized; a refused request's collective fails for every process;
5. the regions the call names are those of its session, pinned until it ends;
6. the handler runs; it only validates, dispatches and encodes;
7. whatever it raised becomes a status: a service error with its code, a codec
   error as INVALID_ARGUMENT, running out of memory as RESOURCE_EXHAUSTED, a
   bug as INTERNAL (logged with its traceback); messages are cut to fit
   gRPC's metadata (:func:`short`);
8. the call is counted per method and status code with its bytes in and out
   (:class:`~xreduced.metrics.Stats`), logged in one line
   (``event=call id=7 method=/xreduce.v1.CrossDeviceOps/Reduce bytes_in=…
   bytes_out=… ms=… status=OK``), and malloc's heaps are trimmed after a
   large one.

When the daemon stops, the pipeline drains (:meth:`CallPipeline.drain`): new
calls of the service are refused with UNAVAILABLE while the calls in flight
finish.

Replies are serialized here, once, to count their bytes; gRPC sends those
bytes as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import grpc
from xreduce.wire import codec
from xreduce.wire.contract import ANSWERED_METADATA, METHOD_PREFIX

from xreduced.admission import Admission, LimitExceeded
from xreduced.deferred import Deferred
from xreduced.errors import InvalidArgument, ServiceError, Unauthenticated, Unavailable
from xreduced.memory import TRIM_BYTES, trim_malloc
from xreduced.metrics import Stats
from xreduced.prepared import SHAPED_METHODS, shape_of
from xreduced.regions import CallRegions, RegionTable, session_of

log = logging.getLogger("xreduced.calls")

MAX_MESSAGE_CHARS = 2000
"""Error messages are cut to this: a client drops metadata over 8 KiB, and with it the real error."""


def short(message: str) -> str:
    """The message in ASCII (non-ASCII escaped: gRPC sends it percent-encoded, up to 6 bytes a
    character), cut to MAX_MESSAGE_CHARS; the field name comes first, so it survives.

    Example:
        >>> print(short("device 'é'"))
        device '\\xe9'

        >>> len(short("é" * 10000)) <= MAX_MESSAGE_CHARS
        True
    """
    message = message.encode("ascii", "backslashreplace").decode("ascii")
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + "... (message cut)"


@dataclasses.dataclass
class Call:
    """One call as the pipeline serves it.

    Example:
        >>> Call(7, "/xreduce.v1.CrossDeviceOps/Reduce").name
        'Reduce'
    """

    id: int
    method: str
    regions: CallRegions | None = None
    """The regions the call may name (its session's); None outside the service."""
    bytes_in: int = 0
    bytes_out: int = 0
    held: int = 0
    """Bytes the call holds in the in-flight budget."""
    code: str = "OK"
    started: float = dataclasses.field(default_factory=time.monotonic)
    seconds: float = 0.0
    """How long the call took, once it has ended."""
    refused_draining: bool = False
    """The call came while the daemon was stopping: it is refused."""
    shape: bytes | None = None
    """The request's shape (:func:`xreduced.prepared.shape_of`), for a small ``Reduce`` or ``BatchReduce``."""
    collective: Any = None
    """The collective an express call takes part in, counted against ``--max-collectives`` while it is held."""

    @property
    def name(self) -> str:
        """The method's own name, e.g. ``Reduce``.

        Example:
            >>> Call(8, "/xreduce.v1.CrossDeviceOps/BatchReduce").name
            'BatchReduce'
        """
        return self.method.rsplit("/", 1)[-1]


_CURRENT: contextvars.ContextVar[Call | None] = contextvars.ContextVar("xreduce_call", default=None)


def current_call() -> Call | None:
    """The call whose handler runs in this thread, or None outside the pipeline.

    Example:
        >>> current_call() is None
        True
    """
    return _CURRENT.get()


class Gate(Protocol):
    """What the pipeline asks before anything else (see :class:`~xreduced.security.TokenCheck`).

    Example:
        >>> from xreduced.security import TokenCheck
        >>> gate: Gate = TokenCheck(b"s3cret")
        >>> CallPipeline(Stats(), Admission(), gate=gate).gate is gate
        True
    """

    def refusal(self, method: str, metadata) -> str | None:
        """Why a call of ``method`` with ``metadata`` is refused (UNAUTHENTICATED), or None.

        Example:
            >>> from xreduced.security import TokenCheck
            >>> TokenCheck(b"s3cret").refusal("/xreduce.v1.CrossDeviceOps/Reduce", [("authorization", "Bearer no")])
            '/xreduce.v1.CrossDeviceOps/Reduce needs a valid bearer token (authorization: Bearer <token>)'
        """


@dataclasses.dataclass
class _Incoming:
    """A request message as the pipeline's deserializer leaves it: its size, and the
    message unless it was too large or did not parse."""

    size: int
    message: Any = None
    error: str | None = None


_ids = itertools.count(1)


class CallPipeline(grpc.ServerInterceptor):
    """Serves every call of the daemon through the steps in the module docstring.

    Args:
        stats: where calls are counted.
        admission: the daemon's limits and in-flight budget.
        regions: the sessions' regions.
        refused: called with a request and the LimitExceeded that refused it at
            admission (the service fails the collective it belonged to).
        gate: refuses callers first; None lets every caller in.

    Example:
        >>> p = CallPipeline(Stats(), Admission())
        >>> p.intercept_service(lambda details: None, None) is None
        True
    """

    def __init__(self, stats: Stats, admission: Admission, regions: RegionTable | None = None,
                 refused: Callable[[Any, LimitExceeded], None] | None = None, gate: Gate | None = None):
        self.stats = stats
        self.admission = admission
        self.regions = regions
        self.refused = refused
        self.gate = gate
        self._calls = 0  # in flight, every service's
        self._ended_draining = 0
        self._draining = False
        self._idle = threading.Condition()
        self._held = threading.local()

    @contextlib.contextmanager
    def records_held(self) -> Iterator[list[Call]]:
        """Within the block, the calls this thread ends are counted and logged (step 8) only when the caller
        passes the list it got to :meth:`record`: the local lane's thread sends its replies first.

        Example:
            >>> p = CallPipeline(Stats(), Admission())
            >>> with p.records_held() as ended:
            ...     pass
            >>> p.record(ended)
        """
        held: list[Call] = []
        self._held.calls = held
        try:
            yield held
        finally:
            self._held.calls = None

    def record(self, calls: list[Call]) -> None:
        """Counts and logs ``calls`` (held by :meth:`records_held`), in the order they ended."""
        for call in calls:
            self._record(call)
        calls.clear()

    def drain(self, timeout: float) -> int | None:
        """Refuses new calls of the service from now on, and waits up to ``timeout`` seconds for
        the calls in flight to end.

        Returns:
            How many calls ended while draining, or None when some were still in flight at the
            timeout.

        Example:
            >>> p = CallPipeline(Stats(), Admission())
            >>> p.drain(timeout=1.0)
            0
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            self._draining = True
            while self._calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._idle.wait(left)
            return self._ended_draining

    def begin_express(self, method: str, request, size: int, shape: bytes, collective: Any) -> Call | None:
        """A call the express lane (:mod:`xreduced.express`) serves without the interceptor: counted in flight
        (the daemon drains it as any call) with its working set admitted (step 4) and its ``collective`` (the
        rendezvous's key) counted against ``--max-collectives``; None, with nothing held, while the daemon
        drains or when a limit refuses it (the full path then answers it). Its caller passed the gate at the
        lane's hello, and a request of a remembered shape is of a size admitted before. :meth:`end_express`
        ends it.

        Example:
            >>> from xreduce.v1 import xreduce_pb2 as pb
            >>> from xreduced.decode import CollectiveKey
            >>> pipeline = CallPipeline(Stats(), Admission())
            >>> call = pipeline.begin_express("/x.Y/Reduce", pb.ReduceRequest(), 64, b"shape", CollectiveKey("g", 1))
            >>> call.bytes_in, call.held > 0, pipeline.admission.collectives.open()
            (64, True, 1)
            >>> pipeline.end_express(call, 32)
            >>> pipeline.admission.inflight.value, pipeline.admission.collectives.open()
            (0, 0)
            >>> pipeline.stats.snapshot()["/x.Y/Reduce"]
            {'calls_by_code': {'OK': 1}, 'bytes_in': 64, 'bytes_out': 32}
        """
        if self._draining:
            return None
        try:
            self.admission.collectives.enter(collective, "")
        except LimitExceeded:
            return None
        try:
            held = self.admission.admit(request, size, shape)
        except LimitExceeded:
            self.admission.collectives.leave(collective)
            return None
        call = Call(next(_ids), method, bytes_in=size, held=held, shape=shape, collective=collective)
        with self._idle:
            self._calls += 1
        return call

    def begin_repeat(self, method: str, size: int, held: int) -> Call | None:
        """A call the lane serves as a kept repeat (:mod:`xreduced.repeated`) without the interceptor: counted in
        flight and its working set (``held``, what the full path admitted for the same request) reserved in the
        in-flight budget; None, with nothing held, while the daemon drains or when the budget refuses it (the full
        path then answers it). :meth:`end_express` ends it.

        Example:
            >>> pipeline = CallPipeline(Stats(), Admission())
            >>> call = pipeline.begin_repeat("/x.Y/Reduce", 64, 128)
            >>> pipeline.admission.inflight.value
            128
            >>> pipeline.end_express(call, 32); pipeline.admission.inflight.value
            0
        """
        if self._draining:
            return None
        try:
            self.admission.inflight.reserve(held, size)
        except LimitExceeded:
            return None
        call = Call(next(_ids), method, bytes_in=size, held=held)
        with self._idle:
            self._calls += 1
        return call

    def end_express(self, call: Call | None, bytes_out: int | None) -> None:
        """Ends a call of :meth:`begin_express` or :meth:`begin_repeat`: counted and logged (step 8) with
        ``bytes_out`` sent; with None, it is handed to the full path instead, which counts it itself (only its
        hold is released here)."""
        if call is None:
            return
        if call.collective is not None:
            self.admission.collectives.leave(call.collective)
        call.bytes_out = bytes_out or 0
        self._end(call, counted=bytes_out is not None)

    def intercept_service(self, continuation, handler_call_details):
        """The handler of a call, wrapped in the pipeline; None for a method nobody serves.

        Example:
            >>> from types import SimpleNamespace
            >>> p, echo = CallPipeline(Stats(), Admission()), grpc.unary_unary_rpc_method_handler(lambda r, c: r)
            >>> h = p.intercept_service(lambda _: echo, SimpleNamespace(method="/x.Y/Z", invocation_metadata=()))
            >>> h.unary_unary(h.request_deserializer(b"ping"), SimpleNamespace(peer=lambda: "unix:", code=lambda: None))
            b'ping'
            >>> p.stats.snapshot()
            {'/x.Y/Z': {'calls_by_code': {'OK': 1}, 'bytes_in': 4, 'bytes_out': 4}}
        """
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        deserialize = self._deserializer(handler, method)
        if handler.request_streaming:
            inner = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
        serialize = handler.response_serializer or _same
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        streams = handler.request_streaming, handler.response_streaming

        if handler.response_streaming:
            def behavior(request, context):
                return self._stream(method, metadata, streams, inner, serialize, request, context)
        else:
            def behavior(request, context):
                return self._unary(method, metadata, streams, inner, serialize, request, context)

        return make(behavior, request_deserializer=deserialize, response_serializer=_same)

    def _deserializer(self, handler, method: str) -> Callable[[bytes], _Incoming]:
        parse = handler.request_deserializer or _same
        streaming = handler.request_streaming
        limit = None if streaming else self.admission.limits.max_request_bytes
        what = "a request message" if streaming else "the request"

        def deserialize(data: bytes) -> _Incoming:
            size = len(data)
            if limit is not None and size > limit:
                return _Incoming(size)  # never parsed
            try:
                return _Incoming(size, parse(data))
            except Exception as e:  # not a valid message of the method's request type
                return _Incoming(size, error=f"{method}: {what} does not parse ({type(e).__name__}: {e})")

        return deserialize

    def _unary(self, method, metadata, streams, inner, serialize, request, context):
        """A call with one reply: the handler's reply, serialized. A handler that answers later (a
        :class:`~xreduced.deferred.Deferred`, for a local-lane call waiting in a collective) gets a deferred
        of the serialized reply, or of the error as :meth:`_answer` raises it; the call ends when it
        resolves."""
        call = self._begin(method, context)
        deferred = None
        try:
            with self._current(call):
                argument = self._admit(call, metadata, streams, request)
                reply = inner(argument, context)
            del argument
            if isinstance(reply, Deferred):
                deferred = reply.settle(lambda value, error: self._settle(call, context, request, serialize,
                                                                          value, error))
                return deferred
            return self._serialized(call, context, request, serialize, reply)
        except Exception as e:
            self._answer(call, context, e)
        finally:
            if deferred is None:
                if isinstance(request, _Incoming):
                    request.message = None
                self._end(call)

    def _serialized(self, call: Call, context, request, serialize, reply) -> bytes:
        if isinstance(request, _Incoming):
            request.message = None  # the parsed request is not needed while the reply is serialized
        if context.code() not in (None, grpc.StatusCode.OK):  # set_code() and returned, without raising
            call.code = _code_name(context)
        data = serialize(reply)
        del reply
        call.bytes_out = len(data) if isinstance(data, bytes) else 0
        return data

    def _settle(self, call: Call, context, request, serialize, reply, error: BaseException | None) -> bytes:
        """A deferred call's end, in the thread that resolved it: its reply serialized, or its error answered."""
        try:
            if error is not None:
                raise error
            return self._serialized(call, context, request, serialize, reply)
        except Exception as e:
            self._answer(call, context, e)
        finally:
            if isinstance(request, _Incoming):
                request.message = None
            self._end(call)

    def _stream(self, method, metadata, streams, inner, serialize, request, context) -> Iterator[bytes]:
        """A call with a stream of replies, each serialized as it leaves; the call is current only
        while the handler's code runs."""
        call = self._begin(method, context)
        replies = None
        try:
            with self._current(call):
                replies = iter(inner(self._admit(call, metadata, streams, request), context))
            while True:
                with self._current(call):
                    reply = next(replies, _DONE)
                if reply is _DONE:
                    break
                data = serialize(reply)
                call.bytes_out += len(data)
                yield data
        except GeneratorExit:  # the client went away while a reply was being sent
            call.code = "CANCELLED"
            raise
        except Exception as e:
            self._answer(call, context, e)
        finally:
            if isinstance(replies, Generator):  # its own clean-up runs now, not when it is collected
                replies.close()
            self._end(call)

    def _begin(self, method: str, context) -> Call:
        call = Call(next(_ids), method)
        with self._idle:
            self._calls += 1
            call.refused_draining = self._draining and method.startswith(METHOD_PREFIX)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("event=handling method=%s peer=%s", call.name, context.peer())
        if self.regions is not None and method.startswith(METHOD_PREFIX):
            call.regions = self.regions.for_call(session_of(context))
        return call

    def _admit(self, call: Call, metadata, streams: tuple[bool, bool], request):
        """Steps 2 to 4; returns what the handler gets: the parsed request, or the stream of them."""
        if call.refused_draining:
            raise Unavailable("the daemon is stopping: it takes no new calls (call another daemon, or this one "
                              "once it is back)")
        if self.gate is not None:
            refusal = self.gate.refusal(call.method, metadata)
            if refusal is not None:
                raise Unauthenticated(refusal)
        if streams[0]:
            return self._messages(call, request)
        call.bytes_in = request.size
        self.admission.check_request(request.size, call.method)
        if request.error is not None:
            raise InvalidArgument(request.error)
        if not streams[1] and call.method.startswith(METHOD_PREFIX):
            if call.method in SHAPED_METHODS:
                call.shape = shape_of(request.message, request.size)
            try:
                call.held = self.admission.admit(request.message, request.size, call.shape)
            except LimitExceeded as e:
                if self.refused is not None:
                    self.refused(request.message, e)
                raise
        return request.message

    def _messages(self, call: Call, requests) -> Iterator[Any]:
        """A request stream's messages, counted; one that does not parse ends it with INVALID_ARGUMENT."""
        for incoming in requests:
            call.bytes_in += incoming.size
            if incoming.error is not None:
                raise InvalidArgument(incoming.error)
            yield incoming.message

    def _current(self, call: Call) -> _Current:
        return _Current(call)

    def _answer(self, call: Call, context, error: Exception) -> None:
        """Ends the call with the status ``error`` stands for (step 7), by raising as ``context.abort``
        does; called while ``error`` is handled."""
        if isinstance(error, ServiceError):
            if isinstance(error, LimitExceeded):
                self.stats.rejected(error.limit)
            code, message = error.code, short(str(error))
        elif isinstance(error, codec.CodecError):
            code, message = grpc.StatusCode.INVALID_ARGUMENT, short(str(error))
        elif isinstance(error, MemoryError):
            log.exception("event=out_of_memory id=%d method=%s", call.id, call.name)
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "the daemon ran out of memory for this call"
        elif context.code() not in (None, grpc.StatusCode.OK):  # context.abort(): the status is set already
            call.code = _code_name(context)
            raise error
        else:  # a bug: keep serving, say so
            log.exception("event=internal_error id=%d method=%s", call.id, call.name)
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {call.name}; see the daemon's log"
        call.code = code.name
        context.set_trailing_metadata(((ANSWERED_METADATA, "1"),))
        context.abort(code, message)

    def _end(self, call: Call, counted: bool = True) -> None:
        """The call's holds released; it is counted and logged (step 8) unless not ``counted`` (an express call
        handed to the full path, which counts it as its own)."""
        if call.regions is not None:
            call.regions.release()
        if call.held:
            self.admission.release(call.held)
        call.seconds = time.monotonic() - call.started
        if counted:
            held = getattr(self._held, "calls", None)
            if held is not None:
                held.append(call)
            else:
                self._record(call)
        with self._idle:
            self._calls -= 1
            if self._draining:
                self._ended_draining += counted and not call.refused_draining
                self._idle.notify_all()

    def _record(self, call: Call) -> None:
        self.stats.record(call.method, call.code, call.bytes_in, call.bytes_out, call.seconds)
        log.info("event=call id=%d method=%s bytes_in=%d bytes_out=%d ms=%.3f status=%s",
                 call.id, call.method, call.bytes_in, call.bytes_out, call.seconds * 1e3, call.code)
        if call.bytes_in + call.bytes_out >= TRIM_BYTES:
            trim_malloc()


class _Current:
    """Makes ``call`` the current call (:func:`current_call`) within a ``with`` block; a class, not a generator,
    as every call enters it."""

    __slots__ = ("call", "token")

    def __init__(self, call: Call):
        self.call = call
        self.token = None

    def __enter__(self) -> None:
        self.token = _CURRENT.set(self.call)

    def __exit__(self, *_) -> None:
        _CURRENT.reset(self.token)


_DONE = object()


def _same(data):
    """The identity: a message that needs no (de)serializing."""
    return data


def _code_name(context) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if code is None else str(code)
