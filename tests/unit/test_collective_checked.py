"""Collectives whose processes' request shapes passed the checks together before skip them (reduce_together
with Contribution.shape): the same results, and a failed or new combination is checked every time."""

from __future__ import annotations

import numpy as np
import pytest
from xreduced import collective
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.collective import Contribution, reduce_together
from xreduced.deadline import Deadline
from xreduced.engine import Engine, Value
from xreduced.errors import InvalidArgument


def share(pid: int, dtype=np.float32, shape: bytes | None = b"float32[3]", op: str = "SUM") -> Contribution:
    value = Value((pid,), (np.arange(3, dtype=dtype) * (pid + 1),), "pairs[0].value")
    return Contribution("BatchReduce", op, 1, "hierarchical_copy", None, ((value, (pid,)),), out=(None,),
                        shape=None if shape is None else shape + b"@%d" % pid)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = collective.check_shares
    monkeypatch.setattr(collective, "check_shares", lambda *a: (calls.append(a), real(*a))[1])
    return calls


def results(out) -> dict:
    return {pid: [(r.devices, [a.tolist() for a in r.arrays], r.route) for r in rs] for pid, rs in out.items()}


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_a_joint_shape_seen_before_skips_the_checks_with_the_same_results(counted, op):
    engine = Engine(NumpyBackend(3))
    unshaped = results(reduce_together(engine, {p: share(p, shape=None, op=op) for p in range(3)}, "c", Deadline(9)))
    first = results(reduce_together(engine, {p: share(p, op=op) for p in range(3)}, "c", Deadline(9)))
    again = results(reduce_together(engine, {p: share(p, op=op) for p in range(3)}, "c", Deadline(9)))
    assert unshaped == first == again
    assert first[0][0][1][0] == ([0.0, 6.0, 12.0] if op == "SUM" else [0.0, 2.0, 4.0])
    assert len(counted) == 2  # the shapeless collective and the first shaped one; not the second


def test_a_joint_that_failed_is_checked_again(counted):
    engine = Engine(NumpyBackend(2))
    shares = {0: share(0), 1: share(1, dtype=np.float64, shape=b"float64[3]")}
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="process 1 sent float64\\[3\\] but process 0 sent float32\\[3\\]"):
            reduce_together(engine, shares, "c", Deadline(9))
    assert len(counted) == 2


def test_joints_are_remembered_per_engine_and_per_combination(counted):
    a, b = Engine(NumpyBackend(2)), Engine(NumpyBackend(2))
    for engine in (a, b, a):
        reduce_together(engine, {p: share(p) for p in range(2)}, "c", Deadline(9))
    reduce_together(a, {0: share(0), 1: share(1, shape=b"other")}, "c", Deadline(9))
    assert len(counted) == 3  # a's first, b's first, a's other combination


def test_an_engine_told_a_batch_is_checked_still_checks_one_with_out():
    engine = Engine(NumpyBackend(2))
    value = Value((0, 1), (np.ones(2, np.float32), np.ones(2, np.float32)))
    with pytest.raises(InvalidArgument, match="out\\[0\\]"):
        engine.batch_reduce("SUM", [(value, ())], out=[{1: np.empty(2, np.float64)}], checked=True)
