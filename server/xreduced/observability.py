"""What the daemon is doing: per-call log lines, counters, in-flight bytes.

One interceptor sees every call: it gives the call a request id, counts it
per method and status code with its bytes in and out, and writes one
structured log line when it ends.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import grpc

log = logging.getLogger("xreduced.calls")


class Stats:
    """Counters since the daemon started; thread-safe.

    Example:
        >>> s = Stats()
        >>> s.record("/x.Y/Z", "OK", 10, 20, 0.001)
        >>> s.snapshot()["/x.Y/Z"]["calls_by_code"]
        {'OK': 1}
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._methods: dict[str, dict] = collections.defaultdict(
            lambda: {"calls_by_code": collections.Counter(), "bytes_in": 0, "bytes_out": 0})
        self.inflight_bytes = 0

    def record(self, method: str, code: str, bytes_in: int, bytes_out: int, seconds: float) -> None:
        """Counts one finished call."""
        with self._lock:
            m = self._methods[method]
            m["calls_by_code"][code] += 1
            m["bytes_in"] += bytes_in
            m["bytes_out"] += bytes_out

    def snapshot(self) -> dict[str, dict]:
        """A copy of the counters, per method."""
        with self._lock:
            return {k: {"calls_by_code": dict(v["calls_by_code"]), "bytes_in": v["bytes_in"],
                        "bytes_out": v["bytes_out"]} for k, v in self._methods.items()}


_ids = itertools.count(1)


class CallInterceptor(grpc.ServerInterceptor):
    """Counts every unary call and logs one line when it ends:
    ``event=call id=7 method=/xreduce.v1.CrossDeviceOps/Reduce bytes_in=… bytes_out=… ms=… status=OK``.
    """

    def __init__(self, stats: Stats):
        self.stats = stats

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        method = handler_call_details.method
        inner = handler.unary_unary

        def observed(request, context):
            call_id = next(_ids)
            start = time.monotonic()
            bytes_in = request.ByteSize() if hasattr(request, "ByteSize") else 0
            code, bytes_out = "OK", 0
            try:
                reply = inner(request, context)
                bytes_out = reply.ByteSize() if hasattr(reply, "ByteSize") else 0
                return reply
            except Exception:
                code = _code_name(context)
                raise
            finally:
                seconds = time.monotonic() - start
                self.stats.record(method, code, bytes_in, bytes_out, seconds)
                log.info("event=call id=%d method=%s bytes_in=%d bytes_out=%d ms=%.3f status=%s",
                         call_id, method, bytes_in, bytes_out, seconds * 1e3, code)

        return grpc.unary_unary_rpc_method_handler(
            observed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _code_name(context) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if code is None else str(code)
