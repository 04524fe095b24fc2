"""TF's cross_device_ops_test cases for HierarchicalCopyAllReduce and
ReductionToOneDevice, ported to the SDK against a real daemon.

Ported from ``_testReductionAndBroadcast``: values ``float(d)`` on each device,
reduced with MEAN and SUM to the value's own devices (mirrored), to another
device (different) and to a device string, alone and in batches, and broadcast.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xreduce
from xreduce.distribute import (
    CommunicationOptions,
    HierarchicalCopyAllReduce,
    Mirrored,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
)

DEVICE_SETS = {1: ["CPU:0"], 2: ["CPU:0", "CPU:1"], 3: ["CPU:0", "CPU:1", "CPU:2"],
               4: ["CPU:0", "CPU:1", "CPU:2", "CPU:3"], 8: [f"CPU:{i}" for i in range(8)]}


def _fake_mirrored(value, destinations, like):
    """What TF expects back: ``value`` on every destination device."""
    if isinstance(destinations, str):
        names = [destinations]
    elif isinstance(destinations, (list, tuple)):
        names = list(destinations)
    else:
        names = list(destinations.devices)
    return [xreduce.canonical(n) for n in names], np.asarray(value, like.dtype)


def _assert_mirrored_equal(got, expected):
    names, value = expected
    if len(names) == 1:
        assert isinstance(got, np.ndarray)
        arrays = [got]
    else:
        assert isinstance(got, Mirrored)
        assert sorted(got.devices) == sorted(names)
        arrays = got.values
    for a in arrays:
        assert a.dtype == value.dtype
        np.testing.assert_array_equal(a, value)


def _ops(kind, address, num_packs):
    if kind == "hierarchical_copy":
        return HierarchicalCopyAllReduce(num_packs=num_packs, address=address)
    return ReductionToOneDevice(address=address)


CONFIGS = [("hierarchical_copy", n, k) for n in sorted(DEVICE_SETS) for k in range(4)] + [
    ("reduction_to_one_device", n, 0) for n in sorted(DEVICE_SETS)
]


@pytest.mark.parametrize("kind, n, num_packs", CONFIGS, ids=[f"{k}-n{n}-packs{p}" for k, n, p in CONFIGS])
def test_reduction_and_broadcast(daemon, kind, n, num_packs):
    ops = _ops(kind, daemon.address, num_packs)
    devices = DEVICE_SETS[n]
    values = [np.float32(d) for d in range(n)]
    per_replica = PerReplica(values, devices=devices)
    mean = (n - 1.0) / 2.0
    per_replica_2 = PerReplica([np.float32(d + 1.0) for d in range(n)], devices=devices)
    mean_2 = mean + 1.0
    like = np.float32(0)
    destination_mirrored = Mirrored([np.float32(1.0)] * n, devices=devices)
    destination_different = Mirrored([np.float32(1.0)], devices=["CPU:7"])
    destination_str = "/device:CPU:7"
    all_destinations = [destination_mirrored, destination_different, destination_str]

    for dest in all_destinations:
        _assert_mirrored_equal(ops.reduce(ReduceOp.MEAN, per_replica, dest), _fake_mirrored(mean, dest, like))
        _assert_mirrored_equal(ops.reduce(ReduceOp.MEAN, per_replica_2, dest), _fake_mirrored(mean_2, dest, like))
        _assert_mirrored_equal(ops.reduce(ReduceOp.SUM, per_replica, dest), _fake_mirrored(mean * n, dest, like))
        _assert_mirrored_equal(ops.reduce(ReduceOp.SUM, per_replica_2, dest),
                               _fake_mirrored(mean_2 * n, dest, like))

    for d1, d2 in itertools.product(all_destinations, all_destinations):
        got = ops.batch_reduce(ReduceOp.MEAN, [(per_replica, d1), (per_replica_2, d2)])
        _assert_mirrored_equal(got[0], _fake_mirrored(mean, d1, like))
        _assert_mirrored_equal(got[1], _fake_mirrored(mean_2, d2, like))
        got = ops.batch_reduce(ReduceOp.SUM, [(per_replica, d1), (per_replica_2, d2)])
        _assert_mirrored_equal(got[0], _fake_mirrored(mean * n, d1, like))
        _assert_mirrored_equal(got[1], _fake_mirrored(mean_2 * n, d2, like))

    for dest in all_destinations:
        _assert_mirrored_equal(ops.broadcast(np.float32(1.0), dest), _fake_mirrored(1.0, dest, like))
    ops.close()


@pytest.mark.parametrize("dtype, promoted", [
    (np.int8, np.float32), (np.int16, np.float32), (np.uint8, np.float32), (np.uint16, np.float32),
    (np.int32, np.float64), (np.int64, np.float64), (np.uint32, np.float64), (np.uint64, np.float64),
    (np.float16, np.float16), (np.float32, np.float32), (np.float64, np.float64),
])
def test_integer_mean_is_promoted(daemon, dtype, promoted):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([np.array([1, 2], dtype), np.array([2, 5], dtype), np.array([0, 0], dtype)],
                   devices=["CPU:0", "CPU:1", "CPU:2"])
    out = ops.reduce("mean", v, v)
    assert all(a.dtype == promoted for a in out.values)
    np.testing.assert_array_equal(out.values[2], np.array([1, 7 / 3], promoted))


@pytest.mark.parametrize("num_packs", [0, 1, 2, 3, 100])
def test_batch_reduce_packs_mixed_shapes(daemon, num_packs):
    """Packing flattens and splits the batch; results keep every shape and value."""
    rng = np.random.default_rng(num_packs)
    shapes = [(3, 4), (), (0,), (5,), (2, 0, 3), (7,)]
    devices = [f"CPU:{i}" for i in range(8)]
    values = [PerReplica([rng.standard_normal(s).astype(np.float32) for _ in devices], devices=devices)
              for s in shapes]
    ops = HierarchicalCopyAllReduce(num_packs=num_packs, address=daemon.address)
    out = ops.batch_reduce("sum", [(v, v) for v in values])
    for v, r in zip(values, out):
        x = [np.asarray(a) for a in v.values]
        want = ((x[0] + x[1]) + x[2] + x[3]) + (((x[4] + x[5]) + x[6]) + x[7])
        for a in r.values:
            assert a.shape == x[0].shape
            assert a.tobytes() == want.astype(np.float32).tobytes()


def test_reduce_to_one_device_honours_reduce_to_device(daemon):
    ops = ReductionToOneDevice(reduce_to_device="/cpu:5", address=daemon.address)
    v = PerReplica([np.array([1.0]), np.array([2.0])], devices=["CPU:0", "CPU:1"])
    out = ops.reduce("sum", v, ["CPU:2", "CPU:3"])
    assert list(out.devices) == [xreduce.canonical("CPU:2"), xreduce.canonical("CPU:3")]
    np.testing.assert_array_equal(out.values[0], [3.0])


def test_accumulation_fn_runs_client_side(daemon):
    ops = ReductionToOneDevice(accumulation_fn=lambda xs: np.maximum.reduce(xs), address=daemon.address)
    v = PerReplica([np.array([1.0, 9.0]), np.array([4.0, 2.0])], devices=["CPU:0", "CPU:1"])
    out = ops.reduce("mean", v, "CPU:3")
    np.testing.assert_array_equal(out, [2.0, 4.5])


def test_same_devices_in_another_order_all_reduce(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v1 = PerReplica([np.array([1.0]), np.array([2.0])], devices=["CPU:0", "CPU:1"])
    v2 = PerReplica([np.array([10.0]), np.array([20.0])], devices=["CPU:1", "CPU:0"])
    a, b = ops.batch_reduce("sum", [(v1, v1), (v2, v2)])
    assert list(b.devices) == list(a.devices) == [xreduce.canonical("CPU:0"), xreduce.canonical("CPU:1")]
    np.testing.assert_array_equal(b.values[0], [30.0])


def test_options_timeout_becomes_the_deadline(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([np.ones(4, np.float32)] * 2, devices=["CPU:0", "CPU:1"])
    out = ops.reduce("sum", v, v, options=CommunicationOptions(timeout_seconds=30))
    np.testing.assert_array_equal(out.values[0], np.full(4, 2.0, np.float32))
    with pytest.raises(ValueError, match="timeout_seconds"):
        CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="bytes_per_pack"):
        CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="implementation"):
        CommunicationOptions(implementation="bogus")
    assert CommunicationOptions(implementation="nccl").implementation.name == "NCCL"
