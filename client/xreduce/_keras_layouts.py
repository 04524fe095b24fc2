"""keras.distribution over the daemon, part two: meshes, layouts and distributions.

Objects that are given their devices never talk to the daemon; default devices
come from :func:`list_devices` when first needed.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from xreduce import _keras_devices
from xreduce._input import Rows, batch_rows, elements, fill, map_structure, split_sizes
from xreduce._job_devices import job_devices
from xreduce._keras_devices import list_devices, process_info
from xreduce._ops import CrossDeviceOps, HierarchicalCopyAllReduce, ReduceOp
from xreduce._values import DistributedValues, PerReplica
from xreduce.wire.devices import DeviceName

DEFAULT_BATCH_DIM_NAME = "batch"
"""The mesh axis name DataParallel uses when it builds its own mesh."""


# --- meshes and layouts --------------------------------------------------------------------------------------


def _mesh_name(spec: Any) -> str:
    name = DeviceName.parse(spec)
    if (name.job, name.replica, name.task) == ("localhost", 0, 0):
        return name.keras
    return name.canonical


def _device_array(devices: Any) -> np.ndarray:
    """Device names in any DeviceSpec form (nested lists allowed) as an array of keras-form names."""
    if isinstance(devices, str):
        raise ValueError(f"devices must be a list of device names; got the string {devices!r}")
    arr = np.array(devices, dtype=object)
    if arr.size == 0:
        raise ValueError(
            f"devices can not be empty; got {devices!r} (pass devices=None for every device of list_devices())"
        )
    names = [_mesh_name(d) for d in arr.flat]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"devices names {twice} more than once; got {np.asarray(devices).tolist()!r}")
    out = np.array(names, dtype=object).reshape(arr.shape)
    out.flags.writeable = False
    return out


def _is_empty(value: Any) -> bool:
    return value is None or (hasattr(value, "__len__") and len(value) == 0)


class DeviceMesh:
    """A grid of devices with a name per axis (Keras' ``DeviceMesh``).

    Args:
        shape: the grid, e.g. ``(8,)`` for data parallelism or ``(4, 2)``.
        axis_names: one name per axis, e.g. ``["batch", "model"]``.
        devices: device names in the keras form (``"gpu:0"``) or any
            DeviceSpec form, flat or nested; default :func:`list_devices`,
            asked for when :attr:`devices` is first read.

    Raises:
        ValueError: an empty shape or axis_names, a shape that is not positive
            integers, axis_names of another length than shape or repeated,
            ``devices`` empty, repeated, unparsable, or not ``prod(shape)`` of
            them; the message names what was received.

    Example:
        >>> mesh = DeviceMesh((2, 2), ["batch", "model"], ["gpu:0", "/gpu:1", "GPU:2", "/device:GPU:3"])
        >>> mesh.devices
        array([['gpu:0', 'gpu:1'],
               ['gpu:2', 'gpu:3']], dtype=object)
        >>> DeviceMesh((4, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
        Traceback (most recent call last):
        ...
        ValueError: Shape does not match the number of devices. Received: shape=(4, 2) (8 devices); \
devices.shape=(2,) (2 devices)
    """

    def __init__(self, shape: int | Sequence[int], axis_names: Sequence[str], devices: Any = None):
        if _is_empty(shape) or _is_empty(axis_names):
            raise ValueError(f"Shape and axis_names cannot be empty. Received: shape={shape}, axis_names={axis_names}")
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in dims):
            raise ValueError(f"shape must be positive integers such as (8,) or (4, 2); got shape={shape!r}")
        if isinstance(axis_names, str) or not all(isinstance(a, str) and a for a in axis_names):
            raise ValueError(f"axis_names must be a list of non-empty strings, one per axis; got {axis_names!r}")
        if len(dims) != len(axis_names):
            raise ValueError(
                f"Shape and axis_names should have same size. Received: shape={shape}, axis_names={axis_names}"
            )
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"axis_names must be distinct; got {list(axis_names)!r}")
        self._shape = tuple(int(d) for d in dims)
        self._axis_names = list(axis_names)
        self._devices = None if devices is None else self._fit(_device_array(devices), "")

    def _fit(self, devices: np.ndarray, origin: str) -> np.ndarray:
        if devices.size != math.prod(self._shape):
            raise ValueError(
                f"Shape does not match the number of devices. Received: shape={self._shape} "
                f"({math.prod(self._shape)} devices); devices.shape={devices.shape} ({devices.size} devices){origin}"
            )
        return devices.reshape(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape."""
        return self._shape

    @property
    def axis_names(self) -> list[str]:
        """One name per axis."""
        return list(self._axis_names)

    @property
    def devices(self) -> np.ndarray:
        """Keras-form device names (read-only object array of ``shape``); default ones are listed now."""
        if self._devices is None:
            self._devices = self._fit(_device_array(list_devices()), " from list_devices()")
        return self._devices

    def __repr__(self) -> str:
        return f"<{type(self).__name__} shape={self.shape}, axis_names={self.axis_names}>"


class TensorLayout:
    """How a tensor's dimensions map onto mesh axes (Keras' ``TensorLayout``).

    Args:
        axes: one entry per tensor dimension: a mesh axis name, or None for a
            dimension that is not sharded.
        device_mesh: the :class:`DeviceMesh`; may be set once, later.

    Raises:
        ValueError: axes that are not names or None, or name one mesh axis
            twice; names that are not axes of the mesh (Keras' message).

    Example:
        >>> mesh = DeviceMesh((4, 2), ["data", "model"], [f"cpu:{i}" for i in range(8)])
        >>> TensorLayout(("data", None), mesh).axes
        ('data', None)
        >>> TensorLayout(("data", "unknown"), mesh)
        Traceback (most recent call last):
        ...
        ValueError: Invalid axis names for Layout. Valid axis names: ['data', 'model'], Got ['unknown']
    """

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None):
        if isinstance(axes, str) or not isinstance(axes, Sequence):
            raise ValueError(f"axes must be a tuple of mesh axis names or None, one per dimension; got {axes!r}")
        self._axes = tuple(axes)
        named = [a for a in self._axes if a is not None]
        if not all(isinstance(a, str) for a in named):
            raise ValueError(f"axes must be mesh axis names (strings) or None; got axes={self._axes!r}")
        if len(set(named)) != len(named):
            raise ValueError(f"axes can map a mesh axis to one dimension only; got axes={self._axes!r}")
        self._device_mesh = None
        if device_mesh is not None:
            self.device_mesh = device_mesh

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The mesh axis (or None) of each dimension."""
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh; it can be set once, and is checked against :attr:`axes` when set."""
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, device_mesh: DeviceMesh) -> None:
        if self._device_mesh is not None:
            raise ValueError(f"Cannot override device mesh value. Existing value is {self._device_mesh}")
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(
                f"device_mesh must be a DeviceMesh; got {device_mesh!r} of type {type(device_mesh).__name__}"
            )
        unknown = [a for a in self._axes if a is not None and a not in device_mesh.axis_names]
        if unknown:
            raise ValueError(
                f"Invalid axis names for Layout. Valid axis names: {device_mesh.axis_names}, Got {unknown}"
            )
        self._device_mesh = device_mesh

    def __repr__(self) -> str:
        return f"<{type(self).__name__} axes={self.axes}, device_mesh={self.device_mesh}>"


# --- distributions -------------------------------------------------------------------------------------------

_current = threading.local()  # per thread, as Keras' global state


def distribution() -> Distribution | None:
    """The current distribution (this thread's), or None.

    Example:
        >>> distribution() is None
        True
    """
    return getattr(_current, "distribution", None)


def set_distribution(value: Distribution | None) -> None:
    """Makes ``value`` the current distribution of this thread (None clears it).

    Raises:
        ValueError: ``value`` is neither a :class:`Distribution` nor None.

    Example:
        >>> dp = DataParallel(devices=["cpu:0", "cpu:1"])
        >>> set_distribution(dp)
        >>> distribution() is dp
        True
        >>> set_distribution(None)
    """
    if value is not None and not isinstance(value, Distribution):
        raise ValueError(f"set_distribution takes a Distribution or None; got {value!r} of type {type(value).__name__}")
    _current.distribution = value


class Distribution:
    """Base class of distributions: a :class:`DeviceMesh` and the layouts over it.

    Args:
        device_mesh: a :class:`DeviceMesh`.

    Raises:
        ValueError: ``device_mesh`` is not a :class:`DeviceMesh`.

    Example:
        >>> mesh = DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
        >>> outer, inner = Distribution(mesh), Distribution(mesh)
        >>> with outer.scope():
        ...     with inner.scope():
        ...         distribution() is inner
        ...     distribution() is outer
        True
        True
        >>> distribution() is None
        True
    """

    def __init__(self, device_mesh: DeviceMesh):
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(
                f"device_mesh must be a DeviceMesh; got {device_mesh!r} of type {type(device_mesh).__name__}"
            )
        self._device_mesh: DeviceMesh | None = device_mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The distribution's mesh."""
        return self._device_mesh

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        """The layout of an input batch of ``data_shape``; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} defines no data layout; use DataParallel")

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """The layout of a variable (anything with ``shape``); subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} defines no variable layout; use DataParallel")

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        """The layout of an intermediate tensor named ``path``; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} defines no tensor layout; use DataParallel")

    def distribute_dataset(self, dataset: Any) -> Any:
        """This process's share of a dataset of global batches; subclasses define it (as in Keras).

        Raises:
            NotImplementedError: always; :class:`DataParallel` defines it.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no distribute_dataset; use DataParallel")

    @contextlib.contextmanager
    def scope(self) -> Iterator[Distribution]:
        """Makes this the current distribution inside the block, then restores the previous one.

        Example:
            >>> with DataParallel(devices=["cpu:0"]).scope() as dp:
            ...     distribution() is dp
            True
        """
        previous = distribution()
        set_distribution(self)
        try:
            yield self
        finally:
            set_distribution(previous)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device_mesh={self.device_mesh}>"


class DataParallel(Distribution):
    """Data parallelism: each device holds the whole model and a slice of every batch (Keras' ``DataParallel``).

    Give ``device_mesh`` or ``devices``, or neither for every device of
    :func:`list_devices` (listed when the mesh is first needed, so building
    one needs no daemon). Gradients are all-reduced by the daemon with
    :class:`xreduce.distribute.HierarchicalCopyAllReduce`.

    Args:
        device_mesh: a :class:`DeviceMesh`; its first axis is the batch axis. A
            mesh of more than one axis draws a warning; the devices along the
            other axes receive the same slices.
        devices: device names (any DeviceSpec form) for a 1-D mesh with axis
            ``"batch"``.
        auto_shard_dataset: whether :meth:`distribute_dataset` gives each
            process its own rows of every global batch (default); False for a
            dataset already sharded across processes.
        cross_device_ops: what reduces gradients; default
            ``HierarchicalCopyAllReduce()`` on the SDK's daemon.

    With several processes (after :func:`initialize`) the mesh is the global
    one (every process's devices, from :func:`list_devices`), and each process
    feeds and reduces the mesh devices it drives: its rows of each global batch
    (:meth:`distribute_dataset`) split across them (:meth:`distribute_batch`),
    their gradients all-reduced with every other process's.

    Raises:
        ValueError: both ``device_mesh`` and ``devices``; ``auto_shard_dataset``
            not a bool; ``devices=[]`` (it
            never means "all devices"); a ``device_mesh`` that is not a
            :class:`DeviceMesh` (Keras' message).

    Example:
        >>> dp = DataParallel(devices=["gpu:0", "gpu:1"])  # no daemon needed yet
        >>> dp.batch_dim_name, dp.get_data_layout((16, 3)).axes
        ('batch', ('batch', None))
    """

    def __init__(self, device_mesh: DeviceMesh | None = None, devices: Sequence[str] | None = None,
                 auto_shard_dataset: bool = True, *, cross_device_ops: CrossDeviceOps | None = None):
        if device_mesh is not None and devices is not None:
            raise ValueError(f"DataParallel takes device_mesh or devices, not both; got device_mesh={device_mesh}, "
                             f"devices={devices!r}")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"cross_device_ops must be a CrossDeviceOps; got {type(cross_device_ops).__name__}")
        if auto_shard_dataset not in (True, False):
            raise ValueError(f"auto_shard_dataset must be True or False; got {auto_shard_dataset!r}")
        self._auto_shard_dataset = bool(auto_shard_dataset)
        self._cross_device_ops = cross_device_ops
        self._device_mesh = None
        if device_mesh is not None:
            if not isinstance(device_mesh, DeviceMesh):
                raise ValueError(
                    "Expect `mesh` to be an instance of `DeviceMesh`. "
                    f"Received: mesh={device_mesh!r} (of type {type(device_mesh)})"
                )
            if len(device_mesh.shape) != 1:
                warnings.warn(
                    f"Expect the input mesh to be 1D, but received mesh.devices.ndim={len(device_mesh.shape)}. "
                    f"The first axis ({device_mesh.axis_names[0]!r}) will be used for data-parallel sharding.",
                    stacklevel=2,
                )
            self._device_mesh = device_mesh
        elif devices is not None:
            names = _device_array(devices)
            if names.ndim != 1:
                raise ValueError(f"devices must be a flat list of device names; got an array of shape {names.shape}"
                                 " (pass a DeviceMesh for more axes)")
            self._device_mesh = DeviceMesh((names.size,), [DEFAULT_BATCH_DIM_NAME], list(names))
        self._batch_dim_name = self._device_mesh.axis_names[0] if self._device_mesh else DEFAULT_BATCH_DIM_NAME

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh; with neither ``device_mesh`` nor ``devices`` given, built now from :func:`list_devices`."""
        if self._device_mesh is None:
            names = list_devices()
            self._device_mesh = DeviceMesh((len(names),), [DEFAULT_BATCH_DIM_NAME], names)
        return self._device_mesh

    @property
    def batch_dim_name(self) -> str:
        """The mesh axis the batch is split along."""
        return self._batch_dim_name

    @property
    def auto_shard_dataset(self) -> bool:
        """Whether :meth:`distribute_dataset` shards a dataset across processes."""
        return self._auto_shard_dataset

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """What all-reduces gradients (made on first use)."""
        if self._cross_device_ops is None:
            self._cross_device_ops = HierarchicalCopyAllReduce()
        return self._cross_device_ops

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        """Splits the first dimension along the batch axis; the others are replicated.

        Example:
            >>> DataParallel(devices=["cpu:0"]).get_data_layout((8, 2, 2)).axes
            ('batch', None, None)
        """
        shape = tuple(data_shape)
        if not shape:
            raise ValueError(f"data_shape needs a batch dimension; got data_shape={data_shape!r}")
        return TensorLayout((self._batch_dim_name,) + (None,) * (len(shape) - 1), self.device_mesh)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """Variables are replicated: no dimension is split.

        Example:
            >>> import numpy as np
            >>> DataParallel(devices=["cpu:0"]).get_variable_layout(np.zeros((3, 2))).axes
            (None, None)
        """
        shape = getattr(variable, "shape", None)
        if shape is None:
            raise ValueError(f"variable must have a shape; got {type(variable).__name__}")
        return TensorLayout((None,) * len(shape), self.device_mesh)

    def get_tensor_layout(self, path: str) -> None:
        """Intermediate tensors keep their layout under data parallelism: always None.

        Example:
            >>> DataParallel(devices=["cpu:0"]).get_tensor_layout("dense/output") is None
            True
        """
        return None

    def _replica_devices(self) -> list[str]:
        """The mesh's devices this process drives: all of them alone; after a multi-process
        :func:`initialize`, its own (the job's names), each process feeding its own."""
        devices = self.device_mesh.devices.ravel().tolist()
        group = _keras_devices.current_group()
        if group is None:
            return devices
        job = job_devices(group)
        mine = [d for i, d in enumerate(devices) if job.find(d, f"mesh.devices[{i}]").process_id == group.process_id]
        if not mine:
            raise ValueError(f"the mesh's devices {devices} hold none of this process's devices "
                             f"{[DeviceName.parse(d).keras for d in job.mine]}")
        return mine

    def distribute_dataset(self, dataset: Any) -> Any:
        """This process's rows of each global batch of ``dataset`` (Keras' ``DataParallel.distribute_dataset``).

        With one process, or ``auto_shard_dataset=False``, ``dataset`` itself.
        With P processes, a re-iterable of this process's share of each global
        batch (Keras' arithmetic, TF's ``batch_sizes_for_worker`` with one
        replica per worker): of a batch of ``B`` rows, process ``p`` gets the
        ``p``-th of P contiguous parts, the first ``B % P`` of them one row
        longer; ``B`` is the first batch's rows, and a later partial batch fills
        the parts in order with those sizes (the last processes may get empty
        batches). Every process must iterate the same global batches. Unlike
        Keras, which shards a ``tf.data.Dataset`` only, any iterable of batches
        (arrays, or tuples, lists and dicts of them) is accepted; one with
        ``as_numpy_iterator()`` is read through it.

        Raises:
            ValueError: with several processes, ``dataset`` is not iterable, or
                a batch's arrays differ in rows (at iteration).

        Example:
            >>> import numpy as np
            >>> data = [np.arange(8).reshape(4, 2)]
            >>> DataParallel(devices=["cpu:0", "cpu:1"]).distribute_dataset(data) is data  # one process
            True
        """
        info = process_info()
        if info is None or not info.is_multi_process or not self._auto_shard_dataset:
            return dataset
        where = "distribute_dataset"
        elements(dataset, where)
        return Rows(dataset, info.num_processes, info.process_id, where)

    def distribute_batch(self, batch: Any) -> Any:
        """Splits a global batch along its first dimension, one slice per device.

        Rows are split as ``numpy.array_split`` splits them (the first slices
        take one more row when they do not divide evenly). ``batch`` is an
        array (anything with ``shape`` and slicing: numpy, CuPy, torch, JAX) or
        a tuple, list or dict of them, e.g. ``(x, y)``, which all have the same
        number of rows; the result has the same structure with a
        :class:`~xreduce.distribute.PerReplica` in place of each array. With a
        mesh of more axes, the devices along the other axes get the same slice.
        After a multi-process :func:`initialize`, ``batch`` is this process's
        share of the global batch, split across the devices it drives.

        Raises:
            ValueError: fewer rows than slices, arrays with different numbers
                of rows, or a leaf that is not an array with a first dimension.

        Example:
            >>> import numpy as np
            >>> dp = DataParallel(devices=["cpu:0", "cpu:1", "cpu:2"])
            >>> x, y = dp.distribute_batch((np.arange(8).reshape(4, 2), np.arange(4)))
            >>> [v.tolist() for v in y.values], y.devices[2]
            ([[0, 1], [2], [3]], '/job:localhost/replica:0/task:0/device:CPU:2')
        """
        devices = self._replica_devices()
        copies = self.device_mesh.devices.size // self.device_mesh.shape[0]
        slices = max(len(devices) // copies, 1)
        n = batch_rows("distribute_batch", batch)
        if n < slices:
            raise ValueError(
                f"distribute_batch: a batch of {n} rows can not be split across {slices} data-parallel replicas "
                f"(mesh axis {self._batch_dim_name!r} of size {slices}); give at least {slices} rows"
            )
        bounds = fill(split_sizes(n, slices), n)

        def split(leaf: Any) -> PerReplica:
            parts = [leaf[a:b] for a, b in bounds]
            return PerReplica([p for p in parts for _ in range(copies)], devices=devices)

        return map_structure(split, batch)

    def all_reduce_gradients(self, per_replica_grads: Any, reduce_op: ReduceOp | str = "mean") -> Any:
        """All-reduces per-replica gradients through the daemon.

        Args:
            per_replica_grads: a :class:`~xreduce.distribute.PerReplica` (one
                gradient per device of the mesh, in ``mesh.devices`` order; after
                a multi-process :func:`initialize`, per device this process
                drives, as :meth:`distribute_batch` gave them) or a list of
                them, e.g. one per variable. A value without devices is placed
                on those devices. Every process of the job reduces together.
            reduce_op: ``"mean"`` (default) or ``"sum"``, or a ``ReduceOp``.

        Returns:
            For each input, what ``HierarchicalCopyAllReduce.batch_reduce``
            returns: a :class:`~xreduce.distribute.Mirrored` over the devices,
            or an array with one device; a list for a list.

        Raises:
            ValueError: an input that is not a PerReplica or has another number
                of values than the mesh has devices; an unknown ``reduce_op``.
            xreduce.XReduceError: what the daemon rejects.

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.distribute import PerReplica
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     dp = DataParallel()
            ...     grads = PerReplica([np.array([1.0, 2.0]), np.array([3.0, 6.0])])
            ...     dp.all_reduce_gradients(grads).values
            (array([2., 4.]), array([2., 4.]))
        """
        op = ReduceOp.from_value(reduce_op)
        single = isinstance(per_replica_grads, DistributedValues)
        if single:
            grads = [per_replica_grads]
        elif isinstance(per_replica_grads, (list, tuple)):
            grads = list(per_replica_grads)
        else:
            raise ValueError(
                "all_reduce_gradients takes a PerReplica or a list of them; "
                f"got {type(per_replica_grads).__name__}"
            )
        devices = self._replica_devices()
        values = []
        for i, grad in enumerate(grads):
            where = "per_replica_grads" if single else f"per_replica_grads[{i}]"
            if not isinstance(grad, DistributedValues):
                raise ValueError(f"{where} must be a PerReplica; got {type(grad).__name__}")
            if len(grad) != len(devices):
                raise ValueError(f"{where} has {len(grad)} values but the distribution has {len(devices)} devices "
                                 f"{devices}")
            values.append(grad if grad._devices is not None else PerReplica(grad.values, devices=devices))
        # One batch per dtype: a packed batch must share one dtype, and models may mix them.
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, value in enumerate(values):
            by_dtype.setdefault(value.hosts()[0].array.dtype, []).append(i)
        results: list[Any] = [None] * len(values)
        for indices in by_dtype.values():
            reduced = self.cross_device_ops.batch_reduce(op, [(values[i], values[i]) for i in indices])
            for i, out in zip(indices, reduced):
                results[i] = out
        return results[0] if single else results

    def __repr__(self) -> str:
        mesh = self._device_mesh if self._device_mesh is not None else "<every device of list_devices()>"
        return f"<{type(self).__name__} device_mesh={mesh}, batch_dim_name={self._batch_dim_name!r}>"
