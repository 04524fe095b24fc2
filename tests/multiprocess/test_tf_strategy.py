"""``xreduce.tensorflow.MirroredStrategy`` in jobs of several real TensorFlow processes on one daemon.

Keras ``fit`` runs are ``python -m xreduce_bench.keras_job`` processes (SGD with momentum, so that a
wrong gradient scale shows); the strategy's own API runs in this module run as a script, one
process per id. The reference is one process with all the job's replicas, on the same daemon.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from children import Started, child_env
from daemons import wait_log
from tf_env import QUIET

JOB_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8",
                               "--collective-timeout", "120", "--log-level", "INFO")


STARTED = Started()


@pytest.fixture(autouse=True)
def no_child_left():
    """Every process a test started is gone after it, whatever the test's outcome."""
    yield
    STARTED.end_all()


def start(daemon, argv: list[str], group: str, **env: str) -> subprocess.Popen:
    environ = dict(child_env(), XREDUCE_ADDRESS=daemon.address, XREDUCE_GROUP=group,
                   XREDUCE_STALL_WARNING_SECONDS="0", **QUIET, **env)
    return STARTED.popen([sys.executable, *argv], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)


def keras_job(daemon, group: str, processes: int, replicas: int, out: str = "", *flags: str,
              **env: str) -> list[subprocess.Popen]:
    return [start(daemon, ["-m", "xreduce_bench.keras_job", "--strategy", "xreduce", "--replicas", str(replicas),
                           "--processes", str(processes), "--process-id", str(p), "--no-arithmetic-optimization",
                           *(["--out", f"{out}-{p}.npz"] if out else []), *flags], group, **env)
            for p in range(processes)]


def events(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return found or [{"event": "none", "stderr": err[-3000:]}]


def weights(path: str) -> list[np.ndarray]:
    with np.load(path) as w:
        return [w[k] for k in w.files]


def bitwise(a, b) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize(("processes", "replicas", "kernel"), [(2, 2, "1"), (2, 1, "0")],
                         ids=["2x2-kernel", "2x1-bridge"])
def test_processes_train_to_the_weights_of_one_process_with_every_replica(daemon, tmp_path, processes, replicas,
                                                                          kernel):
    """2 processes x R replicas against 1 process x 2R, on the same global batches (and a partial last one):
    the same weights bit for bit (the daemon adds the job's replicas in one order), the same logged loss and
    metric in every process; each process starts from different random weights, so process 0's initial
    values must reach process 1, and with one replica per process the processes must still communicate. Each
    step's all-reduce is a group's prepared batch, sent by xreduce's TF kernel or by the bridge."""
    flags = ("--extra-rows", "37", "--epochs", "2")
    one = events(keras_job(daemon, f"one-{processes}x{replicas}", 1, processes * replicas,
                           str(tmp_path / "one"), *flags)[0])[-1]
    assert one["event"] == "fit", one
    job = keras_job(daemon, f"job-{processes}x{replicas}", processes, replicas, str(tmp_path / "job"), *flags,
                    XREDUCE_TF_KERNEL=kernel)
    fits = [events(p)[-1] for p in job]
    for fit in fits:
        assert fit["event"] == "fit", fit
        assert fit["replicas"] == processes * replicas
        assert fit["history"] == one["history"]
        calls = fit["kernel_calls"] if kernel == "1" else fit["prepared_calls"]
        assert calls >= 4, fit  # two epochs of at least two steps
        if kernel == "0":
            assert fit["kernel_calls"] == 0, fit
    reference = weights(str(tmp_path / "one-0.npz"))
    for p in range(processes):
        assert bitwise(weights(str(tmp_path / f"job-{p}.npz")), reference)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_process_ended_during_fit_fails_the_others_fit_naming_it(daemon, tmp_path, how):
    """Process 1 is killed (or stopped by SIGTERM, which ends it without its teardown) while both fit: process 0's
    fit raises at once with the daemon's error naming process 1, far within the collective timeout (120 s), and
    the daemon serves the next job."""
    group = f"kill-{how.name.lower()}"
    job = keras_job(daemon, group, 2, 1, "", "--steps", "2000", "--epochs", "1000")  # small data, fits for long
    for proc in job:  # both are training: their first step is done
        while json.loads(proc.stdout.readline() or '{"event": "gone"}')["event"] not in ("training", "gone"):
            pass
    time.sleep(1.0)
    job[1].send_signal(how)
    killed_at = time.monotonic()
    survivor = events(job[0], 60)[-1]
    waited = time.monotonic() - killed_at
    job[1].wait(10)
    assert survivor["event"] == "error", survivor
    assert survivor["type"] in ("AbortedError", "UnknownError")
    assert f'process 1 of group "{group}" ended without leaving the group' in survivor["message"]
    print(f"\n{how.name}: process 0's fit failed {waited:.2f} s after the signal")
    assert wait_log(daemon, rf'event=process_gone group="{group}" process=1')
    again = keras_job(daemon, f"{group}-after", 2, 1, "", "--steps", "3")
    assert [events(p)[-1]["event"] for p in again] == ["fit", "fit"]


def test_the_strategys_api_spans_the_job(daemon):
    """reduce, gather, datasets, values from a function, replica ids and a timeout, in two processes of two
    replicas each (this module's ``_main``), against what one process over the job's four replicas gives; a
    distributed dataset reads through one tf.data iterator a replica."""
    procs = [start(daemon, [__file__, str(p)], "api") for p in range(2)]
    results = [events(p)[-1] for p in procs]
    for r in results:
        assert r.get("event") == "done", r
    p0, p1 = results
    assert p0["num_replicas"] == p1["num_replicas"] == 4
    assert (p0["replica_ids"], p1["replica_ids"]) == ([0, 1], [2, 3])
    assert p0["reduce"] == p1["reduce"] == [0 + 1 + 2 + 3] * 2
    assert p0["mean_axis"] == p1["mean_axis"] == 50 / 10  # replica r holds r + 1 rows of r + 3
    assert p0["gather"] == p1["gather"] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    # TF's one-process split of each global batch of 10 rows over 4 replicas: 3, 3, 3, 1 rows; then the
    # partial batch of 5: 2, 2, 1, 0. Process 0 feeds replicas 0-1, process 1 replicas 2-3.
    assert p0["dataset"] == [[[0, 1, 2], [3, 4, 5]], [[10, 11], [12, 13]]]
    assert p1["dataset"] == [[[6, 7, 8], [9]], [[14], []]]
    assert p0["dict_dataset"] == [[{"a": [0, 1, 2], "b": [0, 10, 20]}, {"a": [3, 4, 5], "b": [30, 40, 50]}]]
    assert p0["iterators"] == p1["iterators"] == ["OwnedIterator", "OwnedIterator"]
    assert (p0["contexts"], p1["contexts"]) == ([[2, 0, 4]], [[2, 1, 4]])
    assert (p0["values_from_function"], p1["values_from_function"]) == ([0, 1], [2, 3])
    assert p0["int32"] == p1["int32"] == [6, 6]
    assert p0["phased"] == p1["phased"] == [True, True]  # each replica's sum of the job's four, exact
    assert p0["timeout"]["type"] == "DeadlineExceededError"
    assert "timed out after 1s waiting for process(es) [1]" in p0["timeout"]["message"]


def _main(pid: int) -> None:
    os.environ.update(QUIET)
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import xreduce
    import xreduce.tensorflow

    xreduce.distribution.initialize(num_processes=2, process_id=pid)
    strategy = xreduce.tensorflow.MirroredStrategy()
    out: dict = {"num_replicas": strategy.num_replicas_in_sync}

    def rid():
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    out["replica_ids"] = [int(v) for v in strategy.experimental_local_results(strategy.run(rid))]
    per = strategy.run(lambda: tf.fill([2], tf.cast(rid(), tf.float32)))
    out["reduce"] = strategy.reduce("SUM", per, axis=None).numpy().tolist()
    rows = strategy.run(lambda: tf.fill([rid() + 1], tf.cast(rid(), tf.float32) + 3.0))
    out["mean_axis"] = float(strategy.reduce("MEAN", rows, axis=0).numpy())
    out["gather"] = strategy.gather(strategy.run(lambda: tf.fill([rid() + 1], rid())), axis=0).numpy().tolist()
    data = tf.data.Dataset.range(15).batch(10)
    out["dataset"] = [[v.numpy().tolist() for v in strategy.experimental_local_results(x)]
                      for x in strategy.experimental_distribute_dataset(data)]
    pairs = tf.data.Dataset.from_tensor_slices({"a": tf.range(10), "b": tf.range(10) * 10}).batch(10)
    out["dict_dataset"] = [[{k: v.numpy().tolist() for k, v in replica.items()}
                            for replica in strategy.experimental_local_results(x)]
                           for x in strategy.experimental_distribute_dataset(pairs)]
    # One plain tf.data iterator a replica: no MultiDeviceIterator, whose background thread crashed TF between
    # fits (bench/keras_refits.py). TF's private attributes: what the test is about is their kind.
    iterator = iter(strategy.experimental_distribute_dataset(data))
    out["iterators"] = [type(worker._iterator).__name__ for worker in iterator._iterators]
    contexts = []

    def dataset_fn(ctx):
        contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync])
        return tf.data.Dataset.range(4).batch(ctx.get_per_replica_batch_size(8))

    list(strategy.distribute_datasets_from_function(dataset_fn))
    out["contexts"] = contexts
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
    out["values_from_function"] = list(strategy.experimental_local_results(values))
    ints = strategy.run(lambda: tf.cast(rid(), tf.int32))  # TF reduces int32 on one process only
    out["int32"] = [int(v) for v in strategy.experimental_local_results(
        strategy.extended.reduce_to("SUM", ints, ints))]
    # A traced all-reduce of one 2.4 MB tensor a replica: xreduce's TF kernel sends it in two phases (4 MiB of
    # inputs in this process; xreduce._prepared.PHASED_BYTES), each one of the job's collectives.
    base = (np.arange(600_001) % 1009).astype(np.float32)

    @tf.function
    def phased():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.constant(base) * tf.cast(rid() + 1, tf.float32)))

    for _ in range(2):
        summed = phased()
    out["phased"] = [bool(np.array_equal(v.numpy(), base * 10)) for v in strategy.experimental_local_results(summed)]
    if pid == 0:  # process 1 never calls: the daemon's deadline, from CommunicationOptions(timeout_seconds=1)
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=1)
        try:
            strategy.extended.reduce_to("SUM", per, per, options)
        except tf.errors.OpError as e:
            out["timeout"] = {"type": type(e).__name__, "message": e.message}
    else:
        time.sleep(3)
    out["event"] = "done"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
