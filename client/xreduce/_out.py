"""``out=``: results written into the caller's own arrays, as gloo and MPI all-reduce in place.

``reduce(..., out=a)`` writes the result into ``a`` (one destination device)
or into ``out[i]`` for the i-th destination device, and returns them; ``a``
may be the input itself (``reduce("sum", v, v, out=v)``): the reduce is then
in place, and a process needs no memory for a result. Each array must be a
writable, C-contiguous numpy array of the result's shape and dtype (the
value's; for a ``MEAN`` of integers the float type :func:`xreduce.wire.contract.mean_dtype`
gives), and either apart from the values or exactly one of them (one that
overlaps a value elsewhere is refused: chunk by chunk it would overwrite
values not yet read). If the call fails, what the arrays hold is unspecified
(as with gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xreduce import _sparse
from xreduce._call import Pair
from xreduce._values import Mirrored
from xreduce.wire.contract import mean_dtype


def result_dtype(op: str, dtype: np.dtype) -> np.dtype:
    """The dtype of a reduce's result: the value's, or for a ``MEAN`` of integers its float type.

    Example:
        >>> result_dtype("MEAN", np.dtype("int32")), result_dtype("SUM", np.dtype("int32"))
        (dtype('float64'), dtype('int32'))
    """
    return mean_dtype(dtype) if op == "MEAN" else np.dtype(dtype)


def checked(out: Any, pair: Pair, op: str, field: str) -> list[np.ndarray] | None:
    """``out`` for ``pair`` as one array per destination, or None when it is None.

    Raises:
        ValueError: naming ``field`` (``out``, ``out[1]``, ``out[0][1]``...) and what it got: not a numpy
            array, read-only, not C-contiguous, another shape or dtype than the result's, or not one per
            destination; or a sparse value (its result's size is known only once reduced).

    Example:
        >>> from xreduce._values import PerReplica
        >>> pair = Pair(PerReplica([np.ones(2, np.float32)] * 2), ("CPU:0", "CPU:1"), ("CPU:0",))
        >>> checked(np.zeros(2, np.float32), pair, "SUM", "out")[0].shape
        (2,)
        >>> checked(np.zeros(3, np.float32), pair, "SUM", "out")
        Traceback (most recent call last):
        ...
        ValueError: out must have the result's shape (2,); got shape (3,)
    """
    if out is None:
        return None
    if _sparse.is_sparse(pair.value.values):
        raise ValueError(f"{field} cannot take a sparse (IndexedSlices) result: its size is known only once "
                         "reduced; leave out None")
    first = pair.value.hosts()[0].array
    shape, dtype = tuple(first.shape), result_dtype(op, first.dtype)
    many = len(pair.destinations) > 1
    if many:
        if isinstance(out, np.ndarray) or not isinstance(out, Sequence) or len(out) != len(pair.destinations):
            raise ValueError(f"{field} must be a list of {len(pair.destinations)} arrays, one per destination "
                             f"device {list(pair.destinations)}; got {describe(out)}")
        arrays = list(out)
    else:
        arrays = [out]
    for i, a in enumerate(arrays):
        name = f"{field}[{i}]" if many else field
        if not isinstance(a, np.ndarray):
            raise ValueError(f"{name} must be a numpy array; got {describe(a)}")
        if a.shape != shape:
            raise ValueError(f"{name} must have the result's shape {shape}; got shape {a.shape}")
        if a.dtype != dtype:
            raise ValueError(f"{name} must have the result's dtype {dtype}; got dtype {a.dtype}")
        if not a.flags.writeable:
            raise ValueError(f"{name} must be writable; got a read-only array")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous; got strides {a.strides}")
        for h in pair.value.hosts():
            if np.may_share_memory(a, h.array) and not same(a, h.array):
                raise ValueError(f"{name} overlaps one of the values without being it; a result goes into its "
                                 "own array or over one value exactly (in place)")
    return arrays


def written(result: Any, arrays: list[np.ndarray] | None) -> Any:
    """``result`` copied into ``arrays`` and returned as they are (one array, or a ``Mirrored`` over the
    result's devices); ``result`` itself when there are none.

    Example:
        >>> a = np.zeros(2)
        >>> written(np.array([1.0, 2.0]), [a]) is a, a.tolist()
        (True, [1.0, 2.0])
    """
    if arrays is None:
        return result
    values = result.values if isinstance(result, Mirrored) else (result,)
    for a, v in zip(arrays, values):
        copy_into(a, np.asarray(v))
    return like(devices_of(result), arrays)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same bytes (same start, same extent).

    Example:
        >>> x = np.zeros(4)
        >>> same(x, x.reshape(2, 2)), same(x, x[1:])
        (True, False)
    """
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


def copy_into(dest: np.ndarray, source: np.ndarray) -> None:
    """Copies ``source`` into ``dest`` unless it is ``dest`` already (the daemon wrote it in place).

    Example:
        >>> a = np.zeros(3)
        >>> copy_into(a[1:], np.ones(2)); a.tolist()
        [0.0, 1.0, 1.0]
    """
    if not (same(dest, source) and dest.strides == source.strides and dest.shape == source.shape):
        np.copyto(dest, source)


def like(devices: tuple[str, ...] | None, arrays: Sequence[np.ndarray]) -> Any:
    """``arrays`` as a reduce returns them: the one array (``devices`` None), or a ``Mirrored`` over
    ``devices`` (a result's ``devices``, see :func:`devices_of`).

    Example:
        >>> like(None, [np.ones(1)]).tolist()
        [1.0]
    """
    if devices is None:
        return arrays[0]
    out = Mirrored(list(arrays), devices=list(devices))
    out._devices = devices  # a device name of the daemon's stays one
    return out


def devices_of(result: Any) -> tuple[str, ...] | None:
    """The devices of a ``Mirrored`` result, None for one array.

    Example:
        >>> devices_of(np.zeros(1)) is None
        True
    """
    return result.devices if isinstance(result, Mirrored) else None


def describe(value: Any) -> str:
    """How an error message shows a wrong ``out``.

    Example:
        >>> describe([1, 2]), describe(np.zeros((2, 3)))
        ('a list of 2', 'an array of shape (2, 3)')
    """
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    return type(value).__name__ if not isinstance(value, (list, tuple)) else f"a {type(value).__name__} of {len(value)}"
