"""ReplicaContext collectives across two real processes against one real daemon (issue 13).

Each process joins the job with ``xreduce.distribution.initialize`` (two of the daemon's four
devices each) and runs replica threads whose ``all_reduce``, ``all_gather`` and ``merge_call``
meet the other process's replicas through the daemon. Run as a script, this module is one worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from children import child_env

WORKER_TIMEOUT = 120.0
"""Seconds the two workers may take before the test kills them."""


def worker(process_id: int) -> dict:
    """One process of the job: its replicas' results, as JSON-friendly lists."""
    from xreduce import distribute, distribution

    distribution.initialize(num_processes=2, process_id=process_id)
    strategy = distribute.MirroredStrategy()

    def fn():
        ctx = distribute.get_replica_context()
        i = ctx.replica_id_in_sync_group
        total = ctx.all_reduce("sum", {"g": np.array([i, 1.0])})
        mean = ctx.all_reduce(distribute.ReduceOp.MEAN, np.float64(i))
        rows = ctx.all_gather(np.full((i + 1, 1), i, np.int32), axis=0)
        local = ctx.merge_call(lambda s, ids: " ".join(map(str, s.experimental_local_results(ids))), args=(i,))
        return i, total["g"], mean, rows, local

    ids, total, mean, rows, local = strategy.run(fn)
    results = strategy.experimental_local_results
    devices = strategy.extended.worker_devices
    per_replica_ids = distribute.PerReplica([np.int32([x]) for x in results(ids)], devices=devices)
    gathered = strategy.gather(per_replica_ids, axis=0)
    return {"ids": [int(x) for x in results(ids)], "total": [r.tolist() for r in results(total)],
            "mean": [float(r) for r in results(mean)], "rows": [r.ravel().tolist() for r in results(rows)],
            "local": local, "gathered": gathered.tolist(), "replicas": strategy.num_replicas_in_sync}


@pytest.fixture(scope="module")
def daemon4(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4")


def test_replica_collectives_meet_across_two_processes(daemon4):
    env = {**child_env(), "XREDUCE_ADDRESS": daemon4.address, "XREDUCE_GROUP": f"replicas-{os.getpid()}"}
    procs = [subprocess.Popen([sys.executable, __file__, str(p)], env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for p in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=WORKER_TIMEOUT)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [o["ids"] for o in outs] == [[0, 1], [2, 3]]
    for o in outs:
        assert o["replicas"] == 4
        assert o["total"] == [[6.0, 4.0]] * 2  # ids 0+1+2+3, and four ones
        assert o["mean"] == [1.5, 1.5]
        assert o["rows"] == [[0, 1, 1, 2, 2, 2, 3, 3, 3, 3]] * 2  # replica i gave i+1 rows of i
        assert o["gathered"] == [0, 1, 2, 3]
    # merge_call meets this process's replicas: each process sees its own ids.
    assert [o["local"] for o in outs] == ["0 1", "2 3"]


if __name__ == "__main__":
    print(json.dumps(worker(int(sys.argv[1]))))
