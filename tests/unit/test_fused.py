"""The fused host executor against the generic one: bit-identical on random plans,
never writing into its (read-only, shared-buffer) inputs; ``out=`` arrays in
the executor, the engine and multi-process collectives; ``Engine.routes``.

The generic executor runs every step as the numpy backend's uploads, copies and
sums; it is the reference here (the conformance tests check it, and now the
fused path, against TF's vectors through a real daemon).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xreduce.wire import mean_dtype
from xreduced import planner
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.collective import BroadcastShare, Contribution, broadcast_together, reduce_together
from xreduced.deadline import Deadline
from xreduced.engine import MEAN, SUM, Engine, Value, result_dtype
from xreduced.errors import DeadlineExceeded, InvalidArgument
from xreduced.executor import Fused, execute, execute_fused, execute_generic

DTYPES = [np.dtype(d) for d in (
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.complex64, np.complex128)]
NUM_DEVICES = 9
PROPERTY = settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def values(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Values that make the association of additions show: wide magnitudes, infinities, NaNs, wrap-around."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    part = np.dtype(np.float64)
    scale = {2: 4, 4: 30, 8: 200}[(dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize)]

    def real():
        x = np.asarray(rng.standard_normal(shape) * 10.0 ** rng.uniform(-scale, scale, shape))
        special = np.asarray(rng.random(shape))
        x[special < 0.01] = np.inf
        x[(special >= 0.01) & (special < 0.02)] = np.nan
        return x.astype(part)

    with np.errstate(over="ignore", invalid="ignore"):
        x = real() + 1j * real() if dtype.kind == "c" else real()
        return x.astype(dtype)


def shared(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The arrays as read-only views into one buffer, as a shared-memory region hands them over."""
    sizes = [a.nbytes for a in arrays]
    buffer = bytes(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    out, offset = [], 0
    for a, size in zip(arrays, sizes):
        view = np.frombuffer(buffer, a.dtype, a.size, offset).reshape(a.shape)
        assert not view.flags.writeable
        out.append(view)
        offset += size
    return out


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Every bit equal, except that a NaN may be any NaN.

    Which operand's NaN an addition of two NaNs returns (sign and payload) depends on numpy's loop (SIMD body,
    remainder, in place or not), so it is not the same for one element in a long array and in a short one;
    every other value is bit for bit.
    """
    if got.tobytes() == want.tobytes():
        return True
    g, w = np.ascontiguousarray(got).reshape(-1), np.ascontiguousarray(want).reshape(-1)
    if g.dtype.kind in "iu":
        return False
    if g.dtype.kind == "c":
        part = np.dtype(f"f{g.dtype.itemsize // 2}")
        g, w = g.view(part), w.view(part)
    bits = np.dtype(f"u{g.dtype.itemsize}")
    nan = np.isnan(g) & np.isnan(w)
    return bool(np.array_equal(g.view(bits)[~nan], w.view(bits)[~nan]))


def test_same_bits_tells_values_apart_but_not_nans():
    x = np.array([1.0, np.nan, -0.0])
    assert same_bits(x, np.array([1.0, -np.nan, -0.0]))
    assert not same_bits(x, np.array([1.0, np.nan, 0.0]))
    assert not same_bits(x.astype(np.complex64), np.array([1.0, 1.0, 0.0], np.complex64))


def assert_same(got: dict[int, list[np.ndarray]], want: dict[int, list[np.ndarray]], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for d in want:
        assert len(got[d]) == len(want[d]), what
        for t, (g, w) in enumerate(zip(got[d], want[d])):
            where = f"{what}: tensor {t} on device {d}"
            assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{where}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            assert same_bits(g, w), f"{where}:\n{g!r}\n!=\n{w!r}"


@st.composite
def cases(draw):
    """(plan, inputs, mean, chunk_bytes, threads): a random plan of any of the three kinds."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["hierarchical_copy", "hierarchical_copy", "to_one", "broadcast"]))
    n = draw(st.integers(1, 7))
    devices = [int(d) for d in rng.permutation(NUM_DEVICES)[:n]]
    count = draw(st.integers(1, 4)) if kind == "hierarchical_copy" else 1
    shapes = [tuple(draw(st.lists(st.integers(0, 9), max_size=3))) for _ in range(count)]
    num_packs = draw(st.integers(0, 5))
    if num_packs > 0 or draw(st.booleans()):
        dtypes = [draw(st.sampled_from(DTYPES))] * count
    else:
        dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(count)]
    elements = [math.prod(s) for s in shapes]
    itemsizes = [d.itemsize for d in dtypes]
    mean = kind != "broadcast" and draw(st.booleans())
    if kind == "hierarchical_copy":
        plan = planner.hierarchical_copy(devices, elements, itemsizes, num_packs)
    elif kind == "to_one":
        dests = [int(d) for d in rng.permutation(NUM_DEVICES)[: draw(st.integers(1, 4))]]
        reduce_to = draw(st.sampled_from([None, *range(NUM_DEVICES)]))
        plan = planner.reduction_to_one_device(devices, dests, elements, itemsizes, reduce_to)
    else:
        dests = [int(d) for d in rng.permutation(NUM_DEVICES)[: draw(st.integers(1, 5))]]
        plan = planner.broadcast(devices[0], dests, elements[0], itemsizes[0])
    inputs = [shared([values(rng, dt, s) for dt, s in zip(dtypes, shapes)]) for _ in plan.devices]
    chunk_bytes = draw(st.sampled_from([1, 8, 24, 64, 512 << 10]))
    threads = draw(st.integers(1, 4))
    return plan, inputs, mean, chunk_bytes, threads


@PROPERTY
@given(cases())
def test_fused_is_bit_identical_to_generic(case):
    plan, inputs, mean, chunk_bytes, threads = case
    want = execute_generic(plan, NumpyBackend(NUM_DEVICES), inputs, mean)
    got = execute_fused(plan, inputs, mean, chunk_bytes=chunk_bytes, threads=threads)
    assert_same(got, want, f"{planner.describe(plan)}\nmean={mean} chunk={chunk_bytes} threads={threads}")


@PROPERTY
@given(cases())
def test_out_arrays_receive_the_results_on_both_paths(case):
    plan, inputs, mean, chunk_bytes, threads = case
    want = execute_generic(plan, NumpyBackend(NUM_DEVICES), inputs, mean)
    for run in (lambda out: execute_generic(plan, NumpyBackend(NUM_DEVICES), inputs, mean, out=out),
                lambda out: execute_fused(plan, inputs, mean, out=out, chunk_bytes=chunk_bytes, threads=threads)):
        # Every other destination gets caller arrays, one of them a non-contiguous view.
        out = {d: [np.full_like(a, 7) for a in want[d]] for d in plan.destinations[::2]}
        if out and want[plan.destinations[0]][0].ndim:
            base = np.zeros(want[plan.destinations[0]][0].shape + (2,), want[plan.destinations[0]][0].dtype)
            out[plan.destinations[0]][0] = base[..., 1]
        got = run(out)
        for d, arrays in out.items():
            assert all(g is o for g, o in zip(got[d], arrays))
        assert_same(got, want, planner.describe(plan))


@PROPERTY
@given(cases(), st.integers(0, 2**32 - 1))
def test_out_arrays_over_the_inputs_receive_the_results(case, seed):
    """An in-place reduce: each destination's result goes into a fresh array, into one of the inputs (exactly: a
    replica's own tensor, the result then written straight into it where nothing reads it later), into an array
    another destination has too, or over part of an input; the results are the generic way's on the inputs'
    first values."""
    plan, inputs, mean, chunk_bytes, threads = case
    rng = np.random.default_rng(seed)
    buffers = [[np.concatenate([a.reshape(-1), a.reshape(-1)[:1]]) for a in c] for c in inputs]  # room to shift
    inputs = [[b[: a.size].reshape(a.shape) for a, b in zip(c, bc)] for c, bc in zip(inputs, buffers)]  # writable
    want = execute_generic(plan, NumpyBackend(NUM_DEVICES), [[a.copy() for a in c] for c in inputs], mean)
    out: dict[int, list[np.ndarray]] = {}
    used: set[tuple[int, int]] = set()  # inputs a sink lies over: one array each (the daemon's never overlap)
    for d in plan.destinations:
        out[d] = []
        for t, w in enumerate(want[d]):
            over = [p for p, c in enumerate(inputs) if c[t].dtype == w.dtype and (p, t) not in used]
            given = [o[t] for e, o in out.items() if e != d]
            choice, p = rng.integers(4), rng.choice(over) if over else None
            if choice == 1 and over:
                out[d].append(inputs[p][t])
                used.add((p, t))
            elif choice == 2 and given:
                out[d].append(given[rng.integers(len(given))])
            elif choice == 3 and over and w.size:
                out[d].append(buffers[p][t][1:].reshape(w.shape))
                used.add((p, t))
            else:
                out[d].append(np.full_like(w, 7))
    got = execute_fused(plan, inputs, mean, out=out, chunk_bytes=chunk_bytes, threads=threads)
    assert_same(got, want, f"{planner.describe(plan)}\nmean={mean} chunk={chunk_bytes} threads={threads}")


def test_a_result_over_its_first_replica_is_written_there_directly(monkeypatch):
    """TF's kernel's call: the total goes straight into replica 0's input, with no scratch and no copy, and the
    numbers are those of a reduce into a fresh array."""
    x = [np.arange(300_000, dtype=np.float32) * (k + 1) / 7 for k in range(2)]
    want = execute_fused(planner.hierarchical_copy([0, 1], [x[0].size], 4), [[a] for a in x])[0][0]
    copies = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copies.append(dst.size), real(dst, src, **kw)))
    plan = planner.hierarchical_copy([0, 1], [x[0].size], 4)
    got = execute_fused(plan, [[a] for a in x], out=dict.fromkeys((0, 1), [x[0]]), chunk_bytes=64 << 10, threads=2)
    assert got[0][0] is x[0] and got[1][0] is x[0] and same_bits(x[0], want)
    assert copies == []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("n", [2, 3, 8], ids=lambda n: f"N{n}")
def test_fused_matches_generic_on_chunked_parallel_inputs(dtype, n):
    """Inputs of several chunks on several threads, every dtype, SUM and MEAN, packed and not."""
    rng = np.random.default_rng([n, dtype.num])
    inputs = [shared([values(rng, dtype, (3, 1000)), values(rng, dtype, (517,))]) for _ in range(n)]
    for num_packs in (0, 1, 3):
        plan = planner.hierarchical_copy(range(n), [3000, 517], dtype.itemsize, num_packs)
        for mean in (False, True):
            want = execute_generic(plan, NumpyBackend(n), inputs, mean)
            got = execute_fused(plan, inputs, mean, chunk_bytes=1000, threads=3)
            assert_same(got, want, f"num_packs={num_packs} mean={mean}")
            if mean:
                assert got[0][0].dtype == mean_dtype(dtype)


def test_the_numpy_backend_runs_fused_and_a_forwarding_wrapper_runs_generic():
    class Forwarding:
        def __init__(self, backend):
            self._b = backend
            self.uploads = 0

        def upload(self, device, array):
            self.uploads += 1
            return self._b.upload(device, array)

        def __getattr__(self, name):
            return getattr(self._b, name)

    plan = planner.hierarchical_copy([0, 1], [3], 4)
    inputs = [[np.ones(3, np.float32)], [np.ones(3, np.float32)]]
    wrapper = Forwarding(NumpyBackend(2))
    execute(plan, wrapper, inputs)
    assert wrapper.uploads == 2
    assert execute(plan, NumpyBackend(2), inputs)[1][0].tolist() == [2, 2, 2]


def test_fused_deadline_stops_work_and_names_the_pack():
    inputs = [[np.ones(1 << 16, np.float32)] for _ in range(4)]
    plan = planner.hierarchical_copy(range(4), [1 << 16], 4, num_packs=2)
    with pytest.raises(DeadlineExceeded, match=r"timed out after -1 s while reducing pack [01] of 2"):
        execute_fused(plan, inputs, deadline=Deadline(-1), chunk_bytes=4096, threads=3)


def test_a_pack_of_mixed_dtypes_is_refused():
    plan = planner.hierarchical_copy([0, 1], [2, 2], [4, 8], num_packs=1)
    inputs = [[np.ones(2, np.float32), np.ones(2, np.float64)]] * 2
    with pytest.raises(ValueError, match=r"pack 0 mixes dtypes \(tensor 0 float32, tensor 1 float64\)"):
        execute(plan, NumpyBackend(2), inputs)


@pytest.mark.parametrize("bad, message", [
    (np.zeros(3, np.float64), r"out\[1\]\[0\]: must be a writable float32\[3\] array; got float64\[3\]"),
    (np.zeros(4, np.float32), r"out\[1\]\[0\]: must be a writable float32\[3\] array; got float32\[4\]"),
    (np.frombuffer(bytes(12), np.float32), r"got a read-only float32\[3\]"),
    ([0.0, 0.0, 0.0], r"out\[1\]\[0\]: must be a writable float32\[3\] array; got list"),
])
def test_a_bad_out_array_is_refused_naming_it(bad, message):
    plan = planner.hierarchical_copy([0, 1], [3], 4)
    inputs = [[np.ones(3, np.float32)]] * 2
    for backend in (NumpyBackend(2), None):
        with pytest.raises(InvalidArgument, match=message):
            if backend is None:
                execute_fused(plan, inputs, out={1: [bad]})
            else:
                execute_generic(plan, backend, inputs, out={1: [bad]})


# --- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return Engine(NumpyBackend(8))


def test_routes_say_what_batch_reduce_runs(engine):
    rng = np.random.default_rng(11)
    for _ in range(300):
        pairs = []
        base = [int(d) for d in rng.permutation(8)[: rng.integers(1, 5)]]
        for _ in range(rng.integers(1, 4)):
            devices = base if rng.random() < 0.6 else [int(d) for d in rng.permutation(8)[: rng.integers(1, 4)]]
            order = [int(d) for d in rng.permutation(devices)]
            dests = () if rng.random() < 0.5 else tuple(int(d) for d in rng.permutation(8)[: rng.integers(1, 4)])
            if rng.random() < 0.2:
                dests = tuple(devices)
            arrays = tuple(np.full(3, p, np.int32) for p in range(len(order)))
            pairs.append((Value(tuple(order), arrays), dests))
        algorithm = planner.REDUCTION_TO_ONE_DEVICE if rng.random() < 0.3 else planner.HIERARCHICAL_COPY
        num_packs = int(rng.integers(0, 3))
        routes = engine.routes(SUM, pairs, algorithm=algorithm, num_packs=num_packs)
        results = engine.batch_reduce(SUM, pairs, algorithm=algorithm, num_packs=num_packs)
        assert routes == [r.route for r in results]


def test_routes_refuse_what_batch_reduce_refuses(engine):
    pairs = [(Value((0, 1), (np.ones(2, np.float32),) * 2), ()), (Value((1, 0), (np.ones(2, np.int32),) * 2), ())]
    for call in (engine.routes, engine.batch_reduce):
        with pytest.raises(InvalidArgument, match="num_packs=1 packs the batch into one buffer"):
            call(SUM, pairs, num_packs=1)
    assert engine.routes(SUM, pairs, num_packs=0) == [planner.HIERARCHICAL_COPY] * 2
    with pytest.raises(InvalidArgument, match="reduce_op must be SUM or MEAN; got 'MAX'"):
        engine.routes("MAX", pairs)


@pytest.mark.parametrize("op", [SUM, MEAN])
@pytest.mark.parametrize("algorithm", [planner.HIERARCHICAL_COPY, planner.REDUCTION_TO_ONE_DEVICE])
def test_batch_reduce_writes_into_out_and_returns_those_arrays(engine, op, algorithm):
    rng = np.random.default_rng(5)
    pairs = [
        (Value((2, 0, 5), tuple(rng.integers(-9, 9, (4, 3)).astype(np.int32) for _ in range(3))), ()),
        (Value((0, 5, 2), tuple(rng.integers(-9, 9, (7,)).astype(np.int32) for _ in range(3))), ()),
        (Value((6,), (rng.integers(-9, 9, (2,)).astype(np.int32),)), ()),  # identity: copied into out
        (Value((6,), (rng.integers(-9, 9, (2,)).astype(np.int32),)), (1, 6)),
    ]
    want = engine.batch_reduce(op, pairs, algorithm=algorithm, num_packs=0)
    routes = engine.routes(op, pairs, algorithm=algorithm, num_packs=0)
    out = []
    for (value, dests), route in zip(pairs, routes):
        dtype = result_dtype(op, value.arrays[0].dtype, route)
        out.append({d: np.empty(value.arrays[0].shape, dtype) for d in (dests or value.devices)[:2]})
    got = engine.batch_reduce(op, pairs, algorithm=algorithm, num_packs=0, out=out)
    for i, (g, w, mine) in enumerate(zip(got, want, out)):
        assert (g.devices, g.route) == (w.devices, w.route)
        for d, garr, warr in zip(g.devices, g.arrays, w.arrays):
            if d in mine:
                assert garr is mine[d], f"pair {i} on {d}"
            assert garr.dtype == warr.dtype and garr.tobytes() == warr.tobytes(), f"pair {i} on {d}"
    assert got[2].route == planner.IDENTITY and got[2].arrays[0] is not pairs[2][0].arrays[0]


def test_reduce_and_broadcast_take_out(engine):
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    mine = np.empty((2, 3), np.float16)
    r = engine.reduce(MEAN, Value((1, 3), (x, x + 1)), (), num_packs=2, out={3: mine})
    assert r.arrays[1] is mine and mine.tolist() == (x + np.float16(0.5)).tolist()
    lone = engine.reduce(MEAN, Value((4,), (x,)), (), out={4: mine})
    assert lone.arrays[0] is mine and mine.tobytes() == x.tobytes()
    target = np.empty((2, 3), np.float16)
    b = engine.broadcast(x, 0, [0, 7], out={7: target})
    assert b.arrays[1] is target and target.tobytes() == x.tobytes()


def test_bad_out_entries_are_refused_naming_the_field(engine):
    v = Value((0, 1), (np.ones(3, np.int32),) * 2)
    cases = [
        ([{0: np.empty(3, np.int32)}], MEAN,
         r"out\[0\]\[CPU:0\]: must be a writable float64\[3\] array; got int32\[3\]"),
        ([{5: np.empty(3, np.int32)}], SUM, r"out\[0\]: CPU:5 is not a destination of pairs\[0\]; its destinations "
                                            r"are \['CPU:0', 'CPU:1'\]"),
        ([None, None], SUM, r"out: one entry per pair; got 2 for 1 pairs"),
    ]
    for out, op, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            engine.batch_reduce(op, [(v, ())], out=out)
    with pytest.raises(InvalidArgument, match=r"out: CPU:2 is not a destination; the destinations are \['CPU:1'\]"):
        engine.broadcast(np.ones(2), 0, [1], out={2: np.empty(2)})


# --- collectives --------------------------------------------------------------------------------------------


def test_reduce_together_writes_each_process_results_into_its_own_out(engine):
    rng = np.random.default_rng(3)
    data = {p: [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(2)] for p in range(3)}
    devices = {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    alone = engine.reduce(SUM, Value(tuple(range(6)), tuple(a for p in range(3) for a in data[p])), ())

    def shares(outs):
        return {p: Contribution("Reduce", SUM, 1, planner.HIERARCHICAL_COPY, None,
                                ((Value(devices[p], tuple(data[p])), devices[p]),), outs[p])
                for p in range(3)}

    # Process 0 gives arrays for both its devices, process 1 for one, process 2 none.
    outs = {0: ({0: np.empty((2, 5), np.float32), 1: np.empty((2, 5), np.float32)},),
            1: ({3: np.empty((2, 5), np.float32)},), 2: None}
    results = reduce_together(engine, shares(outs), "collective 0", Deadline(None))
    for p, (result,) in results.items():
        assert result.devices == devices[p]
        for d, arr in zip(result.devices, result.arrays):
            if outs[p] is not None and d in outs[p][0]:
                assert arr is outs[p][0][d]
            assert arr.tobytes() == alone.arrays[0].tobytes()

    bad = {0: ({2: np.empty((2, 5), np.float32)},), 1: None, 2: None}
    with pytest.raises(InvalidArgument, match=r"process 0's out for tensor 0 of collective 0: CPU:2 is not one "
                                              r"of its destinations \['CPU:0', 'CPU:1'\]"):
        reduce_together(engine, shares(bad), "collective 0", Deadline(None))


def test_broadcast_together_writes_into_each_process_out(engine):
    x = np.arange(4, dtype=np.int64)
    mine = {0: np.empty(4, np.int64), 1: np.empty(4, np.int64)}
    shares = {0: BroadcastShare(0, x, 0, (0, 1), {1: mine[0]}), 1: BroadcastShare(0, None, None, (1, 2), {1: mine[1]})}
    results = broadcast_together(engine, shares, "collective 1", Deadline(None))
    assert results[0].arrays[1] is mine[0] and results[1].arrays[0] is mine[1]
    for arr in (*results[0].arrays, *results[1].arrays):
        assert arr.tolist() == [0, 1, 2, 3]


@st.composite
def batches(draw):
    """(op, pairs, num_packs, rng, dests): an all-reduce batch over one random device set, writable inputs, and the
    order of its destinations."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    devices = tuple(int(d) for d in rng.permutation(8)[: draw(st.integers(2, 6))])
    count = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(DTYPES))
    shapes = [tuple(draw(st.lists(st.integers(1, 9), max_size=3))) for _ in range(count)]
    pairs = [(Value(devices, tuple(np.array(values(rng, dtype, s)) for _ in devices), f"pairs[{i}].value"), ())
             for i, s in enumerate(shapes)]
    op = draw(st.sampled_from([SUM, MEAN]))
    dests = devices[:: -1 if draw(st.booleans()) else 1]
    return op, pairs, draw(st.integers(0, 3)), rng, dests


@PROPERTY
@given(batches())
def test_a_prepared_batch_reduces_new_values_as_batch_reduce_does(case):
    """Engine.prepare, as a kept repeat uses it: prepared from one step's arrays, run on the same arrays holding
    the next steps' values, bit for bit what batch_reduce writes."""
    op, pairs, num_packs, rng, dests = case
    engine = Engine(NumpyBackend(8))
    dtype = result_dtype(op, pairs[0][0].arrays[0].dtype, planner.HIERARCHICAL_COPY)
    if rng.random() < 0.5:
        out = [{d: np.empty(v.arrays[0].shape, dtype) for d in dests} for v, _ in pairs]
    else:  # every destination given one array, as the daemon does for output_one_copy
        out = [dict.fromkeys(dests, np.empty(v.arrays[0].shape, dtype)) for v, _ in pairs]
    prepared = engine.prepare(op, pairs, num_packs=num_packs, out=out)
    assert prepared is not None
    bound = prepared.bind(pairs, out)  # as a kept repeat runs it: bound to these arrays once
    for step in range(4):
        for v, _ in pairs:
            for a in v.arrays:
                a[...] = values(rng, a.dtype, a.shape)
        want = engine.batch_reduce(op, pairs, num_packs=num_packs)
        if step % 2:
            assert bound.run()
        else:
            prepared.run(pairs, out)
        for i, (w, mine) in enumerate(zip(want, out)):
            for d, arr in zip(w.devices, w.arrays):
                assert same_bits(mine[d], arr), f"step {step}: pair {i} on device {d}"


@pytest.mark.parametrize("op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_a_bound_reduction_on_several_threads_matches_execute_fused(op, dtype):
    """Fused.bind with the chunks spread over threads (each with scratch of its own: 3 devices sum through it),
    run again on new values: the bits execute_fused gives."""
    rng = np.random.default_rng(7)
    plan = planner.hierarchical_copy([0, 1, 2], [1000, 37], np.dtype(dtype).itemsize, num_packs=2)
    inputs = [[np.empty(1000, dtype), np.empty(37, dtype)] for _ in range(3)]
    result = np.dtype(mean_dtype(np.dtype(dtype))) if op == MEAN else np.dtype(dtype)
    sinks = {d: [np.empty(1000, result), np.empty(37, result)] for d in plan.destinations}
    bound = Fused(plan, inputs, sinks, chunk_bytes=256, threads=3).bind(inputs, sinks, op == MEAN)
    for _ in range(3):
        for component in inputs:
            for a in component:
                a[...] = values(rng, a.dtype, a.shape)
        want = execute_fused(plan, inputs, op == MEAN)
        assert bound.run()
        for d in plan.destinations:
            assert all(same_bits(got, w) for got, w in zip(sinks[d], want[d])), f"device {d}"


def test_only_contiguous_arrays_are_bound():
    """A flat view of a strided array would be a copy made once: later values would never be read."""
    plan = planner.hierarchical_copy([0, 1], [4], 4)
    inputs = [[np.zeros(8, np.float32)[::2]], [np.zeros(4, np.float32)]]
    sinks = {d: [np.empty(4, np.float32)] for d in plan.destinations}
    with pytest.raises(ValueError, match="C-contiguous"):
        Fused(plan, inputs, sinks).bind(inputs, sinks)


def test_a_bound_reduction_another_thread_runs_is_left_alone(engine):
    """One run at a time: a second caller is told to reduce another way, and nothing is written."""
    x = [np.ones(4, np.float32), np.full(4, 2, np.float32)]
    pairs, out = [(Value((0, 1), tuple(x)), ())], [{0: np.zeros(4, np.float32), 1: np.zeros(4, np.float32)}]
    bound = engine.prepare(SUM, pairs, out=out).bind(pairs, out)
    with bound._lock:
        assert bound.run() is False
    assert out[0][0].tolist() == [0.0] * 4
    assert bound.run() and out[0][1].tolist() == [3.0] * 4


def test_a_prepared_batch_that_writes_over_its_inputs_reads_them_first(engine):
    x = [np.arange(6, dtype=np.float32) * (k + 1) for k in range(3)]
    want = engine.batch_reduce(SUM, [(Value((0, 1, 2), tuple(a.copy() for a in x)), ())])[0].arrays[0]
    pairs = [(Value((0, 1, 2), tuple(x)), ())]
    out = [{0: x[2], 1: x[1], 2: x[0]}]  # each result over another device's input
    engine.prepare(SUM, pairs, out=out).run(pairs, out)
    assert all(a.tolist() == want.tolist() for a in x)


@pytest.mark.parametrize("elements", [6, 300_000])  # one chunk, and several
def test_destinations_given_one_array_have_it_written_once(engine, monkeypatch, elements):
    """output_one_copy's sinks: the sum goes into the one array, and no copy follows for the other destination
    (the runner sees one sink); given an array each, the second gets its copy."""
    x = [np.arange(elements, dtype=np.float32) * (k + 1) for k in range(2)]
    pairs = [(Value((0, 1), tuple(x)), ())]
    copies = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copies.append(dst.size), real(dst, src, **kw)))
    for shared in (True, False):
        copies.clear()
        out = [dict.fromkeys((0, 1), np.empty(elements, np.float32))] if shared else \
            [{d: np.empty(elements, np.float32) for d in (0, 1)}]
        engine.prepare(SUM, pairs, out=out).run(pairs, out)
        assert all(a.tolist() == (x[0] * 3).tolist() for a in out[0].values())
        assert sum(copies) == (0 if shared else elements)


def test_what_cannot_be_prepared_is_left_to_batch_reduce(engine):
    x = np.ones(4, np.float32)
    pair = (Value((0, 1), (x, x)), ())

    def out(*devices):
        return [{d: np.empty(4, np.float32) for d in devices}]

    assert engine.prepare(SUM, [pair], out=out(0)) is None  # a destination without an out array
    assert engine.prepare(SUM, [pair], algorithm=planner.REDUCTION_TO_ONE_DEVICE, out=out(0, 1)) is None
    assert engine.prepare(SUM, [(Value((0, 1), (x, x)), (2,))], out=[{2: np.empty(4, np.float32)}]) is None
    assert engine.prepare(SUM, [(Value((3,), (x,)), ())], out=out(3)) is None  # one device: TF's identity
    strided = np.empty(8, np.float32)[::2]
    assert engine.prepare(SUM, [pair], out=[{0: np.empty(4, np.float32), 1: strided}]) is None
    with pytest.raises(InvalidArgument, match="reduce_op must be SUM or MEAN"):
        engine.prepare("MAX", [pair], out=out(0, 1))
