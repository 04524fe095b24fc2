"""What the daemon is doing: per-call log lines, counters, in-flight bytes, Prometheus metrics.

One interceptor sees every unary call: it gives the call a request id, refuses
it when it is over ``--max-request-bytes`` (before parsing it), counts it per
method and status code with its bytes in and out, and writes one structured
log line when it ends. The service reserves the call's working set in the
in-flight budget (:meth:`Stats.admit`; it knows which collective a refused
request belonged to); the interceptor releases it once the reply is
serialized, after dropping the parsed request, and trims malloc's heaps after
large calls.

The Prometheus metrics live in each daemon's own registry (several daemons
can run in one process); ``--metrics-listen`` serves them over HTTP:

* ``xreduce_calls_total{method,code}``: finished calls per method and status code
  (errors are the codes other than ``OK``);
* ``xreduce_bytes_in_total{method}``, ``xreduce_bytes_out_total{method}``:
  serialized request and reply bytes;
* ``xreduce_reduction_seconds{method}`` (histogram): how long the reduction of a
  successful Reduce, BatchReduce or Broadcast took, from decoded request to
  result (a multi-process collective counts once, when every process is in);
* ``xreduce_algbw_bytes_per_second{method}`` (histogram): algorithm bandwidth
  of those reductions, one replica's bytes divided by the reduction seconds
  (as nccl-tests' algbw);
* ``xreduce_inflight_bytes`` (gauge): the estimated working sets of the calls being served
  (:func:`xreduced.limits.working_set`);
* ``xreduce_collectives_waiting`` (gauge);
* ``xreduce_limit_rejections_total{limit}``: calls refused by each limit.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import grpc
import prometheus_client

from xreduced.errors import InvalidArgument
from xreduced.limits import InflightBytes, LimitExceeded, Limits, trim_malloc, working_set

log = logging.getLogger("xreduced.calls")

REDUCTION_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                             1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ALGBW_BUCKETS = (1e4, 1e5, 1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11, 2.5e11,
                 5e11, 1e12)
"""Bytes per second, 10 kB/s to 1 TB/s."""


class Stats:
    """Counters since the daemon started, its limits and its Prometheus registry; thread-safe.

    Example:
        >>> s = Stats()
        >>> s.record("/x.Y/Z", "OK", 10, 20, 0.001)
        >>> s.snapshot()["/x.Y/Z"]["calls_by_code"]
        {'OK': 1}
        >>> s.registry.get_sample_value("xreduce_calls_total", {"method": "/x.Y/Z", "code": "OK"})
        1.0
    """

    def __init__(self, limits: Limits | None = None):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._methods: dict[str, dict] = collections.defaultdict(
            lambda: {"calls_by_code": collections.Counter(), "bytes_in": 0, "bytes_out": 0})
        self.limits = Limits()
        self.inflight = InflightBytes()
        self.collectives_waiting: Callable[[], int] = lambda: 0
        """Collectives waiting for participants now; the service points it at its rendezvous."""
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        self._calls = prometheus_client.Counter(
            "xreduce_calls", "Finished calls per method and status code.", ["method", "code"], registry=r)
        self._bytes_in = prometheus_client.Counter(
            "xreduce_bytes_in", "Serialized request bytes per method.", ["method"], registry=r)
        self._bytes_out = prometheus_client.Counter(
            "xreduce_bytes_out", "Serialized reply bytes per method.", ["method"], registry=r)
        self._seconds = prometheus_client.Histogram(
            "xreduce_reduction_seconds", "Seconds a successful Reduce, BatchReduce or Broadcast took to reduce.",
            ["method"], buckets=REDUCTION_SECONDS_BUCKETS, registry=r)
        self._algbw = prometheus_client.Histogram(
            "xreduce_algbw_bytes_per_second", "Algorithm bandwidth of a reduction: one replica's bytes "
            "divided by its seconds.", ["method"], buckets=ALGBW_BUCKETS, registry=r)
        self._rejections = prometheus_client.Counter(
            "xreduce_limit_rejections", "Calls refused by a limit.", ["limit"], registry=r)
        prometheus_client.Gauge("xreduce_inflight_bytes", "Estimated working sets of the calls being served now.",
                                registry=r).set_function(lambda: self.inflight.value)
        prometheus_client.Gauge("xreduce_collectives_waiting", "Multi-process collectives waiting for "
                                "participants now.", registry=r).set_function(lambda: self.collectives_waiting())
        self.configure(limits or Limits())

    def configure(self, limits: Limits, collectives_waiting: Callable[[], int] | None = None) -> None:
        """Installs the daemon's limits (and where to count waiting collectives)."""
        self.limits = limits
        self.inflight.limit = limits.max_inflight_bytes
        if collectives_waiting is not None:
            self.collectives_waiting = collectives_waiting

    @property
    def inflight_bytes(self) -> int:
        """Estimated working sets of the calls being served now."""
        return self.inflight.value

    def admit(self, request, size: int) -> Callable[[], None]:
        """Reserves a call's working set (:func:`~xreduced.limits.working_set` of
        ``request``, ``size`` serialized bytes) in the in-flight budget.

        Returns:
            What the caller runs when its handler ends: inside a call the
            :class:`CallInterceptor` observes, nothing (the interceptor releases
            the bytes once the reply is serialized); otherwise the release.

        Raises:
            LimitExceeded: over ``--max-inflight-bytes``; nothing is reserved.

        Example:
            >>> from xreduce.v1 import xreduce_pb2 as pb
            >>> s = Stats()
            >>> release = s.admit(pb.ListDevicesRequest(), 100)
            >>> s.inflight_bytes
            200
            >>> release(); s.inflight_bytes
            0
        """
        n = working_set(request, size)
        self.inflight.reserve(n, size)
        call = _CALL.get()
        if call is None:
            return functools.partial(self.inflight.release, n)
        call.held += n
        return _nothing

    def record(self, method: str, code: str, bytes_in: int, bytes_out: int, seconds: float) -> None:
        """Counts one finished call."""
        with self._lock:
            m = self._methods[method]
            m["calls_by_code"][code] += 1
            m["bytes_in"] += bytes_in
            m["bytes_out"] += bytes_out
        self._calls.labels(method, code).inc()
        self._bytes_in.labels(method).inc(bytes_in)
        self._bytes_out.labels(method).inc(bytes_out)

    def observe_reduction(self, method: str, seconds: float, replica_bytes: int) -> None:
        """Counts one finished reduction of ``replica_bytes`` per replica."""
        self._seconds.labels(method).observe(seconds)
        if seconds > 0 and replica_bytes > 0:
            self._algbw.labels(method).observe(replica_bytes / seconds)

    def rejected(self, limit: str) -> None:
        """Counts one call refused by ``limit`` (e.g. ``max_inflight_bytes``)."""
        self._rejections.labels(limit).inc()

    def snapshot(self) -> dict[str, dict]:
        """A copy of the counters, per method."""
        with self._lock:
            return {k: {"calls_by_code": dict(v["calls_by_code"]), "bytes_in": v["bytes_in"],
                        "bytes_out": v["bytes_out"]} for k, v in self._methods.items()}


_ids = itertools.count(1)

TRIM_BYTES = 4 << 20
"""After a call whose request and reply add up to this many bytes, malloc's heaps are trimmed (the parts of
them below the mmap threshold that such a call freed: on a 16 x 100 call run of bench/load.py, peak RSS
-10 to -20%, no throughput change measurable)."""


@dataclasses.dataclass
class _Call:
    """What an observed call holds in the in-flight budget."""

    held: int = 0


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("xreduce_call", default=None)


def _nothing() -> None:
    return None

REQUEST_BYTES: contextvars.ContextVar[int | None] = contextvars.ContextVar("xreduce_request_bytes", default=None)
"""The serialized size of the request being served in this thread, as it arrived
(the service reserves it in the in-flight budget; protobuf's ByteSize would
serialize the whole message again to find it)."""


@dataclasses.dataclass
class _Incoming:
    """A request as the interceptor's deserializer leaves it: its size, and the
    message unless it was too large or did not parse."""

    size: int
    message: object = None
    error: str | None = None


class CallInterceptor(grpc.ServerInterceptor):
    """Limits and counts every unary call and logs one line when it ends:
    ``event=call id=7 method=/xreduce.v1.CrossDeviceOps/Reduce bytes_in=… bytes_out=… ms=… status=OK``.
    """

    def __init__(self, stats: Stats):
        self.stats = stats

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.request_streaming or handler.response_streaming:
            return _parsing_safely(handler, handler_call_details.method)
        method = handler_call_details.method
        inner = handler.unary_unary
        parse = handler.request_deserializer
        serialize = handler.response_serializer
        stats = self.stats

        def deserialize(data: bytes) -> _Incoming:
            size = len(data)
            limit = stats.limits.max_request_bytes
            if limit is not None and size > limit:
                return _Incoming(size)  # never parsed
            try:
                return _Incoming(size, parse(data) if parse is not None else data)
            except Exception as e:  # not a valid message of the method's request type
                return _Incoming(size, error=f"{method}: the request does not parse ({type(e).__name__}: {e})")

        def observed(incoming: _Incoming, context):
            call_id = next(_ids)
            start = time.monotonic()
            bytes_in, code, bytes_out = incoming.size, "OK", 0
            size_token = REQUEST_BYTES.set(bytes_in)
            call = _Call()
            call_token = _CALL.set(call)
            try:
                try:
                    stats.limits.check_request(bytes_in, method)
                except LimitExceeded as e:
                    stats.rejected(e.limit)
                    context.abort(e.code, str(e))
                if incoming.error is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, incoming.error)
                reply = inner(incoming.message, context)
                incoming.message = None  # the parsed request is not needed while the reply is serialized
                if context.code() not in (None, grpc.StatusCode.OK):  # set_code() and returned, without raising
                    code = _code_name(context)
                # Serialized here, once, to count its bytes: gRPC then sends these bytes as they are.
                data = reply if reply is None or serialize is None else serialize(reply)
                del reply
                bytes_out = len(data) if isinstance(data, bytes) else 0
                return data
            except Exception:
                code = _code_name(context)
                raise
            finally:
                incoming.message = None
                if call.held:
                    stats.inflight.release(call.held)
                _CALL.reset(call_token)
                REQUEST_BYTES.reset(size_token)
                seconds = time.monotonic() - start
                stats.record(method, code, bytes_in, bytes_out, seconds)
                log.info("event=call id=%d method=%s bytes_in=%d bytes_out=%d ms=%.3f status=%s",
                         call_id, method, bytes_in, bytes_out, seconds * 1e3, code)
                if bytes_in + bytes_out >= TRIM_BYTES:
                    trim_malloc()

        return grpc.unary_unary_rpc_method_handler(
            observed, request_deserializer=deserialize, response_serializer=_already_serialized)


class _Undecodable:
    """A streamed request message that does not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


def _parsing_safely(handler, method: str):
    """A streaming handler whose messages that do not parse get INVALID_ARGUMENT, naming the method,
    where gRPC's own deserializer would answer INTERNAL. (Streaming calls count and log themselves.)"""
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data) if parse is not None else data
        except Exception as e:  # not a valid message of the method's request type
            return _Undecodable(f"{method}: a request message does not parse ({type(e).__name__}: {e})")

    if handler.request_streaming:
        inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

        def checked(iterator):
            for message in iterator:
                if isinstance(message, _Undecodable):
                    raise InvalidArgument(message.error)
                yield message

        def behavior(request_iterator, context):
            return inner(checked(request_iterator), context)

        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
            else grpc.stream_unary_rpc_method_handler
    else:
        inner = handler.unary_stream

        def behavior(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            return inner(request, context)

        make = grpc.unary_stream_rpc_method_handler
    return make(behavior, request_deserializer=deserialize, response_serializer=handler.response_serializer)


def _already_serialized(data: bytes) -> bytes:
    """The reply serializer of an observed call: its handler returned the bytes already."""
    return data


def _code_name(context) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if code is None else str(code)


class MetricsServer:
    """Serves a registry's metrics in Prometheus' text format over HTTP at ``/metrics`` (any path works).

    Args:
        listen: ``host:port``; port 0 picks a free one (``address`` names it).

    Raises:
        RuntimeError: ``listen`` is malformed or cannot be bound.

    Example:
        >>> m = MetricsServer("127.0.0.1:0", Stats().registry)
        >>> m.address.startswith("127.0.0.1:")
        True
        >>> m.stop()
    """

    def __init__(self, listen: str, registry: prometheus_client.CollectorRegistry):
        host, _, port_text = listen.rpartition(":")
        host = host.strip("[]")
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise RuntimeError(f"--metrics-listen {listen!r}: must be host:port (port 0 picks a free port)")
        try:
            self._httpd, self._thread = prometheus_client.start_http_server(
                int(port_text), host or "0.0.0.0", registry=registry)
        except OSError as e:
            raise RuntimeError(f"--metrics-listen {listen!r}: cannot listen ({e.strerror or e})") from None
        port = self._httpd.server_address[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
