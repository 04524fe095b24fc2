"""The call pipeline's drain: what a stopping daemon does with calls in flight and new ones."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest
from xreduce.wire.contract import METHOD_PREFIX
from xreduced.admission import Admission
from xreduced.metrics import Stats
from xreduced.pipeline import CallPipeline


class Aborted(Exception):
    pass


class Context:
    """The parts of a gRPC servicer context the pipeline uses."""

    def __init__(self):
        self.status = None

    def peer(self):
        return "unix:"

    def code(self):
        return None

    def set_trailing_metadata(self, metadata):
        pass

    def abort(self, code, message):
        self.status = (code, message)
        raise Aborted(message)


def handler(pipeline: CallPipeline, method: str, behaviour):
    inner = grpc.unary_unary_rpc_method_handler(behaviour)
    details = SimpleNamespace(method=method, invocation_metadata=())
    return pipeline.intercept_service(lambda _: inner, details)


def call(h, context=None):
    return h.unary_unary(h.request_deserializer(b"x"), context or Context())


def test_drain_waits_for_the_call_in_flight_and_refuses_new_ones():
    pipeline = CallPipeline(Stats(), Admission())
    release, entered = threading.Event(), threading.Event()

    def slow(request, context):
        entered.set()
        assert release.wait(10)
        return b"done"

    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("reply", call(handler(pipeline, "/x.Y/Slow", slow))))
    thread.start()
    assert entered.wait(10)
    assert pipeline.drain(timeout=0.05) is None  # still in flight

    context = Context()
    with pytest.raises(Aborted):
        call(handler(pipeline, METHOD_PREFIX + "ListDevices", lambda r, c: b"devices"), context)
    code, message = context.status
    assert code is grpc.StatusCode.UNAVAILABLE and "stopping" in message
    # Calls outside the service (health checks) are still served while draining.
    assert call(handler(pipeline, "/grpc.health.v1.Health/Check", lambda r, c: b"ok")) == b"ok"

    release.set()
    thread.join(10)
    assert out["reply"] == b"done"
    assert pipeline.drain(timeout=10) == 2  # the slow call and the health check; not the refused one


def test_an_idle_pipeline_drains_at_once():
    assert CallPipeline(Stats(), Admission()).drain(timeout=0) == 0


def test_held_records_are_counted_and_logged_only_when_recorded(caplog):
    """The local lane's thread holds its calls' records (step 8) until their replies are sent."""
    stats = Stats()
    pipeline = CallPipeline(stats, Admission())
    echo = handler(pipeline, "/x.Y/Echo", lambda r, c: b"reply")
    with caplog.at_level("INFO", logger="xreduced.calls"):
        with pipeline.records_held() as ended:
            assert call(echo) == b"reply"
            assert [c.name for c in ended] == ["Echo"]
            assert "event=call" not in caplog.text
            other = {}  # another thread's calls are not held
            thread = threading.Thread(target=lambda: other.setdefault("reply", call(echo)))
            thread.start()
            thread.join(10)
            assert other["reply"] == b"reply" and caplog.text.count("event=call") == 1
        assert _calls(stats) == 1
        pipeline.record(ended)
        assert ended == [] and caplog.text.count("event=call") == 2 and _calls(stats) == 2
        # Outside the block, a call is recorded as it ends.
        call(echo)
        assert caplog.text.count("event=call") == 3 and caplog.text.count("method=/x.Y/Echo") == 3
    assert _calls(stats) == 3


def _calls(stats: Stats) -> float:
    return stats.registry.get_sample_value("xreduce_calls_total", {"method": "/x.Y/Echo", "code": "OK"}) or 0.0
