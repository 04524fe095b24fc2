"""Repeated calls against real daemons: a request sent again over the local lane, byte for byte, its tensors in
shared memory, is served as a kept repeat (xreduced.repeated) with the regions' new bytes; a region that changed
sends it back to the full path, which answers as it always has. The SDK's prepared batches (xreduce._prepared)
make such calls, and give the numbers of batch_reduce."""

from __future__ import annotations

import contextlib
import gc
import time

import ml_dtypes
import numpy as np
import pytest
import xreduce
from test_express import metrics
from test_local_lane import call, connect, session
from xreduce import distribute
from xreduce._prepared import MAX_SLOTS, PreparedBatch, Spec
from xreduce._segments import Segment
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec

SESSION = "x-xreduce-session"


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                               "--metrics-listen", "127.0.0.1:0")


def repeat_calls(daemon) -> float:
    return metrics(daemon)[("xreduce_local_lane_repeat_calls_total", ())]


class Regions:
    """A session with an input and an output segment registered under the names ``in`` and ``out``, and a raw
    lane connection."""

    def __init__(self, first, stub, n: int, replicas: int = 2):
        self.first, self.stub, self.n, self.replicas = first, stub, n, replicas
        self.metadata = ((SESSION, first.session_id),)
        self.inp, self.out = Segment(replicas * 64 + n * 8 * replicas, "xrt"), Segment(replicas * (n * 8 + 64), "xrt")
        self.register("in", self.inp)
        self.register("out", self.out)
        self.sock, hello = connect(first.local_lane, first.session_id)
        assert hello[0] == 0

    def register(self, name: str, seg: Segment) -> None:
        self.stub.RegisterRegion(pb.RegisterRegionRequest(name=name, shm_key=seg.name, byte_size=seg.size),
                                 metadata=self.metadata, timeout=10)

    def unregister(self, name: str) -> None:
        self.stub.UnregisterRegion(pb.UnregisterRegionRequest(name=name), metadata=self.metadata, timeout=10)

    def request(self, op=pb.REDUCE_OP_SUM) -> pb.ReduceRequest:
        stride = -(-self.n * 4 // 64) * 64
        components = [pb.Component(device=f"CPU:{i}", tensor=pb.Tensor(
            dtype=codec.dtype_enum(np.dtype(np.float32)), shape=[self.n],
            region=pb.RegionSlice(name="in", offset=i * stride, byte_size=self.n * 4))) for i in range(self.replicas)]
        return pb.ReduceRequest(reduce_op=op, value=pb.DistributedValue(components=components),
                                destinations=[f"CPU:{i}" for i in range(self.replicas)],
                                output=pb.RegionSlice(name="out", offset=0, byte_size=self.out.size))

    def write(self, arrays) -> None:
        stride = -(-self.n * 4 // 64) * 64
        for i, a in enumerate(arrays):
            self.inp.base[i * stride:i * stride + a.nbytes].view(np.float32)[:] = a

    def reduce(self, request) -> tuple[int, bytes, list[np.ndarray]]:
        code, _, body = call(self.sock, "Reduce", request)
        if code:
            return code, body, []
        result = pb.ReduceResponse.FromString(body).result
        out = []
        for c in result.components:
            r = c.tensor.region
            out.append(self.out.base[r.offset:r.offset + r.byte_size].view(np.float32).copy())
        return code, body, out

    def close(self) -> None:
        self.sock.close()
        self.inp.unlink()
        self.out.unlink()


@contextlib.contextmanager
def opened(daemon, n: int):
    """A session with its :class:`Regions` of ``n`` floats a replica, and their request."""
    with session(daemon.address) as (first, stub):
        regions = Regions(first, stub, n)
        try:
            yield regions, regions.request()
        finally:
            regions.close()


def test_a_request_sent_again_is_a_repeat_that_reduces_the_regions_new_bytes(daemon):
    rng = np.random.default_rng(1)
    with opened(daemon, 1000) as (regions, request):
        before = repeat_calls(daemon)
        replies = set()
        for _ in range(5):
            a, b = rng.standard_normal((2, 1000), dtype=np.float32)
            regions.write([a, b])
            code, body, out = regions.reduce(request)
            assert code == 0
            replies.add(body)
            for o in out:
                np.testing.assert_array_equal(o, a + b)
        assert repeat_calls(daemon) - before == 4  # the first took the full path
        assert len(replies) == 1  # a repeat's reply is the full path's, byte for byte


@pytest.mark.parametrize("n", [1 << 19, (1 << 20) + 1024], ids=["lane-thread", "worker"])
def test_a_repeat_of_more_than_the_full_path_s_inline_bytes_is_served_too(daemon, n):
    """8 MiB of regions (2 replicas x 2 MiB in, 2 x 2 MiB out): over the full path's 4 MiB, within a repeat's
    16 MiB (the lane's thread); a little over 16 MiB: a worker."""
    rng = np.random.default_rng(2)
    with opened(daemon, n) as (regions, request):
        before = repeat_calls(daemon)
        for _ in range(3):
            a, b = rng.standard_normal((2, n), dtype=np.float32)
            regions.write([a, b])
            code, _, out = regions.reduce(request)
            assert code == 0 and all(np.array_equal(o, a + b) for o in out)
        assert repeat_calls(daemon) - before == 2


def test_a_region_unregistered_or_registered_again_sends_the_repeat_back_to_the_full_path(daemon):
    with opened(daemon, 64) as (regions, request):
        regions.write([np.full(64, 1, np.float32), np.full(64, 2, np.float32)])
        assert regions.reduce(request)[0] == 0
        assert regions.reduce(request)[0] == 0  # now kept
        regions.unregister("in")
        code, body, _ = regions.reduce(request)
        assert code == 5 and b"no region 'in'" in body  # NOT_FOUND, from the full path
        # Registered again under the same name: another object, other bytes.
        other = Segment(regions.inp.size, "xrt")
        try:
            stride = 256
            other.base[:256].view(np.float32)[:] = 10
            other.base[stride:stride + 256].view(np.float32)[:] = 20
            regions.register("in", other)
            before = repeat_calls(daemon)
            code, _, out = regions.reduce(request)
            assert code == 0 and out[0].tolist() == [30.0] * 64
            assert repeat_calls(daemon) == before  # the kept repeat named the old region: full path
            assert regions.reduce(request)[2][1].tolist() == [30.0] * 64
            assert repeat_calls(daemon) == before + 1  # kept again, for the new region
        finally:
            other.unlink()


def test_a_region_that_shrank_is_refused_not_read(daemon):
    with opened(daemon, 4096) as (regions, request):
        regions.write([np.ones(4096, np.float32)] * 2)
        assert regions.reduce(request)[0] == 0
        assert regions.reduce(request)[0] == 0
        with open(f"/dev/shm/{regions.inp.name}", "r+b") as f:
            f.truncate(64)
        code, body, _ = regions.reduce(request)
        assert code == 3 and b"shrank" in body  # INVALID_ARGUMENT


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int64"])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_a_prepared_batch_gives_batch_reduce_s_numbers(daemon, dtype, op, replicas):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(replicas)
    devices = tuple(f"CPU:{i}" for i in range(replicas))
    shapes = [(3, 5), (1000,), (7,)]
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    prepared = PreparedBatch(ops, op, [Spec(devices, devices, dt, s) for s in shapes])
    try:
        for _ in range(3):
            arrays = [(rng.standard_normal(s) * 100).astype(dt) for s in shapes for _ in devices]
            got = [r.copy() for r in prepared(arrays)]
            it = iter(arrays)
            pairs = [(distribute.PerReplica([next(it) for _ in devices], devices=list(devices)), list(devices))
                     for _ in shapes]
            want = ops.batch_reduce(op, pairs)
            for g, w in zip(got, want):
                w = w.values[0]
                assert g.dtype == w.dtype and g.shape == w.shape
                assert g.tobytes() == w.tobytes()
        assert prepared.fast_calls == 3
    finally:
        prepared.close()


def test_a_prepared_batch_s_results_stay_as_they_are_while_they_are_held(daemon):
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    spec = Spec(("CPU:0", "CPU:1"), ("CPU:0", "CPU:1"), np.dtype(np.float32), (100,))
    prepared = PreparedBatch(ops, "SUM", [spec])
    try:
        held = []
        for k in range(MAX_SLOTS + 2):
            (result,) = prepared([np.full(100, k, np.float32), np.full(100, 1, np.float32)])
            held.append(result)
        # Each output segment is reused only once its results are gone: with all of them held, the calls past
        # MAX_SLOTS took batch_reduce; every result is still its own.
        assert [r[0] for r in held] == [k + 1 for k in range(MAX_SLOTS + 2)]
        assert prepared.fast_calls == MAX_SLOTS
        del held, result
        gc.collect()
        for k in range(4):
            (result,) = prepared([np.full(100, k, np.float32), np.full(100, 2, np.float32)])
            assert result[0] == k + 2
        assert prepared.fast_calls == MAX_SLOTS + 4
    finally:
        prepared.close()


def test_a_prepared_batch_takes_batch_reduce_on_the_wire(daemon):
    spec = Spec(("CPU:0", "CPU:1"), ("CPU:0",), np.dtype(np.float64), (4,))
    wire = PreparedBatch(distribute.HierarchicalCopyAllReduce(address=daemon.address, transport="wire"), "MEAN",
                         [spec])
    assert wire([np.arange(4.0), np.arange(4.0) + 2])[0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert wire.fast_calls == 0


def test_a_prepared_batch_prepares_again_after_its_daemon_restarts(start_daemon, tmp_path):
    path = tmp_path / "d.sock"
    args = ("--listen", f"unix:{path}", "--backend", "numpy", "--virtual-devices", "2")
    daemon = start_daemon(*args)
    ops = distribute.HierarchicalCopyAllReduce(address=daemon.address)
    prepared = PreparedBatch(ops, "SUM", [Spec(("CPU:0", "CPU:1"), ("CPU:0", "CPU:1"), np.dtype(np.float32), (8,))])
    try:
        ones = [np.ones(8, np.float32)] * 2
        assert prepared(ones)[0].tolist() == [2.0] * 8
        daemon.terminate()
        with pytest.raises(xreduce.XReduceError):
            prepared(ones)
        start_daemon(*args)
        deadline = time.monotonic() + 30
        while True:  # gRPC waits out its reconnect backoff after the failure above before it connects again
            try:
                prepared(ones)
                break
            except xreduce.UnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        fast = prepared.fast_calls
        for _ in range(3):
            assert prepared(ones)[0].tolist() == [2.0] * 8
        assert prepared.fast_calls == fast + 3
    finally:
        prepared.close()


def test_a_prepared_batch_refuses_arrays_that_do_not_fit_its_specs(daemon):
    spec = Spec(("CPU:0", "CPU:1"), ("CPU:0", "CPU:1"), np.dtype(np.float32), (4,))
    prepared = PreparedBatch(distribute.HierarchicalCopyAllReduce(address=daemon.address), "SUM", [spec])
    with pytest.raises(ValueError, match=r"arrays: 2 \(one per replica of each pair\) expected; got 1"):
        prepared([np.ones(4, np.float32)])
    with pytest.raises(ValueError, match=r"arrays\[1\]: float32\[4\] expected \(pair 0\); got float64\[4\]"):
        prepared([np.ones(4, np.float32), np.ones(4)])
    with pytest.raises(ValueError, match="needs at least one pair"):
        PreparedBatch(distribute.HierarchicalCopyAllReduce(address=daemon.address), "SUM", [])
