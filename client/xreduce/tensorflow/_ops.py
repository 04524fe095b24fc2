"""``tf.distribute.CrossDeviceOps`` subclasses whose reductions run in the xreduce daemon.

TF's front (``reduce``, ``batch_reduce``: validation, TF's shortcuts) stays TF's;
the implementations hand the whole batch to the SDK's front
(:mod:`xreduce._ops`) through :mod:`xreduce.tensorflow._bridge`: one daemon call
per ``reduce_implementation`` or ``batch_reduce_implementation``, whatever the
number of tensors, eager or inside ``tf.function``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as tf_cdo
from tensorflow.python.distribute import reduce_util

from xreduce import _gather
from xreduce import _ops as sdk
from xreduce._options import ConnectionOptions
from xreduce._prepared import PreparedBatch, Spec
from xreduce._runtime import ProcessGroup
from xreduce.tensorflow import _bridge, _kernel
from xreduce.tensorflow._devices import local_name, sdk_name


def _op_name(reduce_op: Any) -> str:
    """``"SUM"`` or ``"MEAN"`` from a ``tf.distribute.ReduceOp``, or what the SDK takes (its name in any case).

    Example:
        >>> _op_name(reduce_util.ReduceOp.MEAN), _op_name("sum")
        ('MEAN', 'SUM')
    """
    if isinstance(reduce_op, reduce_util.ReduceOp):
        reduce_op = reduce_op.value
    return sdk.ReduceOp.from_value(reduce_op).value


class _DaemonOps:
    """What both classes share: the SDK's ops object they call, and TF's names mapped to the SDK's."""

    _sdk: sdk.CrossDeviceOps

    def __init__(self):
        self._kept: list[PreparedBatch] = []
        """Prepared batches whose native part a traced step's kernel uses (:mod:`xreduce.tensorflow._kernel`):
        their segments live as long as these ops."""
        super().__init__()

    def _group(self) -> ProcessGroup | None:
        return self._sdk._group()

    @property
    def client(self):
        """The SDK's connection to the daemon (``xreduce.Client``)."""
        return self._sdk.client

    @property
    def _num_between_graph_workers(self) -> int:
        # TF skips the reduction of a value with one replica unless it knows of other workers.
        group = self._group()
        return group.num_processes if group is not None else 1

    _replica_devices: tuple[str, ...] | None = None
    """The TF devices of the strategy's replicas, in order, once a :class:`xreduce.tensorflow.MirroredStrategy`
    uses these ops."""

    def _sdk_names(self, tf_devices: tuple[str, ...], group: ProcessGroup | None) -> tuple[str, ...]:
        """The SDK's name of each component's device. TF may hold several replicas' tensors on one device (the
        shapes ``strategy.reduce(..., axis=...)`` computes live on the host): component ``i`` is then replica
        ``i``, on the strategy's ``i``-th device (TF's own all-reduce also goes by position)."""
        names = tuple(sdk_name(d, group) for d in tf_devices)
        if len(set(names)) == len(names):
            return names
        replicas = self._replica_devices
        if replicas is None:
            kind = tf.DeviceSpec.from_string(tf_devices[0]).device_type or "CPU"
            replicas = tuple(f"/{kind.lower()}:{i}" for i in range(len(names)))
        if len(replicas) < len(names):
            raise ValueError(f"a value of {len(names)} replicas on the devices {list(tf_devices)}, but the strategy "
                             f"has {len(replicas)} replicas")
        return tuple(sdk_name(d, group) for d in replicas[:len(names)])

    def _pairs(self, value_destination_pairs: list) -> list[_bridge.Pair]:
        group = self._group()
        pairs = []
        for value, destinations in value_destination_pairs:
            value = tf_cdo._make_tensor_into_per_replica(value)
            tf_devices = tuple(value._devices)
            devices = self._sdk_names(tf_devices, group)
            if destinations is value or not tf_cdo.check_destinations(destinations):
                dests, sdk_dests = tf_devices, devices
            else:
                dests = tuple(tf_cdo.get_devices_from(destinations))
                sdk_dests = self._sdk_names(dests, group)
            pairs.append(_bridge.Pair(tuple(value.values), devices, tuple(local_name(d) for d in dests),
                                      sdk_dests))
        return pairs

    def _reduce_batch(self, reduce_op: Any, value_destination_pairs: list, options: Any, single: bool) -> list:
        op = _op_name(reduce_op)
        given = self._pairs(value_destination_pairs)
        timeout = getattr(options, "timeout_seconds", None)
        sdk_options = sdk.CommunicationOptions(timeout_seconds=timeout) if timeout else None
        prepared = self._prepared(op, given, timeout)
        # A prepared batch copies each tensor into its place in shared memory and returns each result as a view:
        # packing in TF first would only add a concatenation and a split to the step.
        plan = _bridge.unpacked(given) if prepared is not None else _bridge.pack(given)
        pairs = [sent for sent, _, _ in plan]

        def reduce(arrays: list) -> list:
            if prepared is not None:
                return prepared(arrays)
            it = iter(arrays)
            batch = [(sdk.PerReplica(p.sdk_value(it), devices=p.devices), list(p.sdk_destinations)) for p in pairs]
            if single:
                results = [self._sdk.reduce(op, batch[0][0], batch[0][1], sdk_options)]
            else:
                results = self._sdk.batch_reduce(op, batch, sdk_options)
            return [a for r, p in zip(results, pairs) for a in _bridge.sdk_result(r, p.sparse)]

        inputs = [t for p in pairs for t in p.inputs()]
        outputs = [o for p in pairs for o in p.outputs(op)]
        name = "xreduce_reduce" if single else "xreduce_batch_reduce"
        made = None
        if prepared is not None:
            _bridge.refuse_xla()
            made = _kernel.call(prepared, inputs, outputs, name)
            if made is not None:
                self._kept.append(prepared)  # its native segments live as long as the traced step may run
        tensors = iter(made if made is not None else _bridge.numpy_call(reduce, inputs, outputs, name))
        results: list[Any] = [None] * len(given)
        for _, unpack, places in plan:
            for place, result in zip(places, unpack(tensors)):
                results[place] = result
        return results

    def _prepared(self, op: str, pairs: list[_bridge.Pair], timeout: float | None) -> PreparedBatch | None:
        """The batch as a :class:`~xreduce._prepared.PreparedBatch` (a traced step's call made once, then
        repeated without the SDK's per-call work), in one process or a group of one daemon, when every value is
        dense and of a known shape; else None (eagerly too: each eager call is a new one; in a group across nodes,
        the SDK's collective path)."""
        group = self._group()
        if tf.executing_eagerly() or (group is not None and group.num_nodes > 1) or any(
                p.sparse or not all(c.shape.is_fully_defined() for c in p.components) for p in pairs):
            return None
        specs = [Spec(p.devices, p.sdk_destinations, np.dtype(p.components[0].dtype.as_numpy_dtype),
                      tuple(p.components[0].shape.as_list())) for p in pairs]
        return PreparedBatch(self._sdk, op, specs, timeout)

    _replicas: tuple[int, int] | None = None
    """(the global id of this process's first replica, the job's replica count), once a
    :class:`xreduce.tensorflow.MirroredStrategy` of several processes uses these ops."""

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        """In one process, TF's (a concatenation on the first destination, no daemon call, as TF's
        all-reduce classes do); across processes, the SDK's gather through the daemon
        (:mod:`xreduce._gather`)."""
        group = self._group()
        if group is None:
            return tf_cdo.ReductionToOneDevice()._gather(per_replica_value, destinations, axis, options)
        if self._replicas is None:
            raise ValueError("a gather across the processes of a group needs the job's replicas: use "
                             "xreduce.tensorflow.MirroredStrategy")
        (pair,) = self._pairs([(per_replica_value, destinations)])
        first, total = self._replicas

        def gather(arrays: list) -> list:
            def reduce(op, pairs):
                return self._sdk.batch_reduce(op, pairs)

            value = sdk.PerReplica(arrays, devices=pair.devices)
            (result,) = _gather.batch_gather(reduce, [(value, list(pair.sdk_destinations))], axis, pair.devices,
                                             first, total, True)
            return _bridge.sdk_result(result, sparse=False)

        shape = pair.components[0].shape
        if shape.rank is not None:
            shape = shape[:axis % shape.rank].concatenate([None]).concatenate(shape[axis % shape.rank + 1:])
        (tensor,) = _bridge.numpy_call(gather, pair.inputs(), [(pair.components[0].dtype, shape)], "xreduce_gather")
        return _bridge.copies(tensor, pair.destinations)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        """One ``Reduce`` call to the daemon (TF calls it from ``reduce`` after its checks and shortcuts)."""
        return self._reduce_batch(reduce_op, [(per_replica_value, destinations)], options, single=True)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        """One ``BatchReduce`` call to the daemon for the whole batch (every gradient of a training step)."""
        if not value_destination_pairs:
            return []
        return self._reduce_batch(reduce_op, list(value_destination_pairs), options, single=False)


class HierarchicalCopyAllReduce(_DaemonOps, tf_cdo.CrossDeviceOps):
    """TF's ``tf.distribute.HierarchicalCopyAllReduce``, run by the xreduce daemon.

    A real ``tf.distribute.CrossDeviceOps``: give it to ``tf.distribute.MirroredStrategy``
    (or :class:`xreduce.tensorflow.MirroredStrategy`), and every reduction TF asks of
    it (Keras' gradient all-reduce, ``ReplicaContext.all_reduce``, ``extended.reduce_to``)
    is one call to the daemon, which adds in TF's order: the same bytes as TF's own.

    Args:
        num_packs: as TF's: the batch is concatenated and split into this many packs
            (0: no packing); never changes the numbers.
        address, token, transport, options: the daemon and how to reach it, as
            :class:`xreduce.distribute.HierarchicalCopyAllReduce` takes them.

    Raises:
        ValueError: ``num_packs`` < 0, with TF's message.

    Example:
        >>> import tensorflow as tf, xreduce
        >>> ops = HierarchicalCopyAllReduce(num_packs=2)
        >>> isinstance(ops, tf.distribute.CrossDeviceOps), ops.num_packs
        (True, 2)
    """

    def __init__(self, num_packs: int = 1, address: str | None = None, token: str | None = None,
                 transport: str | None = None, *, options: ConnectionOptions | None = None):
        self._sdk = sdk.HierarchicalCopyAllReduce(num_packs, address, token, transport, options=options)
        self.num_packs = self._sdk.num_packs
        super().__init__()


class ReductionToOneDevice(_DaemonOps, tf_cdo.CrossDeviceOps):
    """TF's ``tf.distribute.ReductionToOneDevice``, run by the xreduce daemon.

    Args:
        reduce_to_device: where the daemon sums (a TF device name); default the
            first destination.
        accumulation_fn: as TF's, a TF function of a list of tensors; when given,
            the reduction runs in TF in this process (TF's own
            ``ReductionToOneDevice``), never in the daemon, and a multi-process
            group refuses it.
        address, token, transport, options: the daemon and how to reach it.

    Example:
        >>> ReductionToOneDevice(reduce_to_device="/cpu:1").reduce_to_device
        '/cpu:1'
    """

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None,
                 address: str | None = None, token: str | None = None, transport: str | None = None, *,
                 options: ConnectionOptions | None = None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
        self._tf = tf_cdo.ReductionToOneDevice(reduce_to_device, accumulation_fn) if accumulation_fn else None
        self._sdk = sdk.ReductionToOneDevice(
            None if reduce_to_device is None else sdk_name(reduce_to_device, None), None, address, token,
            transport, options=options)
        super().__init__()

    def _reduce_batch(self, reduce_op, value_destination_pairs, options, single):
        if self._tf is None:
            if self.reduce_to_device is not None:
                self._sdk.reduce_to_device = sdk_name(self.reduce_to_device, self._group())
            return super()._reduce_batch(reduce_op, value_destination_pairs, options, single)
        group = self._group()
        if group is not None:
            raise ValueError("accumulation_fn runs in TF in one process; it cannot reduce across the processes "
                             f"of group {group.group!r}")
        return [self._tf.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs]
