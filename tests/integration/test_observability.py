"""Observability against real daemons: the per-call log line, GetStatus's
counters, the Prometheus endpoint (fetched over HTTP and parsed), and the
``xreduce status`` command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from daemons import wait_log
from prometheus_client.parser import text_string_to_metric_families
from xreduce import _cli
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduced.config import Config
from xreduced.server import Daemon

PREFIX = "/xreduce.v1.CrossDeviceOps/"
REDUCE, BATCH, BROADCAST, STATUS = (PREFIX + m for m in ("Reduce", "BatchReduce", "Broadcast", "GetStatus"))
TOKEN = "observability-s3cret"


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                               "--metrics-listen", "127.0.0.1:0")


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        yield pb_grpc.CrossDeviceOpsStub(channel)


def metrics_address(daemon) -> str:
    return re.search(r"event=metrics address=(\S+)", daemon.log()).group(1)


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """The endpoint's samples, parsed: {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def value(n: int, devices=("CPU:0", "CPU:1")) -> pb.DistributedValue:
    return pb.DistributedValue(components=[
        pb.Component(device=d, tensor=codec.encode(np.arange(n, dtype=np.float32))) for d in devices])


def reduce_request(n: int = 4, devices=("CPU:0", "CPU:1")) -> pb.ReduceRequest:
    return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value(n, devices))


def method_stats(stub) -> dict[str, pb.MethodStats]:
    return {m.method: m for m in stub.GetStatus(pb.GetStatusRequest(), timeout=10).methods}


def test_one_log_line_per_call_with_id_method_bytes_duration_status(stub, daemon):
    request = reduce_request(37)  # a size no other test sends
    reply = stub.Reduce(request, timeout=10)
    m = wait_log(daemon, rf"event=call id=(\d+) method={REDUCE} bytes_in={request.ByteSize()} "
                         rf"bytes_out={reply.ByteSize()} ms=(\d+\.\d{{3}}) status=OK\n")
    bad = reduce_request(37, ("CPU:0", "CPU:9"))
    with pytest.raises(grpc.RpcError) as e:
        stub.Reduce(bad, timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    m2 = wait_log(daemon, rf"event=call id=(\d+) method={REDUCE} bytes_in={bad.ByteSize()} bytes_out=0 "
                          r"ms=[\d.]+ status=NOT_FOUND\n")
    assert int(m2.group(1)) > int(m.group(1))  # request ids go up


def test_a_request_that_does_not_parse_is_invalid_argument_and_logged(daemon, stub):
    garbage = b"\x12\xff\xff\xff\xff\x0f"  # field 2 with a length far past the end
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(REDUCE)  # no serializers: raw bytes on the wire
        with pytest.raises(grpc.RpcError) as e:
            call(garbage, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{REDUCE}: the request does not parse")
    wait_log(daemon, rf"method={REDUCE} bytes_in={len(garbage)} bytes_out=0 ms=[\d.]+ status=INVALID_ARGUMENT")
    stub.Reduce(reduce_request(), timeout=10)  # still serving


def test_get_status_counters_go_up_by_the_calls_and_their_bytes(stub):
    before = method_stats(stub)
    requests = [reduce_request(8), reduce_request(16)]
    replies = [stub.Reduce(r, timeout=10) for r in requests]
    with pytest.raises(grpc.RpcError):
        stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM), timeout=10)  # no value: INVALID_ARGUMENT
    after = method_stats(stub)
    old = before.get(REDUCE, pb.MethodStats())
    new = after[REDUCE]
    assert new.calls_by_code["OK"] - old.calls_by_code.get("OK", 0) == 2
    assert new.calls_by_code["INVALID_ARGUMENT"] - old.calls_by_code.get("INVALID_ARGUMENT", 0) == 1
    assert new.bytes_in - old.bytes_in == sum(r.ByteSize() for r in requests) + 2  # + the empty one's reduce_op
    assert new.bytes_out - old.bytes_out == sum(r.ByteSize() for r in replies)
    assert after[STATUS].calls_by_code["OK"] >= 1  # GetStatus counts itself too (once it has answered)


def test_metrics_endpoint_shows_the_series_with_labels(stub, daemon):
    address = metrics_address(daemon)
    before = scrape(address)
    v = value(1 << 12, ("CPU:0", "CPU:1", "CPU:2", "CPU:3"))
    stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=v), timeout=10)
    batch = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, pairs=[pb.ReducePair(value=v)] * 2)
    stub.BatchReduce(batch, timeout=10)
    stub.Broadcast(pb.BroadcastRequest(tensor=codec.encode(np.ones(256)), destinations=["CPU:1", "CPU:2"]),
                   timeout=10)
    with pytest.raises(grpc.RpcError):
        stub.Reduce(reduce_request(4, ("CPU:0", "CPU:9")), timeout=10)  # NOT_FOUND
    stats = method_stats(stub)
    after = scrape(address)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("xreduce_calls_total", method=REDUCE, code="OK") == 1
    assert delta("xreduce_calls_total", method=REDUCE, code="NOT_FOUND") == 1
    assert delta("xreduce_calls_total", method=BATCH, code="OK") == 1
    assert delta("xreduce_calls_total", method=BROADCAST, code="OK") == 1
    for method in (REDUCE, BATCH, BROADCAST):  # the endpoint and GetStatus agree on the bytes
        assert sample(after, "xreduce_bytes_in_total", method=method) == stats[method].bytes_in
        assert sample(after, "xreduce_bytes_out_total", method=method) == stats[method].bytes_out
        assert delta("xreduce_reduction_seconds_count", method=method) == 1
        assert delta("xreduce_reduction_seconds_sum", method=method) > 0
        assert delta("xreduce_algbw_bytes_per_second_count", method=method) == 1
        assert delta("xreduce_reduction_seconds_bucket", method=method, le="+Inf") == 1
    # algbw: one replica's bytes over the seconds; Reduce's replica is 16 KiB, BatchReduce's two of them.
    reduce_seconds = delta("xreduce_reduction_seconds_sum", method=REDUCE)
    assert delta("xreduce_algbw_bytes_per_second_sum", method=REDUCE) == pytest.approx(
        (1 << 14) / reduce_seconds, rel=1e-6)
    assert sample(after, "xreduce_inflight_bytes") == 0
    assert sample(after, "xreduce_collectives_waiting") == 0


def test_xreduce_status_prints_devices_limits_and_counters(stub, daemon, capsys):
    stub.Reduce(reduce_request(), timeout=10)
    assert _cli.main(["status", "--address", daemon.address]) == 0
    out = capsys.readouterr().out
    assert re.match(rf"xreduced \S+ at {re.escape(daemon.address)}, up [\d.]+s\n  backend     numpy\n"
                    r"  security    plaintext, no token\n  local lane  unix-abstract:xreduce-lane-\S+, \d+ "
                    r"connection\(s\), \d+ call\(s\)\n\ndevices \(4\)\n  CPU:0 ", out), out
    for line in ("  max request bytes    1 GiB (1073741824)", "  max in-flight bytes  4 GiB (4294967296)",
                 "  max collectives      1024", "  collective timeout   60s", "  in-flight bytes      0 B (0)",
                 "  collectives waiting  0"):
        assert line + "\n" in out, out
    assert re.search(r"\n  Reduce +\d+  OK \d+", out), out


def test_xreduce_status_json_is_the_get_status_message(stub, daemon, capsys):
    stub.Reduce(reduce_request(), timeout=10)
    assert _cli.main(["status", "--address", daemon.address, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["backend"] == "numpy"
    assert [d["short_name"] for d in status["devices"]] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    assert status["limits"]["max_collectives"] == 1024
    assert status["limits"]["max_inflight_bytes"] == str(4 << 30)  # int64 is a string in proto3 JSON
    assert status["inflight_bytes"] == "0" and status["collectives_waiting"] == 0
    assert status["tls"] is False and status["token_auth"] is False
    reduce = next(m for m in status["methods"] if m["method"] == REDUCE)
    assert int(reduce["calls_by_code"]["OK"]) >= 1 and int(reduce["bytes_in"]) > 0


def test_xreduce_status_command_exits_1_naming_an_unreachable_address(tmp_path):
    address = f"unix:{tmp_path}/nobody.sock"
    run = subprocess.run([sys.executable, "-m", "xreduce._cli", "status", "--address", address, "--timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stdout == ""
    assert f"xreduce status: no daemon answers at {address} (" in run.stderr, run.stderr


def test_xreduce_status_sends_xreduce_token(tmp_path_factory, monkeypatch, capsys, start_daemon):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2",
                     "--auth-token-file", str(token_file))
    try:
        monkeypatch.delenv("XREDUCE_TOKEN", raising=False)
        monkeypatch.setenv("XREDUCE_ADDRESS", d.address)  # no --address: the environment names the daemon
        assert _cli.main(["status", "--timeout", "5"]) == 1
        err = capsys.readouterr().err
        assert f"cannot get the status of the daemon at {d.address} (UNAUTHENTICATED)" in err, err
        monkeypatch.setenv("XREDUCE_TOKEN", TOKEN)
        assert _cli.main(["status", "--timeout", "5"]) == 0
        out = capsys.readouterr().out
        assert "  security    plaintext, bearer token\n" in out, out
        assert "devices (2)" in out
    finally:
        d.terminate()


def test_metrics_registries_are_per_daemon_and_stop_with_it():
    daemons = [Daemon(Config(listen="127.0.0.1:0", backend="numpy", virtual_devices=2,
                             metrics_listen="127.0.0.1:0")).start() for _ in range(2)]
    try:
        with grpc.insecure_channel(daemons[0].address) as channel:
            pb_grpc.CrossDeviceOpsStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        first, second = (scrape(d.metrics.address) for d in daemons)
        assert sample(first, "xreduce_calls_total", method=STATUS, code="OK") == 1
        assert sample(second, "xreduce_calls_total", method=STATUS, code="OK") == 0
    finally:
        for d in daemons:
            d.stop(0)
    with pytest.raises(urllib.error.URLError):
        scrape(daemons[0].metrics.address)


@pytest.mark.parametrize("listen, needle", [("nowhere", "must be host:port"), ("127.0.0.1:99999", "must be host:port"),
                                            ("256.0.0.1:0", "cannot listen")])
def test_a_bad_metrics_address_fails_the_start(listen, needle):
    daemon = Daemon(Config(listen="127.0.0.1:0", backend="numpy", virtual_devices=1, metrics_listen=listen))
    with pytest.raises(RuntimeError, match=f"--metrics-listen '{re.escape(listen)}': {needle}"):
        daemon.start()
