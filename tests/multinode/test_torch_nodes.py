"""``xreduce.torch`` across two nodes: network namespaces at 10.0.0.1 and 10.0.0.2, a daemon in each, the ranks of a
``torch.distributed`` job started as plain processes in the nodes with torchrun's variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` node 1's address, ``MASTER_PORT``): torch's store listens on node 1 and node 2's
ranks reach it over the link. DDP (``examples/torch_ddp.py``) over ``xreduce`` against the same ranks over Gloo;
the same job under torchrun itself, an agent in each node; where the coordinator serves; a rank killed during
training.
"""

from __future__ import annotations

import itertools
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from children import child_env
from netns import INTERFACE, Nodes, needs_namespaces, start_node_daemons
from torch_ranks import WORKER

pytestmark = [needs_namespaces, pytest.mark.slow]
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT = 2.0
DAEMON = "127.0.0.1:50551"
"""Where each node's daemon serves, on the node's own loopback (:func:`start_node_daemons`)."""
JOB_TIMEOUT = 180.0
"""Seconds a job's ranks may take to finish (four ranks importing torch on two cores take about 20)."""
PORTS = itertools.count(29500, 10)
"""Each job's ``MASTER_PORT``: the namespaces are this module's own, where nothing else listens below the
ephemeral range; the coordinator takes the port after it."""
ATOL, RTOL = 1e-6, 1e-5
"""How far the weights of 4 ranks may be from Gloo's (``torch.allclose``): see the DDP test."""


@pytest.fixture(scope="module")
def nodes():
    """Two nodes, a daemon of 4 devices in each; every job of the module has a coordinator address of its own."""
    with Nodes(2) as made:
        start_node_daemons(made, 4, PEER_TIMEOUT)
        yield made


class Job:
    """The ranks of one job, rank r in node ``1 + r // per_node``; their output read as it comes."""

    def __init__(self, nodes: Nodes, argv: list[str], per_node: int, **env: str):
        self.port = next(PORTS)
        size = 2 * per_node
        base = {**clean_env(), "PYTHONUNBUFFERED": "1", "XREDUCE_ADDRESS": DAEMON, "XREDUCE_STALL_WARNING_SECONDS": "0",
                "GLOO_SOCKET_IFNAME": INTERFACE, "WORLD_SIZE": str(size), "MASTER_ADDR": nodes[1].address,
                "MASTER_PORT": str(self.port), **env}
        self.lines: list[queue.SimpleQueue] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(size):
            proc = nodes[1 + rank // per_node].popen([sys.executable, *argv], env={**base, "RANK": str(rank)},
                                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True)
            lines: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
            self.procs.append(proc)
            self.lines.append(lines)
        self.output = [[] for _ in self.procs]

    def next_line(self, rank: int, deadline: float) -> str | None:
        """Rank ``rank``'s next line; None once it has exited. Fails the test when the deadline passes."""
        try:
            line = self.lines[rank].get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            self.kill()
            pytest.fail(f"rank {rank} wrote nothing more within {JOB_TIMEOUT:g} s; so far: {self.output[rank]}")
        if line is not None:
            self.output[rank].append(line)
        return line

    def event(self, rank: int, events: tuple[str, ...], deadline: float) -> dict:
        """Rank ``rank``'s next JSON event of one of ``events``."""
        while (line := self.next_line(rank, deadline)) is not None:
            if line.startswith("{") and (event := json.loads(line))["event"] in events:
                return event
        return {"event": "exited", "status": self.procs[rank].wait(30), "output": "".join(self.output[rank][-40:])}

    def finish(self) -> list[str]:
        """Every rank's whole output, once each has exited with status 0 (the others killed when one has not)."""
        deadline = time.monotonic() + JOB_TIMEOUT
        try:
            for rank, proc in enumerate(self.procs):
                while self.next_line(rank, deadline) is not None:
                    pass
                assert proc.wait(max(deadline - time.monotonic(), 1.0)) == 0, "".join(self.output[rank][-40:])
        finally:
            self.kill()
        return ["".join(out) for out in self.output]

    def kill(self) -> None:
        """SIGKILLs the ranks still running."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


def _pump(proc: subprocess.Popen, lines: queue.SimpleQueue) -> None:
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def clean_env() -> dict[str, str]:
    """A child's environment with none of this process's settings (no ``MASTER_*``, no ``XREDUCE_*``), but its
    ``PYTHONPATH``: this checkout's packages and the tests' helpers, as :func:`child_env` gives."""
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": child_env()["PYTHONPATH"]}


def groups(node) -> list[dict]:
    """The groups across nodes that ``node``'s daemon reports (``xreduce status --json``)."""
    done = node.run([sys.executable, "-m", "xreduce._cli", "status", "--address", DAEMON, "--json"],
                    env=clean_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout).get("groups", [])


def coordinated_at(node, coordinator: str) -> list[dict]:
    """The groups ``node``'s daemon knows whose coordinator is at ``coordinator`` (a torch group is named
    ``torch-<hex>@<coordinator>``)."""
    return [g for g in groups(node) if g["group"].endswith(f"@{coordinator}")]


def ddp(nodes: Nodes, backend: str, per_node: int, out: Path) -> Job:
    """``examples/torch_ddp.py`` (30 steps) over ``backend`` on ``per_node`` ranks per node; rank 0's weights
    in ``out``. Rank 0 says every rank ended with the same weights (the example gathers their digests)."""
    job = Job(nodes, ["examples/torch_ddp.py", "--backend", backend, "--out", str(out)], per_node)
    outputs = job.finish()
    assert f"OK: {2 * per_node} rank(s) end with the same weights" in outputs[0], outputs
    assert f"backend {backend}, {2 * per_node} rank(s)" in outputs[0]
    return job


@pytest.mark.parametrize("per_node", [1, 2])
def test_ddp_across_two_nodes_trains_to_gloos_weights(nodes, tmp_path, per_node):
    """DDP over ``xreduce`` and over ``gloo``, the same ranks, the same batches. DDP divides each gradient by the
    world size, then sums. With one rank per node the sum is one addition, ``a + b`` in both: the same weights
    bit for bit. With two per node xreduce adds ``(g0 + g1) + (g2 + g3)`` (the node sums, then across), Gloo's
    ring another order: the weights differ in the last bits; after the example's 30 steps (SGD with momentum,
    weights of order 0.1) by at most 1.8e-7 here; the bound is ``atol=1e-6, rtol=1e-5``.

    The xreduce group spans the nodes: each daemon shows it with both nodes, their ranks and collectives
    that crossed, its coordinator in node 1's daemon at ``MASTER_PORT + 1`` (no other variable is set)."""
    xr = ddp(nodes, "xreduce", per_node, tmp_path / "xreduce.pt")
    ddp(nodes, "gloo", per_node, tmp_path / "gloo.pt")
    ours, gloos = torch.load(tmp_path / "xreduce.pt"), torch.load(tmp_path / "gloo.pt")
    if per_node == 1:
        assert all(torch.equal(a, b) for a, b in zip(ours, gloos))
    else:
        diff = max(float((a - b).abs().max()) for a, b in zip(ours, gloos))
        print(f"\n4 ranks: largest difference from Gloo's weights {diff:.3g}")
        assert all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(ours, gloos)), diff
    coordinator = f"{nodes[1].address}:{xr.port + 1}"
    for index, node in enumerate(nodes):
        (group,) = coordinated_at(node, coordinator)
        where = f"node {index}: {group}"
        assert (group["node_index"], group["coordinator"], group["engine"]) == (index, index == 0, "gloo"), where
        assert [n["address"] for n in group["nodes"]] == [nodes[1].address, nodes[2].address], where
        ranks = [[p["process_id"] for p in n["processes"]] for n in group["nodes"]]
        assert ranks == [list(range(per_node)), list(range(per_node, 2 * per_node))], where
        assert int(group["cross_node_collectives"]) > 0 and group["state"] == "left", where


def test_torchrun_across_two_nodes_trains_the_weights_of_the_same_ranks_started_plain(nodes, tmp_path):
    """torchrun itself, an agent in each node (``--nnodes 2 --node-rank N``, its static rendezvous: node 1's agent
    serves torch's store at ``MASTER_ADDR:MASTER_PORT``), two ranks each, ``examples/torch_ddp.py`` over
    ``xreduce``: the weights of the same four ranks started as plain processes, bit for bit (the same node sums,
    then the same sum across), and the group spans both nodes with torchrun's ranks in them."""
    ddp(nodes, "xreduce", 2, tmp_path / "plain.pt")
    port = next(PORTS)
    env = {**clean_env(), "PYTHONUNBUFFERED": "1", "XREDUCE_ADDRESS": DAEMON, "XREDUCE_STALL_WARNING_SECONDS": "0",
           "GLOO_SOCKET_IFNAME": INTERFACE}
    agents = [node.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                          "--node-rank", str(k), "--master-addr", nodes[1].address, "--master-port", str(port),
                          "examples/torch_ddp.py", "--backend", "xreduce", "--out", str(tmp_path / "torchrun.pt")],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for k, node in enumerate(nodes)]
    try:
        outputs = [agent.communicate(timeout=JOB_TIMEOUT)[0] for agent in agents]
    finally:  # an agent that SIGTERM reaches ends its ranks first
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()
                try:
                    agent.wait(10)
                except subprocess.TimeoutExpired:
                    agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert "backend xreduce, 4 rank(s)" in outputs[0] and "OK: 4 rank(s) end with the same weights" in outputs[0]
    ours, theirs = torch.load(tmp_path / "torchrun.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for index, node in enumerate(nodes):
        (group,) = coordinated_at(node, f"{nodes[1].address}:{port + 1}")
        ranks = [[p["process_id"] for p in n["processes"]] for n in group["nodes"]]
        assert (group["node_index"], ranks) == (index, [[0, 1], [2, 3]]), group


def test_the_coordinator_serves_where_xreduce_coordinator_says(nodes):
    """``XREDUCE_COORDINATOR`` wins over ``MASTER_ADDR:MASTER_PORT+1``: node 1's daemon serves the coordinator
    there, and the group is known by that address on both nodes."""
    coordinator = f"{nodes[1].address}:{next(PORTS)}"
    job = Job(nodes, [str(WORKER), "train", "--steps", "2"], 1, XREDUCE_COORDINATOR=coordinator)
    outputs = job.finish()
    assert all('{"event": "done", "step": 2}' in text for text in outputs), outputs
    for index, node in enumerate(nodes):
        (group,) = coordinated_at(node, coordinator)
        assert (group["coordinator"], len(group["nodes"])) == (index == 0, 2), group
        assert not coordinated_at(node, f"{nodes[1].address}:{job.port + 1}")


def test_a_rank_killed_during_training_fails_the_other_nodes_next_step_naming_it(nodes):
    """Rank 1 (node 2) SIGKILLed while both train: rank 0's next backward pass raises, torch re-raising the
    failed all-reduce of DDP's bucket as a ``RuntimeError`` (as it does Gloo's), its message the
    ``DistBackendError``'s, naming the process and its node (a future failed by ``set_exception`` crashed DDP's
    reducer here once: SIGSEGV); rank 0 then exits, and its daemon shows the group's lost process. Every wait is
    bounded; the time from the kill to the error is printed, not asserted."""
    job = Job(nodes, [str(WORKER), "train"], 1)
    deadline = time.monotonic() + JOB_TIMEOUT
    for rank in range(2):
        assert job.event(rank, ("training",), deadline)["event"] == "training", job.output[rank]
    job.procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    error = job.event(0, ("error", "done"), deadline)
    assert error["event"] == "error", error
    print(f"\nrank 0's step failed {error['at'] - killed_at:.3f} s after rank 1 was killed")
    assert error["type"] == "RuntimeError", error
    assert "DistBackendError: group" in error["message"], error
    assert "process 1 on node 1 (10.0.0.2" in error["message"], error
    assert "ended without leaving the group" in error["message"], error
    assert job.procs[0].wait(JOB_TIMEOUT) == 1, job.output[0]  # its exit, after the failed step, is bounded too
    (group,) = coordinated_at(nodes[1], f"{nodes[1].address}:{job.port + 1}")
    assert [(lost["node_index"], lost["process_ids"]) for lost in group["lost"]] == [(1, [1])], group
