"""The answers ``xreduce bench`` checks results against, from the inputs alone.

Device ``g`` of a sweep (counted across processes, from 0) holds ``g + 1`` in
every element, so each answer is known in closed form. It is computed here
with plain numpy in float64 (an integer sum with exact integer arithmetic),
never with the SDK's rules: a wrong rule in the SDK, say how MEAN treats
integers, shows up as wrong elements.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ml_dtypes
import numpy as np

from xreduce_bench.sweep import Sweep, numpy_dtype


def inputs(sweep: Sweep) -> np.ndarray:
    """What each of the sweep's devices holds, in float64, device by device.

    Example:
        >>> s = Sweep("all_reduce", "int32", "sum", (4,), processes=2, devices=2, iters=1, warmup=0)
        >>> inputs(s)
        array([1., 2., 3., 4.])
    """
    return np.arange(1, sweep.ranks + 1, dtype=np.float64)


def expected(sweep: Sweep) -> float:
    """The value every element of every result must hold.

    A broadcast delivers the first device's value; a sum of integers wraps
    around as the dtype's own additions do (TF's and numpy's rule).

    Example:
        >>> s = Sweep("all_reduce", "int32", "mean", (4,), processes=2, devices=1, iters=1, warmup=0)
        >>> expected(s), expected(Sweep("reduce", "int8", "sum", (1,), processes=1, devices=16, iters=1, warmup=0))
        (1.5, -120.0)
    """
    values = inputs(sweep)
    if sweep.op == "broadcast":
        return float(values[0])
    if sweep.reduce_op == "mean":
        return float(np.mean(values))
    dtype = numpy_dtype(sweep.dtype)
    if dtype.kind in "iu":
        total = sweep.ranks * (sweep.ranks + 1) // 2
        return float(np.array(total, np.int64).astype(dtype))
    return float(np.sum(values))


def tolerance(sweep: Sweep) -> float:
    """The relative error a result may have: none for integer inputs; for
    floating-point ones, the rounding of adding up ``ranks`` values.

    Example:
        >>> tolerance(Sweep("all_reduce", "int32", "mean", (4,), processes=2, devices=1, iters=1, warmup=0))
        0.0
    """
    dtype = numpy_dtype(sweep.dtype)
    if dtype.kind in "iu":
        return 0.0
    return sweep.ranks * float(ml_dtypes.finfo(dtype).eps)


def wrong_elements(arrays: Iterable, sweep: Sweep) -> int:
    """How many elements of ``arrays`` (one result's) differ from :func:`expected`
    by more than :func:`tolerance`; a NaN is always wrong.

    Example:
        >>> s = Sweep("all_reduce", "int16", "mean", (4,), processes=1, devices=2, iters=1, warmup=0)
        >>> wrong_elements([np.full(3, 1.5, np.float32), np.array([1, 1, 2], np.int16)], s)
        3
    """
    want, rtol = expected(sweep), tolerance(sweep)
    wrong = 0
    for a in arrays:
        a = np.asarray(a)  # compared in its own dtype: no float64 copy of a large result
        if rtol == 0:
            wrong += int(np.count_nonzero(a != want))
        else:
            wrong += int(np.count_nonzero(~(np.abs(a - want) <= rtol * abs(want))))
    return wrong


def workload_inputs(sweep: Sweep, device: int) -> list[np.ndarray]:
    """What device ``device`` (counted across processes, from 0) holds for each tensor of the sweep's
    workload: element ``i`` of tensor ``t`` is ``device + 1 + (t + i) % 4``, so that a tensor or an element
    out of place shows up as wrong, and every sum stays exact in every dtype.

    Example:
        >>> from xreduce_bench.workloads import Workload
        >>> s = Sweep("all_reduce", "float32", "mean", (24,), processes=2, devices=1, iters=1, warmup=0,
        ...           workload=Workload("w", ((2,), (2, 2))))
        >>> [a.tolist() for a in workload_inputs(s, 1)]
        [[2.0, 3.0], [[3.0, 4.0], [5.0, 2.0]]]
    """
    dtype = numpy_dtype(sweep.dtype)
    return [_pattern(t, shape).__add__(device + 1).astype(dtype) for t, shape in enumerate(sweep.workload.shapes)]


def workload_expected(sweep: Sweep, t: int) -> np.ndarray:
    """Tensor ``t``'s result, in float64 (exact): the sum over the sweep's devices of
    :func:`workload_inputs`, divided by their number for a mean.

    Example:
        >>> from xreduce_bench.workloads import Workload
        >>> s = Sweep("all_reduce", "float32", "mean", (8,), processes=2, devices=1, iters=1, warmup=0,
        ...           workload=Workload("w", ((2,),)))
        >>> workload_expected(s, 0)
        array([1.5, 2.5])
    """
    n = sweep.ranks
    total = _pattern(t, sweep.workload.shapes[t]) * n + n * (n + 1) // 2
    return total / n if sweep.reduce_op == "mean" else total


def workload_wrong(results: Sequence[Iterable], sweep: Sweep) -> int:
    """How many elements of ``results`` (per tensor of the workload, its arrays on every destination) differ
    from :func:`workload_expected`, compared exactly in each result's own dtype.

    Example:
        >>> from xreduce_bench.workloads import Workload
        >>> s = Sweep("all_reduce", "float32", "mean", (8,), processes=2, devices=1, iters=1, warmup=0,
        ...           workload=Workload("w", ((2,),)))
        >>> workload_wrong([[np.array([1.5, 2.0], np.float32)]], s)
        1
    """
    if len(results) != len(sweep.workload.shapes):
        raise ValueError(f"{len(results)} results for {len(sweep.workload.shapes)} tensors")
    wrong = 0
    for t, arrays in enumerate(results):
        want = workload_expected(sweep, t)
        for a in arrays:
            a = np.asarray(a)
            wrong += int(np.count_nonzero(a != want.astype(a.dtype).reshape(a.shape)))
    return wrong


def _pattern(t: int, shape: tuple[int, ...]) -> np.ndarray:
    """``(t + i) % 4`` for element ``i`` of tensor ``t``, in float64, shaped."""
    count = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(count, dtype=np.int64) + t) % 4).astype(np.float64).reshape(shape)
