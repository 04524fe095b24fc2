"""A group's prepared batches (``xreduce._prepared`` in a multi-process group) and the daemon's group repeats
(``xreduced.repeated.Held`` through the express lane), with real worker processes and a real daemon.

Each process of the group calls its prepared batch step after step: the same request bytes but for the
collective's sequence number, tensors and output in its session's shared memory. The first call takes the
daemon's full path, the others are held by the express lane until every process has sent its share and reduced
there. The numbers must be those of one single-process reduction of every process's data; what is not the plain
case (a process that calls ``batch_reduce`` instead, a process killed while the other waits) gets the full
path's answer.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from daemons import metrics
from test_multiprocess import ok, run_job
from xreduce._prepared import MAX_SLOTS
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
from xreduce_bench.mp_worker import decode, launch, make_array

RUN_TIMEOUT = 60.0
TENSORS = [{"dtype": "float32", "shape": [3, 5]}, {"dtype": "float32", "shape": [7]},
           {"dtype": "float64", "shape": [2]}]


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    """Four host devices, two per process; metrics to count the express lane's calls."""
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                               "--metrics-listen", "127.0.0.1:0", "--collective-timeout", "30")


def express_calls(daemon) -> float:
    return metrics(daemon)[("xreduce_local_lane_express_calls_total", ())]


def run(daemon, steps_by_process, group: str) -> list[dict[int, dict]]:
    return run_job(daemon.address, steps_by_process, group, ["CPU:0,CPU:1", "CPU:2,CPU:3"])


def expected(daemon, op: str, seed: int) -> list[np.ndarray]:
    """One process's reduction of the four replicas' data (global replicas 0..3 on CPU:0..3)."""
    ops = HierarchicalCopyAllReduce(num_packs=0, address=daemon.address)
    try:
        devices = [f"CPU:{i}" for i in range(4)]
        values = [PerReplica([make_array(seed, t, r, s["dtype"], s["shape"]) for r in range(4)], devices=devices)
                  for t, s in enumerate(TENSORS)]
        return [np.asarray(r.values[0]) for r in ops.batch_reduce(op, [(v, v) for v in values])]
    finally:
        ops.close()


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_group_s_prepared_batch_gives_one_process_s_numbers_through_the_express_lane(daemon, op):
    seeds = list(range(11, 19))
    step = {"op": "prepared", "tensors": TENSORS, "reduce_op": op, "seeds": seeds}
    before = express_calls(daemon)
    per_process = run(daemon, [[{"op": "init", "stop_on_error": True}, step]] * 2, f"repeats-{op}")
    for p, events in enumerate(per_process):
        got = ok(events[1])
        assert got["fast_calls"] == len(seeds), f"process {p}: {got['fast_calls']} calls took the prepared path"
        for seed, results in zip(seeds, got["results"]):
            for t, (result, want) in enumerate(zip(results, expected(daemon, op, seed))):
                have = decode(result[0])
                assert have.dtype == want.dtype and have.tobytes() == want.tobytes(), (p, seed, t, have, want)
    # The first collective of each output segment took the full path (it left the repeats); the later ones were
    # both processes' repeats.
    assert express_calls(daemon) - before >= 2 * (len(seeds) - MAX_SLOTS)


def test_a_partner_that_calls_batch_reduce_gets_the_same_numbers_by_the_full_path(daemon):
    seeds = [21, 22, 23]
    prepared = {"op": "prepared", "tensors": TENSORS, "reduce_op": "sum"}
    init = {"op": "init", "stop_on_error": True}
    # Process 0 repeats its prepared batch while process 1 sends the same collectives through batch_reduce.
    steps0 = [init, *({**prepared, "seeds": [s]} for s in seeds)]
    steps1 = [init, *({"op": "batch_reduce", "tensors": TENSORS, "reduce_op": "sum", "seed": s, "num_packs": 0}
                      for s in seeds)]
    per_process = run(daemon, [steps0, steps1], "repeats-mixed")
    for i, seed in enumerate(seeds, start=1):
        want = expected(daemon, "sum", seed)
        for p in range(2):
            got = ok(per_process[p][i])
            results = got["results"][0] if p == 0 else got
            for t, result in enumerate(results):
                assert decode(result[0]).tobytes() == want[t].tobytes(), (p, seed, t)


def test_a_process_killed_while_its_partner_s_repeat_is_held_fails_the_partner_at_once_naming_it(daemon):
    init = {"op": "init", "stop_on_error": True}
    first = {"op": "prepared", "tensors": TENSORS, "seeds": [1, 2], "name": "step"}
    steps0 = [init, first, {"op": "prepared", "tensors": TENSORS, "seeds": [3], "name": "step"}]
    steps1 = [init, first, {"op": "barrier"}]
    workers = launch(daemon.address, [steps0, steps1], "repeats-kill", ["CPU:0,CPU:1", "CPU:2,CPU:3"])
    try:
        for w in workers:
            ok(w.wait_step(1, RUN_TIMEOUT))
        workers[0].wait_calling(2, RUN_TIMEOUT)
        time.sleep(0.3)  # process 0's repeat is held, waiting for process 1's
        killed_at = workers[1].kill()
        event = workers[0].wait_step(2, RUN_TIMEOUT)
        assert not event["ok"]
        assert event["error"] == "AbortedError", event
        assert "process 1" in event["message"], event["message"]
        assert event["t"] - killed_at < 3.0
    finally:
        for w in workers:
            w.close()
