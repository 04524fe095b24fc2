"""``MirroredStrategy`` for a job of several processes, on one node or many, reducing through the daemon.

A ``tf.distribute.MirroredStrategy`` whose extended part knows the job
(``xreduce.distribution.initialize``), as ``MultiWorkerMirroredStrategy``'s
does: ``num_replicas_in_sync`` counts every process's replicas, replica ids are
global, every reduction (gradients, ``strategy.reduce``, the SyncOnRead
variables behind Keras' metrics, int32 values too) spans the job through the
daemon, a global dataset is split so that each process feeds its own replicas'
rows (:mod:`xreduce.tensorflow._input`), and each variable starts from process
0's initial value. Without a multi-process group it is TF's ``MirroredStrategy``
with :class:`~xreduce.tensorflow.HierarchicalCopyAllReduce`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as tf_cdo
from tensorflow.python.distribute import (
    device_util,
    distribute_lib,
    distribute_utils,
    input_lib,
    input_util,
    reduce_util,
)
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended
from tensorflow.python.trackable import base as trackable
from tensorflow.python.util import nest

from xreduce import _ops as sdk
from xreduce._runtime import ProcessGroup
from xreduce.tensorflow import _bridge, _input
from xreduce.tensorflow._devices import sdk_name
from xreduce.tensorflow._ops import HierarchicalCopyAllReduce, ReductionToOneDevice


@dataclasses.dataclass(frozen=True)
class Job:
    """This process's replicas within the job's."""

    group: ProcessGroup
    counts: tuple[int, ...]
    """Every process's replica count, by process id."""

    @property
    def offset(self) -> int:
        """The global id of this process's first replica."""
        return sum(self.counts[: self.group.process_id])

    @property
    def num_replicas(self) -> int:
        """Every process's replicas."""
        return sum(self.counts)


def local_devices() -> list[str]:
    """This process's TF devices: its GPUs, else its logical CPUs.

    Example:
        >>> local_devices()[0].endswith("/device:CPU:0")
        True
    """
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def _meet(ops: HierarchicalCopyAllReduce | ReductionToOneDevice, group: ProcessGroup, devices: Sequence[str]) -> Job:
    """Every process's replica count, from one small collective: each adds its count at its own place."""
    mine = sdk_name(devices[0], group)
    counts = np.zeros(group.num_processes, np.int64)
    counts[group.process_id] = len(devices)
    try:
        total = ops._sdk.reduce("sum", sdk.PerReplica([counts], devices=[mine]), mine)
    except Exception as e:
        raise _bridge.tf_error(e) from None
    return Job(group, tuple(int(c) for c in total))


class _JobExtended(MirroredExtended):
    """``MirroredExtended`` over this process's devices, in a job of several processes when ``job`` is set."""

    def __init__(self, container_strategy, devices, cross_device_ops, job: Job | None):
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)
        self._job = job
        cross_device_ops._replica_devices = self._devices
        if job is not None:
            cross_device_ops._replicas = (job.offset, job.num_replicas)

    @property
    def _num_replicas_in_sync(self) -> int:
        return self._job.num_replicas if self._job else len(self._devices)

    def _get_replica_id_in_sync_group(self, replica_id):
        return replica_id + self._job.offset if self._job else replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self._job.offset if self._job else replica_id_in_sync_group

    def _get_cross_device_ops(self, value):
        _bridge.refuse_xla()
        if self._job:  # int32 values too: TF would reduce them on this process alone
            return self._cross_device_ops
        return super()._get_cross_device_ops(value)

    def _reduce_to(self, reduce_op, value, destinations, options):
        if not self._job:
            return super()._reduce_to(reduce_op, value, destinations, options)
        if distribute_utils.is_mirrored(value) and reduce_op == reduce_util.ReduceOp.MEAN:
            return value

        def reduce(v):
            if not isinstance(v, tf_values.DistributedValues) and len(self._devices) > 1:
                return tf_cdo.reduce_non_distributed_value(reduce_op, v, destinations, self._num_replicas_in_sync)
            # A plain value of a process with one replica is that replica's.
            return self._get_cross_device_ops(v).reduce(reduce_op, v, destinations=destinations,
                                                        options=self._communication_options.merge(options))

        return nest.map_structure(reduce, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if not self._job:
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        return self._get_cross_device_ops(None).batch_reduce(
            reduce_op, value_destination_pairs, options=self._communication_options.merge(options))

    def _gather_to_implementation(self, value, destinations, axis, options):
        if not self._job:
            return super()._gather_to_implementation(value, destinations, axis, options)
        return self._get_cross_device_ops(None)._gather(value, destinations=destinations, axis=axis,
                                                       options=self._communication_options.merge(options))

    def _experimental_distribute_dataset(self, dataset, options):
        if not self._job:
            return super()._experimental_distribute_dataset(dataset, options)
        if options and options.experimental_replication_mode == distribute_lib.InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "`distribute_datasets_from_function`.")
        mine = _input.shard(dataset, self._job.num_replicas, self._job.offset, len(self._devices))
        # Each replica's minibatches through an iterator of its own, on the host: not TF's MultiDeviceIterator,
        # whose background thread may still be in the pipeline when Keras drops the last fit's iterator (a
        # SIGSEGV between fits). TF's _input_workers_with_options is not asked: it keeps PER_REPLICA's workers
        # for every later call.
        local = len(self._devices)
        replicas = distribute_lib.InputOptions(
            experimental_fetch_to_device=False,
            experimental_replication_mode=distribute_lib.InputReplicationMode.PER_REPLICA)
        workers = input_lib.InputWorkers(tuple((device_util.canonicalize("/device:CPU:0", d), (d,))
                                               for d in self._devices))
        contexts = [distribute_lib.InputContext(num_input_pipelines=local, input_pipeline_id=i,
                                                num_replicas_in_sync=self._job.num_replicas) for i in range(local)]
        return input_util.get_distributed_datasets_from_function(
            lambda context: mine.shard(local, context.input_pipeline_id) if local > 1 else mine, workers, contexts,
            self._container_strategy(), replicas)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if not self._job:
            return super()._distribute_datasets_from_function(dataset_fn, options)
        group = self._job.group
        context = distribute_lib.InputContext(num_input_pipelines=group.num_processes,
                                              input_pipeline_id=group.process_id,
                                              num_replicas_in_sync=self._job.num_replicas)
        return input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [context], self._container_strategy(), options)

    def _experimental_distribute_values_from_function(self, value_fn):
        if not self._job:
            return super()._experimental_distribute_values_from_function(value_fn)
        values = [value_fn(distribute_lib.ValueContext(self._job.offset + i, self._job.num_replicas))
                  for i in range(len(self._devices))]
        return distribute_utils.regroup(values, always_wrap=True)

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if not self._job or replica_id != 0:
            return super()._get_variable_creator_initial_value(replica_id, device, primary_var, **kwargs)
        ops = self._cross_device_ops
        group = self._job.group

        def initial_value_fn():
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                if isinstance(value, trackable.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
                return _broadcast(ops, group, value, device)

        return initial_value_fn


def _broadcast(ops, group: ProcessGroup, value: tf.Tensor, device: str) -> tf.Tensor:
    """Process 0's ``value`` in every process (one ``Broadcast`` collective)."""
    mine = sdk_name(device, group)

    def broadcast(arrays):
        return [np.asarray(ops._sdk.broadcast(arrays[0] if group.process_id == 0 else None, [mine]))]

    return _bridge.numpy_call(broadcast, [value], [(value.dtype, value.shape)], "xreduce_broadcast")[0]


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """TF's ``MirroredStrategy`` for a job of several processes, through the xreduce daemon.

    Call ``xreduce.distribution.initialize(...)`` first in every process (one node or
    many); then each process runs its own replicas and the strategy behaves as
    ``MultiWorkerMirroredStrategy`` does for Keras: ``num_replicas_in_sync`` is the
    job's replica count, replica ids are global, ``model.fit(x, y,
    batch_size=GLOBAL)`` with the same global data in every process gives each
    process its own replicas' rows of every global batch (those TF's one-process
    split over all the job's replicas would give them), variables start equal
    everywhere (process 0's initial values), and ``strategy.reduce`` and the metrics
    Keras logs span the job. Without ``initialize`` it is TF's ``MirroredStrategy``
    with ``cross_device_ops``.

    Args:
        devices: this process's TF devices; default its GPUs, else its logical CPUs.
            TF's ``/cpu:i`` is the ``i``-th device of this process's share of the
            group (``xreduce.distribution.process_info().local_devices``).
        cross_device_ops: default :class:`xreduce.tensorflow.HierarchicalCopyAllReduce`.

    Raises:
        ValueError: a device this process does not hold in the group.
        tf.errors.OpError: the other processes did not construct their strategy within
            the daemon's collective timeout (construction is a collective).

    Example:
        >>> strategy = MirroredStrategy(["/cpu:0"])
        >>> strategy.num_replicas_in_sync, isinstance(strategy, tf.distribute.MirroredStrategy)
        (1, True)
    """

    def __init__(self, devices: Sequence[str] | None = None,
                 cross_device_ops: HierarchicalCopyAllReduce | ReductionToOneDevice | None = None):
        devices = list(devices) if devices is not None else local_devices()
        cross_device_ops = cross_device_ops or HierarchicalCopyAllReduce()
        group = cross_device_ops._group()
        job = None
        if group is not None and group.num_processes > 1:
            for d in devices:
                sdk_name(d, group)
            job = _meet(cross_device_ops, group, devices)
        # TF's MirroredStrategy.__init__ only makes its own extended part and counts the strategy.
        distribute_lib.Strategy.__init__(self, _JobExtended(self, devices, cross_device_ops, job))
        distribute_lib.distribution_strategy_gauge.get_cell("V2").set("MirroredStrategy")
