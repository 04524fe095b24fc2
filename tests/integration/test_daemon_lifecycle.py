"""The real ``xreduced`` process: binding, configuration, health, exit codes, signals.

Every test starts its own daemon subprocess (tests/support/daemons.py). Run with
``pytest -s`` to see the measured start-to-SERVING times.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
from daemons import Daemons
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce_bench.daemon import DaemonProcess

NUMPY = ["--backend", "numpy"]
TCP = ["--listen", "127.0.0.1:0"]
SERVICE = "xreduce.v1.CrossDeviceOps"
SERVING = health_pb2.HealthCheckResponse.SERVING
HAVE_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """The daemons inherit os.environ: no stray XREDUCE_* setting may leak in."""
    for name in list(os.environ):
        if name.startswith("XREDUCE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def sock_dir():
    """A short directory for unix sockets (paths are limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="xrd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def running(args: list[str], env: dict[str, str] | None = None):
    """A daemon that is killed however the test ends."""
    with Daemons(stop_signal=signal.SIGKILL) as start:
        yield start(*args, env=env)


@contextlib.contextmanager
def stub_for(address: str):
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield pb_grpc.CrossDeviceOpsStub(ch)


def list_devices(address: str) -> pb.ListDevicesResponse:
    with stub_for(address) as stub:
        return stub.ListDevices(pb.ListDevicesRequest(), timeout=30)


def f32_value(n: int, devices: int = 2) -> pb.DistributedValue:
    """``devices`` replicas of float32[n]; replica d holds d everywhere."""
    return pb.DistributedValue(
        components=[
            pb.Component(device=f"CPU:{d}", tensor=codec.encode(np.full(n, d, np.float32)))
            for d in range(devices)
        ]
    )


def check_sum(reply: pb.ReduceResponse, n: int, devices: int) -> None:
    want = np.full(n, sum(range(devices)), np.float32)
    assert len(reply.result.components) == devices
    for comp in reply.result.components:
        np.testing.assert_array_equal(codec.decode(comp.tensor), want)


def run_to_exit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m xreduced ARGS`` that is expected to exit on its own."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("XREDUCE_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "xreduced", *args], env=full_env, capture_output=True, text=True, timeout=60
    )


# A client that waits for a daemon still starting: retry the connection every
# 20 ms instead of gRPC's default 1 s backoff.
FAST_RETRY = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 50),
]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def catches_sigterm(pid: int) -> bool:
    """Has process ``pid`` installed a SIGTERM handler? (Linux: SigCgt in /proc/PID/status.)"""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def stop(proc: DaemonProcess, sig: int = signal.SIGTERM) -> int:
    """Signals the daemon once its handlers are installed (see test_signal_handlers_precede_serving)."""
    wait_for(lambda: catches_sigterm(proc.proc.pid), what="the daemon's SIGTERM handler")
    return proc.terminate(sig)


# A call slow enough (about a second on the numpy backend) to be in flight
# while the daemon shuts down: 8 replicas, 30000 non-empty packs.
SLOW_N, SLOW_DEVICES, SLOW_PACKS = 60_000, 8, 30_000


def slow_reduce_in_thread(stub) -> tuple[threading.Thread, dict]:
    request = pb.ReduceRequest(
        reduce_op=pb.REDUCE_OP_SUM, value=f32_value(SLOW_N, SLOW_DEVICES), num_packs=SLOW_PACKS
    )
    out: dict = {}

    def call():
        try:
            out["reply"] = stub.Reduce(request, timeout=120)
        except grpc.RpcError as e:
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, out


# --------------------------------------------------------------------------- binding


def test_port_zero_binds_a_free_port_and_logs_it():
    with running([*TCP, *NUMPY]) as proc:
        m = re.fullmatch(r"127\.0\.0\.1:(\d+)", proc.address)
        assert m and int(m.group(1)) > 0, proc.address
        assert f"event=serving address={proc.address} backend=numpy devices=8" in proc.log()
        reply = list_devices(proc.address)
        assert reply.backend == "numpy"
        assert [d.short_name for d in reply.devices] == [f"CPU:{i}" for i in range(8)]
        assert stop(proc) == 0


@pytest.mark.slow
def test_unix_socket_address(sock_dir):
    address = f"unix:{sock_dir}/xreduced.sock"
    with running(["--listen", address, *NUMPY]) as proc:
        assert proc.address == address
        assert len(list_devices(address).devices) == 8
        assert stop(proc) == 0


def test_a_port_in_use_exits_1_naming_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_exit(["--listen", f"127.0.0.1:{port}", *NUMPY])
    assert result.returncode == 1, result.stderr
    assert "event=start_failed" in result.stderr
    assert (f"cannot listen on '127.0.0.1:{port}': the address is already in use; pick another --listen, or "
            "--listen 127.0.0.1:0 for a free port") in result.stderr, result.stderr
    # What gRPC's core would print itself is not shown: the daemon's own line says it.
    assert "Failed to add port" not in result.stderr and "Traceback" not in result.stderr, result.stderr


# --------------------------------------------------------------------------- health


def test_health_reports_serving_and_start_time():
    with running([*TCP, *NUMPY]) as proc:
        with grpc.insecure_channel(proc.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", SERVICE):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
                assert reply.status == SERVING, name
            with pytest.raises(grpc.RpcError) as info:
                health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        print(f"\nxreduced: process start to event=serving (SERVING): {proc.serving_after * 1000:.0f} ms")
        assert stop(proc) == 0


def test_start_to_first_serving_health_check(sock_dir):
    """The time a client polling the health service waits for SERVING (printed, not asserted)."""
    address = f"unix:{sock_dir}/h.sock"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "xreduced", "--listen", address, *NUMPY],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with grpc.insecure_channel(address, options=FAST_RETRY) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30, wait_for_ready=True)
            elapsed = time.monotonic() - started
        assert reply.status == SERVING
        print(f"\nxreduced: process start to first SERVING health check: {elapsed * 1000:.0f} ms")
    finally:
        proc.kill()
        proc.wait(10)


# --------------------------------------------------------------------------- settings: environment twins


@pytest.mark.parametrize(
    "args, env, count",
    [
        pytest.param([], {"XREDUCE_VIRTUAL_DEVICES": "3"}, 3, id="env-3"),
        pytest.param(["--virtual-devices", "5"], {"XREDUCE_VIRTUAL_DEVICES": "3"}, 5, id="arg-5-beats-env-3"),
        pytest.param(["--virtual-devices", "2"], {}, 2, id="arg-2"),
        pytest.param([], {}, 8, id="default-8"),
    ],
)
def test_virtual_devices(args, env, count):
    with running([*TCP, *NUMPY, *args], env) as proc:
        reply = list_devices(proc.address)
        assert [d.short_name for d in reply.devices] == [f"CPU:{i}" for i in range(count)]
        assert len(reply.peer_access) == count
        assert f"devices={count} " in proc.log()


def test_listen_from_environment():
    with running(NUMPY, {"XREDUCE_LISTEN": "127.0.0.1:0"}) as proc:
        assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", proc.address), proc.address
        assert len(list_devices(proc.address).devices) == 8


def test_unix_listen_from_environment(sock_dir):
    address = f"unix:{sock_dir}/env.sock"
    with running(NUMPY, {"XREDUCE_LISTEN": address}) as proc:
        assert proc.address == address
        assert len(list_devices(address).devices) == 8


def test_listen_argument_beats_environment():
    # The environment names an address that cannot be bound; the argument wins.
    with running([*TCP, *NUMPY], {"XREDUCE_LISTEN": "unix:/nonexistent-dir/xreduced.sock"}) as proc:
        assert proc.address.startswith("127.0.0.1:"), proc.address
        assert len(list_devices(proc.address).devices) == 8


def test_backend_from_environment():
    with running(TCP, {"XREDUCE_BACKEND": "numpy"}) as proc:
        assert list_devices(proc.address).backend == "numpy"


def test_backend_argument_beats_environment():
    # XREDUCE_BACKEND=tpu alone would exit 2; the argument wins before it is looked at.
    with running([*TCP, *NUMPY], {"XREDUCE_BACKEND": "tpu"}) as proc:
        assert list_devices(proc.address).backend == "numpy"


def test_log_level_warning_from_environment_hides_info(sock_dir):
    """At WARNING the daemon logs only its serving line while healthy, and still serves."""
    address = f"unix:{sock_dir}/quiet.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XREDUCE_")}
    # The score this process has: the daemon need not lower it, so a root without CAP_SYS_RESOURCE logs no warning.
    with open("/proc/self/oom_score_adj") as f:
        env.update(XREDUCE_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1", XREDUCE_OOM_SCORE_ADJ=f.read().strip())
    proc = subprocess.Popen(
        [sys.executable, "-m", "xreduced", "--listen", address, *NUMPY],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        with grpc.insecure_channel(address, options=FAST_RETRY) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30, wait_for_ready=True)
            assert reply.status == SERVING
            assert pb_grpc.CrossDeviceOpsStub(ch).ListDevices(pb.ListDevicesRequest(), timeout=30).backend == "numpy"
        wait_for(lambda: catches_sigterm(proc.pid), what="the daemon's SIGTERM handler")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        # Only the serving line, which names the bound address whatever the level.
        events = [line for line in err.splitlines() if "event=" in line]
        assert len(events) == 1 and " WARNING xreduced event=serving address=" + address in events[0], err
        assert " INFO " not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.parametrize(
    "args, env",
    [
        pytest.param([], {"XREDUCE_LOG_LEVEL": "DEBUG"}, id="env-DEBUG"),
        pytest.param([], {"XREDUCE_LOG_LEVEL": "info"}, id="env-info-lowercase"),
        pytest.param(["--log-level", "INFO"], {"XREDUCE_LOG_LEVEL": "WARNING"}, id="arg-INFO-beats-env-WARNING"),
    ],
)
def test_log_level_accepted_and_info_visible(args, env):
    # DaemonProcess only returns once it has read the INFO line event=serving.
    with running([*TCP, *NUMPY, *args], env) as proc:
        assert " INFO xreduced event=serving " in proc.log()
        assert stop(proc) == 0
        assert "event=stopped" in proc.log()


def _reduce(address: str, n: int) -> pb.ReduceResponse:
    with stub_for(address) as stub:
        return stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=f32_value(n)), timeout=30)


def test_max_message_bytes_from_environment():
    with running([*TCP, *NUMPY, "--virtual-devices", "2"], {"XREDUCE_MAX_MESSAGE_BYTES": "1000"}) as proc:
        check_sum(_reduce(proc.address, 4), 4, 2)  # ~150 bytes: fits
        with pytest.raises(grpc.RpcError) as info:
            _reduce(proc.address, 1000)  # ~8 KB
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        check_sum(_reduce(proc.address, 4), 4, 2)  # and it keeps serving


def test_max_message_bytes_argument_beats_environment():
    args = [*TCP, *NUMPY, "--virtual-devices", "2", "--max-message-bytes", "100000"]
    with running(args, {"XREDUCE_MAX_MESSAGE_BYTES": "1000"}) as proc:
        check_sum(_reduce(proc.address, 1000), 1000, 2)


@pytest.mark.parametrize(
    "args, env, shown",
    [
        pytest.param([], {}, "10", id="default-10"),
        pytest.param([], {"XREDUCE_GRACE_SECONDS": "2.5"}, "2.5", id="env-2.5"),
        pytest.param(["--grace-seconds", "4"], {"XREDUCE_GRACE_SECONDS": "2.5"}, "4", id="arg-4-beats-env-2.5"),
    ],
)
def test_grace_seconds(args, env, shown):
    with running([*TCP, *NUMPY, *args], env) as proc:
        assert stop(proc) == 0
        assert f"event=stopping grace_seconds={shown}\n" in proc.log()


@pytest.mark.parametrize(
    "args, env, second_call_waits",
    [
        pytest.param([], {"XREDUCE_WORKERS": "1"}, True, id="env-1"),
        pytest.param(["--workers", "4"], {"XREDUCE_WORKERS": "1"}, False, id="arg-4-beats-env-1"),
    ],
)
@pytest.mark.slow
def test_workers(args, env, second_call_waits):
    """With one worker thread a second call waits for the first; with four it does not."""
    with running([*TCP, *NUMPY, *args], env) as proc, stub_for(proc.address) as stub:
        thread, out = slow_reduce_in_thread(stub)
        time.sleep(0.3)  # the slow call now holds a worker
        try:
            stub.ListDevices(pb.ListDevicesRequest(), timeout=0.3)
            waited = False
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.details()
            waited = True
        thread.join(120)
        assert "reply" in out, out
        assert waited == second_call_waits
        assert len(stub.ListDevices(pb.ListDevicesRequest(), timeout=30).devices) == 8


# --------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "args, env, message",
    [
        pytest.param(["--backend", "tpu"], {}, "xreduced: --backend must be auto, numpy or cupy; got 'tpu'",
                     id="backend-tpu"),
        pytest.param([], {"XREDUCE_BACKEND": "tpu"},
                     "xreduced: XREDUCE_BACKEND must be auto, numpy or cupy; got 'tpu'", id="env-backend-tpu"),
        pytest.param([], {"XREDUCE_VIRTUAL_DEVICES": "0"}, "xreduced: XREDUCE_VIRTUAL_DEVICES must be >= 1; got 0",
                     id="env-virtual-devices-0"),
        pytest.param(["--virtual-devices", "two"], {}, "xreduced: --virtual-devices must be int; got 'two'",
                     id="virtual-devices-two"),
        pytest.param([], {"XREDUCE_MAX_MESSAGE_BYTES": "0"},
                     "xreduced: XREDUCE_MAX_MESSAGE_BYTES must be in [1, 2147483647] (gRPC's limit); got 0",
                     id="env-max-message-bytes-0"),
        pytest.param(["--log-level", "LOUD"], {},
                     "xreduced: --log-level must be DEBUG, INFO, WARNING or ERROR; got 'LOUD'", id="log-level-LOUD"),
        pytest.param([], {"XREDUCE_GRACE_SECONDS": "-1"},
                     "xreduced: XREDUCE_GRACE_SECONDS must be a number of seconds in [0, 3600]; got -1",
                     id="env-grace-seconds-negative"),
        pytest.param(["--workers", "0"], {}, "xreduced: --workers must be >= 1; got 0", id="workers-0"),
        pytest.param(["--listen", ""], {}, "xreduced: --listen must be host:port or unix:PATH; got ''",
                     id="listen-empty"),
        pytest.param(["--listen", "127.0.0.1:99999"], {},
                     "xreduced: --listen must be host:port or unix:PATH; got '127.0.0.1:99999' (port 99999 is not "
                     "in 0..65535; 0 picks a free port)", id="listen-port-99999"),
        pytest.param(["--listen", "127.0.0.1"], {},
                     "xreduced: --listen must be host:port or unix:PATH; got '127.0.0.1' (no port)",
                     id="listen-no-port"),
        pytest.param(["--node-address", "999.1.1.1"], {},
                     "xreduced: --node-address must be an IP address or a host name, without a port; got '999.1.1.1' "
                     "(not an IPv4 address)", id="node-address-999"),
        pytest.param([], {"XREDUCE_NODE_ADDRESS": "999.1.1.1"},
                     "xreduced: XREDUCE_NODE_ADDRESS must be an IP address or a host name, without a port; got "
                     "'999.1.1.1' (not an IPv4 address)", id="env-node-address-999"),
        pytest.param(["--no-such-flag"], {}, "xreduced: error: unrecognized arguments: --no-such-flag",
                     id="unknown-flag"),
    ],
)
def test_a_bad_setting_exits_2_naming_it(args, env, message):
    result = run_to_exit([*TCP, *args], env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "event=serving" not in result.stderr


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed here")
@pytest.mark.parametrize(
    "args, env",
    [
        pytest.param(["--backend", "cupy"], {}, id="arg"),
        pytest.param([], {"XREDUCE_BACKEND": "cupy"}, id="env"),
    ],
)
def test_cupy_backend_without_cupy_exits_1(args, env):
    result = run_to_exit([*TCP, *args], env)
    assert result.returncode == 1, result.stderr
    assert "event=start_failed" in result.stderr
    assert "--backend cupy: CuPy is not installed" in result.stderr, result.stderr


# --------------------------------------------------------------------------- signals and shutdown


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly(sig):
    with running([*TCP, *NUMPY]) as proc:
        assert stop(proc, sig) == 0, proc.log()
        log = proc.log()
        events = [
            f"event=signal signal={sig.name}",
            "event=stopping grace_seconds=10",
            "event=stopped",
        ]
        positions = [log.find(e) for e in events]
        assert all(p >= 0 for p in positions) and positions == sorted(positions), log
        assert "Traceback" not in log, log


@pytest.mark.slow
def test_an_in_flight_call_completes_during_the_grace_period():
    args = [*TCP, *NUMPY, "--grace-seconds", "60", "--log-level", "DEBUG"]
    with running(args) as proc, stub_for(proc.address) as stub:
        wait_for(lambda: catches_sigterm(proc.proc.pid), what="the daemon's SIGTERM handler")
        thread, out = slow_reduce_in_thread(stub)
        wait_for(lambda: "event=handling method=Reduce" in proc.log(), what="the daemon handling the slow call")
        proc.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "event=stopping" in proc.log(), what="event=stopping")
        assert thread.is_alive(), "the slow call ended before shutdown began; make it slower"
        # New calls are refused while the old one finishes. event=stopping is logged
        # just before the server stops accepting, so a call may still slip in first.
        refused = None
        for _ in range(50):
            try:
                stub.ListDevices(pb.ListDevicesRequest(), timeout=5)
            except grpc.RpcError as e:
                refused = e
                break
            time.sleep(0.01)
        assert refused is not None, "calls were still accepted during the grace period"
        assert refused.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), refused.details()
        thread.join(120)
        assert "reply" in out, (out, proc.log())
        check_sum(out["reply"], SLOW_N, SLOW_DEVICES)
        assert proc.proc.wait(60) == 0
        log = proc.log()
        assert log.index("event=stopping") < log.index("event=stopped"), log


_SIGTERM_AT_SERVING = """
import logging, os, signal, sys
from xreduced import cli

class SigtermOnServing(logging.Handler):
    def emit(self, record):
        if "event=serving" in record.getMessage():
            os.kill(os.getpid(), signal.SIGTERM)

logging.getLogger("xreduced").addHandler(SigtermOnServing())
sys.exit(cli.main(["--listen", "127.0.0.1:0", "--backend", "numpy"]))
"""


def test_signal_handlers_precede_serving():
    """A SIGTERM delivered the moment event=serving is logged (made deterministic by
    sending it from a logging handler in the daemon's own process) stops it cleanly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XREDUCE_")}
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERM_AT_SERVING], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "event=stopped" in result.stderr, result.stderr
