"""The CuPy backend against the numpy backend, bit for bit (needs a GPU).

Every test compares :class:`CupyBackend` (8 logical devices spread over the
visible GPUs, one stream each) with :class:`NumpyBackend` (8 host devices)
running the same plans, and, for the conformance set, with TF's expected
arrays. Skipped, with the reason, where CuPy or a GPU is missing; run with
``pytest -m gpu tests/gpu/test_cupy_backend.py`` on a GPU machine.
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib

import ml_dtypes
import numpy as np
import pytest
from xreduced.backends import cupy_backend
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.engine import MEAN, SUM, Engine, Value

_REASON = cupy_backend.unavailable_reason()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"GPU backend unavailable: {_REASON}"),
    # NaN, inf and integer wrap-around are the point of several tests, not accidents.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
DOC = json.loads((HERE / "cases.json").read_text())
ARRAYS = np.load(HERE / "arrays.npz")
BF16 = np.dtype(ml_dtypes.bfloat16)
N = 8


@pytest.fixture(scope="module")
def gpu():
    return cupy_backend.CupyBackend(N)


@pytest.fixture(scope="module")
def gpu_engine(gpu):
    return Engine(gpu)


@pytest.fixture(scope="module")
def host_engine():
    return Engine(NumpyBackend(N))


# --- helpers ---------------------------------------------------------------


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's bytes as unsigned integers of its item size (complex: of its parts)."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "c":
        a = a.view(np.float32 if a.dtype.itemsize == 8 else np.float64)
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Same dtype, shape and bytes; on failure, how many items differ and the first few."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.tobytes() == want.tobytes():
        return
    g, w = _bits(got), _bits(want)
    bad = np.flatnonzero(g != w)
    first = ", ".join(f"[{i}] got {g[i]:#x} want {w[i]:#x}" for i in bad[:8])
    pytest.fail(f"{what}: {bad.size} of {g.size} items differ ({got.dtype}): {first}")


def _assert_results(got, want, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.devices == w.devices, f"{what}[{i}]: devices {g.devices} != {w.devices}"
        assert g.route == w.route, f"{what}[{i}]: route {g.route} != {w.route}"
        assert len(g.arrays) == len(w.arrays)
        for d, a, b in zip(g.devices, g.arrays, w.arrays):
            _assert_same(a, b, f"{what}[{i}] on device {d}")


def _rng(*salt) -> np.random.Generator:
    """A generator seeded from ``salt``, the same in every process."""
    return np.random.default_rng([20251118, zlib.crc32(repr(salt).encode())])


def _random(rng: np.random.Generator, dtype: np.dtype, shape) -> np.ndarray:
    """Finite random data of ``dtype``: full range for integers, many exponents for floats."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True).reshape(shape)
    if dtype.kind == "c":
        part = np.float32 if dtype.itemsize == 8 else np.float64
        return (_random(rng, part, shape) + 1j * _random(rng, part, shape)).astype(dtype)
    if dtype == np.float16:
        return (rng.standard_normal(size) * 50).astype(np.float16).reshape(shape)
    scale = 10.0 ** rng.uniform(-6, 6, size)
    return (rng.standard_normal(size) * scale).astype(dtype).reshape(shape)


def _value(arrays, devices=None) -> Value:
    devices = tuple(range(len(arrays))) if devices is None else tuple(devices)
    return Value(devices, tuple(arrays))


# --- conformance set -------------------------------------------------------


def _dests(spec) -> tuple[int, ...]:
    return () if spec == "same" else tuple(spec)


def _op(case) -> str:
    return (case["reduce_op"] or (case.get("reduce_op_python") or "").strip("'\"")).upper()


def _run_case(engine: Engine, case):
    if case["call"] == "broadcast":
        v = case["values"][0]
        return [engine.broadcast(ARRAYS[v["key"]], v["device"], _dests(case["destinations"]))]
    values = [Value(tuple(v["devices"]), tuple(ARRAYS[k] for k in v["keys"])) for v in case["values"]]
    if case["call"] == "reduce":
        return [engine.reduce(_op(case), values[0], _dests(case["destinations"]), num_packs=case["num_packs"])]
    pairs = [(v, _dests(d)) for v, d in zip(values, case["destinations"])]
    return engine.batch_reduce(_op(case), pairs, num_packs=case["num_packs"])


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["id"] for c in DOC["cases"]])
def test_conformance_case(gpu_engine, host_engine, case):
    got = _run_case(gpu_engine, case)
    _assert_results(got, _run_case(host_engine, case), f"{case['id']} cupy vs numpy")
    assert len(got) == len(case["expected"])
    for i, (r, want) in enumerate(zip(got, case["expected"])):
        assert r.devices == tuple(want["devices"]), f"{case['id']}[{i}]: devices"
        assert r.route == want["algorithm"], f"{case['id']}[{i}]: route"
        for d, a, key in zip(r.devices, r.arrays, want["keys"]):
            _assert_same(a, ARRAYS[key], f"{case['id']}[{i}] on device {d} vs TF")


# --- every dtype the wire carries ------------------------------------------


# The wire's dtypes, for when the generated stubs cannot be imported on the GPU machine
# (grpcio/protobuf older than the stubs): the dtype tests still run; test_wire_dtypes fails.
_WIRE_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
                "uint8", "uint16", "uint32", "uint64", "complex64", "complex128")


def _supported_dtypes() -> tuple[str, ...]:
    try:
        from xreduce.wire import codec
    except Exception:
        return _WIRE_DTYPES
    return codec.SUPPORTED_DTYPES


def test_wire_dtypes():
    from xreduce.wire import codec

    assert set(codec.SUPPORTED_DTYPES) == set(_WIRE_DTYPES)


SHAPES = [(1000,), (17, 33), (), (0,), (3, 1, 5)]


@pytest.mark.parametrize("num_packs", [0, 1, 3])
@pytest.mark.parametrize("op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", _supported_dtypes())
def test_every_dtype_batch(gpu_engine, host_engine, dtype, op, num_packs):
    rng = _rng(dtype, op, num_packs)
    values = [_value([_random(rng, np.dtype(dtype) if dtype != "bfloat16" else BF16, s) for _ in range(N)])
              for s in SHAPES]
    pairs = [(v, ()) for v in values]
    got = gpu_engine.batch_reduce(op, pairs, num_packs=num_packs)
    _assert_results(got, host_engine.batch_reduce(op, pairs, num_packs=num_packs), f"{dtype} {op}")


@pytest.mark.parametrize("dtype", _supported_dtypes())
@pytest.mark.parametrize("dests", [(3,), (6, 1)], ids=["to_3", "to_6_1"])
def test_every_dtype_reduction_to_one_device(gpu_engine, host_engine, dtype, dests):
    rng = _rng(dtype, dests)
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    value = _value([_random(rng, dt, (257,)) for _ in range(5)], devices=(7, 0, 2, 5, 4))
    for op in (SUM, MEAN):
        got = gpu_engine.reduce(op, value, dests)
        _assert_results([got], [host_engine.reduce(op, value, dests)], f"{dtype} {op} -> {dests}")


# --- bfloat16 --------------------------------------------------------------

_BF16_SPECIAL = np.array(
    [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F,  # zeros, subnormals, max
     0x7F80, 0xFF80,  # +inf, -inf
     0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x7FFF],  # quiet and signalling NaNs of both signs
    np.uint16,
)


def _bf16_random(rng, shape, nonfinite: bool) -> np.ndarray:
    size = int(np.prod(shape))
    mags = 10.0 ** rng.uniform(-38, 30, size)  # below bf16's normal range up to far from overflow
    x = (rng.standard_normal(size) * mags).astype(np.float32).astype(BF16)
    if nonfinite:
        pos = rng.choice(size, size // 16, replace=False)
        x.view(np.uint16)[pos] = rng.choice(_BF16_SPECIAL, pos.size)
    return x.reshape(shape)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "with_nan_inf"])
@pytest.mark.parametrize("num_devices", [8, 7])
@pytest.mark.parametrize("op", [SUM, MEAN])
def test_bfloat16_matches_ml_dtypes(gpu_engine, host_engine, op, num_devices, nonfinite):
    rng = _rng("bf16", op, num_devices, nonfinite)
    value = _value([_bf16_random(rng, (4099,), nonfinite) for _ in range(num_devices)])
    for num_packs in (1, 3):
        got = gpu_engine.reduce(op, value, (), num_packs=num_packs)
        want = host_engine.reduce(op, value, (), num_packs=num_packs)
        _assert_results([got], [want], f"bfloat16 {op} over {num_devices} (num_packs={num_packs})")


def _all_bf16(nonfinite: bool) -> np.ndarray:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if not nonfinite:
        bits = bits[(bits & 0x7F80) != 0x7F80]  # drop every inf and NaN
    return bits.view(BF16)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "with_nan_inf"])
def test_bfloat16_add_every_bit_pattern(gpu, nonfinite):
    """Every bfloat16 (as a) plus a shuffled copy (b), on two devices of one stream each."""
    a = _all_bf16(nonfinite)
    b = _rng("perm", nonfinite).permutation(a)
    host = NumpyBackend(2)
    for x, y in ((a, b), (b, a), (a, a)):
        got = gpu.download(gpu.add(gpu.upload(0, x), gpu.copy(gpu.upload(1, y), 0)))
        _assert_same(got, host.add(x, y), f"bfloat16 add ({'with' if nonfinite else 'no'} NaN/inf)")


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "with_nan_inf"])
@pytest.mark.parametrize("n", [2, 3, 7, 8])
def test_bfloat16_divide_every_bit_pattern(gpu, n, nonfinite):
    a = _all_bf16(nonfinite)
    got = gpu.download(gpu.divide(gpu.upload(2, a), n))
    _assert_same(got, NumpyBackend(1).divide(a, n), f"bfloat16 / {n}")


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_float32_subnormals_are_kept(gpu, dtype):
    """CuPy's kernels flush float32 subnormals; sums and means must not (numpy keeps them)."""
    rng = np.random.default_rng(7)
    tiny = rng.integers(0, 1 << 23, 4096, dtype=np.uint32).view(np.float32)  # every one subnormal or zero
    signs = np.where(rng.random(4096) < 0.5, np.float32(-1), np.float32(1))
    a = np.concatenate([tiny * signs, np.float32([1e-38, -1.2e-38, 3.4e38, 0.0])])
    b = rng.permutation(a)
    if dtype == "complex64":
        a, b = a[::2] + 1j * a[1::2], b[::2] + 1j * b[1::2]
        a, b = a.astype(np.complex64), b.astype(np.complex64)
    host = NumpyBackend(2)
    got = gpu.download(gpu.add(gpu.upload(0, a), gpu.copy(gpu.upload(1, b), 0)))
    _assert_same(got, host.add(a, b), f"{dtype} add with subnormals")
    for n in (2, 3, 8):
        _assert_same(gpu.download(gpu.divide(gpu.upload(2, a), n)), host.divide(a, n), f"{dtype} / {n}")


# --- NaN and inf in IEEE floats --------------------------------------------


@pytest.mark.parametrize("op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_float_nan_inf_positions(gpu_engine, host_engine, dtype, op):
    """NaN and inf land where numpy puts them, every non-NaN bit is numpy's.

    NaN payloads are not compared: GPUs return the canonical NaN where x86
    propagates an operand's payload (TF on a GPU does the same).
    """
    rng = _rng("nan", dtype, op)
    arrays = []
    for _ in range(N):
        x = _random(rng, np.dtype(dtype), (2048,))
        pos = rng.choice(x.size, 64, replace=False)
        x[pos] = rng.choice(np.array([np.nan, -np.nan, np.inf, -np.inf], dtype), pos.size)
        arrays.append(x)
    value = _value(arrays)
    got = gpu_engine.reduce(op, value, ())
    want = host_engine.reduce(op, value, ())
    for d, g, w in zip(got.devices, got.arrays, want.arrays):
        assert g.dtype == w.dtype and g.shape == w.shape
        nan = np.isnan(w)
        np.testing.assert_array_equal(np.isnan(g), nan, err_msg=f"{dtype} {op}: NaN positions on device {d}")
        _assert_same(g[~nan], w[~nan], f"{dtype} {op}: non-NaN items on device {d}")


# --- large all-reduces (packs, pool reuse across streams) -------------------


@pytest.mark.timeout(300)
def test_float32_64mib_all_reduce_num_packs_4(gpu_engine, host_engine):
    """64 MiB per device on 8 devices, 4 packs; three runs, so freed pool blocks get reused."""
    rng = _rng("64MiB")
    count = (64 << 20) // 4
    value = _value([rng.standard_normal(count, dtype=np.float32) for _ in range(N)])
    want = host_engine.reduce(SUM, value, (), num_packs=4)
    for run in range(3):
        got = gpu_engine.reduce(SUM, value, (), num_packs=4)
        _assert_results([got], [want], f"64 MiB float32 all-reduce, run {run}")


@pytest.mark.timeout(300)
def test_large_batch_many_packs(gpu_engine, host_engine):
    """A batch whose packs span several tensors (the gather concatenates) and MEAN."""
    rng = _rng("batch")
    sizes = [3_000_001, 17, 1_500_000, 999_983, 2_000_000, 5]
    values = [_value([rng.standard_normal(s, dtype=np.float32) for _ in range(N)]) for s in sizes]
    pairs = [(v, ()) for v in values]
    for op, packs in ((SUM, 3), (MEAN, 5), (SUM, 0)):
        want = host_engine.batch_reduce(op, pairs, num_packs=packs)
        for run in range(2):
            got = gpu_engine.batch_reduce(op, pairs, num_packs=packs)
            _assert_results(got, want, f"batch {op} num_packs={packs}, run {run}")


@pytest.mark.timeout(300)
def test_concurrent_reduces_from_threads(gpu_engine, host_engine):
    """The daemon serves calls from many threads on one backend: results must not mix."""
    from concurrent.futures import ThreadPoolExecutor

    rng = _rng("threads")
    values = [_value([rng.standard_normal(1 << 20, dtype=np.float32) for _ in range(N)]) for _ in range(4)]
    wants = [host_engine.reduce(SUM, v, (), num_packs=2) for v in values]

    def work(i):
        return [gpu_engine.reduce(SUM, values[i], (), num_packs=2) for _ in range(3)]

    with ThreadPoolExecutor(4) as pool:
        for i, runs in enumerate(pool.map(work, range(4))):
            for run, got in enumerate(runs):
                _assert_results([got], [wants[i]], f"thread {i} run {run}")


# --- the backend's own surface ---------------------------------------------


def test_devices_report_gpus(gpu):
    import cupy

    rt = cupy.cuda.runtime
    num_gpus = rt.getDeviceCount()
    infos = gpu.devices()
    assert len(infos) == N
    for i, info in enumerate(infos):
        g = i % num_gpus
        props = rt.getDeviceProperties(g)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        sharing = sum(1 for j in range(N) if j % num_gpus == g)
        assert info.device_type == "GPU"
        assert info.index == i
        assert info.physical_device == f"cuda:{g} {name}"
        assert re.fullmatch(r"cuda:\d+ \S.*", info.physical_device)
        assert info.memory_bytes == props["totalGlobalMem"] // sharing > 0


def test_peer_access_matrix(gpu):
    import cupy

    rt = cupy.cuda.runtime
    num_gpus = rt.getDeviceCount()
    m = gpu.peer_access()
    assert len(m) == N and all(len(row) == N for row in m)
    for i in range(N):
        for j in range(N):
            assert isinstance(m[i][j], bool), f"peer_access[{i}][{j}] is {type(m[i][j]).__name__}"
            a, b = i % num_gpus, j % num_gpus
            want = i != j and (a == b or bool(rt.deviceCanAccessPeer(a, b)))
            assert m[i][j] == want, f"peer_access[{i}][{j}]"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex128", "int8"])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (1001,), (4, 0, 2), (1 << 20,)])
def test_copy_round_trip(gpu, dtype, shape):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = _random(_rng("copy", dtype, shape), dt, shape)
    src = gpu.upload(0, x)
    for dst in (1, 7, 0):
        out = gpu.copy(src, dst)
        _assert_same(gpu.download(out), x, f"copy 0 -> {dst}")
    _assert_same(gpu.download(src), x, "source after copies")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex128", "int8", "float16"])
def test_device_arrays_in_and_out(gpu, dtype):
    """upload of a device array (what a CUDA IPC region view is) and write to host and device arrays."""
    import cupy

    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    shape = (7, 143)
    x = _random(_rng("device", dtype), dt, shape)
    raw = cupy.asarray(x.view(f"u{dt.itemsize}") if dtype == "bfloat16" else x).reshape(-1).view(cupy.uint8)
    cupy.cuda.Device().synchronize()  # the backend's streams do not wait on the null stream
    view = cupy_backend.device_view(raw, dt, shape)
    assert view.shape == shape and np.dtype(view.dtype) == dt
    buf = gpu.upload(3, view)
    _assert_same(gpu.download(buf), x, f"upload of a device {dtype} array")
    host = np.empty(shape, dt)
    flat = np.empty(x.size, dt)
    device_out = cupy.zeros(x.nbytes, cupy.uint8)
    gpu.write(host, buf)
    gpu.write(flat, buf)
    gpu.write(cupy_backend.device_view(device_out, dt, shape), buf)
    again = np.empty(shape, dt)
    gpu.write(again, view)  # a raw device array (the one-replica shortcut)
    gpu.synchronize()
    _assert_same(host, x, "write into a host array")
    _assert_same(flat.reshape(shape), x, "write into a host array of another shape")
    _assert_same(device_out.get().view(dt).reshape(shape), x, "write into a device array")
    _assert_same(again, x, "write of a device array")
    with pytest.raises(ValueError, match="C-contiguous"):
        gpu.upload(0, cupy.zeros((4, 4), cupy.float32)[:, 1])


# --- the daemon on the GPU -------------------------------------------------


@pytest.mark.timeout(180)
def test_daemon_serves_gpu_devices_and_reduces(start_daemon):
    import grpc
    from xreduce.v1 import xreduce_pb2 as pb
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduce.wire import codec

    proc = start_daemon("--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", str(N), timeout=120)
    try:
        with grpc.insecure_channel(proc.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            stub = pb_grpc.CrossDeviceOpsStub(ch)
            listing = stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
            assert listing.backend == "cupy"
            assert [d.short_name for d in listing.devices] == [f"GPU:{i}" for i in range(N)]
            for i, d in enumerate(listing.devices):
                assert d.device_type == "GPU" and d.index == i
                assert d.name == f"/job:localhost/replica:0/task:0/device:GPU:{i}"
                assert d.memory_bytes > 0
                assert d.physical_device.startswith("cuda:"), d.physical_device
            assert len(listing.peer_access) == N
            assert all(len(r.can_access) == N for r in listing.peer_access)

            rng = _rng("daemon")
            xs = [rng.standard_normal((5, 7), dtype=np.float32) for _ in range(N)]
            reply = stub.Reduce(pb.ReduceRequest(
                reduce_op=pb.REDUCE_OP_SUM,
                value=pb.DistributedValue(components=[
                    pb.Component(device=f"GPU:{i}", tensor=codec.encode(x)) for i, x in enumerate(xs)
                ]),
            ), timeout=60)
            # TF's hierarchical-copy association: (x0+..+x3) + (x4+..+x7), left folds.
            lo, hi = xs[0], xs[N // 2]
            for x in xs[1:N // 2]:
                lo = lo + x
            for x in xs[N // 2 + 1:]:
                hi = hi + x
            total = lo + hi
            assert reply.route == pb.ROUTE_HIERARCHICAL_COPY
            assert [c.device for c in reply.result.components] == [
                f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(N)
            ]
            for c in reply.result.components:
                _assert_same(codec.decode(c.tensor), total, f"Reduce on {c.device}")
    finally:
        code = proc.terminate()
    assert code == 0, f"xreduced exited {code}:\n{proc.log()}"
