"""Sparse values (TF's ``tf.IndexedSlices``) on the wire: the checks both sides make, the
``IndexedSlices`` message, and TF's reduction of them (concatenation).

A sparse value is the rows ``values[i]`` of a dense tensor of shape ``dense_shape``
at rows ``indices[i]``; a row given twice means the sum of its rows. TF reduces
sparse replicas by concatenating them (``backprop_util.AggregateIndexedSlicesGradients``),
never by adding: :func:`concat` is that rule, shared by the daemon (which reduces)
and the SDK (which checks and converts).

Example:
    >>> a = Slices(np.array([[1.0, 2.0]]), np.array([1]), (5, 2))
    >>> b = Slices(np.array([[3.0, 4.0], [5.0, 6.0]]), np.array([1, 3]), (5, 2))
    >>> total = concat([a, b])
    >>> total.indices.tolist(), to_dense(total)[1].tolist()
    ([1, 1, 3], [4.0, 6.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
"""The dtypes TF allows for indices."""


@dataclasses.dataclass(frozen=True)
class Slices:
    """One sparse replica as host arrays: ``values`` rows at ``indices`` of a tensor of shape
    ``dense_shape`` (None: unknown). Build it with :func:`check` first.

    Example:
        >>> Slices(np.zeros((2, 3), np.float32), np.array([0, 4]), (5, 3))
        IndexedSlices(values float32[2, 3], indices int64[2], dense_shape [5, 3])
    """

    values: np.ndarray
    indices: np.ndarray
    dense_shape: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        """Bytes of values and indices."""
        return int(self.values.nbytes + self.indices.nbytes)

    def spec(self) -> tuple:
        """What the replicas of one value must agree on: the values' dtype, a row's shape,
        the dense shape (not the number of rows, which each replica chooses)."""
        return self.values.dtype, tuple(self.values.shape[1:]), self.dense_shape

    def __repr__(self) -> str:
        shape = "unknown" if self.dense_shape is None else list(self.dense_shape)
        return (f"IndexedSlices(values {_label(self.values)}, indices {_label(self.indices)}, "
                f"dense_shape {shape})")


def _label(array: np.ndarray) -> str:
    return f"{array.dtype.name}{list(array.shape)}"


def check(values: np.ndarray, indices: np.ndarray, dense_shape: Sequence[int] | None, field: str) -> Slices:
    """Checks one sparse replica and returns it; ``field`` names it in the messages.

    Raises:
        CodecError: values with no dimension; indices not int32/int64 or not one
            dimension; a row count that is not the index count; a ``dense_shape``
            with no dimension or a negative one; rows not of shape ``dense_shape[1:]``;
            an index outside ``[0, dense_shape[0])`` (negative ones always).

    Example:
        >>> check(np.ones((2, 2)), np.array([0, 7]), (5, 2), "value")
        Traceback (most recent call last):
        ...
        xreduce.wire.codec.CodecError: value.indices: each must be in [0, dense_shape[0]) = [0, 5); got indices[1] = 7
        >>> check(np.ones((2, 2)), np.array([0.0, 1.0]), (5, 2), "value")
        Traceback (most recent call last):
        ...
        xreduce.wire.codec.CodecError: value.indices.dtype: must be int32 or int64; got float64
    """
    if values.ndim < 1:
        raise codec.CodecError(f"{field}.values.shape: a sparse value's values have one row per index, so at least "
                               f"one dimension; got {_label(values)}")
    if indices.dtype not in INDEX_DTYPES:
        raise codec.CodecError(f"{field}.indices.dtype: must be int32 or int64; got {indices.dtype.name}")
    if indices.ndim != 1:
        raise codec.CodecError(f"{field}.indices.shape: must have one dimension; got {list(indices.shape)}")
    if values.shape[0] != indices.shape[0]:
        raise codec.CodecError(f"{field}.values.shape: one row per index; got {values.shape[0]} rows "
                               f"({_label(values)}) for {indices.shape[0]} indices")
    if dense_shape is not None:
        dense_shape = tuple(int(d) for d in dense_shape)
        if not dense_shape or any(d < 0 for d in dense_shape):
            raise codec.CodecError(f"{field}.dense_shape: at least one dimension, each >= 0; got "
                                   f"{list(dense_shape)}")
        if tuple(values.shape[1:]) != dense_shape[1:]:
            raise codec.CodecError(f"{field}.values.shape: rows must have shape dense_shape[1:] = "
                                   f"{list(dense_shape[1:])}; got {_label(values)}")
    bad = np.flatnonzero((indices < 0) | (indices >= dense_shape[0]) if dense_shape is not None else indices < 0)
    if bad.size:
        at = int(bad[0])
        where = f"[0, dense_shape[0]) = [0, {dense_shape[0]})" if dense_shape is not None else ">= 0"
        raise codec.CodecError(f"{field}.indices: each must be in {where}; got indices[{at}] = {int(indices[at])}")
    return Slices(values, indices, dense_shape)


def encode(slices: Slices, encoding: str = codec.RAW) -> pb.IndexedSlices:
    """A sparse replica as an ``IndexedSlices`` message, in the given encoding.

    Example:
        >>> m = encode(Slices(np.array([[1.0]], np.float32), np.array([2], np.int64), (4, 1)), codec.TYPED)
        >>> list(m.indices.int_values), list(m.dense_shape)
        ([2], [4, 1])
    """
    return pb.IndexedSlices(values=codec.encode(slices.values, encoding),
                            indices=codec.encode(slices.indices, encoding), dense_shape=slices.dense_shape or ())


def decode(message: pb.IndexedSlices, field: str = "indexed_slices") -> Slices:
    """An ``IndexedSlices`` message, decoded and checked (see :func:`check`).

    Raises:
        CodecError: naming the field and the value, e.g. ``value.components[1].indexed_slices.indices``.

    Example:
        >>> m = pb.IndexedSlices(values=codec.encode(np.ones((1, 2))), indices=codec.encode(np.array([1])),
        ...                      dense_shape=[3, 2])
        >>> decode(m).dense_shape
        (3, 2)
    """
    for name in ("values", "indices"):
        if not message.HasField(name):
            raise codec.CodecError(f"{field}.{name}: a sparse value needs {name}; got none")
        if getattr(message, name).HasField("region") or getattr(message, name).streamed:
            raise codec.CodecError(f"{field}.{name}: a sparse value's tensors carry their data (raw_data or typed "
                                   "values), never a region or a stream")
    values = codec.decode(message.values, f"{field}.values")
    indices = codec.decode(message.indices, f"{field}.indices")
    return check(values, indices, tuple(message.dense_shape) or None, field)


def encoding_of(message: pb.IndexedSlices) -> str:
    """``'typed'`` when the values or the indices carry typed values, else ``'raw'``.

    Example:
        >>> encoding_of(pb.IndexedSlices(indices=pb.Tensor(int_values=[0])))
        'typed'
    """
    typed = codec.TYPED in (codec.encoding_of(message.values), codec.encoding_of(message.indices))
    return codec.TYPED if typed else codec.RAW


def concat(parts: Sequence[Slices]) -> Slices:
    """TF's reduction of sparse replicas: values and indices concatenated in order, ``dense_shape``
    the first's; int32 indices become int64 when the parts mix both (TF's ``_as_indexed_slices_list``).

    Example:
        >>> a = Slices(np.ones((1, 1), np.float32), np.array([0], np.int32), (3, 1))
        >>> b = Slices(np.ones((1, 1), np.float32), np.array([2], np.int64), (3, 1))
        >>> concat([a, b]).indices.dtype.name
        'int64'
    """
    index_dtype = np.result_type(*(p.indices.dtype for p in parts))
    values = np.concatenate([p.values for p in parts], axis=0)
    indices = np.concatenate([p.indices.astype(index_dtype, copy=False) for p in parts])
    return Slices(values, indices, parts[0].dense_shape)


def to_dense(slices: Slices) -> np.ndarray:
    """The dense tensor: rows at repeated indices added (TF's ``tf.convert_to_tensor`` of an IndexedSlices).

    Raises:
        ValueError: the dense shape is unknown.

    Example:
        >>> to_dense(Slices(np.array([1, 2, 3]), np.array([0, 2, 0]), (3,))).tolist()
        [4, 0, 2]
    """
    if slices.dense_shape is None:
        raise ValueError("an IndexedSlices with an unknown dense_shape (None) cannot be made dense")
    out = np.zeros(slices.dense_shape, slices.values.dtype)
    np.add.at(out, slices.indices, slices.values)
    return out
