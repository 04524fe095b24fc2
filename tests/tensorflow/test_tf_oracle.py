"""The SDK's TF look-alikes (``xreduce.distribute``) and what they were derived from, checked against TF 2.21 itself.

* The conformance vectors: every case runs through TF's own ``HierarchicalCopyAllReduce`` on eight
  logical CPUs, and TF must give what the vectors record of it (their ``expected``, or, where
  xreduce fixes a TF bug, ``tf_expected`` or ``tf_error``); the SDK's side of the same vectors is
  ``tests/integration/test_sdk_conformance.py``.
* Input: how a global batch is split across replicas (the SDK's strategy and
  ``xreduce.tensorflow``'s share of it for each process), ``InputContext`` and ``InputOptions``.
* Structures: ``experimental_local_results`` of a nest, and a dict element of a distributed dataset.
"""

from __future__ import annotations

import ast
import json
import pathlib

import numpy as np
import pytest
from tf_env import logical_cpus

tf = logical_cpus()
import xreduce  # noqa: E402
from tensorflow.python.distribute import values as tf_values  # noqa: E402
from xreduce import distribute  # noqa: E402
from xreduce._input import check_options  # noqa: E402
from xreduce.tensorflow._input import shard  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
DOC = json.loads((HERE / "cases.json").read_text())
ARRAYS = np.load(HERE / "arrays.npz")
CPUS = [f"/cpu:{i}" for i in range(8)]


def on(device: int, array: np.ndarray) -> tf.Tensor:
    with tf.device(CPUS[device]):
        return tf.identity(tf.constant(array))


def tf_value(entry) -> tf_values.PerReplica:
    return tf_values.PerReplica(tuple(on(d, ARRAYS[k]) for d, k in zip(entry["devices"], entry["keys"])))


def tf_destination(spec, value):
    if spec == "same":
        return value
    if len(spec) == 1:
        return CPUS[spec[0]]
    return tf_values.Mirrored(tuple(on(d, np.float32(0)) for d in spec))


def by_device(result) -> dict[str, bytes]:
    parts = result.values if isinstance(result, tf_values.DistributedValues) else (result,)
    return {tf.DeviceSpec.from_string(t.device).device_index: (t.numpy().dtype.str, t.numpy().shape,
                                                               t.numpy().tobytes()) for t in parts}


def recorded(entry) -> dict[int, bytes]:
    return {d: (ARRAYS[k].dtype.str, ARRAYS[k].shape, ARRAYS[k].tobytes())
            for d, k in zip(entry["devices"], entry["keys"])}


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["id"] for c in DOC["cases"]])
def test_tf_gives_what_the_conformance_vectors_record_of_it(case):
    ops = tf.distribute.HierarchicalCopyAllReduce(num_packs=case["num_packs"])
    op = (ast.literal_eval(case["reduce_op_python"]) if case.get("reduce_op_python")  # what TF was given
          else tf.distribute.ReduceOp(case["reduce_op"]) if case["reduce_op"] else None)

    def run():
        if case["call"] == "broadcast":
            v = case["values"][0]
            tensor = v["python_value"] if "python_value" in v else on(v["device"], ARRAYS[v["key"]])
            return [ops.broadcast(tensor, tf_destination(case["destinations"], None))]
        if case["call"] == "reduce":
            value = tf_value(case["values"][0])
            if case["values"][0].get("tf_kind") == "tensor":
                value = value.values[0]
            destination = tf_destination(case["destinations"], value)
            if case["id"].startswith("reduce_hc_equiv"):
                # TF's reduce() on CPUs falls back to a reduction to one device (bug (b)): the vectors record its
                # hierarchical copy, which a batch_reduce of the one pair runs on any device.
                return ops.batch_reduce(op, [(value, destination)])
            return [ops.reduce(op, value, destination)]
        values = [tf_value(v) for v in case["values"]]
        return ops.batch_reduce(op, [(v, tf_destination(d, v)) for v, d in zip(values, case["destinations"])])

    if "tf_error" in case:
        with pytest.raises(Exception) as info:
            run()
        assert type(info.value).__name__ == case["tf_error"]["type"]
        return
    want = case["tf_expected"] if "tf_expected" in case else case["expected"]
    got = run()
    assert len(got) == len(want)
    for result, entry in zip(got, want):
        assert by_device(result) == recorded(entry)


# --- input ------------------------------------------------------------------------------------------------------

SPLITS = [(25, 10, 4), (10, 7, 3), (10, 4, 4), (9, 2, 2), (3, 4, 2), (64 * 3 + 5, 64, 4)]


def tf_steps(dataset, n: int) -> list[list[list]]:
    strategy = tf.distribute.MirroredStrategy(CPUS[:n])
    return [[v.numpy().tolist() for v in strategy.experimental_local_results(x)]
            for x in strategy.experimental_distribute_dataset(dataset)]


@pytest.mark.parametrize(("rows", "batch", "n"), SPLITS)
def test_the_sdks_split_of_a_global_batch_is_tfs(daemon, rows, batch, n):
    """TF 2.21's MirroredStrategy gives each replica ceil(b / N) rows of a batch of b, in order (not
    batch_sizes_for_worker's as-even-as-possible sizes); the SDK's strategy does the same."""
    sdk = distribute.MirroredStrategy(devices=[f"CPU:{i}" for i in range(n)],
                                      cross_device_ops=distribute.HierarchicalCopyAllReduce(address=daemon.address))
    ours = [[v.tolist() for v in step.values] for step in
            sdk.experimental_distribute_dataset([np.arange(rows)[i:i + batch] for i in range(0, rows, batch)])]
    assert ours == tf_steps(tf.data.Dataset.range(rows).batch(batch), n)


SHARES = [(rows, batch, n, p) for rows, batch, n in SPLITS for p in (2, 4) if n % p == 0]
"""Every worker of a TF strategy has the same replica count: processes that divide the replicas."""


@pytest.mark.parametrize(("rows", "batch", "n", "processes"), SHARES)
def test_each_processs_share_is_its_replicas_of_tfs_split(rows, batch, n, processes):
    """What ``xreduce.tensorflow.MirroredStrategy`` feeds each process's replicas, step by step, put side by
    side over the processes, is TF's one-process split over all the job's replicas, empty batches included."""
    local = n // processes
    for dataset in (tf.data.Dataset.range(rows).batch(batch), _keras_dataset(rows, batch)):
        shares = [list(shard(dataset, n, p * local, local)) for p in range(processes)]
        steps = [sum((share[s * local:(s + 1) * local] for share in shares), [])
                 for s in range(len(shares[0]) // local)]
        assert [[v.numpy().tolist() for v in step] for step in steps] == tf_steps(dataset, n)


def _keras_dataset(rows: int, batch: int):
    """What Keras' fit makes of numpy arrays: a dataset of unknown batch size (TF then rebatches otherwise)."""
    from keras.src.trainers.data_adapters import array_data_adapter

    x = np.arange(rows, dtype="int64")
    return array_data_adapter.ArrayDataAdapter(x, batch_size=batch, shuffle=False).get_tf_dataset().map(
        lambda *e: e[0])


def test_input_context_is_tfs():
    for cls in (tf.distribute.InputContext, distribute.InputContext):
        ctx = cls(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
        assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 6)
        assert ctx.get_per_replica_batch_size(12) == 2
        with pytest.raises(ValueError, match="The `global_batch_size` 13 is not divisible by `num_replicas_in_sync` 6"):
            ctx.get_per_replica_batch_size(13)


def test_tfs_input_options_are_accepted():
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=3,
                                         experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    got = check_options(options, "distribute_datasets_from_function")
    assert got == distribute.InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=3,
                                          experimental_replication_mode=distribute.InputReplicationMode.PER_REPLICA)


# --- structures -------------------------------------------------------------------------------------------------


def test_local_results_of_a_nest_are_one_nest_per_replica_as_tfs(daemon):
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    sdk = distribute.MirroredStrategy(devices=["CPU:0", "CPU:1"], cross_device_ops=ops)
    theirs = tf.distribute.MirroredStrategy(CPUS[:2])

    def nest(rid):
        return {"a": rid * 1.0, "b": [rid + 10.0, (rid * 2.0,)]}

    ours = sdk.experimental_local_results(
        sdk.run(lambda: nest(distribute.get_replica_context().replica_id_in_sync_group)))
    tf_nest = theirs.experimental_local_results(theirs.run(
        lambda: nest(tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))))
    as_floats = tf.nest.map_structure(lambda t: float(t), tf_nest)
    assert tf.nest.map_structure(float, ours) == as_floats
    assert isinstance(ours, tuple) and len(ours) == 2


def test_a_dict_element_of_a_distributed_dataset_is_tfs(daemon):
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    sdk = distribute.MirroredStrategy(devices=["CPU:0", "CPU:1"], cross_device_ops=ops)
    theirs = tf.distribute.MirroredStrategy(CPUS[:2])
    data = {"x": np.arange(6.0), "y": np.arange(6) * 10}
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(3)
    got = [sdk.experimental_local_results(x) for x in sdk.experimental_distribute_dataset(dataset)]
    want = [theirs.experimental_local_results(x) for x in theirs.experimental_distribute_dataset(dataset)]
    assert [[{k: v.tolist() for k, v in r.items()} for r in step] for step in got] == \
        [[{k: v.numpy().tolist() for k, v in r.items()} for r in step] for step in want]
    assert xreduce  # the SDK's names, side by side with TF's


# --- the ported TF tests, side by side ---------------------------------------------------------------------------


def sdk_result(result) -> dict[int, tuple]:
    parts = result.values if isinstance(result, distribute.DistributedValues) else (result,)
    devices = result.devices if isinstance(result, distribute.DistributedValues) else None
    out = {}
    for i, part in enumerate(parts):
        index = xreduce.DeviceName.parse(devices[i]).index if devices else None
        array = np.asarray(part)
        out[index] = (array.dtype.str, array.shape, array.tobytes())
    return out


def tf_result(result) -> dict[int, tuple]:
    got = by_device(result)
    return got if isinstance(result, tf_values.DistributedValues) else {None: next(iter(got.values()))}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["hcar", "rtod"])
def test_reduction_and_broadcast_are_tfs(daemon, kind, n):
    """``_testReductionAndBroadcast`` of TF's cross_device_ops_test (tests/integration/test_tf_ported.py
    computes its expectations by formula): the SDK against TF itself, for every destination kind, in batches too.
    With several devices TF's ``reduce`` of HierarchicalCopyAllReduce on CPUs reduces to one device (bug (b));
    these values are small integers, so any order of additions gives the same bytes."""
    tf_ops = (tf.distribute.HierarchicalCopyAllReduce() if kind == "hcar" else tf.distribute.ReductionToOneDevice())
    ops = (distribute.HierarchicalCopyAllReduce if kind == "hcar" else distribute.ReductionToOneDevice)(
        address=daemon.address)
    values = [np.float32(d) for d in range(n)]
    sdk_value = distribute.PerReplica(values, devices=[f"CPU:{d}" for d in range(n)])
    tf_value_ = tf_values.PerReplica(tuple(on(d, v) for d, v in enumerate(values)))
    sdk_dest = {"mirrored": distribute.Mirrored([np.float32(1)] * n, devices=[f"CPU:{d}" for d in range(n)]),
                "different": distribute.Mirrored([np.float32(1)], devices=["CPU:7"]), "string": "/device:CPU:7"}
    tf_dest = {"mirrored": tf_values.Mirrored(tuple(on(d, np.float32(1)) for d in range(n))),
               "different": tf_values.Mirrored((on(7, np.float32(1)),)), "string": "/device:CPU:7"}
    for op in ("SUM", "MEAN"):
        for dest in sdk_dest:
            assert sdk_result(ops.reduce(op, sdk_value, sdk_dest[dest])) == \
                tf_result(tf_ops.reduce(tf.distribute.ReduceOp(op), tf_value_, tf_dest[dest]))
            got = ops.batch_reduce(op, [(sdk_value, sdk_dest[dest]), (sdk_value, sdk_dest["string"])])
            want = tf_ops.batch_reduce(tf.distribute.ReduceOp(op), [(tf_value_, tf_dest[dest]),
                                                                    (tf_value_, tf_dest["string"])])
            assert [sdk_result(r) for r in got] == [tf_result(r) for r in want]
    for dest in sdk_dest:
        assert sdk_result(ops.broadcast(np.float32(1.0), sdk_dest[dest])) == \
            tf_result(tf_ops.broadcast(tf.constant(1.0), tf_dest[dest]))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_sparse_values_reduce_as_tfs(daemon, op, dtype):
    """IndexedSlices (tests/integration/test_sparse.py derives them from TF's source): the SDK's results,
    values, indices and dense shape, against TF's for a sparse value alone and in a batch with a dense one."""
    rng = np.random.default_rng(5)
    n = 4
    parts = [(rng.integers(-9, 9, (k + 1, 2)).astype(dtype), rng.integers(0, 6, k + 1).astype("int64"))
             for k in range(n)]
    dense = [rng.standard_normal(4).astype("float32") for _ in range(n)]
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    sdk_sparse = distribute.PerReplica([distribute.IndexedSlices(v, i, [6, 2]) for v, i in parts],
                                       devices=[f"CPU:{d}" for d in range(n)])
    sdk_dense = distribute.PerReplica(dense, devices=[f"CPU:{d}" for d in range(n)])
    tf_sparse = tf_values.PerReplica(tuple(
        tf.IndexedSlices(on(d, v), on(d, i), on(d, np.array([6, 2], "int64"))) for d, (v, i) in enumerate(parts)))
    tf_dense = tf_values.PerReplica(tuple(on(d, v) for d, v in enumerate(dense)))
    got = ops.batch_reduce(op, [(sdk_sparse, sdk_sparse), (sdk_dense, sdk_dense)])
    want = tf.distribute.HierarchicalCopyAllReduce().batch_reduce(
        tf.distribute.ReduceOp(op), [(tf_sparse, tf_sparse), (tf_dense, tf_dense)])
    for mine, theirs in zip(got[0].values, want[0].values):
        assert isinstance(mine, distribute.IndexedSlices) and isinstance(theirs, tf.IndexedSlices)
        assert np.asarray(mine.values).tobytes() == theirs.values.numpy().tobytes()
        assert np.asarray(mine.values).dtype == theirs.values.numpy().dtype
        assert np.asarray(mine.indices).tolist() == theirs.indices.numpy().tolist()
        assert list(mine.dense_shape) == theirs.dense_shape.numpy().tolist()
    assert sdk_result(got[1]) == tf_result(want[1])
