"""Which engine carries a node sum across nodes: NCCL for the dtypes it adds, in GPU memory, Gloo for the rest.

No GPU here: :class:`DeviceArray` stands for a CuPy array, :class:`GpuLike` for the cupy backend (the numpy
backend behind a wrapper, so the executor runs the generic way and writes results into device arrays through
the backend), and the two engines for a second node whose node sums are known (:func:`peer`): each adds the
peer's sum after this node's, ``node 0 + node 1``, as both NCCL and Gloo do with two nodes. What is checked:
which tensors go on which engine, one buffer per dtype in tensor order, the node sums never passing through
the host on their way to NCCL, MEAN dividing once by the global replica count, results written into the
callers' device arrays, and the numbers exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from xreduced import across, planner
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.collective import Contribution
from xreduced.deadline import Deadline
from xreduced.engine import MEAN, SUM, Engine, Value


class DeviceArray:
    """A stand-in for a CuPy array: device memory the test reads through ``host``."""

    def __init__(self, host: np.ndarray):
        self.host = host

    dtype = property(lambda self: self.host.dtype)
    shape = property(lambda self: self.host.shape)
    size = property(lambda self: self.host.size)
    nbytes = property(lambda self: self.host.nbytes)

    def reshape(self, *shape):
        return DeviceArray(self.host.reshape(*shape))


class GpuLike:
    """The numpy backend behind a wrapper, whose device arrays are :class:`DeviceArray`; counts reads of device
    memory back to the host."""

    name = "gpulike"
    cuda_ipc = False

    def __init__(self, n: int):
        self._host = NumpyBackend(n)
        self.device_reads = 0

    def __getattr__(self, name):
        return getattr(self._host, name)

    def is_device_array(self, array) -> bool:
        return isinstance(array, DeviceArray)

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, DeviceArray):
            self.device_reads += 1
            return array.host.copy()
        return np.asarray(array)

    def upload(self, device: int, array):
        return self._host.upload(device, array.host if isinstance(array, DeviceArray) else array)

    def write(self, dst, buf) -> None:
        src = np.asarray(buf.host if isinstance(buf, DeviceArray) else buf)
        target = dst.host if isinstance(dst, DeviceArray) else dst
        np.copyto(target, src.reshape(target.shape))


def peer(dtype, size: int) -> np.ndarray:
    """The other node's node sum, flat, as its engine would bring it."""
    return (np.arange(size) % 7 - 3).astype(dtype)


class FakeNccl:
    """The device engine for two nodes: adds :func:`peer` after this node's buffer, in place."""

    name = "nccl"

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def adds(self, dtype) -> bool:
        return np.dtype(dtype).name in ("float16", "float32", "float64", "int32")

    def buffers(self, dtype, shapes):
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        flat = np.full(sum(counts), -99, dtype)  # what the node sums must overwrite
        views, at = [], 0
        for shape, count in zip(shapes, counts):
            views.append(DeviceArray(flat[at:at + count].reshape(shape)))
            at += count
        return DeviceArray(flat), views

    def all_reduce(self, buffer: DeviceArray, timeout: float):
        assert isinstance(buffer, DeviceArray), "NCCL got a host array"
        self.calls.append((buffer.dtype.name, buffer.size))
        buffer.host[...] = buffer.host + peer(buffer.dtype, buffer.size)
        return buffer


class FakeGloo:
    """Gloo for two nodes: sums add :func:`peer`; all-gathers (of int16 sums, in this batch) bring it as node
    1's bytes. The headers do not come here: :class:`FakeCluster` exchanges them."""

    name = "gloo"

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []

    def all_reduce(self, buffer: np.ndarray, timeout: float) -> np.ndarray:
        assert isinstance(buffer, np.ndarray), "Gloo got a device array"
        self.calls.append(("all_reduce", buffer.dtype.name, buffer.size))
        buffer[...] = buffer + peer(buffer.dtype, buffer.size)
        return buffer

    def all_gather(self, buffer: np.ndarray, timeout: float) -> list[np.ndarray]:
        self.calls.append(("all_gather", "uint8", buffer.size))
        return [buffer.copy(), peer(np.int16, buffer.size // 2).view(np.uint8)]


class FakeCluster:
    """Node 0 of two; the other node sent the same header (its processes' collective, two replicas)."""

    node_index = 0

    def __init__(self, device_engine, gloo: FakeGloo):
        self.device_engine, self.gloo = device_engine, gloo

    def describe(self, index: int) -> str:
        return f"node {index}"

    def exchange(self, sequence, mine, work, deadline, label):
        headers = [mine.copy(), mine.copy()]
        result, _ = work(self.gloo, headers, 10.0)
        return headers, result


SPECS = [("float32", (3, 2)), ("int16", (4,)), ("float32", (5,)), ("float64", (2, 2)), ("float16", (0,))]
"""A batch: two float32 tensors (one NCCL buffer, in tensor order), an int16 one NCCL does not add (Gloo, as
bytes gathered), float64 (a buffer of its own) and an empty float16 one."""


def inputs(t: int, dtype: str, shape) -> list[np.ndarray]:
    rng = np.random.default_rng(t)
    return [rng.integers(-8, 9, size=shape).astype(dtype) for _ in range(2)]


def run(op: str, device_engine) -> tuple[dict, GpuLike, FakeGloo, dict[int, DeviceArray]]:
    backend = GpuLike(2)
    engine = Engine(backend)
    pairs, out = [], []
    outs: dict[int, DeviceArray] = {}
    for t, (dtype, shape) in enumerate(SPECS):
        arrays = inputs(t, dtype, shape)
        if t == 0:  # CUDA IPC's case: the caller's values and results are device memory
            arrays = [DeviceArray(a) for a in arrays]
            result_dtype = np.dtype(dtype)
            outs = {d: DeviceArray(np.full(shape, -1, result_dtype)) for d in (0, 1)}
            out.append(outs)
        else:
            out.append(None)
        pairs.append((Value((0, 1), tuple(arrays), f"tensor {t}"), (0, 1)))
    share = Contribution("BatchReduce", op, 0, planner.HIERARCHICAL_COPY, None, tuple(pairs), tuple(out))
    gloo = FakeGloo()
    cluster = FakeCluster(device_engine, gloo)
    results = across.reduce_across(cluster, engine, {0: share}, "the batch", Deadline(None), 0)
    return results, backend, gloo, outs


def expected(t: int, op: str) -> np.ndarray:
    """``node 0 + node 1``, node 0's sum its two replicas' (both nodes' flat buffers hold the tensors of one
    dtype in tensor order); MEAN over the 4 replicas of both nodes."""
    dtype, shape = SPECS[t]
    a, b = inputs(t, dtype, shape)
    size = int(np.prod(shape))
    offset = sum(int(np.prod(s)) for d, s in SPECS[:t] if d == dtype)
    total = (a + b).reshape(-1) + peer(dtype, offset + size)[offset:]
    total = total.reshape(shape)
    if op == MEAN:
        from xreduced.backends.numpy_backend import divide

        total = divide(np, total, 4)
    return total


@pytest.mark.parametrize("op", [SUM, MEAN])
def test_device_node_sums_cross_on_nccl_and_the_rest_on_gloo(op):
    nccl = FakeNccl()
    results, backend, gloo, outs = run(op, nccl)
    assert nccl.calls == [("float32", 6 + 5), ("float64", 4)], "one NCCL buffer per dtype, in tensor order"
    assert gloo.calls == [("all_gather", "uint8", 4 * 2)], "only int16 crosses on Gloo (gathered: Gloo cannot add it)"
    assert backend.device_reads == 0, "a node sum went through the host"
    for t, result in enumerate(results[0]):
        want = expected(t, op)
        assert result.devices == (0, 1)
        for got in result.arrays:
            got = got.host if isinstance(got, DeviceArray) else got
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=f"tensor {t} {SPECS[t]}")
    assert [r is o for r, o in zip(results[0][0].arrays, outs.values())] == [True, True], \
        "the caller's device arrays hold the results"


@pytest.mark.parametrize("op", [SUM, MEAN])
def test_without_the_device_engine_everything_crosses_on_gloo_as_before(op):
    results, backend, gloo, _ = run(op, None)
    # float32 (both tensors in one buffer), int16 gathered, float64, float16 (empty): in order of first dtype
    assert gloo.calls == [("all_reduce", "float32", 11), ("all_gather", "uint8", 8), ("all_reduce", "float64", 4),
                         ("all_reduce", "float16", 0)]
    for t, result in enumerate(results[0]):
        for got in result.arrays:
            got = got.host if isinstance(got, DeviceArray) else got
            np.testing.assert_array_equal(got, expected(t, op), err_msg=f"tensor {t} {SPECS[t]}")
