"""Reduces in chunks and ``out=``, in one process against a real daemon (8 host devices).

``XREDUCE_CHUNK_BYTES`` makes small tensors go in chunks here, so that every
algorithm, op, dtype and batch shape is compared bit for bit with the same call
sent whole. ``out=`` is checked in place, into other arrays, into
:func:`xreduce.shared_array` arrays (which the daemon writes itself, in place
over its own input too), and against bad arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
import xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, Mirrored, PerReplica, ReductionToOneDevice

DEVICES = [f"CPU:{i}" for i in range(4)]
SHAPES = [(300, 7), (5,), (1000,), (777,)]


def ops_of(kind: str, address: str):
    if kind == "hc0":
        return HierarchicalCopyAllReduce(num_packs=0, address=address)
    if kind == "hc2":
        return HierarchicalCopyAllReduce(num_packs=2, address=address)
    return ReductionToOneDevice(address=address)


def values(dtype, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(s) * 100).astype(dtype) for _ in DEVICES] for s in SHAPES]


def first(result) -> np.ndarray:
    return np.asarray(result.values[0] if isinstance(result, Mirrored) else result)


@pytest.mark.parametrize("kind", ["hc0", "hc2", "r1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32])
def test_chunked_results_are_bit_identical_to_the_whole_call(daemon, monkeypatch, kind, dtype):
    ops = ops_of(kind, daemon.address)
    arrays = values(dtype, 7)
    pairs = [(PerReplica(v, devices=DEVICES), PerReplica(v, devices=DEVICES)) for v in arrays]
    whole = {op: [first(r).copy() for r in ops.batch_reduce(op, pairs)] for op in ("sum", "mean")}
    single = first(ops.reduce("mean", pairs[0][0], "CPU:3")).copy()
    monkeypatch.setenv("XREDUCE_CHUNK_BYTES", "4096")  # 1 KiB a replica a chunk: every pair is cut
    for op in ("sum", "mean"):
        for want, got in zip(whole[op], ops.batch_reduce(op, pairs)):
            got = first(got)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
    got = first(ops.reduce("mean", pairs[0][0], "CPU:3"))
    assert got.tobytes() == single.tobytes()


def test_a_packed_batch_of_mixed_dtypes_is_refused_as_when_whole(daemon, monkeypatch):
    monkeypatch.setenv("XREDUCE_CHUNK_BYTES", "4096")
    a = PerReplica([np.ones(5000, np.float32)] * 2, devices=DEVICES[:2])
    b = PerReplica([np.ones(5000, np.float64)] * 2, devices=DEVICES[:2])
    with pytest.raises(xreduce.InvalidArgumentError, match="every value must share one dtype"):
        HierarchicalCopyAllReduce(num_packs=1, address=daemon.address).batch_reduce("sum", [(a, a), (b, b)])


@pytest.mark.parametrize("chunk", [None, "4096"])
def test_out_in_place_and_into_other_arrays(daemon, monkeypatch, chunk):
    if chunk:
        monkeypatch.setenv("XREDUCE_CHUNK_BYTES", chunk)
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    xs = [np.arange(10_000, dtype=np.float32) * (i + 1) for i in range(2)]
    want = xs[0] + xs[1]
    v = PerReplica(xs, devices=DEVICES[:2])
    r = ops.reduce("sum", v, v, out=xs)
    assert r.values[0] is xs[0] and r.values[1] is xs[1]
    assert np.array_equal(xs[0], want) and np.array_equal(xs[1], want)
    ints = PerReplica([np.arange(9000, dtype=np.int32), np.arange(9000, dtype=np.int32) + 1], devices=DEVICES[:2])
    into = np.full(9000, -1.0)
    (got, _) = ops.batch_reduce("mean", [(ints, "CPU:0"), (ints, "CPU:1")], out=[into, None])
    assert got is into and np.array_equal(into, np.arange(9000) + 0.5)


@pytest.mark.parametrize("chunk", [None, "4096"])
def test_out_in_a_shared_array_is_written_by_the_daemon_even_over_its_input(daemon, monkeypatch, chunk):
    """A reduction to one device sums into its destination in device order: with ``out`` over the last
    device's own input, the daemon must read every input before it writes (its alias guard)."""
    if chunk:
        monkeypatch.setenv("XREDUCE_CHUNK_BYTES", chunk)
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(20_000).astype(np.float32) for _ in DEVICES]
    want = first(ReductionToOneDevice(address=daemon.address).reduce(
        "sum", PerReplica(data, devices=DEVICES), "CPU:3")).copy()
    shared = []
    for d in data:
        s = xreduce.shared_array(d.shape, d.dtype)
        s[...] = d
        shared.append(s)
    got = ReductionToOneDevice(address=daemon.address).reduce("sum", PerReplica(shared, devices=DEVICES), "CPU:3",
                                                              out=shared[3])
    assert got is shared[3]
    assert shared[3].tobytes() == want.tobytes()
    assert shared[0].tobytes() == data[0].tobytes()  # the other inputs are untouched


@pytest.mark.parametrize("out, message", [
    (np.zeros(3, np.float32), r"out must have the result's shape \(4,\); got shape \(3,\)"),
    (np.zeros(4, np.float64), r"out must have the result's dtype float32; got dtype float64"),
    (np.zeros(8, np.float32)[::2], r"out must be C-contiguous"),
    ([1.0, 2.0, 3.0, 4.0], r"out must be a numpy array; got a list of 4"),
])
def test_bad_out_is_refused_naming_it(daemon, out, message):
    v = PerReplica([np.ones(4, np.float32)] * 2, devices=DEVICES[:2])
    with pytest.raises(ValueError, match=message):
        HierarchicalCopyAllReduce(address=daemon.address).reduce("sum", v, "CPU:0", out=out)


def test_bad_out_lists_are_refused_naming_them(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([np.ones(4, np.float32)] * 2, devices=DEVICES[:2])
    with pytest.raises(ValueError, match=r"out must be a list of 2 arrays, one per destination device"):
        ops.reduce("sum", v, v, out=np.zeros(4, np.float32))
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\[1\]\[0\] must be writable"):
        ops.batch_reduce("sum", [(v, "CPU:0"), (v, v)], out=[None, [ro, np.zeros(4, np.float32)]])
    with pytest.raises(ValueError, match=r"out must be a list with one entry .* per pair, 2"):
        ops.batch_reduce("sum", [(v, "CPU:0"), (v, v)], out=[None])


def test_a_deadline_spans_every_chunk(daemon, monkeypatch):
    monkeypatch.setenv("XREDUCE_CHUNK_BYTES", "4096")
    v = PerReplica([np.ones(4 << 20, np.float32)] * 2, devices=DEVICES[:2])
    options = xreduce.distribute.CommunicationOptions(timeout_seconds=0.05)
    with pytest.raises(xreduce.DeadlineExceededError):
        HierarchicalCopyAllReduce(address=daemon.address).reduce("sum", v, v, options=options)


@pytest.mark.parametrize("chunk", [None, "4096"])
def test_out_that_overlaps_a_value_without_being_it_is_refused(daemon, monkeypatch, chunk):
    """Written chunk by chunk, such an ``out`` would overwrite values not yet read: refused before anything."""
    if chunk:
        monkeypatch.setenv("XREDUCE_CHUNK_BYTES", chunk)
    n = 200_000
    base = np.arange(n + 16, dtype=np.float32)
    v = PerReplica([base[:n], np.ones(n, np.float32)], devices=DEVICES[:2])
    with pytest.raises(ValueError, match=r"out overlaps one of the values without being it"):
        HierarchicalCopyAllReduce(address=daemon.address).reduce("sum", v, "CPU:0", out=base[16:])
    assert np.array_equal(base, np.arange(n + 16, dtype=np.float32))
