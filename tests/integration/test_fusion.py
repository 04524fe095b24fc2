"""Tensor fusion on the shared-memory path (``xreduce._fusion``) against a real daemon.

A fused batch must give each value the result it gets alone, bit for bit and in its own dtype and
shape, whether its arrays lie back to back in one shared segment (sent where they lie) or anywhere
(copied back to back); results are the caller's own arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
import xreduce
from xreduce import _fusion, _segments
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

DEVICES = ["CPU:0", "CPU:1", "CPU:2"]
# Small values of two dtypes around one larger than FUSE_UP_TO (sent alone), a zero-size one, an int one
# whose MEAN is float64.
SHAPES = [((3, 5), np.float32), ((7,), np.float32), ((_fusion.FUSE_UP_TO // 4 + 3,), np.float32), ((0, 4), np.float32),
          ((2, 2, 2), np.float64), ((9,), np.int32), ((1,), np.float32), ((64, 33), np.float32)]


def values(rng, shared: bool) -> list[list[np.ndarray]]:
    """Per device, one array per shape: views of one shared_array each (back to back), or plain arrays."""
    per_device = []
    for _ in DEVICES:
        arrays = [(rng.standard_normal(s) * 100).astype(dt) if dt != np.int32 else rng.integers(-50, 50, s, dt)
                  for s, dt in SHAPES]
        if shared:
            placed = []
            for dtype in {dt for _, dt in SHAPES}:  # one buffer per dtype: fused values of a dtype lie together
                mine = [a for a in arrays if a.dtype == dtype]
                flat = xreduce.shared_array((sum(a.size for a in mine),), dtype)
                at = 0
                for a in mine:
                    flat[at:at + a.size] = a.reshape(-1)
                    placed.append((a, flat[at:at + a.size].reshape(a.shape)))
                    at += a.size
            views = dict((id(a), v) for a, v in placed)
            arrays = [views[id(a)] for a in arrays]
        per_device.append(arrays)
    return per_device


@pytest.fixture(scope="module")
def address(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--virtual-devices", "3").address


@pytest.mark.parametrize("shared", [True, False], ids=["shared-views", "plain"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_fused_batch_equals_each_value_reduced_alone(address, shared, op):
    per_device = values(np.random.default_rng(7), shared)
    pairs = [(PerReplica(list(arrays), devices=DEVICES),) * 2 for arrays in zip(*per_device)]
    assert _fusion.groups([_pair(p) for p, _ in pairs]) == [(0, 1, 3, 6, 7), (2,), (4,), (5,)]
    ops = HierarchicalCopyAllReduce(num_packs=0, address=address, transport="shm")  # mixed dtypes: no packs
    try:
        batch = ops.batch_reduce(op, pairs)
        alone = [ops.reduce(op, value, value) for value, _ in pairs]
        for got, want in zip(batch, alone):
            assert got.devices == want.devices
            for g, w in zip(got.values, want.values):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(g, w, strict=True)
        # Each result is the caller's own array: writing one leaves the others alone.
        before = [v.copy() for r in batch for v in r.values]
        for v in batch[0].values:
            v[...] = 0
        after = [v for r in batch for v in r.values]
        assert all(np.array_equal(a, b) for a, b in zip(after[3:], before[3:]))
    finally:
        ops.close()


def test_fusion_off_sends_every_value_alone(monkeypatch):
    monkeypatch.setenv(_fusion.FUSION_VARIABLE, "0")
    pairs = [_pair(PerReplica([np.zeros(2, np.float32)] * 2, devices=DEVICES[:2])) for _ in range(3)]
    assert _fusion.groups(pairs) is None


def test_replicas_that_disagree_are_not_fused_and_the_daemon_names_them(address):
    good = PerReplica([np.ones(2, np.float32)] * 3, devices=DEVICES)
    bad = PerReplica([np.ones(2, np.float32), np.ones(3, np.float32), np.ones(2, np.float32)], devices=DEVICES)
    assert _fusion.groups([_pair(good), _pair(bad), _pair(good)]) == [(0, 2), (1,)]
    ops = HierarchicalCopyAllReduce(address=address, transport="shm")
    try:
        with pytest.raises(xreduce.InvalidArgumentError, match=r"pairs\[1\]"):
            ops.batch_reduce("sum", [(good, good), (bad, bad), (good, good)])
    finally:
        ops.close()


def _pair(value: PerReplica):
    from xreduce._call import Pair
    from xreduce.wire.devices import canonical

    devices = tuple(canonical(d) for d in DEVICES[:len(value.values)])
    return Pair(value, devices, devices)
