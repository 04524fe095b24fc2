"""The seed's two-host cluster for real: nodes at 10.0.0.1 and 10.0.0.2 (network namespaces on a bridge), a
daemon and a training process in each, process 0's address 10.0.0.1:1234 the coordinator, as on Keras'
``initialize`` page; then a node cut off mid-collective, and a new epoch once its link is back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from netns import Nodes, needs_namespaces, start_node_daemons

pytestmark = [needs_namespaces, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
JOB = "10.0.0.1:1234,10.0.0.2:2345"
PEER_TIMEOUT = 2.0
BOUND = 2 * PEER_TIMEOUT + 5.0  # the documented bound, with slack for a loaded 2-core machine

# One training process: join, reduce once, then on each line of stdin ("<elements>", or "again" to form a new
# epoch first) reduce a tensor of that size and print what happened as JSON.
WORKER = r"""
import json, sys, time
import numpy as np
import xreduce
from xreduce import distribution as dist
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, PerReplica, ReduceOp

info = dist.initialize()
ops = HierarchicalCopyAllReduce()
local = list(MirroredStrategy(cross_device_ops=ops).extended.worker_devices)

def step(n):
    v = PerReplica([np.full(n, 10 * info.process_id + i + 1, np.float32) for i in range(len(local))], devices=local)
    return np.asarray(ops.reduce(ReduceOp.SUM, v, v).values[0])

print(json.dumps({"epoch": info.epoch, "nodes": info.num_nodes, "devices": dist.list_devices(),
                  "sum": step(4).tolist()}), flush=True)
for line in sys.stdin:
    if line.strip() == "again":
        dist.shutdown()
        info = dist.initialize()
        print(json.dumps({"epoch": info.epoch, "sum": step(4).tolist()}), flush=True)
        continue
    start = time.monotonic()
    try:
        out = step(int(line))
        print(json.dumps({"result": float(out[0])}), flush=True)
    except xreduce.XReduceError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}),
              flush=True)
"""


def start_daemons(nodes: Nodes) -> None:
    """One daemon per node, listening on the node's own loopback, its engine on the node's address."""
    start_node_daemons(nodes, 2, PEER_TIMEOUT)


def trainer(node, process_id: int, argument_form: bool) -> subprocess.Popen:
    env = {"XREDUCE_ADDRESS": "127.0.0.1:50551", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    if argument_form:
        code = WORKER.replace("dist.initialize()", f"dist.initialize({JOB!r}, 2, {process_id})", 1)
    else:
        code = WORKER
        env |= {"KERAS_DISTRIBUTION_JOB_ADDRESSES": JOB, "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": str(process_id)}
    return node.popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, cwd=ROOT)


def answer(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"the trainer ended: {proc.stderr.read()[-2000:]}")
    return json.loads(line)


def expected_sum(size: int) -> list[float]:
    """Two processes of two devices each: process p's replica i holds 10p + i + 1."""
    return [float(sum(10 * p + i + 1 for p in range(2) for i in range(2)))] * size


@pytest.mark.parametrize("argument_form", [False, True], ids=["environment", "arguments"])
def test_the_seed_cluster_reduces_across_its_two_hosts(argument_form):
    with Nodes(2) as nodes:
        start_daemons(nodes)
        procs = [trainer(nodes[k + 1], k, argument_form) for k in range(2)]
        first = [answer(p) for p in procs]
        for node in nodes:  # the daemon, the coordinator and Gloo listen on the node's loopback or address only
            listening = node.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.split("\n")
            local = [line.split()[3].replace("[::ffff:", "").replace("]", "") for line in listening if line.strip()]
            assert local and all(a.startswith(("127.0.0.1:", f"{node.address}:")) for a in local), local
        for p in procs:
            p.stdin.close()
        assert [f["epoch"] for f in first] == [1, 1] and [f["nodes"] for f in first] == [2, 2]
        assert first[0]["devices"] == first[1]["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        assert first[0]["sum"] == first[1]["sum"] == expected_sum(4)


def test_a_node_cut_off_mid_collective_fails_both_within_the_bound_then_rejoins():
    # Links of 100 Mbit/s: 32 MiB take about 3 s to cross, so the cut lands mid-transfer.
    with Nodes(2, shape="100mbit") as nodes:
        start_daemons(nodes)
        procs = [trainer(nodes[k + 1], k, argument_form=False) for k in range(2)]
        assert [answer(p)["sum"] for p in procs] == [expected_sum(4)] * 2
        for p in procs:
            p.stdin.write(f"{8 << 20}\n")
            p.stdin.flush()
        time.sleep(0.5)
        nodes.cut(nodes[2])
        failed = [answer(p) for p in procs]
        for f in failed:
            assert "error" in f, f"a participant got a result across a cut link: {f}"
            assert f["error"] in ("AbortedError", "UnavailableError") and f["seconds"] < BOUND, f
        assert re.search(r"lost node 1 \(10\.0\.0\.2, processes \[1\]\)", failed[0]["message"]), failed[0]
        assert "node 0 (10.0.0.1, processes [0])" in failed[1]["message"], failed[1]
        nodes.restore(nodes[2])
        for p in procs:
            p.stdin.write("again\n")
            p.stdin.flush()
        again = [answer(p) for p in procs]
        assert [a["epoch"] for a in again] == [2, 2] and [a["sum"] for a in again] == [expected_sum(4)] * 2
        for p in procs:
            p.stdin.write(f"{1 << 20}\n")
            p.stdin.flush()
        assert [answer(p)["result"] for p in procs] == [np.float32(expected_sum(1)[0])] * 2
        for p in procs:
            p.stdin.close()
