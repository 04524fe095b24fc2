"""Replicas that meet, against a real daemon (issue 13): ``run`` in threads, ``ReplicaContext``
collectives, ``gather``, ``broadcast_to``, ``experimental_local_results``, ``NcclAllReduce``.

TensorFlow does not install here: the expected numbers come from TF's tests, read by hand
(``mirrored_strategy_test.py`` and ``strategy_test_lib.py``; each test names its TF original).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xreduce
from xreduce import distribute
from xreduce.distribute import (
    HierarchicalCopyAllReduce,
    Mirrored,
    MirroredStrategy,
    NcclAllReduce,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
)

TWO = ["CPU:0", "CPU:1"]


class _TestException(Exception):
    """strategy_test_lib's _TestException."""


@pytest.fixture
def two(daemon):
    """TF's mirrored_strategy_with_two_gpus, on two of the daemon's host devices."""
    return MirroredStrategy(devices=TWO, cross_device_ops=HierarchicalCopyAllReduce(address=daemon.address))


def _replica_id() -> int:
    return distribute.get_replica_context().replica_id_in_sync_group


def test_run_and_replica_id(two):
    # TwoDeviceDistributionTestBase._test_run and DistributionTestBase._test_replica_id.
    out1 = two.run(lambda: _replica_id() + 1)
    assert two.experimental_local_results(out1) == (1, 2)
    out2 = two.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert two.experimental_local_results(out2["a"]) == (2, 4)
    assert two.experimental_local_results(out2["b"]) == (1, 4)
    out3 = two.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert two.experimental_local_results(out3) == (6, 14)
    assert two.num_replicas_in_sync == 2  # testNumReplicasInSync


def test_replicas_run_in_threads_of_their_own_at_once(two):
    # Both replicas must be inside fn together: a barrier only they can pass.
    barrier = threading.Barrier(2, timeout=30)
    names = two.run(lambda: (barrier.wait(), threading.current_thread().name)[1])
    assert len(set(two.experimental_local_results(names))) == 2


@pytest.mark.parametrize("op, expected", [(ReduceOp.SUM, (4.0, [42.0, 43.0])), (ReduceOp.MEAN, (2.0, [21.0, 21.5]))])
def test_all_reduce_sum_and_mean(two, op, expected):
    # TwoDeviceDistributionTestBase._test_all_reduce_sum / _test_all_reduce_mean: inputs ([1, 3], [[39, 2], [3, 41]]).
    inputs = (PerReplica([np.float32(1.0), np.float32(3.0)], devices=TWO),
              PerReplica([np.array([39.0, 2.0], np.float32), np.array([3.0, 41.0], np.float32)], devices=TWO))

    def comm_fn(a, b):
        return distribute.get_replica_context().all_reduce(op, (a, b))

    outputs = two.run(comm_fn, args=inputs)
    for out, want in zip(outputs, expected):
        for local in two.experimental_local_results(out):
            np.testing.assert_array_equal(local, np.asarray(want, np.float32))


def test_all_reduce_of_nested_values_in_one_batch_across_eight_replicas(daemon):
    strategy = MirroredStrategy(cross_device_ops=ReductionToOneDevice(address=daemon.address))

    def fn():
        i = _replica_id()
        ctx = distribute.get_replica_context()
        grads = ctx.all_reduce("sum", {"w": np.full((2, 2), i, np.float64), "b": [np.int32(i)]})
        return grads, ctx.num_replicas_in_sync, ctx.strategy is strategy, distribute.has_strategy()

    grads, n, same, has = strategy.run(fn)
    assert (n, same, has) == (8, True, True)
    local = strategy.experimental_local_results
    for w, b in zip(local(grads["w"]), local(grads["b"][0])):
        np.testing.assert_array_equal(w, np.full((2, 2), 28.0))
        assert b == 28 and b.dtype == np.int32


def test_call_and_merge_exceptions(two):
    # DistributionTestBase._test_call_and_merge_exceptions: four ways, each raising _TestException.
    def raise_exception_fn(_=None):
        raise _TestException()

    def merge_raises_fn():
        distribute.get_replica_context().merge_call(raise_exception_fn)

    def call_raises_fn(dist):
        dist.run(raise_exception_fn)

    def merge_call_raises_fn():
        distribute.get_replica_context().merge_call(call_raises_fn)

    def call_merge_raises_fn(dist):
        dist.run(merge_raises_fn)

    def merge_call_merge_raises_fn():
        distribute.get_replica_context().merge_call(call_merge_raises_fn)

    with two.scope():
        for fn in (raise_exception_fn, merge_raises_fn, merge_call_raises_fn, merge_call_merge_raises_fn):
            with pytest.raises(_TestException):
                two.run(fn)
    # The strategy is usable afterwards.
    assert two.experimental_local_results(two.run(lambda: distribute.get_replica_context().all_reduce("sum", 1.0))) \
        == (np.float32(2.0), np.float32(2.0))


def test_merge_call_regroups_arguments_and_returns_each_replica_its_part(two):
    seen = []

    def merge_fn(strategy, value, *, offset):
        seen.append((strategy is two, distribute.in_cross_replica_context(), value.values, offset))
        return strategy.extended.reduce_to("sum", value, value), "shared"

    def fn():
        return distribute.get_replica_context().merge_call(merge_fn, args=(np.float64(_replica_id() + 1),),
                                                           kwargs={"offset": 5})

    total, tag = two.run(fn)
    assert seen == [(True, True, (1.0, 2.0), 5)]
    assert two.experimental_local_results(total) == (3.0, 3.0) and tag == "shared"


def test_an_exception_in_one_replica_releases_the_other_from_its_collective(two):
    def fn():
        if _replica_id() == 1:
            raise _TestException("replica 1 failed")
        return distribute.get_replica_context().all_reduce("sum", np.ones(2))

    with pytest.raises(_TestException, match="replica 1 failed"):
        two.run(fn)
    out = two.run(lambda: distribute.get_replica_context().all_reduce("sum", np.ones(2)))
    np.testing.assert_array_equal(two.experimental_local_results(out)[1], [2.0, 2.0])


def test_a_replica_that_skips_a_collective_fails_the_run(two):
    def fn():
        if _replica_id() == 0:
            return distribute.get_replica_context().all_reduce("sum", np.ones(2))
        return np.ones(2)

    with pytest.raises(RuntimeError, match="replica 1 returned while replica 0 waited in all_reduce"):
        two.run(fn)


def test_a_replica_late_to_a_collective_fails_within_the_daemons_collective_timeout(start_daemon):
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2",
                     "--collective-timeout", "1")
    strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce(address=d.address))
    release = threading.Event()

    def fn():
        if _replica_id() == 1:
            release.wait(60)  # elsewhere until the test ends
            return None
        return distribute.get_replica_context().all_reduce("sum", np.ones(2))

    try:
        with pytest.raises(xreduce.DeadlineExceededError, match="replica 1 did not reach all_reduce within 1 s"):
            strategy.run(fn)
    finally:
        release.set()


def test_all_gather_and_gather_with_sizes_that_differ(two):
    def fn():
        i = _replica_id()
        value = np.arange(2 * (i + 1), dtype=np.float32).reshape(i + 1, 2) + 10 * i
        return value, distribute.get_replica_context().all_gather({"v": value, "c": np.int64([i])}, axis=0)

    values, gathered = two.run(fn)
    expected = np.array([[0, 1], [10, 11], [12, 13]], np.float32)
    for local in two.experimental_local_results(gathered["v"]):
        np.testing.assert_array_equal(local, expected)
    np.testing.assert_array_equal(two.experimental_local_results(gathered["c"])[0], [0, 1])
    np.testing.assert_array_equal(two.gather(values, axis=0), expected)
    with pytest.raises(RuntimeError, match="requires cross-replica context"):
        two.run(lambda: two.gather(values, axis=0))


def test_gather_along_another_axis_keeps_torch_tensors_torch(two):
    torch = pytest.importorskip("torch")
    value = PerReplica([torch.ones(2, 1), torch.zeros(2, 2)], devices=TWO)
    out = two.gather(value, axis=1)
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"replica 0: \(2, 1\), replica 1: \(2, 2\)"):
        two.gather(value, axis=0)


def test_broadcast_to_and_local_results(two):
    out = two.extended.broadcast_to(np.arange(3), None)
    assert isinstance(out, Mirrored) and [v.tolist() for v in two.experimental_local_results(out)] == [[0, 1, 2]] * 2
    assert two.extended.broadcast_to(5, "CPU:1") == 5  # TF's fast path for Python numbers
    np.testing.assert_array_equal(two.extended.broadcast_to(np.ones(2), "CPU:1"), [1.0, 1.0])
    assert two.experimental_local_results("x") == ("x",)


def test_contexts_inside_and_outside_a_strategy(two):
    assert not distribute.has_strategy()
    with two.scope():
        assert distribute.get_strategy() is two and distribute.get_replica_context() is None
        assert distribute.in_cross_replica_context()
        inside = two.run(lambda: (distribute.get_strategy() is two, distribute.in_cross_replica_context()))
    assert inside == (True, False)
    assert distribute.get_replica_context().replica_id_in_sync_group == 0


def test_nccl_all_reduce_on_host_devices_says_why(daemon, two):
    # TF without GPUs fails an NCCL all-reduce; here before anything is sent, saying why.
    v = PerReplica([np.ones(2), np.ones(2)], devices=TWO)
    ops = NcclAllReduce(address=daemon.address)
    with pytest.raises(xreduce.InvalidArgumentError) as e:
        ops.reduce("sum", v, v)
    assert str(e.value) == ("NcclAllReduce needs GPUs: CPU:0, CPU:1 are host devices (the daemon's backend is "
                            "numpy); NCCL runs on GPUs only, use HierarchicalCopyAllReduce or ReductionToOneDevice")
    assert e.value.code.name == "INVALID_ARGUMENT"
    strategy = MirroredStrategy(devices=TWO, cross_device_ops=ops)
    with pytest.raises(xreduce.InvalidArgumentError, match="NcclAllReduce needs GPUs"):
        strategy.run(lambda: distribute.get_replica_context().all_reduce("sum", np.ones(2)))
