"""The SDK's front without a daemon: constructing needs none, and bad arguments fail before any call.

What reaches a daemon is in tests/integration/test_sdk.py.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import xreduce
from xreduce.distribute import (
    HierarchicalCopyAllReduce,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_constructing_needs_no_daemon():
    dead = f"127.0.0.1:{_free_port()}"
    HierarchicalCopyAllReduce(num_packs=3, address=dead)
    ReductionToOneDevice(reduce_to_device="gpu:0", address=dead)
    MirroredStrategy(devices=["gpu:0", "gpu:1"], address=dead)
    PerReplica([np.zeros(1), np.zeros(1)], devices=["CPU:0", "CPU:1"])
    xreduce.Client(dead)


def test_reduce_op_strings_any_case_and_bad_ones():
    assert ReduceOp.from_value("Sum") is ReduceOp.SUM
    assert ReduceOp.from_value(ReduceOp.MEAN) is ReduceOp.MEAN
    for bad in ("bogus", None, 1):
        with pytest.raises(ValueError, match=r"`reduce_op` must be Reduce.SUM or Reduce.MEAN; got"):
            ReduceOp.from_value(bad)


def test_per_replica_validation():
    with pytest.raises(ValueError, match="at least one value"):
        PerReplica([])
    with pytest.raises(ValueError, match="2 values but devices="):
        PerReplica([1.0, 2.0], devices=["CPU:0"])
    with pytest.raises(ValueError, match="Unknown attribute 'nope'"):
        PerReplica([1.0], devices=["nope"])
    with pytest.raises(ValueError, match=r"each device may hold one value; got devices=\['CPU:0', '/cpu:0'\]"):
        PerReplica([1.0, 2.0], devices=["CPU:0", "/cpu:0"])


def test_mirrored_strategy_validates_devices():
    with pytest.raises(ValueError, match="non-empty list"):
        MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="twice"):
        MirroredStrategy(devices=["gpu:0", "/device:GPU:0"])
    s = MirroredStrategy(devices=["gpu:0", "/gpu:1"], address="127.0.0.1:1")
    assert s.extended.worker_devices == (xreduce.canonical("GPU:0"), xreduce.canonical("GPU:1"))
    assert s.num_replicas_in_sync == 2


def test_cupy_arrays_carry_their_device():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the gpu extra); needs a GPU")
    from xreduce._arrays import to_host

    host = to_host(cupy.arange(3))
    assert host.device == "GPU:0"
    assert isinstance(host.restore(host.array), cupy.ndarray)
