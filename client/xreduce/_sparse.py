"""``IndexedSlices``: sparse per-replica values (TF's ``tf.IndexedSlices``), what embeddings' gradients are.

Reducing them follows TF: the daemon concatenates the replicas' values and
indices in device order (MEAN divides the values by the replica count) and every
destination gets the concatenation, an ``IndexedSlices`` again (never made dense).
A batch that mixes dense and sparse values is split as TF splits it
(``_split_by_sparsity``): the dense ones all-reduce together, the sparse ones are
concatenated. Sparse values travel as bytes in the request (the
``IndexedSlices`` message of the wire contract), never through shared memory:
their result's size is known only once every replica's rows are in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce._arrays import HostArray, check_dtype, to_host
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire import sparse as wire_sparse


class IndexedSlices:
    """A sparse tensor: the rows ``values`` of a dense tensor of shape ``dense_shape`` at rows
    ``indices`` (TF's ``tf.IndexedSlices``); a row given twice stands for the sum of its rows.

    Args:
        values: the rows, any array type (numpy, CuPy, torch, JAX); shape
            ``[len(indices)] + dense_shape[1:]``.
        indices: int32 or int64, one dimension, each in ``[0, dense_shape[0])``.
        dense_shape: the dense tensor's shape (a list, tuple or 1-D integer array),
            or None when unknown (as TF allows; then nothing is checked against it).

    Raises:
        ValueError: naming the field and the value: indices that are not integers,
            a row count other than the index count, rows not of shape
            ``dense_shape[1:]``, an index out of range, a dtype the daemon does not carry.

    Example:
        >>> import numpy as np
        >>> s = IndexedSlices(np.array([[1.0, 2.0]]), np.array([1]), [5, 2])
        >>> s.dense_shape, s.dtype, s.to_dense()[1]
        ((5, 2), dtype('float64'), array([1., 2.]))
        >>> IndexedSlices(np.ones((2, 2)), np.array([0, 5]), [5, 2])
        Traceback (most recent call last):
        ...
        ValueError: IndexedSlices.indices: each must be in [0, dense_shape[0]) = [0, 5); got indices[1] = 5
    """

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None):
        check_dtype(values, "IndexedSlices.values")
        self._values, self._indices = values, indices
        host_values, host_indices = to_host(values), to_host(indices)
        shape = None if dense_shape is None else _dense_shape(dense_shape)
        try:
            slices = wire_sparse.check(host_values.array, host_indices.array, shape, "IndexedSlices")
        except codec.CodecError as e:  # the wire's error type means nothing to a caller building a value
            raise ValueError(str(e)) from None
        self._host = HostSlices(slices, host_values, host_indices)

    @property
    def values(self) -> Any:
        """The rows, as given."""
        return self._values

    @property
    def indices(self) -> Any:
        """Each row's index in the dense tensor's first dimension, as given."""
        return self._indices

    @property
    def dense_shape(self) -> tuple[int, ...] | None:
        """The dense tensor's shape (TF gives a tensor; here a tuple), or None when unknown."""
        return self._host.slices.dense_shape

    @property
    def dtype(self) -> np.dtype:
        """The values' dtype."""
        return self._host.slices.values.dtype

    @property
    def device(self) -> str | None:
        """The GPU the values live on (``GPU:i``), or None for host arrays."""
        return self._host.device

    def to_dense(self) -> np.ndarray:
        """The dense tensor, rows at repeated indices added: what ``tf.convert_to_tensor`` gives.

        Raises:
            ValueError: ``dense_shape`` is None.

        Example:
            >>> IndexedSlices([[1.0], [2.0]], [0, 0], [2, 1]).to_dense().tolist()
            [[3.0], [0.0]]
        """
        return wire_sparse.to_dense(self._host.slices)

    def __repr__(self) -> str:
        return f"IndexedSlices(indices={self._indices!r}, values={self._values!r}, dense_shape={self.dense_shape!r})"


def _dense_shape(dense_shape: Any) -> tuple[int, ...]:
    array = to_host(dense_shape).array
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise ValueError(f"IndexedSlices.dense_shape: a list of integers (one per dimension); got {dense_shape!r}")
    return tuple(int(d) for d in array)


@dataclasses.dataclass(frozen=True)
class HostSlices:
    """An ``IndexedSlices`` as host arrays, its device, and the way back to the caller's array types
    (what :meth:`DistributedValues.hosts` holds for a sparse component)."""

    slices: wire_sparse.Slices
    host_values: HostArray
    host_indices: HostArray

    @property
    def device(self) -> str | None:
        return self.host_values.device

    def restore(self, slices: wire_sparse.Slices) -> IndexedSlices:
        """A result in the caller's array types."""
        return IndexedSlices(self.host_values.restore(slices.values), self.host_indices.restore(slices.indices),
                             slices.dense_shape)


def host(value: Any) -> HostArray | HostSlices:
    """One per-replica component on the host: a :class:`HostSlices` for an ``IndexedSlices``.

    Example:
        >>> type(host(IndexedSlices([[1.0]], [0], [1, 1]))).__name__, type(host(1.0)).__name__
        ('HostSlices', 'HostArray')
    """
    return value._host if isinstance(value, IndexedSlices) else to_host(value)


def check_component(value: Any, argument: str) -> None:
    """:func:`~xreduce._arrays.check_dtype`, for a component that may be an ``IndexedSlices``
    (whose constructor checked it)."""
    if not isinstance(value, IndexedSlices):
        check_dtype(value, argument)


def is_sparse(values: Sequence[Any]) -> bool:
    """Whether a value's components are ``IndexedSlices`` (all of them: see :func:`uniform`).

    Example:
        >>> is_sparse([IndexedSlices([[1.0]], [0], [1, 1])]), is_sparse([np.ones(1)])
        (True, False)
    """
    return bool(values) and all(isinstance(v, IndexedSlices) for v in values)


def uniform(values: Sequence[Any]) -> list[Any] | None:
    """A value whose components mix ``IndexedSlices`` and dense arrays, made dense (what TF's
    ``AggregateIndexedSlicesGradients`` does: it adds them with ``add_n``); None when it does not mix.

    Raises:
        ValueError: a sparse component whose ``dense_shape`` is None.

    Example:
        >>> uniform([IndexedSlices([[1.0]], [1], [2, 1]), np.zeros((2, 1))])[0].tolist()
        [[0.0], [1.0]]
    """
    sparse = [isinstance(v, IndexedSlices) for v in values]
    if not any(sparse) or all(sparse):
        return None
    return [v._host.host_values.restore(v.to_dense()) if s else v for v, s in zip(values, sparse)]


def component(device: str, value: HostArray | HostSlices) -> pb.Component:
    """A component of a request: the tensor, or the ``indexed_slices`` of a sparse one.

    Example:
        >>> component("CPU:0", host(IndexedSlices([[1.0]], [0], [1, 1]))).HasField("indexed_slices")
        True
    """
    if isinstance(value, HostSlices):
        return pb.Component(device=device, indexed_slices=wire_sparse.encode(value.slices))
    return pb.Component(device=device, tensor=codec.encode(value.array))


def result(message: pb.Component, restore: Callable[[Any], Any], decode: Callable = codec.decode) -> Any:
    """A result component in the caller's types: an ``IndexedSlices`` when the daemon sent one.

    Example:
        >>> s = host(IndexedSlices(np.array([[2.0]]), np.array([1]), [3, 1]))
        >>> result(component("CPU:0", s), s.restore).indices
        array([1])
    """
    if message.HasField("indexed_slices"):
        return restore(wire_sparse.decode(message.indexed_slices, "result"))
    return restore(decode(message.tensor))


def copy(value: HostSlices) -> IndexedSlices:
    """A copy of one replica, as TF's one-replica shortcut returns it (``array_ops.identity``)."""
    s = value.slices
    return value.restore(wire_sparse.Slices(s.values.copy(), s.indices.copy(), s.dense_shape))
