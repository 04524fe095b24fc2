"""The local lane against real daemons: where it is offered, what the SDK sends over it, bad input on its
socket, the token gate, a caller that hangs up in a collective, a daemon that restarts, and its switches."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import time

import grpc
import numpy as np
import pytest
import xreduce
from xreduce import distribute
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire import lane as frames

DEVICES = ("--backend", "numpy", "--virtual-devices", "4")


@contextlib.contextmanager
def session(address: str, metadata=()):
    """An open session (gRPC's OpenSession stream): (its first reply, the stub)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CrossDeviceOpsStub(channel)
        responses = stub.OpenSession(pb.OpenSessionRequest(), metadata=metadata, timeout=60)
        try:
            yield next(responses), stub
        finally:
            responses.cancel()


def connect(lane_address: str, session_id: str, metadata=()) -> tuple[socket.socket, tuple[int, bool, bytes]]:
    """A raw lane connection after its hello, and the daemon's answer to the hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(frames.socket_address(lane_address))
    sock.sendall(frames.hello(session_id, metadata))
    return sock, frames.read_reply(frames.FrameReader(sock).read())


def call(sock: socket.socket, method: str, request, timeout: float = 10.0) -> tuple[int, bool, bytes]:
    sock.sendall(frames.request(method, timeout, request.SerializeToString()))
    return frames.read_reply(frames.FrameReader(sock).read())


def value(*arrays) -> pb.DistributedValue:
    return pb.DistributedValue(components=[pb.Component(device=f"CPU:{i}", tensor=codec.encode(a))
                                           for i, a in enumerate(arrays)])


@pytest.fixture(scope="module")
def lane_daemon(start_module_daemon):
    """A daemon on loopback TCP (so an abstract lane), for the tests that only call it."""
    return start_module_daemon("--listen", "127.0.0.1:0", *DEVICES)


def status(address: str) -> pb.GetStatusResponse:
    with xreduce.Client(address) as client:
        return client.get_status()


def test_the_lane_lies_beside_a_unix_socket_with_its_permissions_and_goes_with_the_daemon(start_daemon, tmp_path):
    path = tmp_path / "d.sock"
    daemon = start_daemon("--listen", f"unix:{path}", *DEVICES)
    with session(daemon.address) as (first, _):
        assert first.local_lane == f"unix:{path}.lane"
    mode = os.stat(f"{path}.lane").st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    daemon.terminate()
    assert not os.path.exists(f"{path}.lane")


def test_a_tcp_daemon_offers_an_abstract_lane_and_reduces_over_it(start_daemon):
    daemon = start_daemon("--listen", "127.0.0.1:0", *DEVICES)
    assert status(daemon.address).local_lane.startswith("unix-abstract:xreduce-lane-")
    with session(daemon.address) as (first, _):
        sock, hello = connect(first.local_lane, first.session_id)
        assert hello == (0, False, b"")
        code, _, body = call(sock, "Reduce", pb.ReduceRequest(
            reduce_op=pb.REDUCE_OP_MEAN, value=value(np.float32([1, 2]), np.float32([3, 5])), destinations=["CPU:3"]))
        assert code == 0
        reply = pb.ReduceResponse.FromString(body)
        assert reply.result.components[0].device.endswith("CPU:3")
        np.testing.assert_array_equal(codec.decode(reply.result.components[0].tensor), np.float32([2, 3.5]))
        now = status(daemon.address)
        assert (now.local_lane_connections, now.local_lane_calls) == (1, 1)
        sock.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "int32", "uint64",
                                   "complex64"])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_the_sdk_sends_small_calls_over_the_lane_and_gets_the_wire_s_bytes(lane_daemon, dtype, op):
    daemon = lane_daemon
    if dtype == "bfloat16":
        import ml_dtypes

        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    rng = np.random.default_rng(7)
    parts = [(rng.standard_normal(5) * 50).astype(np_dtype) for _ in range(4)]
    per_replica = distribute.PerReplica(parts, devices=[f"CPU:{i}" for i in range(4)])
    before = status(daemon.address).local_lane_calls
    results = {}
    for transport in ("auto", "wire"):
        ops = distribute.HierarchicalCopyAllReduce(address=daemon.address, transport=transport)
        reduced = ops.reduce(op, per_replica, "CPU:2")
        batch = ops.batch_reduce(op, [(per_replica, per_replica)])[0]
        broadcast = ops.broadcast(parts[1], ["CPU:0", "CPU:3"])
        results[transport] = [reduced, *batch.values, *broadcast.values]
    for a, b in zip(results["auto"], results["wire"]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))  # bit for bit
    assert status(daemon.address).local_lane_calls == before + 3  # the auto calls, not the wire's




def test_bad_input_on_the_lane_gets_a_clear_answer_and_the_daemon_serves_on(start_daemon):
    daemon = start_daemon("--listen", "127.0.0.1:0", *DEVICES)
    address = status(daemon.address).local_lane
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(30)
    raw.connect(frames.socket_address(address))
    raw.sendall(frames.frame(b"GET / HTTP/1.1\r\n\r\n"))
    code, _, message = frames.read_reply(frames.FrameReader(raw).read())
    assert (grpc.StatusCode.INVALID_ARGUMENT.value[0], b"lane hello: must start with b'XRL1'; got b'GET '") == (
        code, message)
    assert frames.FrameReader(raw).read() is None  # and the connection is closed
    _, (code, _, message) = connect(address, "no-such-session")
    assert code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert message == b"session: no-such-... is not open (it was closed, or the daemon restarted); open a new session"
    with session(daemon.address) as (first, _):
        sock, _ = connect(address, first.session_id)
        sock.sendall(frames.request("BatchReduce", 5.0, b"\xff\xff\xff"))
        code, answered, message = frames.read_reply(frames.FrameReader(sock).read())
        assert (code, answered) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], True)
        assert message.startswith(b"/xreduce.v1.CrossDeviceOps/BatchReduce: the request does not parse")
        sock.sendall(frames.frame(b"\x07" + bytes(8)))
        code, _, message = frames.read_reply(frames.FrameReader(sock).read())
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert message == b"lane request: method 7 is not one of 0..2 (Reduce, BatchReduce, Broadcast)"
        code, _, message = call(sock, "Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value(
            np.float32([1]), np.float32([2])), destinations=["CPU:9"]))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and message.startswith(b"destinations[0]: "), message
        code, _, body = call(sock, "Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value(
            np.float32([1]), np.float32([2])), destinations=["CPU:0"]))
        assert code == 0
        assert codec.decode(pb.ReduceResponse.FromString(body).result.components[0].tensor).tolist() == [3.0]
        sock.close()


def test_the_lane_s_calls_pass_the_token_gate(start_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = start_daemon("--listen", "127.0.0.1:0", "--auth-token-file", str(token), *DEVICES)
    good = (("authorization", "Bearer s3cret"),)
    request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value(np.int32([1]), np.int32([2])))
    with session(daemon.address, good) as (first, _):
        sock, _ = connect(first.local_lane, first.session_id)  # a hello without the token
        code, _, message = call(sock, "Reduce", request)
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert b"needs a valid bearer token" in message
        sock, _ = connect(first.local_lane, first.session_id, (("authorization", "Bearer wrong"),))
        assert call(sock, "Reduce", request)[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        sock, _ = connect(first.local_lane, first.session_id, good)
        assert call(sock, "Reduce", request)[0] == 0
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address, token="s3cret")
    values = distribute.PerReplica([np.int32([1]), np.int32([2])], devices=["CPU:0", "CPU:1"])
    with xreduce.Client(daemon.address, token="s3cret") as client:
        before = client.get_status().local_lane_calls
        assert ops.reduce("SUM", values, "CPU:0").tolist() == [3]
        assert client.get_status().local_lane_calls == before + 1


def test_a_process_whose_lane_connection_ends_mid_collective_leaves_it_at_once(start_daemon):
    daemon = start_daemon("--listen", "127.0.0.1:0", "--collective-timeout", "60", *DEVICES)

    def request(process_id: int) -> pb.BatchReduceRequest:
        return pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM,
            pairs=[pb.ReducePair(value=pb.DistributedValue(components=[pb.Component(
                device=f"CPU:{process_id}", tensor=codec.encode(np.float32([process_id])))]))],
            collective=pb.CollectiveSpec(group="lane-hangup", num_processes=2, process_id=process_id, sequence=1))

    with session(daemon.address) as (first, _):
        waiting, _ = connect(first.local_lane, first.session_id)
        waiting.sendall(frames.request("BatchReduce", 60.0, request(0).SerializeToString()))
        with xreduce.Client(daemon.address) as client:  # process 0 waits in the collective
            for _ in range(200):
                if client.get_status().collectives_waiting:
                    break
                time.sleep(0.05)
            assert client.get_status().collectives_waiting == 1
        waiting.close()  # its process dies
        late, _ = connect(first.local_lane, first.session_id)
        code, _, message = call(late, "BatchReduce", request(1))
        assert code == grpc.StatusCode.ABORTED.value[0], message
        assert b"process 0 left (its call ended or its process died) before every process arrived" in message


def test_a_lane_call_waiting_in_a_collective_ends_at_its_deadline_naming_who_is_missing(start_daemon):
    """The call waits without a thread of its own: the lane's thread wakes at its deadline and answers it."""
    daemon = start_daemon("--listen", "127.0.0.1:0", "--collective-timeout", "60", *DEVICES)
    request = pb.BatchReduceRequest(
        reduce_op=pb.REDUCE_OP_SUM,
        pairs=[pb.ReducePair(value=pb.DistributedValue(components=[pb.Component(
            device="CPU:0", tensor=codec.encode(np.float32([1])))]))],
        collective=pb.CollectiveSpec(group="lane-deadline", num_processes=2, process_id=0, sequence=1))
    with session(daemon.address) as (first, _):
        sock, _ = connect(first.local_lane, first.session_id)
        other, _ = connect(first.local_lane, first.session_id)
        start = time.monotonic()
        code, answered, message = call(sock, "BatchReduce", request, timeout=1.0)
        took = time.monotonic() - start
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and answered, message
        assert b"waiting for process(es) [1]; arrived: [0]" in message, message
        assert took < 30, took  # bounded by the call's 1 s, not the daemon's 60 s
        # Meanwhile and after, the lane's one thread serves other connections.
        code, _, _ = call(other, "BatchReduce", pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value(np.float32([1]), np.float32([2])))]))
        assert code == 0


def test_calls_sent_before_the_reply_wait_their_turn_and_are_answered_in_order(start_daemon):
    """A caller may send its next calls before a reply (xreduce's TF kernel sends a phased call's requests back to
    back): they wait while the call before waits in a collective or runs on a worker, then are served in order.
    More than the lane lets wait ends the connection, and the lane serves on."""
    from xreduced.lane import QUEUED_MAX_BYTES
    daemon = start_daemon("--listen", "127.0.0.1:0", "--collective-timeout", "60", *DEVICES)

    def collective(process_id: int, sequence: int) -> bytes:
        return frames.request("BatchReduce", 60.0, pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM,
            pairs=[pb.ReducePair(value=pb.DistributedValue(components=[pb.Component(
                device=f"CPU:{process_id}", tensor=codec.encode(np.float32([process_id + 1])))]))],
            collective=pb.CollectiveSpec(group="lane-queue", num_processes=2, process_id=process_id,
                                         sequence=sequence)).SerializeToString())

    def solo(*arrays) -> bytes:
        return frames.request("BatchReduce", 60.0, pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value(*arrays))]).SerializeToString())

    def results(reply) -> list:
        code, _, body = reply
        assert code == 0, body
        return [codec.decode(r.result.components[0].tensor).tolist()
                for r in pb.BatchReduceResponse.FromString(body).results]

    big = np.ones(300_000, np.float32)  # a message over the lane thread's 1 MiB: a worker serves it
    with session(daemon.address) as (first, _):
        waiting, _ = connect(first.local_lane, first.session_id)
        other, _ = connect(first.local_lane, first.session_id)
        waiting.sendall(collective(0, 1) + solo(np.float32([1]), np.float32([2])) +
                        solo(np.float32([3]), np.float32([4])))
        time.sleep(0.5)  # all three have come; the first waits for process 1
        other.sendall(collective(1, 1))
        assert results(frames.read_reply(frames.FrameReader(other).read())) == [[3.0]]
        reader = frames.FrameReader(waiting)
        assert [results(frames.read_reply(reader.read())) for _ in range(3)] == [[[3.0]], [[3.0]], [[7.0]]]
        waiting.sendall(solo(big, big) + solo(np.float32([5]), np.float32([6])))
        assert [results(frames.read_reply(reader.read())) for _ in range(2)] == [[[2.0] * big.size], [[11.0]]]
        # A caller that sends more than may wait while its call is in progress is dropped.
        waiting.sendall(collective(0, 2) + solo(np.zeros(QUEUED_MAX_BYTES // 4, np.float32), np.float32([0])))
        reader = frames.FrameReader(waiting)
        code, _, message = frames.read_reply(reader.read())  # its waiting call left the collective
        assert code == grpc.StatusCode.ABORTED.value[0] and b"process 0 left" in message, message
        assert reader.read() is None  # and the connection ended
        code, _, _ = call(other, "BatchReduce", pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value(np.float32([1]), np.float32([2])))]))
        assert code == 0


def test_the_sdk_goes_on_after_its_daemon_restarts(start_daemon, tmp_path):
    address = f"unix:{tmp_path}/d.sock"
    daemon = start_daemon("--listen", address, *DEVICES)
    ops = distribute.HierarchicalCopyAllReduce(address=address)
    values = distribute.PerReplica([np.float32([1]), np.float32([2])], devices=["CPU:0", "CPU:1"])
    assert ops.reduce("SUM", values, "CPU:0").tolist() == [3.0]
    daemon.terminate()
    start_daemon("--listen", address, *DEVICES)
    try:
        first = ops.reduce("SUM", values, "CPU:0").tolist()
    except xreduce.UnavailableError as e:  # the call that finds the old lane gone; nothing is retried
        assert "local lane" in str(e) or "unavailable" in str(e), e
    else:
        assert first == [3.0]
    assert ops.reduce("SUM", values, "CPU:0").tolist() == [3.0]
    assert status(address).local_lane_calls >= 1  # the new daemon's lane carries the calls


def test_the_lane_is_off_with_the_flag_or_the_sdk_s_variable(start_daemon, monkeypatch):
    off = start_daemon("--listen", "127.0.0.1:0", "--local-lane", "false", *DEVICES)
    values = distribute.PerReplica([np.float32([1]), np.float32([2])], devices=["CPU:0", "CPU:1"])
    assert status(off.address).local_lane == ""
    with session(off.address) as (first, _):
        assert first.local_lane == ""
    assert distribute.HierarchicalCopyAllReduce(address=off.address).reduce("SUM", values, "CPU:0").tolist() == [3.0]
    on = start_daemon("--listen", "127.0.0.1:0", *DEVICES)
    monkeypatch.setenv("XREDUCE_LOCAL_LANE", "0")
    assert distribute.HierarchicalCopyAllReduce(address=on.address).reduce("SUM", values, "CPU:0").tolist() == [3.0]
    assert status(on.address).local_lane_calls == 0
    monkeypatch.delenv("XREDUCE_LOCAL_LANE")
    assert distribute.HierarchicalCopyAllReduce(address=on.address).reduce("SUM", values, "CPU:0").tolist() == [3.0]
    assert status(on.address).local_lane_calls == 1


def test_the_idle_cost_benchmark_runs():
    """bench/lane_idle.py, briefly: it reports the daemon's CPU with lane connections held (the figure is the
    note's, not asserted here)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "lane_idle.py"
    out = subprocess.run([sys.executable, str(script), "--processes", "2", "--seconds", "0.2", "--settle", "0"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "2 processes holding 2 lane connection(s) after 2 lane call(s)" in out.stdout, out.stdout



def test_the_cores_benchmark_runs():
    """bench/lane_cores.py, briefly: a round of each kind, checked sums, the medians line (the figures are the
    note's, not asserted here)."""
    import subprocess
    import sys
    from pathlib import Path

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores: it compares the daemon free and confined to one")
    script = Path(__file__).resolve().parents[2] / "bench" / "lane_cores.py"
    out = subprocess.run([sys.executable, str(script), "--rounds", "1", "--iters", "50"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "free (every core)" in out.stdout and "confined to core" in out.stdout, out.stdout
    assert re.search(r"one core / free: time [\d.]+, daemon CPU [\d.]+$", out.stdout.strip()), out.stdout


def test_the_work_count_and_the_turns_benchmark_run():
    """bench/lane_work.py and bench/lane_ab.py, briefly: both sides counted, both systems timed in turns with
    checked sums (the figures are the note's, not asserted here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    work = subprocess.run([sys.executable, str(root / "bench" / "lane_work.py"), "--iters", "20", "--top", "3"],
                          capture_output=True, text=True, timeout=300)
    assert work.returncode == 0, work.stderr
    assert re.search(r"^daemon lane thread: \d+ instructions per all-reduce", work.stdout, re.M), work.stdout
    assert re.search(r"^SDK process 0: \d+ instructions per call", work.stdout, re.M), work.stdout
    turns = subprocess.run([sys.executable, str(root / "bench" / "lane_ab.py"), str(root), "echo", "--blocks", "2",
                            "--iters", "10"], capture_output=True, text=True, timeout=300, cwd=root)
    assert turns.returncode == 0, turns.stderr
    assert re.search(r"echo: [\d.]+ us +median block ratio [\d.]+", turns.stdout), turns.stdout

FORK_SCRIPT = r"""
import os, sys, numpy as np
from xreduce import distribute
ops = distribute.HierarchicalCopyAllReduce(address=sys.argv[1])
def check(base):
    for i in range(50):
        values = distribute.PerReplica([np.float32([base + i]), np.float32([1])], devices=["CPU:0", "CPU:1"])
        got = ops.reduce("SUM", values, "CPU:0").tolist()
        assert got == [base + i + 1], (base, i, got)
check(0)  # the parent's lane connection is open now
pid = os.fork()
check(1000 if pid == 0 else 2000)  # at once, each on its own connection
if pid == 0:
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""


def test_a_forked_child_opens_its_own_lane(lane_daemon):
    import subprocess
    import sys

    before = status(lane_daemon.address).local_lane_calls
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, lane_daemon.address], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert status(lane_daemon.address).local_lane_calls == before + 150
