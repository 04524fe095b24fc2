"""``MirroredStrategy``: one replica per device, reductions through the daemon.

``run`` runs each local replica in a thread of its own, as TF's eager
``MirroredStrategy`` does, so that replicas meet in the collectives of their
``ReplicaContext`` (:mod:`xreduce._replicas`); every reduction, broadcast and
gather is a call to the daemon, which spans the processes of a multi-process job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from xreduce import _gather, _input
from xreduce._contexts import ReplicaContext, ValueContext, entered, in_replica_context_of_a_strategy
from xreduce._errors import NotFoundError
from xreduce._job_devices import job_devices, to_daemon
from xreduce._ops import CommunicationOptions, CrossDeviceOps, HierarchicalCopyAllReduce, ReduceOp, _mean
from xreduce._replicas import Meeting, regroup, select_replica
from xreduce._runtime import ProcessGroup, process_group
from xreduce._sparse import IndexedSlices
from xreduce._values import DistributedValues, PerReplica
from xreduce.wire.devices import DeviceName, canonical

STATUS_TIMEOUT_SECONDS = 10.0
"""How long ``run`` waits for the daemon's ``GetStatus`` (its collective timeout), asked once per strategy."""


def reduce_non_distributed_value(reduce_op: ReduceOp, value: Any, num_replicas: int) -> Any:
    """TF's rule for a plain value: MEAN keeps it; SUM keeps it only with one replica.

    Example:
        >>> reduce_non_distributed_value(ReduceOp.MEAN, 2.0, 4)
        2.0
    """
    if reduce_op is ReduceOp.MEAN or num_replicas == 1:
        return value
    raise ValueError(
        f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {reduce_op}."
    )


class MirroredExtended:
    """``strategy.extended``: the cross-replica reductions of a strategy."""

    def __init__(self, strategy: MirroredStrategy):
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This process's devices of the strategy, canonical names (not checked against the daemon's): in a
        multi-process job, the job's names (``process_info().local_devices``), the same on every node."""
        return self._strategy._devices()

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces ``value`` to ``destinations`` through the strategy's cross-device ops.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     v = s.experimental_distribute_values_from_function(lambda c: np.float32(c.replica_id_in_sync_group))
            ...     s.extended.reduce_to("sum", v, "CPU:0")
            array(1., dtype=float32)
        """
        op = ReduceOp.from_value(reduce_op)
        self._strategy._checked_devices()
        if not isinstance(value, DistributedValues):
            local = self.worker_devices
            if self._strategy._group() is None or len(local) != 1:
                return reduce_non_distributed_value(op, value, self._strategy.num_replicas_in_sync)
            # One local replica of a multi-process job: the value is that replica's.
            value = PerReplica([value], devices=local)
        return self._strategy.cross_device_ops.reduce(op, value, destinations, options)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None) -> list[Any]:
        """Reduces each (value, destinations) pair; see ``CrossDeviceOps.batch_reduce``."""
        self._strategy._checked_devices()
        return self._strategy.cross_device_ops.batch_reduce(reduce_op, value_destination_pairs, options)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to ``destinations`` (TF's ``extended.broadcast_to``): a
        :class:`Mirrored`, or one array for one device. Python numbers come back unchanged, as
        in TF; ``destinations`` None means the strategy's devices. In a multi-process job every
        process calls it and process 0's tensor is sent.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     s.extended.broadcast_to(np.arange(2), None).values[1]
            array([0, 1])
        """
        if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
            return tensor
        devices = self._strategy._checked_devices()
        destinations = list(devices) if destinations is None else destinations
        return self._strategy.cross_device_ops.broadcast(tensor, destinations)

    def _batch_gather_to(self, value_destination_pairs: Any, axis: int,
                         options: CommunicationOptions | None = None) -> list[Any]:
        """Each value gathered along ``axis`` over every replica, to its destinations (see :mod:`xreduce._gather`)."""
        strategy = self._strategy
        devices = strategy._checked_devices()

        def reduce(op: ReduceOp, pairs: list) -> list:
            return strategy.cross_device_ops.batch_reduce(op, pairs, options)

        return _gather.batch_gather(reduce, list(value_destination_pairs), axis, devices, strategy._first_replica_id(),
                                    strategy.num_replicas_in_sync, strategy._group() is not None)


class MirroredStrategy:
    """Synchronous data parallelism over the daemon's devices (TF's ``MirroredStrategy``).

    Args:
        devices: device names (any form the SDK gives out: ``cpu:4``, any
            DeviceSpec spelling, ``/job:worker/replica:0/task:P/device:CPU:i``);
            default every daemon device, or in a multi-process job
            (``xreduce.distribution.initialize``) this process's devices.
        cross_device_ops: default ``HierarchicalCopyAllReduce()``.
        address: the daemon, when ``cross_device_ops`` is not given.
        token: the daemon's bearer token, when ``cross_device_ops`` is not
            given; default ``XREDUCE_TOKEN``, else none.

    In a multi-process job each process runs its own replicas; every
    reduction spans all processes, ``num_replicas_in_sync`` counts them all and
    replica ids are global: a process's first replica's id is the number of
    devices of the processes of lower id, on every node of the group.

    Raises:
        ValueError: ``devices`` is empty or names a device twice.
        xreduce.NotFoundError: at the first ``run``, ``reduce`` or value made
            (not at construction), ``devices`` names a device the daemon (in a
            multi-process job, the job) does not have; the message lists them.
        xreduce.InvalidArgumentError: likewise, in a multi-process job,
            ``devices`` names another process's device; the message says whose.

    Example:
        >>> import numpy as np, xreduce
        >>> with xreduce.serve_embedded(virtual_devices=4):
        ...     s = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
        ...     ctx = xreduce.distribute.get_replica_context
        ...     grads = s.run(lambda: np.ones(2) * (ctx().replica_id_in_sync_group + 1))
        ...     s.reduce("sum", grads, axis=None)
        array([10., 10.])
        >>> remote = MirroredStrategy(address="10.0.0.5:50551", token="s3cret")  # asks the daemon on first use
    """

    def __init__(self, devices: Sequence[str] | None = None, cross_device_ops: CrossDeviceOps | None = None,
                 address: str | None = None, token: str | None = None):
        if devices is not None:
            if isinstance(devices, str) or not len(devices):
                raise ValueError(f"devices must be a non-empty list of device names; got {devices!r}")
            names = tuple(canonical(d) for d in devices)
            if len(set(names)) != len(names):
                raise ValueError(f"devices names a device twice; got {list(devices)!r}")
            self._device_names: tuple[str, ...] | None = names
        else:
            self._device_names = None
        self._given_devices = None if devices is None else list(devices)
        self._devices_checked = devices is None  # else on first use: constructing needs no daemon
        self.cross_device_ops = cross_device_ops or HierarchicalCopyAllReduce(address=address, token=token)
        self.extended = MirroredExtended(self)
        self._collective_timeout: float | None = None

    def _group(self) -> ProcessGroup | None:
        """The multi-process group this process joined with the daemon of ``cross_device_ops``, or None."""
        return process_group(self.cross_device_ops.client.address)

    def _devices(self) -> tuple[str, ...]:
        if self._device_names is None:
            group = self._group()
            names = job_devices(group).mine if group else self.cross_device_ops.client.device_names()
            self._device_names = tuple(names)
        return self._device_names

    def _checked_devices(self) -> tuple[str, ...]:
        """:meth:`_devices`, the given ones checked the first time they are used (a single device is never
        sent to the daemon, which would otherwise catch a wrong one): in a multi-process job, against the
        job's devices (this process's own), else against the daemon's."""
        devices = self._devices()
        if not self._devices_checked:
            group = self._group()
            where = f"MirroredStrategy(devices={self._given_devices!r})"
            client = self.cross_device_ops.client
            known = client.device_names() if group is None else ()
            for i, spec in enumerate(self._given_devices):
                name = to_daemon(spec, group, f"{where}: devices[{i}]")
                if group is None and name not in known:
                    listing = ", ".join(DeviceName.parse(d).short for d in known)
                    raise NotFoundError(f"{where}: no device {spec!r} on the daemon at {client.address}; its devices "
                                        f"are {listing}", grpc.StatusCode.NOT_FOUND)
            self._devices_checked = True
        return devices

    def _first_replica_id(self) -> int:
        """The global id of this process's first replica: its device's position in the global list."""
        group = self._group()
        if group is None:
            return 0
        return job_devices(group).own(self._devices()[0], "devices[0]").replica

    @property
    def num_replicas_in_sync(self) -> int:
        """One replica per device, over every process of a multi-process job."""
        group = self._group()
        return len(group.global_devices) if group else len(self._devices())

    @contextlib.contextmanager
    def scope(self) -> Iterator[MirroredStrategy]:
        """Makes this the current strategy inside the block, in cross-replica context
        (:func:`get_strategy` returns it, :func:`get_replica_context` None)."""
        with entered(self, None):
            yield self

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """Calls ``fn`` once per local replica, each in its own thread, all at once.

        ``PerReplica`` arguments are unwrapped to that replica's component; inside ``fn``,
        :func:`get_replica_context` is the replica's :class:`ReplicaContext`, whose
        collectives (``all_reduce``, ``all_gather``, ``merge_call``) meet every replica.
        The results are regrouped into ``PerReplica`` values (nested lists, tuples and dicts
        are followed; an object every replica returns stays itself). An exception in a
        replica is raised from ``run``; the other replicas are released.

        Raises:
            RuntimeError: the replicas did not make the same collective calls.
            xreduce.DeadlineExceededError: a replica waited in a collective longer than the
                daemon's collective timeout for the others to reach it.
        """
        devices = self._checked_devices()
        first, total = self._first_replica_id(), self.num_replicas_in_sync
        meeting = Meeting(len(devices), self._meeting_seconds() if len(devices) > 1 else 0.0, first_id=first)

        def body(i: int) -> Callable[[], Any]:
            replica_args = select_replica(i, tuple(args))
            replica_kwargs = select_replica(i, dict(kwargs or {}))
            context = ReplicaContext(self, first + i, total, _meeting=meeting, _local_index=i)

            def call() -> Any:
                with entered(self, context):
                    return fn(*replica_args, **replica_kwargs)
            return call

        def merge_args(parts: list[tuple], always_wrap: bool) -> tuple:
            return regroup(parts, devices, always_wrap)

        def merge_in_cross_replica(index: int, result: Any) -> Any:
            return select_replica(index, result)

        with entered(self, None):
            outputs = meeting.run([body(i) for i in range(len(devices))], merge_args, merge_in_cross_replica)
        return regroup(outputs, devices)

    def _meeting_seconds(self) -> float:
        """The daemon's collective timeout: how long replicas wait for each other in a collective."""
        if self._collective_timeout is None:
            status = self.cross_device_ops.client.get_status(timeout=STATUS_TIMEOUT_SECONDS)
            self._collective_timeout = status.limits.collective_timeout_seconds
        return self._collective_timeout

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Reduces a per-replica value across replicas (and along ``axis`` within each).

        With ``axis``, MEAN divides by the number of elements reduced over all
        replicas, as TF does.
        """
        op = ReduceOp.from_value(reduce_op)
        self._checked_devices()
        if not isinstance(value, DistributedValues):
            if self._group() is None or len(self._devices()) != 1:
                return reduce_non_distributed_value(op, value, self.num_replicas_in_sync)
            value = PerReplica([value], devices=self._devices())
        if value._devices is None:  # made without devices: it is on the strategy's first devices
            value._resolve_devices(self._devices())
        first = value.devices[0]
        if axis is None:
            return self.extended.reduce_to(op, value, first)
        if any(isinstance(v, IndexedSlices) for v in value.values):
            raise ValueError(f"strategy.reduce(axis={axis!r}): the value holds IndexedSlices, which reduce only "
                             "with axis=None; reduce their .to_dense() along an axis")
        arrays = [h.array for h in value.hosts()]
        sums = PerReplica([np.sum(a, axis=axis) for a in arrays], devices=value.devices)
        total = self.extended.reduce_to(ReduceOp.SUM, sums, first)
        if op is ReduceOp.SUM:
            return total
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        counts = [np.int64(np.prod([a.shape[x] for x in axes])) for a in arrays]
        count = int(self.extended.reduce_to(ReduceOp.SUM, PerReplica(counts, devices=value.devices), first))
        return _mean(np.asarray(total), count)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> PerReplica:
        """Builds a ``PerReplica`` from ``value_fn(ValueContext(i, n))`` for each of this
        process's replicas (``i`` is the global replica id)."""
        devices = self._checked_devices()
        first, total = self._first_replica_id(), self.num_replicas_in_sync
        values = [value_fn(ValueContext(first + i, total)) for i in range(len(devices))]
        return PerReplica(values, devices=devices)

    # --- input: datasets split across the replicas (xreduce._input) ---------------------------------------------

    def _input_replicas(self) -> _input.Replicas:
        group = self._group()
        return _input.Replicas(self._checked_devices(), self._first_replica_id(), self.num_replicas_in_sync,
                               group.num_processes if group else 1, group.process_id if group else 0)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> _input.DistributedDataset:
        """Splits each global batch of ``dataset`` across the replicas in sync (TF's method).

        ``dataset`` is any iterable of global batches: arrays (numpy, CuPy,
        torch, JAX) or tuples, lists and dicts of them, all with the same rows;
        an object with ``as_numpy_iterator()`` (a ``tf.data.Dataset``) is read
        through it. Each batch's rows go to the replicas in global replica-id
        order, as TF 2.21's ``MirroredStrategy`` splits them: of a batch of
        ``b`` rows over ``N`` replicas, ``ceil(b / N)`` each until the rows run
        out, so the last replicas may get fewer or none (an empty batch); a
        partial last batch is split the same way. Each step is the
        batch's structure with a ``PerReplica`` over this process's replicas in
        place of each array; with several processes, each iterates the same
        global batches and keeps its own replicas' rows.

        Args:
            dataset: the global batches; iterated afresh by each ``iter()``.
            options: None or an ``InputOptions`` (``PER_WORKER`` only).

        Raises:
            ValueError: ``dataset`` is not iterable; a batch whose arrays differ
                in rows or holds a scalar; options that cannot be honoured.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     batches = [np.arange(4.0), np.arange(4.0, 7.0)]
            ...     [[v.tolist() for v in x.values] for x in s.experimental_distribute_dataset(batches)]
            [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0]]]
        """
        return _input.distribute_dataset(self._input_replicas(), dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[_input.InputContext], Any],
                                          options: Any = None) -> _input.DistributedDataset:
        """Calls ``dataset_fn(InputContext)`` once per process and feeds its per-replica batches (TF's method).

        ``dataset_fn`` returns an iterable of per-replica batches (its
        ``InputContext`` says which pipeline it is and
        ``get_per_replica_batch_size`` turns a global size into one); at step
        ``k`` this process's replica ``i`` gets element ``k·R + i`` (``R`` local
        replicas). Replicas left without an element at the last step get an
        empty batch. With ``InputOptions(experimental_replication_mode=PER_REPLICA,
        experimental_fetch_to_device=False)`` it is called once per replica
        (pipeline id = replica id) and each replica reads its own dataset.

        Raises:
            ValueError: ``dataset_fn`` is not callable or returns no iterable;
                options that cannot be honoured.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     fn = lambda ctx: [np.full(ctx.get_per_replica_batch_size(4), float(i)) for i in range(3)]
            ...     [[v.tolist() for v in x.values] for x in s.distribute_datasets_from_function(fn)]
            [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], []]]
        """
        return _input.distribute_datasets_from_function(self._input_replicas(), dataset_fn, options)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's values of ``value``, one per local replica (TF's): a ``PerReplica``'s or
        ``Mirrored``'s ``values``; for a nest (lists, tuples, dicts) holding distributed values, one nest
        per local replica, each distributed value replaced by that replica's; else ``(value,)``.

        Example:
            >>> import numpy as np
            >>> s = MirroredStrategy(devices=["CPU:0", "CPU:1"])
            >>> s.experimental_local_results(PerReplica([np.int32(1), np.int32(2)], devices=["CPU:0", "CPU:1"]))
            (np.int32(1), np.int32(2))
            >>> s.experimental_local_results({"a": PerReplica([1, 2], devices=["CPU:0", "CPU:1"]), "b": 3})
            ({'a': 1, 'b': 3}, {'a': 2, 'b': 3})
            >>> s.experimental_local_results(5)
            (5,)
        """
        if isinstance(value, DistributedValues):
            return value.values
        if isinstance(value, (list, tuple, dict)):
            return tuple(select_replica(i, value) for i in range(len(self._devices())))
        return (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates ``value``'s replicas along ``axis``, over every replica of every process,
        in replica id order, onto this process's first device (TF's ``Strategy.gather``).

        Sizes along ``axis`` may differ between replicas. Gathered as a SUM of zero-padded
        placements (the wire contract has no gather): see :mod:`xreduce._gather`.

        Raises:
            RuntimeError: called in a replica context (use ``ReplicaContext.all_gather``), as TF.
            NotImplementedError: a sparse value, as TF.

        Example:
            >>> import numpy as np, xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     v = s.run(lambda: np.arange(xreduce.distribute.get_replica_context().replica_id_in_sync_group + 1))
            ...     s.gather(v, axis=0)
            array([0, 0, 1])
        """
        if in_replica_context_of_a_strategy():
            raise RuntimeError("`tf.distribute.Strategy.gather` method requires cross-replica context, use "
                               "`get_replica_context().all_gather()` instead.")
        if all(hasattr(value, a) for a in ("values", "indices", "dense_shape")):
            raise NotImplementedError("gather does not support IndexedSlices")
        devices = self._checked_devices()
        (result,) = self.extended._batch_gather_to([(value, devices[0])], axis)
        return self.experimental_local_results(result)[0]

