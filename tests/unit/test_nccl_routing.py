"""ALGORITHM_NCCL in the engine: TF's AllReduceCrossDeviceOps routing, packing and MEAN.

TF's ``NcclAllReduce`` is an ``AllReduceCrossDeviceOps`` (cross_device_ops.py): a batch whose pairs
all reduce onto their own devices is one packed all-reduce (``_batch_all_reduce``), a pair onto its
own devices is an all-reduce, any other pair falls back to ``ReductionToOneDevice``; the one-replica
shortcut returns the value as it is. The NCCL collective itself needs GPUs (tests/gpu/test_nccl.py
runs it); here the numpy backend's devices take its place through :class:`_HostCollective`, whose
sum is what NCCL returns for these small integers, so the routing, packing and MEAN around it are checked
without GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
from xreduced import planner
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.engine import MEAN, SUM, Engine, Value
from xreduced.errors import InvalidArgument


class _HostCollective(NumpyBackend):
    """The numpy backend with an all-reduce collective over its host devices, counting the calls."""

    def __init__(self, n: int):
        super().__init__(n)
        self.calls: list[int] = []

    def nccl_refusal(self, devices, dtype=None):
        return None

    def nccl_all_reduce(self, bufs):
        self.calls.append(bufs[0].size)
        total = sum(bufs[1:], bufs[0])
        return [total.copy() for _ in bufs]


def _value(devices, seed, shape=(3, 2), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return Value(tuple(devices), tuple(rng.integers(-8, 8, size=shape).astype(dtype) for _ in devices))


def test_routes_follow_tfs_all_reduce_cross_device_ops():
    e = Engine(_HostCollective(4))
    a, b = _value((0, 1, 2), 1), _value((2, 0, 1), 2)
    assert e.routes(SUM, [(a, ()), (b, ())], algorithm=planner.NCCL) == [planner.NCCL, planner.NCCL]
    # Destinations other than the sources: ReductionToOneDevice, as TF's reduce_implementation falls back.
    assert e.routes(SUM, [(a, ()), (b, (3,))], algorithm=planner.NCCL) == [planner.NCCL,
                                                                            planner.REDUCTION_TO_ONE_DEVICE]
    assert e.routes(SUM, [(a, (1,))], algorithm=planner.NCCL) == [planner.REDUCTION_TO_ONE_DEVICE]
    assert e.routes(SUM, [(_value((2,), 3), ())], algorithm=planner.NCCL) == [planner.IDENTITY]


def test_a_batch_onto_its_own_devices_is_one_packed_all_reduce_per_pack():
    backend = _HostCollective(3)
    a, b = _value((0, 1, 2), 1), _value((1, 2, 0), 2, shape=(5,))
    results = Engine(backend).batch_reduce(MEAN, [(a, ()), (b, ())], num_packs=2, algorithm=planner.NCCL)
    # TF's _split_tensors: 6 + 5 = 11 elements in 2 packs of 5 and 6 elements.
    assert backend.calls == [5, 6]
    for result, value in zip(results, (a, b)):
        assert result.route == planner.NCCL and result.devices == (0, 1, 2)  # the first value's order
        want = sum(value.arrays[1:], value.arrays[0]) / np.float32(3)
        for got in result.arrays:
            np.testing.assert_array_equal(got, want)


def test_a_fallback_pair_is_reduced_to_one_device_without_the_collective():
    backend = _HostCollective(3)
    a = _value((0, 1, 2), 4)
    (result,) = Engine(backend).batch_reduce(SUM, [(a, (1,))], algorithm=planner.NCCL)
    assert backend.calls == [] and result.route == planner.REDUCTION_TO_ONE_DEVICE and result.devices == (1,)
    np.testing.assert_array_equal(result.arrays[0], a.arrays[0] + a.arrays[1] + a.arrays[2])


@pytest.mark.parametrize("dests", [(), (1,)])
def test_host_devices_refuse_nccl_whatever_the_route(dests):
    e = Engine(NumpyBackend(2))
    with pytest.raises(InvalidArgument) as err:
        e.batch_reduce(SUM, [(_value((0, 1), 5), dests)], algorithm=planner.NCCL)
    assert str(err.value) == (
        "algorithm: ALGORITHM_NCCL cannot run on this daemon: NCCL runs on GPUs, but the numpy backend's devices "
        "are host memory; ALGORITHM_HIERARCHICAL_COPY reduces on any devices")
