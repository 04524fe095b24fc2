"""xreduce's TF kernel (``xreduce.tensorflow._kernel``, ``lane_kernel.cc``): a traced step's prepared batch sent
from inside the graph, against real daemons, in this process's TensorFlow (eight logical CPUs).

It is built from source by the machine's C++ compiler (tests/tensorflow/conftest.py installs one where there is
none) into a cache of this test's own, so the build itself is tested too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from children import child_env, stopped
from tf_env import QUIET, logical_cpus

tf = logical_cpus()
import xreduce  # noqa: E402
import xreduce.tensorflow  # noqa: E402
from xreduce.tensorflow import _kernel  # noqa: E402

CPUS = [f"/cpu:{i}" for i in range(8)]


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8")


def step_of(strategy, values, op="SUM", options=None):
    """A traced step: each replica's ``values(replica)`` all-reduced as one batch."""

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(op, values(tf.cast(ctx.replica_id_in_sync_group, tf.float64)), options=options)

        return strategy.run(fn)

    return step


def batch(replica):
    """Three gradients of two dtypes, different in every replica, exact in float64 and int64."""
    return [tf.reshape(tf.range(12, dtype=tf.float64), (3, 4)) * (replica + 1),
            tf.cast(tf.range(5, dtype=tf.float64) * (replica + 2), tf.int64),
            tf.fill([7], replica + 0.5)]


def test_the_traced_batch_takes_the_kernel_and_gives_the_exact_sums(daemon):
    """Four replicas, SUM and MEAN, for several steps: the kernel's calls, the daemon's numbers, the tensors' dtypes
    and shapes as the step declared them."""
    ops = xreduce.tensorflow.HierarchicalCopyAllReduce(address=daemon.address)
    strategy = tf.distribute.MirroredStrategy(CPUS[:4], cross_device_ops=ops)
    for op in ("SUM", "MEAN"):
        step = step_of(strategy, batch, op)
        before = _kernel.calls()
        for _ in range(3):
            out = step()
        assert _kernel.calls() - before == 3
        got = [v.values[0].numpy() for v in out]
        each = [[t.numpy() for t in batch(tf.constant(float(r), tf.float64))] for r in range(4)]
        want = [sum(replicas) for replicas in zip(*each)]
        if op == "MEAN":
            want = [w / 4 for w in want]
        assert [g.dtype for g in got] == [np.float64, np.float64 if op == "MEAN" else np.int64, np.float64]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert len(ops._kept) == 2  # one prepared batch a traced step, its segments kept with the ops


def _in_shared_memory(array: np.ndarray) -> bool:
    """Whether ``array``'s bytes lie in a mapping of a ``/dev/shm`` segment of this process."""
    at = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= at and at + array.nbytes <= end:
                    return True
    return False


def test_results_are_tensors_over_the_output_segment_and_keep_their_values_when_held(daemon):
    """The kernel hands TF each result where the daemon wrote it (no copy out). Results a caller still holds at
    the next call keep their values (they move to memory of their own): every step's results held, then checked."""
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce(
        address=daemon.address))
    with strategy.scope():
        count = tf.Variable(0.0, dtype=tf.float64)

    def values(replica):
        return [tf.fill([1000], count + replica), tf.cast(tf.fill([3, 5], count * 10 + replica), tf.int64)]

    step = step_of(strategy, values)

    @tf.function
    def next_step():
        count.assign_add(1.0)
        return step()

    first = [np.asarray(v.values[0]) for v in next_step()]  # no copy: the tensors' own bytes
    assert all(_in_shared_memory(a) for a in first), "the results were copied out of the output segment"
    detached = _kernel.detaches()
    held = [next_step() for _ in range(4)]  # each step's results still held when the next one runs
    assert _kernel.detaches() - detached == 4
    for k, out in enumerate(held, start=2):
        got = [np.asarray(v.values[0]) for v in out]
        np.testing.assert_array_equal(got[0], np.full(1000, 2 * k + 1.0))
        np.testing.assert_array_equal(got[1], np.full((3, 5), 20 * k + 1))
        # held at the next call, they moved to memory of their own; the last step's are still in the segment
        assert _in_shared_memory(got[0]) == (k == 5)
    np.testing.assert_array_equal(first[0], np.full(1000, 3.0))  # the first step's, unchanged by the later ones
    np.testing.assert_array_equal(first[1], np.full((3, 5), 21))


def test_a_batch_of_several_mib_is_copied_in_blocks_and_gives_the_exact_sums(daemon):
    """Inputs and results of more than a MiB are copied on TF's worker threads, in blocks of 256 KiB: tensors whose
    sizes are no multiple of a block, of two dtypes, each element its own value, summed exactly."""
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce(
        address=daemon.address))

    def values(replica):
        return [tf.cast((tf.range(300_001) % 1009), tf.float32) * tf.cast(replica + 1, tf.float32),
                tf.reshape(tf.range(70_001 * 2, dtype=tf.float64), (70_001, 2)) - replica]

    step = step_of(strategy, values)
    before, spent = _kernel.calls(), _kernel.times()
    for _ in range(2):
        out = step()
    assert _kernel.calls() - before == 2
    # each part of the two calls timed: the exchange waits for the daemon, which reads what was copied in
    assert all(after > earlier for after, earlier in zip(_kernel.times(), spent))
    want = [(np.arange(300_001) % 1009).astype(np.float32) * 3, np.arange(70_001 * 2.0).reshape(70_001, 2) * 2 - 1]
    for value, w in zip(out, want):
        for got in value.values:
            np.testing.assert_array_equal(got.numpy(), w)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_a_large_batch_of_one_kind_goes_in_phases_and_its_results_over_the_inputs(daemon, op):
    """Gradients of one dtype of 4 MiB or more (xreduce._prepared.PHASED_BYTES) go as one pair in two phases: two
    requests a call, the second phase copied in while the daemon reduces the first; the results lie over the first
    replica's inputs in the staging segment (no output segment), exact, and every element reduced once."""
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce(
        address=daemon.address))

    def values(replica):
        base, r = tf.cast(tf.range(600_001) % 1009, tf.float32), tf.cast(replica, tf.float32)
        return [base * (r + 1), tf.reshape(base[:1000], (10, 100)) - r]

    step = step_of(strategy, values, op)
    step()
    with xreduce.Client(daemon.address) as client:
        served = client.get_status().local_lane_calls
        for _ in range(3):
            out = step()
        assert client.get_status().local_lane_calls - served == 6  # two phases a call
    base = (np.arange(600_001) % 1009).astype(np.float32)
    want = [base * 3, base[:1000].reshape(10, 100) * 2 - 1]
    if op == "MEAN":
        want = [w / np.float32(2) for w in want]
    for value, w in zip(out, want):
        np.testing.assert_array_equal(value.values[0].numpy(), w)
    assert _in_shared_memory(np.asarray(out[0].values[0]))  # the first starts aligned: TF has it in place


def test_the_kernel_keeps_the_daemons_error_code(start_daemon):
    """A daemon that stops: the traced step fails with tf.errors.UnavailableError naming it (not the UNKNOWN a
    Python function's error becomes), and fails so again (the kernel gave its shared memory up)."""
    own = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce(
        address=own.address))
    step = step_of(strategy, lambda r: [tf.fill([3], r)])
    assert step()[0].values[0].numpy().tolist() == [1.0] * 3
    own.terminate(signal.SIGKILL)
    for _ in range(2):
        with pytest.raises(tf.errors.UnavailableError, match=f"xreduce daemon at {own.address} .*local lane"):
            step()


def test_a_daemon_that_does_not_answer_is_a_deadline_exceeded_within_the_timeout(start_daemon):
    """CommunicationOptions(timeout_seconds=1) on a stopped (SIGSTOP) daemon: DeadlineExceededError, in time."""
    own = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce(
        address=own.address))
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=1.0)
    step = step_of(strategy, lambda r: [tf.fill([3], r)], options=options)
    step()
    try:
        stopped(own.proc.pid)  # every thread: one woken by the step's request would otherwise answer it
        start = time.monotonic()
        with pytest.raises(tf.errors.DeadlineExceededError, match="got no answer within"):
            step()
        assert time.monotonic() - start < 30  # the bound, with room for a busy machine
    finally:
        os.kill(own.proc.pid, signal.SIGCONT)


def test_without_a_compiler_a_warning_says_so_and_the_bridge_gives_the_same_numbers(daemon, tmp_path):
    """A fresh cache and no compiler: the step takes the tf.numpy_function bridge, after one warning."""
    script = (
        "import os, warnings, tensorflow as tf\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "import xreduce.tensorflow\n"
        "from xreduce.tensorflow import _kernel\n"
        "s = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'],\n"
        "    cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce())\n"
        "def fn():\n"
        "    ctx = tf.distribute.get_replica_context()\n"
        "    return ctx.all_reduce('SUM', tf.fill([2], tf.cast(ctx.replica_id_in_sync_group, tf.float32)))\n"
        "step = tf.function(lambda: s.run(fn))\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(step().values[0].numpy().tolist(), step().values[1].numpy().tolist(), _kernel.calls())\n"
        "print([str(w.message) for w in caught if 'kernel' in str(w.message)])\n")
    env = dict(child_env(), XREDUCE_ADDRESS=daemon.address, XREDUCE_CACHE_DIR=str(tmp_path), CXX="false", **QUIET)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    numbers, warned = done.stdout.splitlines()[-2:]
    assert numbers == "[1.0, 1.0] [1.0, 1.0] 0"
    assert "takes the tf.numpy_function bridge, not xreduce's TF kernel" in warned and "could not build" in warned
    assert not list(tmp_path.glob("*.so"))


def test_the_kernel_is_built_once_into_its_cache(tmp_path, monkeypatch):
    """Built into XREDUCE_CACHE_DIR under a name of TF's version and the source's hash; found there again."""
    monkeypatch.setenv("XREDUCE_CACHE_DIR", str(tmp_path))
    built = _kernel.build()
    assert built.parent == tmp_path and f"tf{tf.__version__}" in built.name
    mtime = built.stat().st_mtime_ns
    assert _kernel.build() == built and built.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob("*.part"))


def test_a_group_s_sequence_counter_becomes_one_that_the_kernels_and_python_share():
    """In a group, the kernel numbers its collectives from the process's counter: made an int64 the kernels take
    numbers from atomically, from where Python's count had got to, and Python's collectives go on taking theirs
    from it (every process's k-th collective stays the others' k-th)."""
    import ctypes

    from xreduce._runtime import ProcessGroup

    group = ProcessGroup("g", 2, 0, ("/cpu:0",), ("/cpu:0", "/cpu:1"))
    assert [group.next_spec().sequence for _ in range(3)] == [0, 1, 2]
    address = _kernel.shared_counter(group)
    assert _kernel.shared_counter(group) == address  # made once
    assert [group.next_spec().sequence for _ in range(2)] == [3, 4]
    cell = ctypes.c_int64.from_address(address)
    assert cell.value == 5
    cell.value += 2  # what two kernel calls do
    assert group.next_spec().sequence == 7
