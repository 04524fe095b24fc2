"""Input distribution and Keras' DataParallel with two real processes against one real daemon.

This module is also the worker: ``python test_distributed_input_processes.py PROCESS_ID`` joins the job
(``xreduce.distribution.initialize``, two processes, devices from the daemon), runs every case and prints
one JSON line per case. The test compares each process's rows with TF's split (each batch of ``b`` rows
gives each replica ``ceil(b / N)`` in order, as TF 2.21's ``MirroredStrategy`` does: checked against TF
itself in tests/tensorflow/test_tf_oracle.py) and with Keras' ``DataParallel.distribute_dataset``
(``batch_sizes_for_worker(B, P, 1, p)``, then shard ``p`` of ``P``, from Keras' source).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import numpy as np
import pytest

RUN_TIMEOUT = 90.0
"""Seconds the two workers may take before the test kills them."""

X = np.arange(42.0).reshape(14, 3)
"""The global dataset: 14 rows, batched by 8 (a full batch, then a partial one of 6)."""


def batches():
    return [X[:8], X[8:]]


def worker(pid: int) -> None:
    from xreduce import distribution as dist
    from xreduce.distribute import Mirrored, MirroredStrategy, PerReplica

    def emit(case: str, **result) -> None:
        print(json.dumps({"case": case, **result}), flush=True)

    dist.initialize(num_processes=2, process_id=pid)
    try:
        strategy = MirroredStrategy()
        emit("strategy", devices=list(strategy.extended.worker_devices), total=strategy.num_replicas_in_sync,
             steps=[[v.tolist() for v in step.values] for step in strategy.experimental_distribute_dataset(
                 batches())])
        losses = []
        for step in strategy.experimental_distribute_dataset(batches()):
            per_replica = strategy.run(lambda b: np.square(b).sum(), args=(step,))
            losses.append(float(strategy.reduce("sum", per_replica, axis=None)))
        emit("loss", losses=losses)
        contexts = []

        def dataset_fn(ctx):
            contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync])
            return [np.full((ctx.get_per_replica_batch_size(8), 1), 100 * ctx.input_pipeline_id + k) for k in range(3)]

        steps = [[v.ravel().tolist() for v in step.values]
                 for step in strategy.distribute_datasets_from_function(dataset_fn)]
        emit("from_function", contexts=contexts, steps=steps)

        dp = dist.DataParallel()  # the default: a mesh of every process's devices
        mine = [b.tolist() for b in dp.distribute_dataset(batches())]
        reduced = []
        for rows in dp.distribute_dataset(batches()):
            x = dp.distribute_batch(rows)
            grads = dp.all_reduce_gradients(PerReplica([np.asarray(v).sum(axis=0) for v in x.values]), "sum")
            # One device gives the array itself, several a Mirrored value.
            reduced.append(np.asarray(grads.values[0] if isinstance(grads, Mirrored) else grads).tolist())
        unsharded = dist.DataParallel(auto_shard_dataset=False)
        data = batches()
        emit("keras", mesh=dp.device_mesh.devices.tolist(), rows=mine, reduced=reduced,
             same=unsharded.distribute_dataset(data) is data)
    finally:
        dist.shutdown()


def run_job(address: str, group: str, local_devices: list[str] | None = None) -> list[dict[str, dict]]:
    from children import child_env

    def run(pid: int) -> subprocess.CompletedProcess:
        env = {**child_env(), "XREDUCE_ADDRESS": address, "XREDUCE_GROUP": group}
        if local_devices:
            env["XREDUCE_LOCAL_DEVICES"] = local_devices[pid]
        # subprocess.run kills its worker when the timeout passes.
        return subprocess.run([sys.executable, os.path.abspath(__file__), str(pid)], env=env, text=True,
                              capture_output=True, timeout=RUN_TIMEOUT)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(run, range(2)))
    outs = [(d.stdout, d.stderr) for d in done]
    assert [d.returncode for d in done] == [0, 0], outs
    return [{r["case"]: r for r in map(json.loads, out.splitlines())} for out, _ in outs]


@pytest.fixture(scope="module")
def daemon4(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4")


@pytest.fixture(scope="module")
def two_each(daemon4):
    """Two processes with two devices each (the daemon's contiguous blocks)."""
    return run_job(daemon4.address, f"input-2x2-{os.getpid()}")


@pytest.fixture(scope="module")
def one_each(daemon4):
    """Two processes with one device each: TF's multi_worker_mirrored_2x1 layout."""
    return run_job(daemon4.address, f"input-2x1-{os.getpid()}", ["cpu:0", "cpu:1"])


def rows(start: int, stop: int) -> list:
    return X[start:stop].tolist()


def test_each_process_gets_its_replicas_rows(two_each):
    """4 replicas, global batch 8: replica g gets rows 2g, 2g+1; the partial batch of 6 fills replicas 0-2
    with 2 rows each and leaves replica 3 an empty batch."""
    p0, p1 = (r["strategy"] for r in two_each)
    assert p0["total"] == p1["total"] == 4
    assert p0["steps"] == [[rows(0, 2), rows(2, 4)], [rows(8, 10), rows(10, 12)]]
    assert p1["steps"] == [[rows(4, 6), rows(6, 8)], [rows(12, 14), []]]


def test_reduced_loss_equals_the_whole_batch_loss(two_each):
    want = [float(np.square(b).sum()) for b in batches()]
    for r in two_each:
        assert r["loss"]["losses"] == pytest.approx(want, rel=1e-12)


def test_uneven_dataset_batches_one_replica_per_process(one_each):
    """TF's split over 2 processes of 1 replica (ceil(b / N) rows each, in order, each batch on its own): the
    global batch of 8 gives each process 4 rows; the partial batch of 6, 3 rows each."""
    p0, p1 = (r["strategy"] for r in one_each)
    assert p0["steps"] == [[rows(0, 4)], [rows(8, 11)]]
    assert p1["steps"] == [[rows(4, 8)], [rows(11, 14)]]


def test_one_input_pipeline_per_process(two_each):
    """InputContext(num_input_pipelines=2, input_pipeline_id=p, num_replicas_in_sync=4), called once per
    process; its 2 replicas take successive elements, the last step's second an empty batch."""
    for p, r in enumerate(two_each):
        case = r["from_function"]
        assert case["contexts"] == [[2, p, 4]]
        k = [100 * p + i for i in range(3)]
        assert case["steps"] == [[[k[0]] * 2, [k[1]] * 2], [[k[2]] * 2, []]]


def test_data_parallel_default_shards_the_dataset_and_reduces_across_processes(two_each):
    """The default DataParallel() with two processes: the global mesh for layouts, each process its rows of
    every global batch (Keras' arithmetic) on its own devices, gradients all-reduced across both."""
    p0, p1 = (r["keras"] for r in two_each)
    assert p0["mesh"] == p1["mesh"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert p0["rows"] == [rows(0, 4), rows(8, 12)]
    assert p1["rows"] == [rows(4, 8), rows(12, 14)]
    want = [X[:8].sum(axis=0).tolist(), X[8:].sum(axis=0).tolist()]
    assert p0["reduced"] == p1["reduced"] == want
    assert p0["same"] and p1["same"]  # auto_shard_dataset=False: the dataset itself


def test_data_parallel_default_with_one_device_per_process(one_each):
    """Keras shards by process, whatever each process's device count: the same rows as with two each."""
    p0, p1 = (r["keras"] for r in one_each)
    assert p0["mesh"] == p1["mesh"] == ["cpu:0", "cpu:1"]
    assert (p0["rows"], p1["rows"]) == ([rows(0, 4), rows(8, 12)], [rows(4, 8), rows(12, 14)])
    assert p0["reduced"] == p1["reduced"] == [X[:8].sum(axis=0).tolist(), X[8:].sum(axis=0).tolist()]


if __name__ == "__main__":
    worker(int(sys.argv[1]))
