"""The arithmetic of input distribution (``xreduce._input``), no daemon.

Keras' arithmetic (``DataParallel.distribute_dataset``) comes from TensorFlow's
``batch_sizes_for_worker`` in ``tensorflow/python/data/experimental/ops/distribute.py``
(its docstring's G=7, W=2, R=2 example) and Keras' own test data; ``InputContextTest``
of ``distribute_lib_test.py``. ``MirroredStrategy``'s split is checked here for its
invariants and against TensorFlow itself in ``tests/tensorflow/test_tf_oracle.py``.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from xreduce._input import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    Rows,
    check_options,
    fill,
    global_batches,
    keras_batches,
    per_replica_rows,
    split_sizes,
)


def batch_sizes_for_worker(global_batch_size: int, num_workers: int, num_replicas_per_worker: int,
                           worker_index: int) -> list[int]:
    """TF's function, transcribed from its constant-size branch: worker 0's sizes, rotated by R·index."""
    n = num_workers * num_replicas_per_worker
    floor = global_batch_size // n
    num_ceil = global_batch_size - n * floor
    worker_0 = [floor + 1] * num_ceil + [floor] * (n - num_ceil)
    offset = worker_index * num_replicas_per_worker
    return worker_0[offset:] + worker_0[:offset]


def test_tf_docstring_example_g7_w2_r2():
    # batch_sizes_for_worker's docstring: worker 0 [2, 2, 2, 1], worker 1 [2, 1, 2, 2].
    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]
    # Over the four replicas of the job, one global batch is split [2, 2, 2, 1] in replica order.
    assert split_sizes(7, 4) == [2, 2, 2, 1]


@given(st.integers(0, 500), st.integers(1, 64))
def test_split_is_tfs_single_worker_rebatch(rows, parts):
    sizes = split_sizes(rows, parts)
    assert sizes == batch_sizes_for_worker(rows, 1, parts, 0)
    assert sum(sizes) == rows and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(st.integers(1, 300), st.integers(1, 16), st.data())
def test_a_partial_batch_fills_parts_in_order(full, parts, data):
    n = data.draw(st.integers(0, full))
    sizes = split_sizes(full, parts)
    bounds = fill(sizes, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(bounds, bounds[1:]))  # contiguous, in order
    got = [b - a for a, b in bounds]
    assert all(0 <= g <= s for g, s in zip(got, sizes))
    # Every part before the first short one is full: the rows go to the lowest replica ids.
    short = next((i for i, (g, s) in enumerate(zip(got, sizes)) if g < s), parts)
    assert all(g == 0 for g in got[short + 1:])


@given(st.integers(1, 200), st.integers(1, 6), st.integers(1, 4))
def test_processes_own_their_replicas_contiguous_rows(rows, num_processes, per_process):
    """Each process's rows are its replicas' slices; together they are the batch, once each."""
    total = num_processes * per_process
    bounds = fill(split_sizes(rows, total), rows)
    seen = []
    for p in range(num_processes):
        for g in range(p * per_process, (p + 1) * per_process):
            seen.extend(range(*bounds[g]))
    assert seen == list(range(rows))


def test_uneven_dataset_batches_two_replicas():
    """input_lib_test.testUnevenDatasetBatchesMultiWorker's data, range(9).batch(2) over 2 replicas:
    [0] [1] | [2] [3] | ... | [8] []."""
    batches = [np.arange(9)[i:i + 2] for i in range(0, 9, 2)]
    got = [[batch[a:b].tolist() for a, b in bounds] for batch, bounds in global_batches(batches, 2, "t")]
    assert got == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], []]]


def test_keras_refuses_a_batch_larger_than_the_first():
    with pytest.raises(ValueError, match=r"t: batch 1 has 5 rows, more than the 4 of batch 0"):
        list(keras_batches([np.zeros(4), np.zeros(5)], 2, "t"))


@given(st.integers(0, 300), st.integers(1, 16))
def test_each_batch_is_split_by_ceil_rows_in_replica_order(rows, parts):
    bounds = per_replica_rows(rows, parts)
    size = -(-rows // parts)
    assert [b - a for a, b in bounds] == [max(0, min(size, rows - i * size)) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(bounds, bounds[1:]))  # contiguous, in order


def test_every_batch_is_split_on_its_own():
    got = [bounds for _, bounds in global_batches([np.zeros(7), np.zeros(10), np.zeros(3)], 3, "t")]
    assert got == [[(0, 3), (3, 6), (6, 7)], [(0, 4), (4, 8), (8, 10)], [(0, 1), (1, 2), (2, 3)]]


@pytest.mark.parametrize(("batch", "message"), [
    ((np.zeros(4), np.zeros(3)), r"every array of the batch must have the same number of rows; batch\[0\] has 4, "
                                 r"batch\[1\] has 3"),
    ({"x": np.zeros(4), "n": 3}, r"batch\['n'\] must be an array with a batch \(first\) dimension; got int 3"),
    (np.float32(1.0), r"batch must be an array with a batch \(first\) dimension; got float32 of shape \(\)"),
    ((), r"the batch holds no arrays; got \(\)"),
])
def test_bad_batches_name_the_array(batch, message):
    with pytest.raises(ValueError, match=r"t: batch 0: " + message):
        list(global_batches([batch], 2, "t"))


def test_rows_of_each_process_keras_arithmetic():
    """Keras' DataParallel.distribute_dataset: batch_sizes_for_worker(B, P, 1, p), then shard(P, p).
    34 rows batched by 16 over 2 processes (Keras' tf_dataset_adapter_test.test_distribute_dataset data):
    process 0 gets rows 0-7, 16-23, 32-33; process 1 rows 8-15, 24-31 and an empty last batch."""
    x = np.arange(34)
    batches = [x[i:i + 16] for i in range(0, 34, 16)]
    assert [b.tolist() for b in Rows(batches, 2, 0, "t")] == [list(range(8)), list(range(16, 24)), [32, 33]]
    assert [b.tolist() for b in Rows(batches, 2, 1, "t")] == [list(range(8, 16)), list(range(24, 32)), []]


def test_rows_keep_the_structure_and_named_tuples():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": Pair(np.arange(6).reshape(3, 2), np.arange(3)), "b": [np.arange(3.0)]}
    (got,) = list(Rows([batch], 2, 1, "t"))
    assert isinstance(got["a"], Pair)
    assert got["a"].x.tolist() == [[4, 5]] and got["a"].y.tolist() == [2] and got["b"][0].tolist() == [2.0]


# --- InputContext: distribute_lib_test.InputContextTest ---------------------------------------------------------


def test_input_context_properties():  # testProperties
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert (ctx.num_replicas_in_sync, ctx.input_pipeline_id, ctx.num_input_pipelines) == (6, 1, 2)


def test_input_context_per_replica_batch_size():  # testPerReplicaBatchSize
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert ctx.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError, match=r"The `global_batch_size` 13 is not divisible by `num_replicas_in_sync` 6"):
        ctx.get_per_replica_batch_size(13)


def test_input_context_str():  # testStr, with xreduce's module name
    assert str(InputContext(1, 0, 42)) == "xreduce.distribute.InputContext(input pipeline id 0, total: 1)"
    assert str(InputContext(3, 1, 42)) == "xreduce.distribute.InputContext(input pipeline id 1, total: 3)"


def test_input_context_defaults_are_tfs():
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_input_pipelines": 0}, "num_input_pipelines must be an integer >= 1; got 0"),
    ({"num_replicas_in_sync": 1.5}, "num_replicas_in_sync must be an integer >= 1; got 1.5"),
    ({"num_input_pipelines": 2, "input_pipeline_id": 2},
     r"input_pipeline_id must be in \[0, num_input_pipelines\); got input_pipeline_id=2, num_input_pipelines=2"),
])
def test_input_context_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        InputContext(**kwargs)


# --- InputOptions ---------------------------------------------------------------------------------------------


class TFLikeOptions:
    """An options object with tf.distribute.InputOptions' four attributes, the replication mode an enum whose
    member is named as TF's (TF's own class is accepted too: tests/tensorflow/test_tf_oracle.py)."""

    def __init__(self, **fields):
        self.experimental_fetch_to_device = None
        self.experimental_replication_mode = InputReplicationMode.PER_WORKER
        self.experimental_place_dataset_on_device = False
        self.experimental_per_replica_buffer_size = 1
        self.__dict__.update(fields)


def test_options_none_and_tf_like_objects_are_accepted():
    assert check_options(None, "m") == InputOptions()
    got = check_options(TFLikeOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=4), "m")
    assert got == InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=4)
    assert InputOptions(experimental_replication_mode="PER_REPLICA").experimental_replication_mode \
        is InputReplicationMode.PER_REPLICA


@pytest.mark.parametrize(("options", "method", "message"), [
    ({"a": 1}, "m", "m: options must be an xreduce.distribute.InputOptions .* got dict"),
    (InputOptions(experimental_place_dataset_on_device=True), "m",
     "m: options.experimental_place_dataset_on_device=True is not supported"),
    (InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA), "experimental_distribute_dataset",
     "PER_REPLICA is supported by distribute_datasets_from_function only"),
    (InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA, experimental_fetch_to_device=True),
     "distribute_datasets_from_function", "experimental_fetch_to_device=True works with .*PER_WORKER only"),
    (TFLikeOptions(experimental_replication_mode="EVERYWHERE"), "m",
     "experimental_replication_mode must be PER_WORKER or PER_REPLICA; got 'EVERYWHERE'"),
])
def test_options_that_cannot_be_honoured_are_refused(options, method, message):
    with pytest.raises(ValueError, match=message):
        check_options(options, method)


@pytest.mark.parametrize(("field", "value"), [
    ("experimental_fetch_to_device", "yes"),
    ("experimental_place_dataset_on_device", None),
    ("experimental_per_replica_buffer_size", True),
])
def test_options_fields_are_type_checked(field, value):
    with pytest.raises(ValueError, match=f"InputOptions.{field} must be .*; got {value!r}"):
        InputOptions(**{field: value})
