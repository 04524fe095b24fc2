"""A process's share of a global dataset: the rows TF's one-process ``MirroredStrategy`` would give its replicas.

Every process of a job iterates the same global batches. TF's own split over the
job's ``N`` replicas (its rebatching, exactly as TF 2.21 chooses it for the
dataset) cuts each global batch into one minibatch per replica, in global replica
order; this process keeps the minibatches of its replicas ``[offset, offset + R)``.
At the last, partial, batch TF may cut fewer than ``N`` minibatches and gives the
replicas left without one an empty batch: so does each process, so that every
process runs the same number of steps and no step needs a collective to agree on it.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.data.experimental.ops import distribute as tf_distribute


def shard(dataset: tf.data.Dataset, num_replicas: int, offset: int, local: int) -> tf.data.Dataset:
    """This process's per-replica minibatches of ``dataset``'s global batches, ``local`` per step.

    Args:
        dataset: batched global data, the same in every process.
        num_replicas: the job's replica count (``N``).
        offset: the global id of this process's first replica.
        local: this process's replica count (``R``).

    Raises:
        ValueError: an element holds something other than dense tensors (no empty batch can be made for it).

    Example:
        >>> ds = tf.data.Dataset.range(10).batch(4)
        >>> [e.numpy().tolist() for e in shard(ds, 4, 2, 2)]
        [[2], [3], [6], [7], [], []]
        >>> [e.numpy().tolist() for e in shard(tf.data.Dataset.range(10).batch(7), 3, 0, 2)]
        [[0, 1, 2], [3, 4, 5], [7], [8]]
    """
    if num_replicas == 1:
        return dataset
    # What TF's own steps for one worker of all the job's replicas make: its rebatching (a `cond` between a rebatch
    # by the static batch size and the legacy rebatch), then its auto-shard rewrite, which for one shard rewrites the
    # first into the second: ceil(rows / N) rows a replica. Made directly, with no rewrite of the whole pipeline and
    # no `cond` of datasets (the same minibatches).
    minibatches = tf_distribute._LegacyRebatchDataset(dataset, num_replicas).prefetch(num_replicas)
    empty = _empty(minibatches.element_spec)
    steps = minibatches.window(num_replicas)

    def mine(*window):
        window = window[0] if len(window) == 1 else window
        step = window if isinstance(window, tf.data.Dataset) else tf.data.Dataset.zip(window)
        padding = tf.data.Dataset.from_tensors(empty).repeat(local)
        return step.skip(offset).take(local).concatenate(padding).take(local)

    return steps.flat_map(mine)


def _empty(spec):
    def zeros(s):
        if not isinstance(s, tf.TensorSpec):
            raise ValueError(f"xreduce.tensorflow.MirroredStrategy shards dense tensors across processes; the "
                             f"dataset's elements hold {s!r} (use distribute_datasets_from_function)")
        return tf.zeros([0] + s.shape.as_list()[1:], s.dtype)

    return tf.nest.map_structure(zeros, spec)
