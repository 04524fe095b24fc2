"""``MirroredStrategy.experimental_distribute_dataset`` and ``distribute_datasets_from_function`` on a real daemon.

TF's ``input_lib_test.py`` cases are ported by name; the expected values are TF's
own (they are literals in its tests), and a small object with ``tf.data.Dataset``'s
iteration protocol (``as_numpy_iterator()``) stands for a dataset here; real
``tf.data.Dataset`` objects, side by side with TF's own strategy, are in
``tests/tensorflow/test_tf_oracle.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xreduce
from xreduce._input import map_structure
from xreduce.distribute import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
)

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format


@pytest.fixture
def strategy(daemon):
    """A strategy over two of the real daemon's devices."""
    s = MirroredStrategy(devices=["CPU:0", "CPU:1"], address=daemon.address)
    yield s
    s.cross_device_ops.close()


def local_results(step) -> list:
    return [np.asarray(v).tolist() for v in step.values]


class FakeTFDataset:
    """Stands in for tf.data.Dataset (TensorFlow is not installable here): ``as_numpy_iterator()`` yields
    numpy batches; plain iteration would yield framework tensors, which must not be what is split."""

    def __init__(self, batches):
        self._batches = batches

    def as_numpy_iterator(self):
        return iter([map_structure(np.asarray, b) for b in self._batches])

    def __iter__(self):
        raise AssertionError("a tf.data.Dataset is read through as_numpy_iterator()")


def range_batches(n: int, batch: int, drop_remainder: bool = False) -> list[np.ndarray]:
    """``tf.data.Dataset.range(n).batch(batch, drop_remainder)`` as numpy batches."""
    out = [np.arange(n, dtype=np.int64)[i:i + batch] for i in range(0, n, batch)]
    return [b for b in out if len(b) == batch] if drop_remainder else out


# --- experimental_distribute_dataset -----------------------------------------------------------------------------


def test_batch_splitting(strategy):
    """testBatchSplitting (num_replicas_in_sync=2): range(100).batch(10) over 2 replicas."""
    got = [local_results(x) for x in strategy.experimental_distribute_dataset(range_batches(100, 10))]
    assert got == [[list(range(i, i + 5)), list(range(i + 5, i + 10))] for i in range(0, 100, 10)]


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_uneven_dataset_batches(strategy, drop_remainder):
    """testUnevenDatasetBatchesMultiWorker's data and numbers (range(9).batch(2), two replicas in sync):
    the last global batch only has data for the first replica; the other gets an empty batch."""
    got = [local_results(x) for x in strategy.experimental_distribute_dataset(range_batches(9, 2, drop_remainder))]
    want = [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]] + ([] if drop_remainder else [[[8], []]])
    assert got == want


def test_uneven_split_gives_the_first_replicas_one_more_row(daemon):
    """batch_sizes_for_worker: 7 rows over 4 replicas are [2, 2, 2, 1]; a partial batch of 5 then
    fills them in order: [2, 2, 1, 0]."""
    s = MirroredStrategy(devices=[f"CPU:{i}" for i in range(4)], address=daemon.address)
    got = [[len(v) for v in x.values] for x in s.experimental_distribute_dataset([np.zeros(7), np.zeros(5)])]
    assert got == [[2, 2, 2, 1], [2, 2, 1, 0]]


def test_get_next_optional_shape(strategy):
    """testGetNextOptionalShape: a dict of features and labels, batch 8, keeps per-replica shapes [4, 10], [4]."""
    batch = {"feature": np.ones([8, 10]), "label": np.ones([8])}
    (step,) = list(strategy.experimental_distribute_dataset(FakeTFDataset([batch])))
    assert [v.shape for v in step["feature"].values] == [(4, 10), (4, 10)]
    assert [v.shape for v in step["label"].values] == [(4,), (4,)]
    assert step["feature"].devices == (CPU(0), CPU(1))


def test_cache_across_iteration(strategy):
    """testCacheAcrossIteration: two epochs over the distributed dataset give the same values."""
    dist = strategy.experimental_distribute_dataset(range_batches(16, 4))
    assert [local_results(x) for x in dist] == [local_results(x) for x in dist]


def test_iterator_get_next_and_strategy_run(strategy):
    """The TF loop: ``strategy.run(fn, args=(next(iterator),))``, then ``strategy.reduce``."""
    iterator = iter(strategy.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0, 8.0)]))
    first = strategy.run(lambda x: (x * x).sum(), args=(next(iterator),))
    second = strategy.run(lambda x: (x * x).sum(), args=(iterator.get_next(),))
    assert float(strategy.reduce(ReduceOp.SUM, first, axis=None)) == 0 + 1 + 4 + 9
    assert float(strategy.reduce(ReduceOp.SUM, second, axis=None)) == 16 + 25 + 36 + 49
    with pytest.raises(StopIteration):
        next(iterator)


def test_nested_tuples_of_torch_and_numpy(strategy):
    x, y = torch.arange(6.0).reshape(3, 2), np.array([1, 2, 3])
    ((px, py),) = list(strategy.experimental_distribute_dataset([(x, y)]))
    assert isinstance(px, PerReplica) and isinstance(px.values[0], torch.Tensor)
    assert [v.tolist() for v in px.values] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0]]]
    assert [v.tolist() for v in py.values] == [[1, 2], [3]]
    loss = strategy.run(lambda a, b: float((a.sum(dim=1) * torch.as_tensor(b)).sum()), args=(px, py))
    assert float(strategy.reduce("sum", loss, axis=None)) == 1 * 1 + 5 * 2 + 9 * 3


def test_one_device(daemon):
    """testOneDeviceCPU: one replica gets every batch whole."""
    s = MirroredStrategy(devices=["CPU:3"], address=daemon.address)
    assert [local_results(x) for x in s.experimental_distribute_dataset(range_batches(4, 2))] == [[[0, 1]], [[2, 3]]]


@pytest.mark.parametrize(("dataset", "options", "message"), [
    (5, None, "experimental_distribute_dataset: dataset must be an iterable of batches .* got int"),
    ("abc", None, "dataset must be an iterable of batches .* got str"),
    ([np.zeros(2)], InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA),
     "PER_REPLICA is supported by distribute_datasets_from_function only"),
])
def test_distribute_dataset_rejects(strategy, dataset, options, message):
    with pytest.raises(ValueError, match=message):
        strategy.experimental_distribute_dataset(dataset, options)


def test_bad_batch_fails_at_its_step_naming_it(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.zeros(4), (np.zeros(4), np.zeros(3))]))
    next(iterator)
    with pytest.raises(ValueError, match=r"batch 1: every array .* batch\[0\] has 4, batch\[1\] has 3"):
        next(iterator)


# --- distribute_datasets_from_function ---------------------------------------------------------------------------


def test_uneven_dataset_batches_from_function(strategy):
    """testUnevenDatasetBatches (input_fn): range(9).batch(2) as per-replica batches over 2 replicas;
    replicas take successive elements, the last step's second replica an empty batch."""
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return range_batches(9, 2)

    got = [local_results(x) for x in strategy.distribute_datasets_from_function(dataset_fn)]
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    (ctx,) = contexts  # called once, for the one input pipeline of this process
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)


def test_from_function_with_a_tf_like_dataset_and_per_replica_batch_size(strategy):
    def dataset_fn(ctx: InputContext):
        size = ctx.get_per_replica_batch_size(4)
        return FakeTFDataset([{"x": np.full((size, 1), i)} for i in range(4)])

    got = [[v.ravel().tolist() for v in step["x"].values] for step in strategy.distribute_datasets_from_function(
        dataset_fn)]
    assert got == [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]


def test_from_function_per_replica(strategy):
    """InputReplicationMode.PER_REPLICA: one call per replica, pipeline id = replica id; each reads its own."""
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                           experimental_fetch_to_device=False)
    fn = lambda ctx: [np.full(1, 10 * ctx.input_pipeline_id + k) for k in range(3 - ctx.input_pipeline_id)]  # noqa: E731
    got = [local_results(x) for x in strategy.distribute_datasets_from_function(fn, options)]
    assert got == [[[0], [10]], [[1], [11]], [[2], []]]


def test_from_function_rejects(strategy):
    with pytest.raises(ValueError, match="dataset_fn must be a function of an InputContext; got list"):
        strategy.distribute_datasets_from_function([1, 2])
    with pytest.raises(ValueError, match="dataset must be an iterable of batches .* got NoneType"):
        strategy.distribute_datasets_from_function(lambda ctx: None)
    # A partial last step needs an element with a batch dimension to make the empty batch from.
    with pytest.raises(ValueError, match="the last element .* must be an array with a batch"):
        list(strategy.distribute_datasets_from_function(lambda ctx: [np.float64(1.0)] * 3))


def test_embedded_daemon_example_loop():
    """The loop of a TF custom training loop, through an embedded daemon: the reduced loss of the split batch
    equals the loss of the whole batch."""
    x = np.linspace(-1.0, 1.0, 30).reshape(10, 3)
    with xreduce.serve_embedded(virtual_devices=3):
        s = MirroredStrategy()
        total = 0.0
        for batch in s.experimental_distribute_dataset([x[:6], x[6:]]):
            per_replica = s.run(lambda b: np.square(b).sum(), args=(batch,))
            total += float(s.reduce("sum", per_replica, axis=None))
    assert total == pytest.approx(float(np.square(x).sum()), rel=1e-12)
