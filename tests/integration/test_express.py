"""The express lane (xreduced.express) against the real daemon: two processes' lane connections reduce small
collectives of known shapes exactly, counted as every call is; and what is not the plain case (a partner on
gRPC, a new shape, a hang-up, a late or missing partner, bad bytes, a duplicate) gets the full path's answer."""

from __future__ import annotations

import concurrent.futures
import re
import time

import grpc
import numpy as np
import pytest
from daemons import metrics, wait_log
from test_local_lane import connect, session
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire import lane as frames

DEVICES = ("--backend", "numpy", "--virtual-devices", "4")


def batch(pid: int, sequence: int, *arrays, op=pb.REDUCE_OP_SUM, group="express", pairs=1, name=""):
    """Process ``pid``'s BatchReduce of ``pairs`` values, each with one component per array on its own two
    devices (process 0: CPU:0, CPU:1; process 1: CPU:2, CPU:3)."""
    value = pb.DistributedValue(components=[pb.Component(device=f"CPU:{2 * pid + i}", tensor=codec.encode(a))
                                            for i, a in enumerate(arrays)])
    return pb.BatchReduceRequest(reduce_op=op, pairs=[pb.ReducePair(value=value)] * pairs, collective=pb.CollectiveSpec(
        group=group, num_processes=2, process_id=pid, sequence=sequence, name=name))


def lane_call(sock, method: str, message, timeout: float = 20.0) -> tuple[int, bytes]:
    sock.sendall(frames.request(method, timeout, message.SerializeToString()))
    code, _, body = frames.read_reply(frames.FrameReader(sock).read())
    return code, body


def results(body: bytes) -> list[list[list]]:
    reply = pb.BatchReduceResponse.FromString(body)
    return [[codec.decode(c.tensor).tolist() for c in r.result.components] for r in reply.results]


def calls(daemon, code: str = "OK") -> float:
    return metrics(daemon).get(("xreduce_calls_total", (("code", code), ("method", "/xreduce.v1.CrossDeviceOps/"
                                                                                "BatchReduce"))), 0.0)


def express_calls(daemon) -> float:
    return metrics(daemon)[("xreduce_local_lane_express_calls_total", ())]


def held(daemon, sock, message) -> None:
    """Sends ``message`` on ``sock`` and returns once the express lane holds it (bounded)."""
    sock.sendall(frames.request("BatchReduce", 20.0, message.SerializeToString()))
    deadline = time.monotonic() + 30
    while metrics(daemon)[("xreduce_local_lane_express_held", ())] < 1:
        assert time.monotonic() < deadline, "the express lane never held the call"
        time.sleep(0.02)


def start(start_daemon, hold: float = 30.0):
    """A daemon whose express lane holds a call ``hold`` seconds: long enough that what a test does while a call
    is held happens within the hold."""
    return start_daemon("--listen", "127.0.0.1:0", "--collective-timeout", "30", "--metrics-listen", "127.0.0.1:0",
                        "--log-level", "DEBUG", "--lane-express-hold", str(hold), *DEVICES)


@pytest.fixture
def daemon(start_daemon, request):
    return start(start_daemon, getattr(request, "param", 30.0))


def handed_over(daemon, reason: str) -> bool:
    """Whether the daemon's log says the express lane handed a collective to the full path for ``reason``
    (waiting, bounded, for the test's thread that reads the log)."""
    return wait_log(daemon, re.escape(f"reason={reason!r}")) is not None


@pytest.fixture
def lanes(daemon):
    """Two processes' lane connections to ``daemon``."""
    with session(daemon.address) as (first, _):
        socks = [connect(first.local_lane, first.session_id)[0] for _ in range(2)]
        yield socks
        for s in socks:
            s.close()


def both(lanes, make, method="BatchReduce", timeout: float = 20.0):
    """Both processes' calls at once: [(code, body)] by process."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lane_call, lanes[pid], method, make(pid), timeout) for pid in range(2)]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("op, dtype", [(pb.REDUCE_OP_SUM, np.float32), (pb.REDUCE_OP_MEAN, np.int32),
                                       (pb.REDUCE_OP_SUM, np.dtype(">f8"))])
def test_collectives_of_known_shapes_are_answered_express_exact_and_counted(daemon, lanes, op, dtype):
    rng = np.random.default_rng(7)
    rounds = 6
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.CrossDeviceOpsStub(channel)
        for step in range(1, rounds + 1):
            arrays = {pid: [(rng.standard_normal(3) * 100).astype(dtype) for _ in range(2)] for pid in range(2)}
            replies = both(lanes, lambda pid: batch(pid, step, *arrays[pid], op=op, pairs=2))  # noqa: B023
            # The same four components in one process's request: the same plan on the same devices.
            alone = batch(0, 0, *arrays[0], *arrays[1], op=op, pairs=2)
            alone.ClearField("collective")
            want = [codec.decode(c.tensor) for c in stub.BatchReduce(alone, timeout=20).results[0].result.components]
            for pid, (code, body) in enumerate(replies):
                assert code == 0, body
                reply = pb.BatchReduceResponse.FromString(body)
                for r in reply.results:
                    got = [codec.decode(c.tensor) for c in r.result.components]
                    assert [c.device for c in r.result.components] == [f"/job:localhost/replica:0/task:0/device:"
                                                                       f"CPU:{2 * pid + i}" for i in range(2)]
                    assert all(g.dtype == want[0].dtype and g.tobytes() == want[0].tobytes() for g in got), (step, pid)
    # The first round validated the shapes on the full path; every later call went express.
    assert express_calls(daemon) == 2 * (rounds - 1)
    assert calls(daemon) == 2 * rounds + rounds


def test_reduce_calls_go_express_too(daemon, lanes):
    def reduce(pid: int, sequence: int, x) -> pb.ReduceRequest:
        one = batch(pid, sequence, *x, op=pb.REDUCE_OP_MEAN)
        return pb.ReduceRequest(reduce_op=one.reduce_op, value=one.pairs[0].value, collective=one.collective,
                                destinations=["CPU:0"])

    for step in range(1, 5):
        x = {pid: [np.float32([step + pid, 0.1]), np.float32([3 * pid, step / 3])] for pid in range(2)}
        replies = both(lanes, lambda pid: reduce(pid, step, x[pid]), method="Reduce")  # noqa: B023
        want = np.mean(np.stack([x[0][0], x[0][1], x[1][0], x[1][1]]), axis=0, dtype=np.float32)
        for code, body in replies:
            assert code == 0, body
            (component,) = pb.ReduceResponse.FromString(body).result.components
            assert component.device.endswith("CPU:0")
            np.testing.assert_allclose(codec.decode(component.tensor), want, rtol=1e-6)
    assert express_calls(daemon) == 2 * 3


def test_a_partner_that_comes_over_grpc_gets_the_collective_handed_over(daemon, lanes):
    arrays = [np.float32([1, 2]), np.float32([3, 4])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    held(daemon, lanes[0], batch(0, 2, *arrays))
    with grpc.insecure_channel(daemon.address) as channel:  # a held collective waits as any other
        status = pb_grpc.CrossDeviceOpsStub(channel).GetStatus(pb.GetStatusRequest(), timeout=20)
    assert status.collectives_waiting == 1
    assert metrics(daemon)[("xreduce_collectives_waiting", ())] == 1
    with grpc.insecure_channel(daemon.address) as channel:
        reply = pb_grpc.CrossDeviceOpsStub(channel).BatchReduce(batch(1, 2, *arrays), timeout=20)
    code, _, body = frames.read_reply(frames.FrameReader(lanes[0]).read())
    assert code == 0, body
    want = [[8.0, 12.0]] * 2
    assert results(body) == [want] and [[codec.decode(c.tensor).tolist() for c in reply.results[0].result.components]
                                       ] == [want]
    assert handed_over(daemon, "a participant came by the full path")


def test_a_partner_of_a_new_shape_gets_the_full_path_s_disagreement(daemon, lanes):
    arrays = [np.float32([1, 2]), np.float32([3, 4])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    other = [np.float32([1, 2, 3]), np.float32([3, 4, 5])]
    held(daemon, lanes[0], batch(0, 2, *arrays))
    replies = [lane_call(lanes[1], "BatchReduce", batch(1, 2, *other))]
    replies.append(frames.read_reply(frames.FrameReader(lanes[0]).read())[::2])
    for code, body in replies:
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], body
        assert b"process 1 sent float32[3] but process 0 sent float32[2] for tensor 0" in body, body
    assert handed_over(daemon, "a participant came by the full path")  # process 1's new shape
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 3, *arrays)))


@pytest.mark.parametrize("daemon", [0.2], indirect=True)
def test_a_late_partner_is_matched_on_the_full_path_after_the_hold(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    before = express_calls(daemon)
    lanes[0].sendall(frames.request("BatchReduce", 20.0, batch(0, 2, *arrays).SerializeToString()))
    handed_over(daemon, "not complete within the hold")  # after 0.2 s: process 0 now waits in the rendezvous
    code, body = lane_call(lanes[1], "BatchReduce", batch(1, 2, *arrays))
    assert code == 0 and results(body) == [[[6.0]] * 2], body
    code, _, body = frames.read_reply(frames.FrameReader(lanes[0]).read())
    assert code == 0 and results(body) == [[[6.0]] * 2], body
    assert express_calls(daemon) == before


def test_a_missing_partner_times_out_naming_it_as_the_full_path_does(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    code, body = lane_call(lanes[0], "BatchReduce", batch(0, 2, *arrays), timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], body
    assert b"waiting for process(es) [1]; arrived: [0]" in body, body
    assert handed_over(daemon, "not complete within the hold")  # at the caller's timeout, before the hold


def test_a_held_caller_that_hangs_up_fails_the_collective_for_its_partner(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    held(daemon, lanes[0], batch(0, 2, *arrays))
    lanes[0].close()
    handed_over(daemon, "process 0 hung up")  # before process 1 calls: it must not complete the collective
    code, body = lane_call(lanes[1], "BatchReduce", batch(1, 2, *arrays))
    assert code == grpc.StatusCode.ABORTED.value[0], body
    assert b"process 0 left (its call ended or its process died) before every process arrived" in body, body


def test_bad_bytes_in_a_known_shape_get_the_full_path_s_errors(daemon, lanes):
    arrays = [np.float32([1, 2]), np.float32([3, 4])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))

    def make(pid):
        r = batch(pid, 2, *arrays)
        if pid == 1:
            r.pairs[0].value.components[0].tensor.raw_data = b"\0" * 4
        return r

    (code0, body0), (code1, body1) = both(lanes, make)
    assert code1 == grpc.StatusCode.INVALID_ARGUMENT.value[0], body1
    assert body1 == b"pairs[0].value.components[0].tensor.raw_data: 4 bytes for float32[2], expected 8"
    assert code0 == grpc.StatusCode.ABORTED.value[0] and b"process 1's request was rejected" in body0, body0
    assert handed_over(daemon, "the reduction raised CodecError")
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 3, *arrays)))


def validated_alone(sock, method: str, message) -> None:
    """Sends ``message`` (of collective 100) alone, so that it times out, but its shape is validated; leaves it
    as collective 2, for the process's next call."""
    code, body = lane_call(sock, method, message, timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], body
    message.collective.sequence = 2


def refused(daemon, sock, method: str, message, error: bytes, reason: str) -> None:
    """``message``'s call fails INVALID_ARGUMENT with ``error``, after a hand-over for ``reason``."""
    code, body = lane_call(sock, method, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and error in body, body
    assert handed_over(daemon, reason)


def test_processes_calling_different_methods_get_the_full_path_s_error(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    one = batch(1, 100, *arrays)
    reduce = pb.ReduceRequest(reduce_op=one.reduce_op, value=one.pairs[0].value, collective=one.collective)
    validated_alone(lanes[1], "Reduce", reduce)
    held(daemon, lanes[0], batch(0, 2, *arrays))
    refused(daemon, lanes[1], "Reduce", reduce, b"process 1 called Reduce but process 0 called BatchReduce",
            "the processes called different methods")


def test_processes_disagreeing_on_num_processes_get_the_full_path_s_error(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    three = batch(0, 100, *arrays)
    three.collective.num_processes = 3
    validated_alone(lanes[0], "BatchReduce", three)
    held(daemon, lanes[0], three)
    refused(daemon, lanes[1], "BatchReduce", batch(1, 2, *arrays),
            b"process 1 says num_processes=2 but process 0 said num_processes=3",
            "the processes disagree on num_processes")


def test_a_process_id_sent_twice_is_refused_as_the_full_path_refuses_it(daemon, lanes):
    arrays = [np.float32([1]), np.float32([2])]
    assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
    replies = both(lanes, lambda pid: batch(0, 2, *arrays))
    codes = sorted(code for code, _ in replies)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2, replies
    assert all(b"process 0 contributed twice" in body for _, body in replies), replies
    assert handed_over(daemon, "a process arrived twice")


def test_a_held_collective_counts_against_max_collectives(start_daemon):
    daemon = start_daemon("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--max-collectives", "1",
                          "--lane-express-hold", "30", *DEVICES)
    with session(daemon.address) as (first, _):
        lanes = [connect(first.local_lane, first.session_id)[0] for _ in range(3)]
        arrays = [np.float32([1]), np.float32([2])]
        assert all(code == 0 for code, _ in both(lanes, lambda pid: batch(pid, 1, *arrays)))
        held(daemon, lanes[0], batch(0, 2, *arrays))
        code, body = lane_call(lanes[2], "BatchReduce", batch(1, 3, *arrays))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], body
        assert b"would be the 2nd collective waiting at once, over --max-collectives 1" in body, body
        code, body = lane_call(lanes[1], "BatchReduce", batch(1, 2, *arrays))
        assert code == 0 and results(body) == [[[6.0]] * 2], body


def test_the_express_lane_is_off_with_its_flag(start_daemon):
    daemon = start_daemon("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--lane-express-hold", "0",
                          *DEVICES)
    with session(daemon.address) as (first, _):
        lanes = [connect(first.local_lane, first.session_id)[0] for _ in range(2)]
        for step in range(1, 4):
            replies = both(lanes, lambda pid: batch(pid, step, np.float32([1]), np.float32([2])))  # noqa: B023
            assert all(code == 0 and results(body) == [[[6.0]] * 2] for code, body in replies), replies
    assert express_calls(daemon) == 0 and calls(daemon) == 6
