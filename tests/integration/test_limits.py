"""The daemon's limits against a real daemon: each one refuses with
RESOURCE_EXHAUSTED and the figures in the message, never blocks, and the
daemon goes on serving; GetStatus shows the limits and what they count.

The in-flight budget counts each call's estimated working set
(``xreduced.admission.working_set``: twice the request plus four times the result
bytes of the reply). The concurrent case is made deterministic with a
multi-process collective: its first participant waits in the daemon holding
its working set (and a collective slot) until the test cancels it.
"""

from __future__ import annotations

import platform
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
from daemons import wait_log
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduced.admission import working_set
from xreduced.memory import MALLOC_ARENAS, MALLOC_MMAP_THRESHOLD

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
REDUCE = "/xreduce.v1.CrossDeviceOps/Reduce"
MAX_REQUEST = 65536
MAX_INFLIGHT = 100_000
MAX_COLLECTIVES = 1


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(
        "--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2",
        "--max-request-bytes", str(MAX_REQUEST), "--max-inflight-bytes", str(MAX_INFLIGHT),
        "--metrics-listen", "127.0.0.1:0",
        env={"XREDUCE_MAX_COLLECTIVES": str(MAX_COLLECTIVES)},  # the environment twin works too
    )


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield pb_grpc.CrossDeviceOpsStub(channel)


def reduce_request(n: int, device: str = "CPU:0", **kw) -> pb.ReduceRequest:
    """A float32[n] value on ``device`` (and on CPU:1 unless it is a collective's share)."""
    devices = [device] if "collective" in kw else ["CPU:0", "CPU:1"]
    value = pb.DistributedValue(components=[
        pb.Component(device=d, tensor=codec.encode(np.full(n, i + 1, np.float32))) for i, d in enumerate(devices)])
    return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value, **kw)


def share(name: str, process_id: int, n: int = 4, timeout: float = 30) -> pb.ReduceRequest:
    """Process ``process_id``'s share (on CPU:``process_id``) of collective ``name`` of 2 processes."""
    spec = pb.CollectiveSpec(group="limits", num_processes=2, process_id=process_id, name=name)
    return reduce_request(n, f"CPU:{process_id}", collective=spec, timeout=Duration(seconds=timeout))


def charge(request) -> int:
    """What the daemon holds in the in-flight budget for ``request``."""
    return working_set(request, request.ByteSize())


def refusal(request, held: int = 0) -> str:
    """The in-flight limit's message for ``request`` with ``held`` bytes in flight."""
    size, n = request.ByteSize(), charge(request)
    return (f"request of {size} bytes (working set {n} bytes) would bring in-flight bytes to {held + n}, over "
            f"--max-inflight-bytes {MAX_INFLIGHT} ({held} in flight now)")


def test_the_working_set_counts_request_and_reply():
    request = reduce_request(1000)  # two float32[1000]: 8 kB of request, 8 kB of results in the reply
    assert charge(request) == 2 * request.ByteSize() + 4 * 8000
    wider = reduce_request(1000, destinations=["CPU:0", "CPU:1", "CPU:2"])  # three copies of the result
    assert charge(wider) == 2 * wider.ByteSize() + 4 * 12000
    mean = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, value=pb.DistributedValue(components=[
        pb.Component(device="CPU:0", tensor=codec.encode(np.ones(1000, np.int16)))]))
    assert charge(mean) == 2 * mean.ByteSize() + 4 * 4000  # MEAN of int16 is float32
    to_region = reduce_request(1000, output=pb.RegionSlice(name="out", byte_size=8000))
    assert charge(to_region) == 2 * to_region.ByteSize()


def rejected(call, request) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=10)
    assert e.value.code() == EXHAUSTED, e.value.details()
    return e.value.details()


def assert_serves(stub) -> None:
    reply = stub.Reduce(reduce_request(2), timeout=10)
    for comp in reply.result.components:
        np.testing.assert_array_equal(codec.decode(comp.tensor), [3, 3])


def status(stub) -> pb.GetStatusResponse:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=10)


def wait_status(stub, check, what: str) -> pb.GetStatusResponse:
    deadline = time.monotonic() + 10
    while True:
        s = status(stub)
        if check(s):
            return s
        assert time.monotonic() < deadline, f"the daemon never showed {what}; last status:\n{s}"
        time.sleep(0.02)


def rejections(daemon) -> dict[str, float]:
    address = re.search(r"event=metrics address=(\S+)", daemon.log()).group(1)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["limit"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "xreduce_limit_rejections" for s in f.samples if s.name.endswith("_total")}


def test_status_shows_the_limits(stub):
    limits = status(stub).limits
    assert (limits.max_request_bytes, limits.max_inflight_bytes, limits.max_collectives) == (
        MAX_REQUEST, MAX_INFLIGHT, MAX_COLLECTIVES)


def test_a_request_over_max_request_bytes_is_refused_with_its_size(stub, daemon):
    request = reduce_request(10000)  # two float32[10000]: about 80 kB
    size = request.ByteSize()
    assert size > MAX_REQUEST
    before = status(stub)
    details = rejected(stub.Reduce, request)
    assert details == f"{REDUCE}: request of {size} bytes is over --max-request-bytes {MAX_REQUEST}"
    assert_serves(stub)
    after = status(stub)
    codes = {m.method: dict(m.calls_by_code) for m in after.methods}[REDUCE]
    old = {m.method: dict(m.calls_by_code) for m in before.methods}.get(REDUCE, {})
    assert codes.get("RESOURCE_EXHAUSTED", 0) == old.get("RESOURCE_EXHAUSTED", 0) + 1
    assert after.inflight_bytes == 0
    wait_log(daemon, rf"event=call id=\d+ method={REDUCE} bytes_in={size} bytes_out=0 ms=[\d.]+ "
             r"status=RESOURCE_EXHAUSTED")
    assert rejections(daemon).get("max_request_bytes", 0) >= 1


def test_a_request_over_max_inflight_bytes_alone_is_refused_with_the_figures(stub, daemon):
    request = reduce_request(2500)  # about 20 kB: under --max-request-bytes; its working set is over the budget
    assert request.ByteSize() <= MAX_REQUEST and charge(request) > MAX_INFLIGHT
    details = rejected(stub.Reduce, request)
    assert details == refusal(request)
    assert_serves(stub)
    assert status(stub).inflight_bytes == 0
    assert rejections(daemon).get("max_inflight_bytes", 0) >= 1


def test_while_a_collective_waits_inflight_bytes_and_collectives_are_limited(stub, daemon):
    hold = share("hold", 0, n=2000)  # about 8 kB (48 kB of working set), waits for process 1 until cancelled
    held = charge(hold)
    waiting = stub.Reduce.future(hold, timeout=30)
    try:
        s = wait_status(stub, lambda s: s.collectives_waiting == 1, "the collective waiting")
        assert s.inflight_bytes == held

        # In-flight bytes: a second request that fits alone is refused while the first is held.
        request = reduce_request(1200)  # about 10 kB (58 kB): fits alone, not on top of the waiting share
        assert charge(request) <= MAX_INFLIGHT < held + charge(request)
        details = rejected(stub.Reduce, request)
        assert details == refusal(request, held)

        # Collectives: a second collective is refused; the daemon holds one already.
        details = rejected(stub.Reduce, share("second", 0))
        assert details == (f'collective "second" in group "limits" would be the 2nd collective waiting at once, '
                           f"over --max-collectives {MAX_COLLECTIVES}")
        assert rejections(daemon).get("max_collectives", 0) >= 1

        # A collective's share over the in-flight budget is refused the same way.
        big = share("big", 0, n=2400)  # about 9.6 kB (58 kB): fits alone, not on top of the waiting share
        assert charge(big) <= MAX_INFLIGHT < held + charge(big)
        details = rejected(stub.Reduce, big)
        assert details == refusal(big, held)

        # Small calls still pass, and the limits never block: each refusal came at once.
        assert_serves(stub)
        assert status(stub).inflight_bytes == held
    finally:
        waiting.cancel()
    wait_status(stub, lambda s: s.inflight_bytes == 0 and s.collectives_waiting == 0, "the cancelled share gone")

    # A refused collective failed for every process: its other member is told at once, not after its timeout.
    for name, flag in (("second", f"--max-collectives {MAX_COLLECTIVES}"),
                       ("big", f"--max-inflight-bytes {MAX_INFLIGHT}")):
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Reduce(share(name, 1), timeout=10)
        assert e.value.code() == grpc.StatusCode.ABORTED
        assert f'collective "{name}" in group "limits" was aborted: process 0\'s request was rejected: ' in (
            e.value.details())
        assert flag in e.value.details()
        assert time.monotonic() - start < 5
    assert waiting.cancelled()


def test_joining_an_open_collective_is_never_refused(stub):
    """At --max-collectives 1 a collective still completes: its second process joins the open one."""
    first = stub.Reduce.future(share("pair", 0), timeout=30)
    wait_status(stub, lambda s: s.collectives_waiting == 1, "the collective waiting")
    second = stub.Reduce(share("pair", 1), timeout=30)
    for reply in (first.result(), second):
        for comp in reply.result.components:
            np.testing.assert_array_equal(codec.decode(comp.tensor), [2, 2, 2, 2])  # 1 + 1 from each process
    s = status(stub)
    assert (s.inflight_bytes, s.collectives_waiting) == (0, 0)
    assert_serves(stub)


def test_the_daemon_tunes_malloc_before_it_serves(start_daemon):
    """Without it glibc keeps one arena per serving thread, and freed arrays stay in them (memory.py)."""
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "1",
                     "--log-level", "DEBUG")
    try:
        glibc = platform.libc_ver()[0] == "glibc"
        line = f"event=malloc tuned={glibc} arenas={MALLOC_ARENAS} mmap_threshold={MALLOC_MMAP_THRESHOLD}"
        log = d.log()
        assert line in log and log.index(line) < log.index("event=serving"), log
    finally:
        d.terminate()
