"""Replica threads, contexts and the default strategy, without a daemon (issue 13).

TF's expected behaviour comes from its sources, read by hand (TensorFlow does not install here):
``mirrored_run.py`` (``_call_for_each_replica``), ``distribute_lib.py`` (the default strategy and
contexts), ``distribute_utils.py`` (``regroup``, ``select_replica``) and ``strategy_test_lib.py``.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
import xreduce
from xreduce import distribute
from xreduce._gather import place, placements
from xreduce._nccl import nccl_refusal
from xreduce._replicas import Meeting, Merge, flatten, pack_as, regroup, select_replica
from xreduce.distribute import PerReplica, experimental
from xreduce.v1 import xreduce_pb2 as pb

DEVICES = ["CPU:0", "CPU:1"]
Point = collections.namedtuple("Point", "x y")


class _TestException(Exception):
    """strategy_test_lib's _TestException."""


def _tuple_regroup(parts, always_wrap):
    return regroup(parts, DEVICES, always_wrap)


def _run(meeting: Meeting, fn, n: int = 2):
    return meeting.run([lambda i=i: fn(i) for i in range(n)], _tuple_regroup, select_replica)


# --- regroup and select (distribute_utils) ---------------------------------------------------------------------


def test_regroup_wraps_leaves_and_keeps_one_object_shared_by_every_replica():
    out = regroup([{"a": 1, "b": Point(2, "s")}, {"a": 3, "b": Point(4, "s")}], DEVICES)
    assert out["a"].values == (1, 3) and isinstance(out["b"], Point)
    assert out["b"].x.values == (2, 4) and out["b"].y == "s"
    assert regroup([None, None], DEVICES) is None
    assert regroup(["s", "s"], DEVICES, always_wrap=True).values == ("s", "s")
    assert regroup([7], DEVICES[:1]) == 7


def test_regroup_error_names_the_replica():
    # TF's testRunRegroupError: lists of different lengths on different replicas (TF asserts).
    with pytest.raises(ValueError, match=r"replica 1 gave a list of 1 but replica 0 gave a list of 0"):
        regroup([[], [0]], DEVICES)


def test_select_replica_follows_nests_and_namedtuples():
    value = {"p": Point(PerReplica([1, 2]), 5), "l": [PerReplica([3, 4])]}
    assert select_replica(1, value) == {"p": Point(2, 5), "l": [4]}


def test_flatten_and_pack_as_round_trip():
    structure = {"b": [1, Point(2, 3)], "a": (4,)}
    leaves = flatten(structure)
    assert leaves == [4, 1, 2, 3]
    assert pack_as(structure, [x * 10 for x in leaves]) == {"b": [10, Point(20, 30)], "a": (40,)}


# --- the meeting (mirrored_run) -----------------------------------------------------------------------------------


def test_merge_runs_once_on_regrouped_arguments_and_each_replica_gets_its_part():
    calls = []

    def merge_fn(value, scale=None):
        calls.append(value.values)
        return PerReplica([v * scale for v in value.values])

    meeting = Meeting(2, 30.0)
    out = _run(meeting, lambda i: meeting.merge_call(i, Merge("merge_call", merge_fn, (i + 1,), {"scale": 10})))
    assert out == [10, 20] and calls == [(1, 2)]


def test_exceptions_in_a_replica_or_in_the_merge_fail_the_run():
    # strategy_test_lib's _test_call_and_merge_exceptions: _raise_exception_fn and _merge_raises_fn.
    def raises(i):
        raise _TestException()

    with pytest.raises(_TestException):
        _run(Meeting(2, 30.0), raises)

    def merge_raises(i, meeting):
        meeting.merge_call(i, Merge("merge_call", raises, (0,), {}))

    meeting = Meeting(2, 30.0)
    with pytest.raises(_TestException):
        _run(meeting, lambda i: merge_raises(i, meeting))


def test_an_exception_releases_a_replica_waiting_in_a_merge():
    meeting = Meeting(2, 600.0)
    released = threading.Event()

    def fn(i):
        if i == 1:
            raise _TestException("replica 1")
        try:
            meeting.merge_call(i, Merge("all_reduce", lambda v: v, (i,), {}))
        finally:
            released.set()

    with pytest.raises(_TestException, match="replica 1"):
        _run(meeting, fn)
    assert released.wait(30)


def test_a_replica_that_skips_a_collective_is_an_error():
    # mirrored_run: "Some replicas made a different number of replica_context().merge_call() calls."
    meeting = Meeting(2, 600.0)

    def fn(i):
        if i == 0:
            meeting.merge_call(i, Merge("all_reduce", lambda v: v, (i,), {}))

    with pytest.raises(RuntimeError, match=r"different number of replica_context\(\).merge_call\(\) calls: "
                                           r"replica 1 returned while replica 0 waited in all_reduce"):
        _run(meeting, fn)


def test_replicas_in_different_collectives_is_an_error():
    meeting = Meeting(2, 600.0, first_id=4)
    names = ["all_reduce", "all_gather"]
    with pytest.raises(RuntimeError, match="replica 4 all_reduce, replica 5 all_gather"):
        _run(meeting, lambda i: meeting.merge_call(i, Merge(names[i], lambda v: v, (i,), {})))


def test_a_replica_that_does_not_arrive_ends_the_wait_within_the_timeout():
    meeting = Meeting(2, 0.5)
    release = threading.Event()

    def fn(i):
        if i == 1:
            release.wait(60)  # busy elsewhere: never reaches the collective in time
            return
        meeting.merge_call(i, Merge("all_reduce", lambda v: v, (i,), {}))

    try:
        with pytest.raises(xreduce.DeadlineExceededError, match="replica 1 did not reach all_reduce within 0.5 s "
                                                                "while replica 0 waited there"):
            _run(meeting, fn)
    finally:
        release.set()


# --- contexts and the default strategy (distribute_lib) -----------------------------------------------------------


def test_outside_any_strategy_the_default_strategy_and_replica_context():
    strategy = distribute.get_strategy()
    ctx = distribute.get_replica_context()
    assert not distribute.has_strategy() and not distribute.in_cross_replica_context()
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.strategy) == (0, 1, strategy)
    with strategy.scope():
        assert distribute.get_replica_context() is None and distribute.in_cross_replica_context()
        assert not distribute.has_strategy()


def test_default_strategy_runs_in_replica_zero_and_communicates_nothing():
    strategy = distribute.get_strategy()
    x = np.array([1.0, 2.0])

    def fn(v):
        ctx = distribute.get_replica_context()
        merged = ctx.merge_call(lambda s, a: (s is strategy, distribute.in_cross_replica_context(), a), args=(v,))
        return ctx.all_reduce("sum", {"v": v}), ctx.all_gather(v, axis=0), merged

    reduced, gathered, merged = strategy.run(fn, args=(x,))
    assert reduced["v"] is x and gathered is x
    assert merged[:2] == (True, True) and merged[2] is x
    assert strategy.experimental_local_results(x) == (x,)
    assert strategy.reduce("mean", x, axis=0) == 1.5 and strategy.reduce("sum", x) is x
    assert strategy.extended.broadcast_to(x, "CPU:0") is x and strategy.gather(x, 0) is x
    assert strategy.experimental_distribute_values_from_function(lambda c: c.num_replicas_in_sync) == 1
    with pytest.raises(RuntimeError, match="worker_devices"):
        _ = strategy.extended.worker_devices


def test_merge_call_in_cross_replica_context_is_refused():
    ctx = distribute.get_replica_context()
    with distribute.get_strategy().scope(), pytest.raises(RuntimeError, match="must be called in the replica"):
        ctx.merge_call(lambda s: None)


# --- gather's arithmetic, names ------------------------------------------------------------------------------------


def test_placements_and_their_errors():
    assert placements([(2, 3), (1, 3), (0, 3)], 0) == ((3, 3), [0, 2, 3])
    assert placements([(2, 1), (2, 2)], 1) == ((2, 3), [0, 1])
    with pytest.raises(ValueError, match=r"axis must be in \[-1, 1\) for values of shape \(2,\); got axis=1"):
        placements([(2,), (2,)], 1)
    with pytest.raises(ValueError, match=r"replica 0: \(2, 3\), replica 1: \(2, 4\)"):
        placements([(2, 3), (2, 4)], 0)
    np.testing.assert_array_equal(place(np.array([[1, 2]]), (1, 4), 1, 2), [[0, 0, 1, 2]])


def test_experimental_names_are_tfs():
    assert [i.name for i in experimental.CommunicationImplementation] == ["AUTO", "RING", "NCCL"]
    assert experimental.CommunicationOptions is distribute.CommunicationOptions
    options = experimental.CommunicationOptions(implementation="ring")
    assert options.implementation is experimental.CommunicationImplementation.RING


def test_nccl_all_reduce_num_packs_as_tf():
    assert distribute.NcclAllReduce().num_packs == 1
    with pytest.raises(ValueError, match="NCCL all-reduce requires num_packs >= 0, but -2 is specified"):
        distribute.NcclAllReduce(num_packs=-2)


def _table(backend, *devices):
    return pb.ListDevicesResponse(backend=backend, devices=[
        pb.Device(name=xreduce.canonical(n), device_type=n.split(":")[0], physical_device=p) for n, p in devices])


def test_nccl_needs_gpus_each_of_its_own():
    gpus = [xreduce.canonical("GPU:0"), xreduce.canonical("GPU:1")]
    distinct = _table("cupy", ("GPU:0", "cuda:0 H200"), ("GPU:1", "cuda:1 H200"))
    assert nccl_refusal(distinct, gpus) is None
    shared = _table("cupy", ("GPU:0", "cuda:0 H200"), ("GPU:1", "cuda:0 H200"))
    assert nccl_refusal(shared, gpus) == (
        "NcclAllReduce needs one GPU per device: GPU:0 and GPU:1 are logical devices on one GPU (cuda:0 H200); NCCL "
        "runs one rank per GPU, use HierarchicalCopyAllReduce for logical devices")
    host = _table("numpy", ("CPU:0", "host"), ("CPU:1", "host"))
    assert nccl_refusal(host, [xreduce.canonical("CPU:0")]).startswith(
        "NcclAllReduce needs GPUs: CPU:0 is a host device (the daemon's backend is numpy)")
