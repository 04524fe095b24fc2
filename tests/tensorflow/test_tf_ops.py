"""``xreduce.tensorflow``'s ``CrossDeviceOps`` side by side with TF 2.21's own, in one process on logical CPUs.

Real TensorFlow (eight logical CPUs here), a real daemon (eight host devices), and TF's
own ``HierarchicalCopyAllReduce`` / ``ReductionToOneDevice`` as the oracle: the same
``tf.distribute.MirroredStrategy`` code runs once with TF's ops and once with
xreduce's, eagerly and inside ``tf.function``, and the results must be the same
tensors bit for bit, of the same types (``Mirrored``, ``PerReplica``, ``IndexedSlices``)
on the same devices.
"""

from __future__ import annotations

import re

import pytest
from tf_env import logical_cpus

tf = logical_cpus()
import xreduce  # noqa: E402
import xreduce.tensorflow  # noqa: E402
from tensorflow.python.distribute import values as tf_values  # noqa: E402
from xreduce.tensorflow._bridge import XLA_MESSAGE  # noqa: E402

CPUS = [f"/cpu:{i}" for i in range(8)]
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int64]


def tf_ops(kind: str, **kwargs):
    return {"hcar": tf.distribute.HierarchicalCopyAllReduce, "rtod": tf.distribute.ReductionToOneDevice}[kind](**kwargs)


def x_ops(daemon, kind: str, **kwargs):
    cls = {"hcar": xreduce.tensorflow.HierarchicalCopyAllReduce, "rtod": xreduce.tensorflow.ReductionToOneDevice}
    return cls[kind](address=daemon.address, **kwargs)


def strategies(daemon, n: int, kind: str = "hcar", **kwargs):
    """TF's strategy with TF's ops, and the same with xreduce's."""
    return (tf.distribute.MirroredStrategy(CPUS[:n], cross_device_ops=tf_ops(kind, **kwargs)),
            tf.distribute.MirroredStrategy(CPUS[:n], cross_device_ops=x_ops(daemon, kind, **kwargs)))


def flat(value):
    """Every tensor of a TF result, with its type and device, in order: what must match bit for bit."""
    out = []
    for leaf in tf.nest.flatten(value, expand_composites=False):
        if isinstance(leaf, tf_values.DistributedValues):
            out.append(type(leaf).__name__)
            out.extend(flat(list(leaf.values)))
        elif isinstance(leaf, tf.IndexedSlices):
            out.append(("IndexedSlices", leaf.values.device))
            out.extend(flat([leaf.values, leaf.indices]))
        else:
            array = leaf.numpy()
            out.append((leaf.device, array.dtype.str, array.shape, array.tobytes()))
    return out


def replica_values(dtype, shape=(3, 5), seed=0):
    """A function of the replica context: each replica's own random value of ``dtype``."""
    def value():
        ctx = tf.distribute.get_replica_context()
        rng = tf.random.stateless_uniform(shape, [seed, 7], -100, 100, dtype=tf.float32)
        scaled = rng * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) / 3.0
        return tf.cast(scaled, dtype)
    return value


def test_the_classes_are_real_tf_cross_device_ops(daemon):
    ops = x_ops(daemon, "hcar", num_packs=2)
    assert isinstance(ops, tf.distribute.CrossDeviceOps) and ops.num_packs == 2
    assert isinstance(x_ops(daemon, "rtod"), tf.distribute.CrossDeviceOps)
    with pytest.raises(ValueError, match="HierarchicalCopy requires num_packs >= 0, but -1 is specified"):
        xreduce.tensorflow.HierarchicalCopyAllReduce(num_packs=-1)
    strategy = xreduce.tensorflow.MirroredStrategy(CPUS[:2], cross_device_ops=ops)
    assert isinstance(strategy, tf.distribute.MirroredStrategy) and strategy.num_replicas_in_sync == 2


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_replica_all_reduce_is_tfs_bit_for_bit(daemon, n, dtype, op):
    """``ReplicaContext.all_reduce`` of a nest (merge_call, then batch_reduce_to), eagerly and traced."""
    def step():
        value = replica_values(dtype)
        return tf.distribute.get_replica_context().all_reduce(op, {"a": value(), "b": [value() * 2, value()[0]]})

    results = []
    for strategy in strategies(daemon, n):
        eager = strategy.run(step)
        traced = tf.function(lambda s=strategy: s.run(step))()
        results.append((flat(eager), flat(traced)))
    assert results[0] == results[1]


@pytest.mark.parametrize("num_packs", [0, 1, 3])
def test_num_packs_never_changes_the_numbers(daemon, num_packs):
    def step():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("SUM", [replica_values(tf.float32, (7,))(), replica_values(tf.float32, (2, 3), 1)()])

    got = [flat(s.run(step)) for s in strategies(daemon, 4, num_packs=num_packs)]
    assert got[0] == got[1]


def test_extended_reduce_and_batch_reduce_to_the_values_devices(daemon):
    """reduce_to and batch_reduce_to onto the values' own devices, and onto a mirrored variable on them."""
    got = []
    for strategy in strategies(daemon, 4):
        per, other = strategy.run(replica_values(tf.float32)), strategy.run(replica_values(tf.float32, seed=3))
        with strategy.scope():
            variable = tf.Variable(tf.zeros((3, 5)))  # a MirroredVariable: what an optimizer reduces to
        got.append(flat([strategy.extended.reduce_to("SUM", per, per),
                         strategy.extended.batch_reduce_to("MEAN", [(per, per), (other, variable)])]))
    assert got[0] == got[1]


def test_reduction_to_one_device_onto_every_kind_of_destination(daemon):
    got = []
    for strategy in strategies(daemon, 4, "rtod"):
        per = strategy.run(replica_values(tf.float32))
        with strategy.scope():
            variable = tf.Variable(tf.zeros((3, 5)))
        got.append(flat([strategy.extended.reduce_to("MEAN", per, "/cpu:6"),
                         strategy.extended.batch_reduce_to("SUM", [(per, per), (per, "/cpu:1"), (per, variable)])]))
    assert got[0] == got[1]


def test_a_mixed_batch_all_reduces_where_tf_falls_back_on_cpus(daemon):
    """A batch whose pairs go to different places: TF's HierarchicalCopyAllReduce reduces each pair on its own
    and, on CPU devices, to one device even where the destinations are the value's own (bug (b) of
    tests/conformance/README.md); the daemon runs the hierarchical copy there, which adds in another order."""
    tf_strategy, x_strategy = strategies(daemon, 4)
    results = []
    for strategy in (tf_strategy, x_strategy):
        per = strategy.run(lambda: tf.constant([1e8, 1.0, -1e8, 1.0], tf.float32)[
            tf.distribute.get_replica_context().replica_id_in_sync_group])
        results.append(strategy.extended.batch_reduce_to("SUM", [(per, per), (per, "/cpu:1")]))
    (tf_all, tf_one), (x_all, x_one) = results
    assert tf_all.values[0].numpy() == 1.0  # ((1e8 + 1) + -1e8) + 1 in float32
    assert x_all.values[0].numpy() == 0.0  # the plan: (1e8 + 1) + (-1e8 + 1)
    assert tf_one.numpy() == x_one.numpy() == 1.0  # to another device: both fold left


def test_reduce_onto_a_cpu_destination_takes_the_hierarchical_copy(daemon):
    """TF's ``reduce`` of HierarchicalCopyAllReduce onto its own CPU devices falls back to ReductionToOneDevice
    (bug (b)); the daemon runs the hierarchical copy."""
    got = []
    for strategy in strategies(daemon, 4):
        per = strategy.run(lambda: tf.constant([1e8, 1.0, -1e8, 1.0], tf.float32)[
            tf.distribute.get_replica_context().replica_id_in_sync_group])
        got.append(strategy.extended._cross_device_ops.reduce(tf.distribute.ReduceOp.SUM, per, per).values[0].numpy())
    assert got == [1.0, 0.0]


def test_indexed_slices_stay_sparse_and_are_tfs(daemon):
    """Embedding-like gradients: TF concatenates them (ReductionToOneDevice), never densifies; so does xreduce."""
    def step():
        ctx = tf.distribute.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        rows = tf.cast(tf.reshape(tf.range(6), (3, 2)) * (rid + 1), tf.float32) / 7.0
        sparse = tf.IndexedSlices(rows, tf.stack([rid, rid + 2, 1]), tf.constant([9, 2]))
        return ctx.all_reduce("MEAN", [sparse, rows])

    got = []
    for strategy in strategies(daemon, 4):
        eager, traced = strategy.run(step), tf.function(lambda s=strategy: s.run(step))()
        assert isinstance(eager[0].values[0], tf.IndexedSlices)
        got.append((flat(eager), flat(traced)))
    assert got[0] == got[1]


def test_one_daemon_call_per_batch_of_gradients(daemon):
    """A batch of ten tensors, traced once (which makes its prepared batch's first call, with zeros: the kernel's)
    and run three times: three BatchReduce calls, not thirty."""
    _, strategy = strategies(daemon, 2)

    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", [replica_values(tf.float32, (i + 1,), i)() for i in range(10)]))

    with xreduce.Client(daemon.address) as client:
        def calls():
            return sum(sum(m.calls_by_code.values()) for m in client.get_status().methods
                       if m.method.endswith("/BatchReduce"))

        step.get_concrete_function()
        before = calls()
        for _ in range(3):
            step()
        assert calls() - before == 3


def test_gather_in_one_process_is_tfs(daemon):
    got = []
    for strategy in strategies(daemon, 3):
        def rows():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            return tf.fill([rid + 1, 2], tf.cast(rid, tf.float32))

        per = strategy.run(rows)
        got.append(flat(strategy.gather(per, axis=0)))
    assert got[0] == got[1]


def test_reduction_to_one_device_sums_where_it_is_told(daemon):
    tf_strategy, x_strategy = strategies(daemon, 4, "rtod", reduce_to_device="/cpu:3")
    got = [flat(s.extended.reduce_to("SUM", s.run(replica_values(tf.float64)), "/cpu:0"))
           for s in (tf_strategy, x_strategy)]
    assert got[0] == got[1]
    assert x_strategy.extended._cross_device_ops._sdk.reduce_to_device.endswith("CPU:3")


def test_accumulation_fn_runs_in_tf(daemon):
    ops = x_ops(daemon, "rtod", accumulation_fn=tf.math.add_n)
    strategy = tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=ops)
    per = strategy.run(lambda: tf.constant([1.0, 2.0]))
    assert strategy.extended.reduce_to("SUM", per, "/cpu:0").numpy().tolist() == [2.0, 4.0]


def test_an_xla_compiled_step_is_refused_with_what_to_do(daemon):
    _, strategy = strategies(daemon, 2)

    @tf.function(jit_compile=True)
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([2])))

    with pytest.raises(ValueError, match=re.escape(XLA_MESSAGE)):
        step()
    assert "jit_compile=False" in XLA_MESSAGE


def test_daemon_errors_are_tfs_error_classes_with_the_daemons_message(start_daemon, monkeypatch):
    """A strategy over four CPUs on a daemon of two: the daemon's NOT_FOUND, as tf.errors.NotFoundError, eagerly
    and from a traced step that takes xreduce's TF kernel (its prepared batch's first call, made as it is traced);
    from one that takes the tf.numpy_function bridge, UNKNOWN with the SDK's class and message."""
    small = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
    strategy = tf.distribute.MirroredStrategy(CPUS[:4], cross_device_ops=x_ops(small, "hcar"))

    def step():
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([2]))

    missing = r"no device '/job:localhost/replica:0/task:0/device:CPU:2' on this daemon; its devices are CPU:0, CPU:1"
    with pytest.raises(tf.errors.NotFoundError, match=missing):
        strategy.run(step)
    where = r"pairs\[0\].value.components\[2\].device: "
    with pytest.raises(tf.errors.NotFoundError, match=where + missing):
        tf.function(lambda: strategy.run(step))()
    # From a tf.numpy_function TF keeps no error code of a Python exception but InvalidArgument's: UNKNOWN.
    monkeypatch.setenv("XREDUCE_TF_KERNEL", "0")
    with pytest.raises(tf.errors.UnknownError, match="NotFoundError: " + where + missing):
        tf.function(lambda: strategy.run(step))()


def test_a_reduce_op_that_is_not_one_is_refused_as_tf_refuses_it(daemon):
    _, strategy = strategies(daemon, 2)
    per = strategy.run(lambda: tf.ones([2]))
    with pytest.raises(ValueError, match="`reduce_op` must be Reduce.SUM or Reduce.MEAN; got 'max'"):
        strategy.extended._cross_device_ops.reduce("max", per, per)
