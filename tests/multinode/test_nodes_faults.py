"""Faults in the middle of a collective across nodes, on loopback: a node's daemon killed or stopped, a
training process killed, the coordinator's daemon killed.

Two node daemons (peer timeout 2 s), three training processes: process 0 on node 0, processes 1 and 2 on
node 1. Each reduces a small tensor, then enters a 32 MiB collective; some processes are in it when the
fault comes, one is held back and calls after (so the collective cannot have completed before the fault).
Every surviving participant must fail with ABORTED or UNAVAILABLE naming what was lost, within twice the
peer timeout and slack; nobody gets a result; the surviving daemon still serves a single-process reduce
and reports the epoch failed; then the processes (a restarted daemon, a restarted process) initialize
again and form a new epoch that reduces correctly.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
from daemons import Daemons
from multinode import FAILS_WITHIN, FAST_PEERS, NODE_FLAGS, group_metrics, group_status, same_bytes, status
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
from xreduce_bench.faults import Cluster, NodeProcess, decode

pytestmark = pytest.mark.slow

FLAGS = [*NODE_FLAGS, *FAST_PEERS, "--collective-timeout", "15", "--metrics-listen", "127.0.0.1:0"]
"""The collective timeout is well above the bound, so that a wait the fault does not end shows."""
PLACEMENT = [0, 1, 1]
BIG = 8 << 20
"""float32 elements of the collective the fault hits: 32 MiB a replica."""


def _small(name: str) -> dict:
    return {"op": "reduce", "name": name, "tensors": [{"dtype": "float32", "shape": [4]}], "fill": "index"}


SCRIPT = [
    {"op": "init"}, _small("warm"), {"op": "barrier"},
    {"op": "reduce", "fill": "index", "digest": True, "tensors": [{"dtype": "float32", "shape": [BIG]}]},
    {"op": "barrier"}, {"op": "shutdown"}, {"op": "init"}, _small("again"),
]
INIT, WARM, ENTER, FAULTED, AFTER, SHUTDOWN, INIT_AGAIN, AGAIN = range(len(SCRIPT))
RESTARTED = [{"op": "init"}, _small("again")]
"""A killed process's replacement: it joins the new epoch."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One kind of fault: who is in the collective when it comes, who is held back, what is lost."""

    lost_node: int
    in_flight: tuple[int, ...]
    held: tuple[int, ...]
    apply: Callable[[Cluster, list[NodeProcess]], None]
    victim: int | None = None
    """A training process killed (its node survives)."""
    stopped: bool = False
    """The lost node's daemon is stopped: its processes hang until it is killed for the restart."""
    settle: float = 0.0
    """Seconds between the group's first collective and the fault: a stopped node is found by its silence,
    which begins with its first heartbeat (see the test of a node stopped before it)."""

    def names(self, cluster: Cluster, pid: int, placement: list[int]) -> list[str]:
        """What process ``pid``'s error may name: the lost node or process, or its own lost daemon."""
        if placement[pid] == self.lost_node and self.victim is None:
            return [cluster.address(self.lost_node)]
        return [f"process {self.victim}"] if self.victim is not None else [f"node {self.lost_node}"]


def _signal_daemon(node: int, sig: int):
    def apply(cluster: Cluster, processes: list[NodeProcess]) -> None:
        cluster.daemons[node].proc.send_signal(sig)
    return apply


def _kill_process(pid: int):
    def apply(cluster: Cluster, processes: list[NodeProcess]) -> None:
        processes[pid].signal(signal.SIGKILL)
    return apply


FAULTS = {
    # Process 0 is in the engine (the only one on its node); process 1 waits for process 2 on node 1.
    "sigkill-node-1-daemon": Fault(1, in_flight=(0, 1), held=(2,), apply=_signal_daemon(1, signal.SIGKILL)),
    "sigstop-node-1-daemon": Fault(1, in_flight=(0, 1), held=(2,), apply=_signal_daemon(1, signal.SIGSTOP),
                                   stopped=True, settle=2.0),
    # Process 1 has arrived on node 1 and waits for process 2 when it dies.
    "sigkill-process-1": Fault(1, in_flight=(0, 1), held=(2,), apply=_kill_process(1), victim=1),
    # The coordinator's node: process 1 waits on node 1 for process 2, which comes only after process 1's
    # outcome (or the bound) is in.
    "sigkill-node-0-daemon": Fault(0, in_flight=(0, 1), held=(2,), apply=_signal_daemon(0, signal.SIGKILL)),
}


@pytest.fixture(scope="module")
def fault_nodes():
    """The module's two node daemons; a test's fault may kill or stop one (it restarts it after)."""
    with Daemons(stop_signal=signal.SIGKILL) as start:
        yield Cluster(2, FLAGS, start=start)


@pytest.fixture
def cluster(fault_nodes) -> Cluster:
    """The two node daemons, both running, with a coordinator address of this test's own."""
    for node, daemon in enumerate(fault_nodes.daemons):
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)
        if daemon.proc.poll() is not None or _stopped(daemon.proc.pid):
            fault_nodes.restart(node)
    fault_nodes.new_job()
    return fault_nodes


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def _waiting(address: str, count: int, timeout: float = 30.0) -> None:
    """Until ``count`` calls wait in the daemon's rendezvous (bounded)."""
    deadline = time.monotonic() + timeout
    while status(address).collectives_waiting < count:
        assert time.monotonic() < deadline, f"no collective waits in the daemon at {address}"
        time.sleep(0.02)


def _failed(event: dict, pid: int, since: float, names: list[str], bounded: bool = True) -> None:
    assert not event["ok"], f"process {pid} got a result from the collective the fault hit"
    where = f"process {pid}: {event['code']} after {event['t'] - since:.1f} s: {event['message']}"
    assert event["code"] in ("ABORTED", "UNAVAILABLE"), where
    assert any(n in event["message"] for n in names), f"{where} (should name one of {names})"
    if bounded:
        assert event["t"] - since <= FAILS_WITHIN, f"{where} (bound: {FAILS_WITHIN} s)"


def _lost_with_its_node(fault: Fault, pid: int) -> bool:
    """Whether process ``pid`` hangs with a stopped daemon (its outcome comes once the daemon is killed)."""
    return fault.stopped and PLACEMENT[pid] == fault.lost_node


def _strike(cluster: Cluster, processes: list[NodeProcess], fault: Fault) -> float:
    """Lets the in-flight processes into the collective, then applies the fault; returns when."""
    time.sleep(fault.settle)
    for pid in fault.in_flight:
        processes[pid].go()
    for pid in fault.in_flight:
        processes[pid].calling(FAULTED)
    if fault.victim is not None:
        _waiting(cluster.address(PLACEMENT[fault.victim]), 1)
    since = time.monotonic()
    fault.apply(cluster, processes)
    return since


def _check_participants(cluster: Cluster, processes: list[NodeProcess], fault: Fault, since: float) -> None:
    """Every participant still running fails, naming what was lost: those in the collective within the
    bound, then those held back (which call after the fault)."""
    for pid in fault.in_flight:
        if pid != fault.victim and not _lost_with_its_node(fault, pid):
            _failed(processes[pid].step(FAULTED, 60), pid, since, fault.names(cluster, pid, PLACEMENT))
    for pid in fault.held:
        processes[pid].go()
    for pid in fault.held:
        if not _lost_with_its_node(fault, pid):
            _failed(processes[pid].step(FAULTED, 60), pid, since, fault.names(cluster, pid, PLACEMENT),
                    bounded=False)


def _check_survivor(cluster: Cluster, fault: Fault, gid: str, epoch: int) -> None:
    """The surviving daemon serves a single-process reduce and reports the epoch failed, naming the loss."""
    surviving = 1 - fault.lost_node if fault.victim is None else 0
    address = cluster.address(surviving)
    ones = PerReplica([np.ones(3, np.float32)] * 4, devices=[f"CPU:{d}" for d in range(4)])
    assert HierarchicalCopyAllReduce(address=address).reduce("SUM", ones, ones).values[3].tolist() == [4.0] * 3
    group = group_status(address, gid)
    assert (group.epoch, group.state) == (epoch, "failed"), group
    lost = {(p.node_index, pid) for p in group.lost for pid in p.process_ids}
    if fault.victim is None:
        assert lost == {(fault.lost_node, p) for p, n in enumerate(PLACEMENT) if n == fault.lost_node}, group
    else:
        assert lost == {(PLACEMENT[fault.victim], fault.victim)}, f"the status should name the lost process: {group}"
    samples = group_metrics(cluster.daemons[surviving], gid)
    assert (samples["xreduce_group_failed"], samples["xreduce_group_epoch"]) == (1.0, epoch), samples
    assert samples["xreduce_group_lost_peers"] == len(group.lost), samples


def _rejoin(cluster: Cluster, processes: list[NodeProcess], fault: Fault, epoch: int) -> None:
    """The lost daemon or process starts again; every process initializes again: a new epoch that reduces."""
    if fault.victim is None:
        cluster.restart(fault.lost_node)
    for pid, p in enumerate(processes):  # a stopped daemon's processes fail once it is gone
        if _lost_with_its_node(fault, pid):
            event = p.step(FAULTED, 60)
            # UNAVAILABLE when the call was held by the stopped daemon; NOT_FOUND naming the group when it
            # reached the restarted one, which knows no group
            assert not event["ok"], event
            assert event["code"] == "UNAVAILABLE" or (
                event["code"] == "NOT_FOUND" and "this daemon is in no group" in event["message"]), event
    if fault.victim is not None:
        processes[fault.victim] = NodeProcess(cluster.address(PLACEMENT[fault.victim]), cluster.coordinator,
                                              len(PLACEMENT), fault.victim, RESTARTED)
    for pid, p in enumerate(processes):
        if pid != fault.victim:
            p.go()
    inits, sums = [], []
    for pid, p in enumerate(processes):
        steps = {e["i"]: e for e in p.steps(120)}
        first = 0 if pid == fault.victim else INIT_AGAIN
        assert steps[first]["ok"] and steps[first + 1]["ok"], (pid, steps.get(first), steps.get(first + 1))
        inits.append(steps[first]["result"])
        sums.append(steps[first + 1]["result"][0])
    assert len({i["epoch"] for i in inits}) == 1 and inits[0]["epoch"] > epoch, inits
    assert [i["node_index"] for i in inits] == PLACEMENT
    replicas = sum(len(i["replicas"]) for i in inits)
    want = np.full(4, replicas * (replicas + 1) // 2, np.float32)
    for pid, components in enumerate(sums):
        assert same_bytes([decode(c) for c in components], want), (pid, components)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_fault_mid_collective_fails_every_survivor_and_a_new_epoch_forms(cluster, kind):
    fault = FAULTS[kind]
    processes = cluster.launch(PLACEMENT, SCRIPT)
    try:
        warm = [p.step(WARM, 120) for p in processes]
        assert all(e["ok"] for e in warm), warm
        info = processes[0].step(INIT)["result"]
        since = _strike(cluster, processes, fault)
        _check_participants(cluster, processes, fault, since)
        _check_survivor(cluster, fault, info["group"], info["epoch"])
        _rejoin(cluster, processes, fault, info["epoch"])
    finally:
        for p in processes:
            p.close()


def test_a_node_stopped_before_its_first_heartbeat_is_lost_within_the_bound(cluster):
    """A node whose daemon stops right after the group formed (before it first beats) is lost too."""
    script = [{"op": "init"}, {"op": "reduce", "fill": "index", "tensors": [{"dtype": "float32", "shape": [4]}]}]
    processes = cluster.launch([0, 1], script)
    try:
        processes[1].step(0, 120)
        since = time.monotonic()
        cluster.daemons[1].proc.send_signal(signal.SIGSTOP)
        assert processes[0].step(0, 120)["ok"]
        _failed(processes[0].step(1, 60), 0, since, ["node 1"])
    finally:
        for p in processes:
            p.close()


def test_a_restarted_coordinator_forms_an_epoch_the_old_one_cannot_be_taken_for(cluster):
    """After the coordinator's daemon restarts, the new epoch's number is not the old one's: a collective of
    the old epoch must stay refused."""
    script = [{"op": "init"}, _small("before"), {"op": "barrier"}, {"op": "shutdown"}, {"op": "init"},
              _small("after")]
    processes = cluster.launch([0, 1], script)
    try:
        assert all(p.step(1, 120)["ok"] for p in processes)
        old = processes[0].step(0)["result"]["epoch"]
        cluster.daemons[0].proc.send_signal(signal.SIGKILL)
        cluster.restart(0)
        for p in processes:
            p.go()
        again = [p.steps(120) for p in processes]
    finally:
        for p in processes:
            p.close()
    assert all(e["ok"] for events in again for e in events[3:]), again
    epochs = sorted({events[4]["result"]["epoch"] for events in again})
    assert len(epochs) == 1 and epochs[0] > old, f"epoch {old} before the restart, {epochs} after"
