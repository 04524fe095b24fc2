"""The bridge between TensorFlow's tensors and the SDK: one daemon call per TF reduction.

TF hands a :class:`~xreduce.tensorflow.HierarchicalCopyAllReduce` its values as
``tf.distribute`` values of tensors (eager ones, or symbolic ones while Keras
traces its ``tf.function``). :func:`run` turns the whole batch into one call of
the SDK's front (:mod:`xreduce._ops`), which sends one request to the daemon:

* eagerly, with the tensors' numpy views;
* inside a ``tf.function``, as one ``tf.numpy_function`` op that takes every
  replica's tensors and returns one result per value (TF's graph then copies it
  to each destination device, as TF's own all-reduce ends with ``identity`` on
  every device).

Errors of the SDK become TF's own error classes (``tf.errors.AbortedError`` and
so on), carrying the daemon's message, so that ``model.fit`` raises what a
``tf.distribute`` user expects. An XLA-compiled function cannot run a Python op:
it is refused while tracing, with what to do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from xreduce import _errors
from xreduce._sparse import IndexedSlices
from xreduce._values import Mirrored
from xreduce.wire.contract import mean_dtype

XLA_MESSAGE = (
    "xreduce.tensorflow reduces through the xreduce daemon, a call XLA cannot compile (xreduce's TF "
    "kernel or a tf.numpy_function, neither of which XLA has): run the step without XLA, e.g. "
    "model.compile(..., jit_compile=False) or tf.function(jit_compile=False)"
)

_TF_ERRORS: dict[type, type] = {
    _errors.InvalidArgumentError: tf.errors.InvalidArgumentError,
    _errors.NotFoundError: tf.errors.NotFoundError,
    _errors.DeadlineExceededError: tf.errors.DeadlineExceededError,
    _errors.UnavailableError: tf.errors.UnavailableError,
    _errors.ResourceExhaustedError: tf.errors.ResourceExhaustedError,
    _errors.AbortedError: tf.errors.AbortedError,
    _errors.UnauthenticatedError: tf.errors.UnauthenticatedError,
    _errors.PermissionDeniedError: tf.errors.PermissionDeniedError,
    _errors.CancelledError: tf.errors.CancelledError,
    _errors.InternalError: tf.errors.InternalError,
}


def tf_error(error: Exception) -> Exception:
    """The ``tf.errors`` exception for an SDK error (same message); other exceptions as they are.

    Example:
        >>> import grpc
        >>> e = tf_error(_errors.AbortedError("collective 3 was aborted", grpc.StatusCode.ABORTED))
        >>> type(e).__name__, e.message
        ('AbortedError', 'collective 3 was aborted')
    """
    for kind, tf_kind in _TF_ERRORS.items():
        if isinstance(error, kind):
            return tf_kind(None, None, str(error))
    return error


def refuse_xla() -> None:
    """Raises ``ValueError`` (:data:`XLA_MESSAGE`) while an XLA-compiled function is being traced."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise ValueError(XLA_MESSAGE)


def numpy_call(fn: Callable[[list[np.ndarray]], list[np.ndarray]], inputs: Sequence[tf.Tensor],
               outputs: Sequence[tuple[tf.DType, tf.TensorShape]], name: str) -> list[tf.Tensor]:
    """``fn`` on the inputs' numpy values: now when eager, else as one ``tf.numpy_function`` op of the graph.

    The results take ``outputs``' dtypes and static shapes. An SDK error comes out eagerly as its
    ``tf.errors`` class (:func:`tf_error`); from a graph, as TF turns a Python exception raised in a
    ``numpy_function`` into a status: ``InvalidArgumentError`` for the SDK's ``InvalidArgumentError`` (a
    ``ValueError``), ``UnknownError`` for the others, its message holding the SDK error's class and message
    (TF's py_func keeps no other error code).

    Example:
        >>> double = lambda arrays: [arrays[0] * 2]
        >>> numpy_call(double, [tf.constant([1.0, 2.0])], [(tf.float32, tf.TensorShape([2]))], "x")[0].numpy()
        array([2., 4.], dtype=float32)
    """

    def typed(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(r, dtype=dtype.as_numpy_dtype) for r, (dtype, _) in zip(fn(list(arrays)), outputs)]

    if tf.executing_eagerly():
        try:
            results = typed(*(t.numpy() for t in inputs))
        except _errors.XReduceError as e:
            raise tf_error(e) from None
        return [tf.convert_to_tensor(r) for r in results]
    refuse_xla()
    results = tf.numpy_function(typed, list(inputs), [dtype for dtype, _ in outputs], stateful=True, name=name)
    for tensor, (_, shape) in zip(results, outputs):
        tensor.set_shape(shape)
    return list(results)


def copies(value: Any, devices: Sequence[str]) -> Any:
    """``value`` (a tensor or ``tf.IndexedSlices``) copied to each device, regrouped as TF regroups an
    all-reduce's results: a ``Mirrored``, or the one copy for one device.

    Example:
        >>> copies(tf.constant(1.0), ["/cpu:0"]).device.endswith("CPU:0")
        True
    """
    out = []
    for device in devices:
        with tf.device(device):
            if isinstance(value, tf.IndexedSlices):
                shape = None if value.dense_shape is None else tf.identity(value.dense_shape)
                out.append(tf.IndexedSlices(tf.identity(value.values), tf.identity(value.indices), shape))
            else:
                out.append(tf.identity(value))
    return distribute_utils.regroup(out, wrap_class=tf_values.Mirrored)


@dataclasses.dataclass(frozen=True)
class Pair:
    """One value of a TF reduction, with its devices as TF names them and as the SDK does."""

    components: tuple[Any, ...]
    """The replicas' tensors or ``tf.IndexedSlices``, as TF gave them."""
    devices: tuple[str, ...]
    """The SDK's name of each component's device."""
    destinations: tuple[str, ...]
    """The TF devices the result goes to."""
    sdk_destinations: tuple[str, ...]
    """The same devices, as the SDK names them (:func:`xreduce.tensorflow._devices.sdk_name`)."""

    @property
    def sparse(self) -> bool:
        """Whether the components are ``tf.IndexedSlices`` (reduced as TF does: concatenated)."""
        return isinstance(self.components[0], tf.IndexedSlices)

    def inputs(self) -> list[tf.Tensor]:
        """The tensors that cross into numpy: each component, or each slice's values, indices and shape."""
        if not self.sparse:
            return [tf.convert_to_tensor(c) for c in self.components]
        out = []
        for c in self.components:
            shape = c.dense_shape if c.dense_shape is not None else tf.constant([-1], tf.int64)
            out += [c.values, c.indices, tf.cast(shape, tf.int64)]
        return out

    def outputs(self, op: str) -> list[tuple[tf.DType, tf.TensorShape]]:
        """The dtypes and static shapes of the result as it comes back from numpy."""
        first = self.components[0]
        if self.sparse:
            values = first.values
            dtype = tf.as_dtype(mean_dtype(values.dtype.as_numpy_dtype)) if op == "MEAN" else values.dtype
            return [(dtype, tf.TensorShape([None]).concatenate(values.shape[1:])),
                    (first.indices.dtype, tf.TensorShape([None]))]
        dtype = tf.as_dtype(first.dtype)
        if op == "MEAN":
            dtype = tf.as_dtype(mean_dtype(dtype.as_numpy_dtype))
        return [(dtype, first.shape)]

    def sdk_value(self, arrays: Any) -> list[Any]:
        """The components as the SDK takes them, from ``arrays`` (an iterator over :meth:`inputs`' values)."""
        if not self.sparse:
            return [next(arrays) for _ in self.components]
        out = []
        for _ in self.components:
            values, indices, shape = next(arrays), next(arrays), next(arrays)
            out.append(IndexedSlices(values, indices, None if len(shape) == 1 and shape[0] < 0 else shape))
        return out

    def result(self, tensors: Any) -> Any:
        """The TF result from :meth:`outputs`' tensors (an iterator), on every destination."""
        if self.sparse:
            values, indices = next(tensors), next(tensors)
            first = self.components[0]
            return copies(tf.IndexedSlices(values, indices, first.dense_shape), self.destinations)
        return copies(next(tensors), self.destinations)


@dataclasses.dataclass(frozen=True)
class Packed:
    """Dense values that go to the same devices, of one dtype, sent as one: each replica's tensors flattened and
    concatenated in TF (TF's own ``num_packs`` packing), the reduced buffer split back in TF. The daemon adds
    element by element, so the numbers are the same as value by value; the SDK then handles one value, not
    one per gradient."""

    members: tuple[Pair, ...]
    indices: tuple[int, ...]
    """Each member's place in the batch."""

    def sent(self) -> Pair:
        """The one value the daemon reduces: per replica, the members' tensors, flattened, end to end."""
        first = self.members[0]
        components = []
        for i, device_tensor in enumerate(first.components):
            with tf.device(device_tensor.device):
                components.append(tf.concat([tf.reshape(m.components[i], [-1]) for m in self.members], 0))
        return dataclasses.replace(first, components=tuple(components))

    def results(self, tensors: Any) -> list[Any]:
        """Each member's result on every destination, from the reduced buffer (the next of ``tensors``)."""
        shapes = [m.components[0].shape for m in self.members]
        parts = tf.split(next(tensors), [s.num_elements() for s in shapes])
        return [copies(tf.reshape(part, shape), m.destinations) for part, shape, m in zip(parts, shapes, self.members)]


def pack(pairs: Sequence[Pair]) -> list[tuple[Pair, Callable[[Any], list[Any]], tuple[int, ...]]]:
    """What to send for ``pairs``: each sparse value, or dense one of a shape not known yet, as it is; dense values
    of one dtype on the same devices to the same destinations as one :class:`Packed` value. Each entry is (the
    value sent, what makes the results of its members from the reduced tensors, their places in ``pairs``).

    Example:
        >>> with tf.device("/cpu:0"):
        ...     a, b = tf.ones([2, 3]), tf.zeros([4])
        >>> pairs = [Pair((a,), ("CPU:0",), ("/cpu:0",), ("CPU:0",)), Pair((b,), ("CPU:0",), ("/cpu:0",), ("CPU:0",))]
        >>> [(sent.components[0].shape.as_list(), places) for sent, _, places in pack(pairs)]
        [([10], (0, 1))]
    """
    groups: dict[tuple, list[int]] = {}
    alone = []
    for i, p in enumerate(pairs):
        if p.sparse or not all(c.shape.is_fully_defined() for c in p.components):
            alone.append(i)
            continue
        key = (tf.as_dtype(p.components[0].dtype), p.devices, p.destinations, p.sdk_destinations)
        groups.setdefault(key, []).append(i)
    out = _entries(pairs, alone)
    for places in groups.values():
        if len(places) == 1:
            p = pairs[places[0]]
            out.append((p, lambda tensors, p=p: [p.result(tensors)], tuple(places)))
        else:
            packed = Packed(tuple(pairs[i] for i in places), tuple(places))
            out.append((packed.sent(), packed.results, tuple(places)))
    return sorted(out, key=lambda entry: entry[2][0])


def unpacked(pairs: Sequence[Pair]) -> list[tuple[Pair, Callable[[Any], list[Any]], tuple[int, ...]]]:
    """What to send for ``pairs`` when each goes as it is (:func:`pack`'s entries, none packed).

    Example:
        >>> with tf.device("/cpu:0"):
        ...     a, b = tf.ones([2, 3]), tf.zeros([4])
        >>> pairs = [Pair((a,), ("CPU:0",), ("/cpu:0",), ("CPU:0",)), Pair((b,), ("CPU:0",), ("/cpu:0",), ("CPU:0",))]
        >>> [places for _, _, places in unpacked(pairs)]
        [(0,), (1,)]
    """
    return _entries(pairs, range(len(pairs)))


def _entries(pairs: Sequence[Pair], indices) -> list[tuple[Pair, Callable[[Any], list[Any]], tuple[int, ...]]]:
    """The entries of :func:`pack` for the pairs at ``indices``, each sent as it is."""
    return [(pairs[i], lambda tensors, p=pairs[i]: [p.result(tensors)], (i,)) for i in indices]


def sdk_result(result: Any, sparse: bool) -> list[np.ndarray]:
    """The arrays :meth:`Pair.outputs` describes, from an SDK result (a ``Mirrored`` holds the same result on
    every destination: the first is taken; TF's graph copies it to each).

    Example:
        >>> sdk_result(Mirrored([np.ones(2), np.ones(2)], devices=["CPU:0", "CPU:1"]), sparse=False)
        [array([1., 1.])]
    """
    first = result.values[0] if isinstance(result, Mirrored) else result
    if sparse:
        return [np.asarray(first.values), np.asarray(first.indices)]
    return [first]
