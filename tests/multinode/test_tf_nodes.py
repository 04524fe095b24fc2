"""``xreduce.tensorflow.MirroredStrategy`` across two nodes: network namespaces at 10.0.0.1 and 10.0.0.2, a daemon
in each, a Keras ``fit`` process of two replicas in each (``xreduce_bench.keras_job``), process 0's node the
coordinator; against one process of four replicas on one of the daemons. Then a process killed mid-``fit``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from netns import Nodes, needs_namespaces, start_node_daemons
from tf_env import QUIET

pytestmark = [needs_namespaces, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
JOB = "10.0.0.1:1234,10.0.0.2:2345"
PEER_TIMEOUT = 2.0


def start_daemons(nodes: Nodes) -> None:
    start_node_daemons(nodes, 4, PEER_TIMEOUT)


def job(node, argv: list[str], process_id: int | None = None) -> subprocess.Popen:
    env = {"XREDUCE_ADDRESS": "127.0.0.1:50551", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
           "XREDUCE_STALL_WARNING_SECONDS": "0", **QUIET}
    if process_id is not None:
        env |= {"KERAS_DISTRIBUTION_JOB_ADDRESSES": JOB}
        argv = [*argv, "--processes", "2", "--process-id", str(process_id)]
    return node.popen([sys.executable, "-m", "xreduce_bench.keras_job", "--strategy", "xreduce", *argv], env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def last(proc: subprocess.Popen, timeout: float = 180.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return events[-1] if events else {"event": "none", "stderr": err[-3000:]}


def weights(path: Path) -> list[bytes]:
    with np.load(path) as w:
        return [w[k].tobytes() for k in w.files]


def test_two_nodes_train_to_the_weights_of_one_process_with_every_replica(tmp_path):
    """Two nodes of one process with two replicas each against one process with four on one daemon: the node
    sums are (x0 + x1) and (x2 + x3), added node 0 first, the hierarchical copy's own order over four replicas:
    the same weights bit for bit, the same logged loss in both processes."""
    flags = ["--replicas", "2", "--no-arithmetic-optimization", "--extra-rows", "37"]
    with Nodes(2) as nodes:
        start_daemons(nodes)
        one = last(job(nodes[1], [*flags[2:], "--replicas", "4", "--out", str(tmp_path / "one.npz")]))
        assert one["event"] == "fit", one
        procs = [job(nodes[p + 1], [*flags, "--out", str(tmp_path / f"p{p}.npz")], p) for p in range(2)]
        fits = [last(p) for p in procs]
    for fit in fits:
        assert fit["event"] == "fit", fit
        assert fit["replicas"] == 4 and fit["history"] == one["history"]
    for p in range(2):
        assert weights(tmp_path / f"p{p}.npz") == weights(tmp_path / "one.npz")


def test_a_process_killed_during_fit_fails_the_other_node_naming_it():
    with Nodes(2) as nodes:
        start_daemons(nodes)
        procs = [job(nodes[p + 1], ["--replicas", "1", "--steps", "2000", "--epochs", "1000"], p) for p in range(2)]
        for proc in procs:
            while json.loads(proc.stdout.readline() or '{"event": "gone"}')["event"] not in ("training", "gone"):
                pass
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = last(procs[0], 60)
        print(f"\nprocess 0's fit failed {time.monotonic() - killed_at:.2f} s after process 1 was killed")
    assert survivor["event"] == "error", survivor
    assert "process 1 on node 1 (10.0.0.2" in survivor["message"], survivor
    assert "ended without leaving the group" in survivor["message"]
