"""Who is in a group across nodes: epochs, jobs side by side, processes and daemons that cannot take part."""

from __future__ import annotations

import re
import signal
import socket
import time

import grpc
import numpy as np
import pytest
from multinode import (
    FAILS_WITHIN,
    NODE_FLAGS,
    exact_total,
    finish,
    group_status,
    inputs,
    results,
    same_bytes,
    without_torch,
)
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce_bench.faults import NodeProcess, decode, free_address

pytestmark = pytest.mark.slow


def _reduce(seed: int) -> dict:
    return {"op": "reduce", "seed": seed, "num_packs": 0,
            "tensors": [{"dtype": "int32", "shape": [6]}, {"dtype": "float64", "shape": [2, 2]}]}


def _check_sums(events: list[list[dict]], steps: dict[int, int], replicas: int) -> None:
    """Step ``i`` of every process is the exact sum of seed ``steps[i]`` over ``replicas`` replicas."""
    for i, seed in steps.items():
        want = [exact_total(inputs(seed, t, range(replicas), d, s, "int"))
                for t, (d, s) in enumerate([("int32", [6]), ("float64", [2, 2])])]
        for pid, process in enumerate(events):
            event = process[i]
            assert event["ok"], (pid, event)
            for components, expected in zip(event["result"], want):
                assert same_bytes([decode(c) for c in components], expected), (pid, i)


def test_initializing_again_forms_a_new_epoch_and_the_old_epoch_is_refused(nodes):
    script = [{"op": "init"}, _reduce(1), {"op": "barrier"}, {"op": "shutdown"}, {"op": "init"}, _reduce(2),
              {"op": "barrier"}]
    processes = nodes.launch([0, 1], script)
    try:
        first = [p.step(0, 120) for p in processes]
        for p in processes:
            p.go()
        second = [p.step(4, 120) for p in processes]
        for p in processes:
            p.step(5, 120)
        old = {e["result"]["epoch"] for e in first}
        new = {e["result"]["epoch"] for e in second}
        gid = first[0]["result"]["group"]
        assert len(old) == len(new) == 1 and new.pop() > (epoch := old.pop()), (first, second)
        assert {e["result"]["group"] for e in first + second} == {gid}, "a new epoch, the same group"
        current = group_status(nodes.address(0), gid)
        assert (current.state, current.epoch) == ("active", epoch + 1)
        for pid in (0, 1):
            value = pb.DistributedValue(components=[pb.Component(device="CPU:0",
                                                                 tensor=codec.encode(np.ones(2, np.float32)))])
            request = pb.BatchReduceRequest(
                reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value)],
                collective=pb.CollectiveSpec(group=gid, num_processes=2, process_id=pid, sequence=7, epoch=epoch))
            with grpc.insecure_channel(nodes.address(pid)) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    pb_grpc.CrossDeviceOpsStub(channel).BatchReduce(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value
            assert f"epoch {epoch} but the group is at epoch {epoch + 1}" in refused.value.details()
        for p in processes:
            p.go()
        events = [p.steps(60) for p in processes]
    finally:
        for p in processes:
            p.close()
    _check_sums(events, {1: 1, 5: 2}, replicas=8)


def test_two_jobs_on_the_same_daemons_do_not_mix(three_nodes):
    """Two jobs, both of group "default", on nodes 0 and 1 at once: one's coordinator on node 0, the other's
    on node 1."""
    script = [{"op": "init"}, _reduce(10), _reduce(11), {"op": "strategy", "reduce_op": "SUM"}]
    other = [{"op": "init"}, _reduce(20), _reduce(21), {"op": "strategy", "reduce_op": "SUM"}]
    first = three_nodes.launch([0, 1], script, coordinator=free_address())
    second = three_nodes.launch([1, 0], other, coordinator=free_address())
    try:
        events = [[p.steps(120) for p in first], [p.steps(120) for p in second]]
        for p in first + second:  # each leaves its group at exit: let it, rather than kill it first
            assert p.proc.wait(60) == 0
    finally:
        for p in first + second:
            p.close()
    gids = [{e[0]["result"]["group"] for e in job} for job in events]
    assert all(len(g) == 1 for g in gids) and gids[0] != gids[1], gids
    _check_sums(events[0], {1: 10, 2: 11}, replicas=8)
    _check_sums(events[1], {1: 20, 2: 21}, replicas=8)
    for job in events:
        assert [results(process)[3]["reduced"][0]["hex"] for process in job] == [
            np.array([36.0, 64.0]).tobytes().hex()] * 2
    for address in (three_nodes.address(0), three_nodes.address(1)):
        for (gid,) in gids:
            # two groups, each whole: "left" once its processes have ended (they leave at exit), never "failed"
            assert group_status(address, gid).state in ("active", "left")


def _until_listening(address: str, timeout: float = 60.0) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens at {address}"
            time.sleep(0.05)


def test_a_process_pointed_at_the_coordinators_port_is_told_it_is_no_daemon(start_daemon):
    """Process 1's XREDUCE_ADDRESS is the job's first address (the coordinator's Peers port), not its daemon."""
    node = start_daemon("--listen", "127.0.0.1:0", *NODE_FLAGS, "--collective-timeout", "3")
    coordinator = free_address()
    first = NodeProcess(node.address, coordinator, 2, 0, [{"op": "init"}])
    try:
        _until_listening(coordinator)  # process 0's daemon serves the coordinator while process 0 joins
        misled = NodeProcess(coordinator, coordinator, 2, 1, [{"op": "init"}])
        (event,), (waited,) = finish([misled, first])
    finally:
        first.close()
    assert not waited["ok"] and "[1]" in waited["message"], waited  # process 0 was told who is missing
    assert not event["ok"]
    assert coordinator in event["message"] and "daemon" in event["message"], event["message"]


def test_process_0_whose_daemon_is_not_on_the_coordinators_host_is_told_so(nodes):
    elsewhere = "192.0.2.1:" + free_address().rpartition(":")[2]  # TEST-NET-1: never this machine's
    process = NodeProcess(nodes.address(0), elsewhere, 2, 0, [{"op": "init"}])
    try:
        (event,) = process.steps(120)
    finally:
        process.close()
    assert not event["ok"] and event["code"] == "FAILED_PRECONDITION", event
    assert elsewhere in event["message"] and "job_addresses[0]" in event["message"], event["message"]


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_a_daemon_without_torch_refuses_a_group_across_nodes(nodes, start_daemon, tmp_path, how):
    """Node 1's daemon cannot import torch: every process of the group is told what to install."""
    node1 = start_daemon("--listen", "127.0.0.1:0", *NODE_FLAGS, "--collective-timeout", "20",
                         env=without_torch(tmp_path, how))
    processes = [NodeProcess(nodes.address(0), nodes.coordinator, 2, 0, [{"op": "init"}]),
                 NodeProcess(node1.address, nodes.coordinator, 2, 1, [{"op": "init"}])]
    try:
        events = [p.steps(120)[0] for p in processes]
    finally:
        for p in processes:
            p.close()
    for pid, event in enumerate(events):
        assert not event["ok"] and event["code"] == "FAILED_PRECONDITION", (pid, event)
        assert "xreduce[cluster]" in event["message"], (pid, event["message"])


def test_a_daemon_without_torch_still_serves_a_group_of_one_node(start_daemon, tmp_path):
    daemon = start_daemon("--listen", "127.0.0.1:0", *NODE_FLAGS, env=without_torch(tmp_path, "missing"))
    coordinator = free_address()
    events = finish([NodeProcess(daemon.address, coordinator, 2, p, [{"op": "init"}, _reduce(3)]) for p in range(2)])
    assert [results(e)[0]["num_nodes"] for e in events] == [1, 1]
    _check_sums(events, {1: 3}, replicas=4)


def test_a_daemon_stops_within_its_grace_while_a_join_waits_at_its_coordinator(start_daemon):
    """Process 0 joined, process 1 never comes: SIGTERM still stops process 0's daemon, which serves the
    coordinator, within its grace (1 s) and slack, not when the join's 30 s run out."""
    node = start_daemon("--listen", "127.0.0.1:0", *NODE_FLAGS, "--collective-timeout", "30", "--grace-seconds", "1")
    coordinator = free_address()
    process = NodeProcess(node.address, coordinator, 2, 0, [{"op": "init"}])
    try:
        _until_listening(coordinator)
        since = time.monotonic()
        assert node.terminate(signal.SIGTERM, timeout=60) == 0, node.log()
        stopped = time.monotonic() - since
    finally:
        process.close()
    assert stopped <= 1 + 10, f"the daemon took {stopped:.1f} s to exit after SIGTERM (grace 1 s)"


def test_a_process_killed_without_shutdown_ends_its_groups_epoch_at_once(nodes):
    """Process 1 shares node 0 with process 0 and is SIGKILLed between collectives: its session with its daemon
    ends, so the epoch ends on every node, naming it; the others' next collective fails with ABORTED at once
    (not at the 20 s collective timeout), and no daemon keeps the group active for a job that is gone."""
    script = [{"op": "init"}, _reduce(30), {"op": "barrier"}, _reduce(31)]
    processes = nodes.launch([0, 0, 1], script)
    try:
        inits = [p.step(0, 120) for p in processes]
        for p in processes:
            assert p.step(1, 120)["ok"]
        gid, epoch = inits[0]["result"]["group"], inits[0]["result"]["epoch"]
        killed_at = processes[1].signal(signal.SIGKILL)
        ended = {}
        while len(ended) < 2 and time.monotonic() - killed_at < FAILS_WITHIN:
            for node in (0, 1):
                state = group_status(nodes.address(node), gid)
                if state.epoch == epoch and state.state == "failed":
                    ended.setdefault(node, state)
            time.sleep(0.1)
        assert sorted(ended) == [0, 1], f"the epoch did not end on every node within {FAILS_WITHIN}s: {ended}"
        for state in ended.values():
            assert "process 1" in state.reason and "ended without leaving" in state.reason, state.reason
        for p in (processes[0], processes[2]):
            p.go()
        failed = [p.step(3, 60) for p in (processes[0], processes[2])]
    finally:
        for p in processes:
            p.close()
    for event in failed:
        assert not event["ok"] and event["code"] == "ABORTED", event
        assert "process 1" in event["message"] and "ended without leaving" in event["message"], event


def test_a_bad_request_across_nodes_fails_that_collective_only_and_the_group_goes_on(nodes):
    """Process 1 (on node 1) names a device the job does not have: its SDK refuses it and gives the collective
    up (``CollectiveSpec.abort``), which fails that collective for every process of every node with process
    1's error; the next collectives of the same epoch succeed, and neither daemon logs an ERROR for it (no
    engine call runs on a torn-down engine). A request the daemon itself rejects takes the same way."""
    bad = {**_reduce(41), "bad_device": "CPU:99"}

    def script(pid: int) -> list[dict]:
        return [{"op": "init"}, _reduce(40), bad if pid == 1 else _reduce(41), _reduce(42), _reduce(43),
                {"op": "shutdown"}]

    marks = [len(nodes.daemons[n].log()) for n in (0, 1)]
    processes = nodes.launch([0, 1], script)
    try:
        events = [p.steps(120) for p in processes]
    finally:
        for p in processes:
            p.close()
    offender, other = events[1][2], events[0][2]
    assert not offender["ok"] and offender["code"] == "NOT_FOUND" and "CPU:99" in offender["message"], offender
    assert not other["ok"] and other["code"] == "ABORTED", other
    assert "process 1" in other["message"] and "CPU:99" in other["message"], other
    assert {e["result"]["epoch"] for e in (events[0][0], events[1][0])} == {events[0][0]["result"]["epoch"]}
    _check_sums([[p[1], p[3], p[4]] for p in events], {0: 40, 1: 42, 2: 43}, replicas=8)
    for n, mark in zip((0, 1), marks):
        log = nodes.daemons[n].log()[mark:]
        assert " ERROR " not in log and "epoch_failed" not in log and "group_failed" not in log, log


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["sigkill", "sigterm", "sigint"])
def test_a_process_ended_while_it_joins_across_nodes_leaves_no_registration_behind(nodes, how):
    """Process 0 waits in initialize() for process 1 (of another node) and is ended by ``how``: its
    registration goes with it, so the restarted job (the same process ids) forms an epoch at once."""
    mark = len(nodes.daemons[0].log())
    victim = NodeProcess(nodes.address(0), nodes.coordinator, 2, 0, [{"op": "init"}])
    try:
        deadline = time.monotonic() + 60
        while not re.search(r"event=registered .*process=0 registered=1", nodes.daemons[0].log()[mark:]):
            assert time.monotonic() < deadline and victim.proc.poll() is None, victim.stderr
            time.sleep(0.05)
        victim.signal(how)
        victim.proc.wait(30)
    finally:
        victim.close()
    processes = nodes.launch([0, 1], [{"op": "init"}, _reduce(50), {"op": "shutdown"}])
    try:
        events = [p.steps(120) for p in processes]
    finally:
        for p in processes:
            p.close()
    for process in events:
        assert process[0]["ok"], process[0]
    _check_sums([p[1:2] for p in events], {0: 50}, replicas=8)
