"""The planner (routing, packing, placement) and the executor on the numpy backend.

The expected values here are written out from TF's rules independently of the
planner: ``aggregate_gradients_using_hierarchical_copy`` (two halves of
``G = N // 2`` devices, per pack ``i`` group 0's main device is ``i % N`` and
group 1's is ``(i + G) % N``), ``_split_tensors`` (``total // k`` elements per
pack, the last pack takes the remainder) and the project's fix for odd ``N``
(the second half takes the extra device; each main device stays in its half).
"""

from __future__ import annotations

import numpy as np
import pytest
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.executor import execute
from xreduced.planner import (
    HIERARCHICAL_COPY,
    IDENTITY,
    REDUCTION_TO_ONE_DEVICE,
    Copy,
    Pack,
    Segment,
    Sum,
    broadcast,
    describe,
    groups,
    hierarchical_copy,
    is_all_reduce,
    main_positions,
    pack_bytes,
    reduction_to_one_device,
    split_packs,
)

NS = range(1, 9)


def n_id(n: int) -> str:
    return f"N{n}"


# --------------------------------------------------------------------------
# Independent statements of TF's rules.


def tf_halves(n: int) -> tuple[list[int], list[int]]:
    """Lower half ``[0, G)``; upper half ``[G, N)`` (it takes the odd device)."""
    g = n // 2
    return list(range(0, g)), list(range(g, n))


def tf_mains(i: int, n: int) -> tuple[int, int]:
    """TF's main devices for even ``n``: ``i % N`` and ``(i % N + G) % N``."""
    assert n % 2 == 0
    m0 = i % n
    return m0, (m0 + n // 2) % n


def tf_pack_sizes(elements: list[int], k: int) -> list[int]:
    if k == 0:
        return list(elements)
    total = sum(elements)
    size = total // k
    return [size] * (k - 1) + [total - size * (k - 1)]


def left_fold(exprs: list):
    acc = exprs[0]
    for e in exprs[1:]:
        acc = ("+", acc, e)
    return acc


def tf_hc_expression(n: int):
    """The symbolic result of hierarchical copy over positions ``0..n-1``."""
    lo, hi = tf_halves(n)
    if n == 1:
        return ("x", 0)
    return ("+", left_fold([("x", p) for p in lo]), left_fold([("x", p) for p in hi]))


# --------------------------------------------------------------------------
# Symbolic simulation of a plan.


def simulate(plan) -> dict[int, dict[int, dict[str, object]]]:
    """Runs ``plan`` on symbols; returns ``held[pack][device][buffer] = expr``.

    Checks, step by step, that a copy's buffer is on its source, that every input
    of a sum is on the sum's device, and that nothing is overwritten with a
    different value. Position ``p`` of the value holds ``("x", p)``.
    """
    held: dict[int, dict[int, dict[str, object]]] = {}
    for pack in plan.packs:
        held[pack.index] = {d: {f"in@{d}": ("x", p)} for p, d in enumerate(plan.devices)}
        for d in plan.destinations:
            held[pack.index].setdefault(d, {})
    for n, step in enumerate(plan.steps):
        on = held[step.pack]
        if isinstance(step, Copy):
            assert step.src != step.dst, f"step {n} copies {step.buffer} onto its own device"
            assert step.buffer in on.get(step.src, {}), (
                f"step {n}: copy of {step.buffer} from {step.src}, which does not hold it "
                f"(holds {sorted(on.get(step.src, {}))})"
            )
            value = on[step.src][step.buffer]
            dst = on.setdefault(step.dst, {})
            assert dst.get(step.buffer, value) == value, f"step {n} overwrites {step.buffer} on {step.dst}"
            dst[step.buffer] = value
        else:
            assert isinstance(step, Sum)
            here = on.get(step.device, {})
            missing = [b for b in step.inputs if b not in here]
            assert not missing, f"step {n}: sum on {step.device} before {missing} reached it"
            value = left_fold([here[b] for b in step.inputs])
            assert here.get(step.out, value) == value, f"step {n} overwrites {step.out} on {step.device}"
            here[step.out] = value
    return held


def test_simulator_rejects_bad_plans():
    import dataclasses

    good = hierarchical_copy(range(4), [4], 4)
    simulate(good)
    early_sum = dataclasses.replace(good, steps=(good.steps[1], good.steps[0]) + good.steps[2:])
    with pytest.raises(AssertionError, match="before"):
        simulate(early_sum)
    wrong_src = dataclasses.replace(good, steps=(Copy(0, "in@1", 2, 0, 16),) + good.steps[1:])
    with pytest.raises(AssertionError, match="does not hold it"):
        simulate(wrong_src)
    swapped = tuple(
        Sum(s.pack, s.device, s.inputs[::-1], s.out) if isinstance(s, Sum) and s.out == "total" else s
        for s in good.steps
    )
    held = simulate(dataclasses.replace(good, steps=swapped))
    assert held[0][0]["total"] != tf_hc_expression(4)


# --------------------------------------------------------------------------
# Groups and main devices.


@pytest.mark.parametrize("n", NS, ids=n_id)
def test_groups_split_in_two_halves(n):
    lo, hi = groups(n)
    want_lo, want_hi = tf_halves(n)
    assert list(lo) == want_lo
    assert list(hi) == want_hi
    assert len(lo) == n // 2


def test_main_devices_one_device():
    assert [main_positions(i, 1) for i in range(3)] == [(0, 0)] * 3


@pytest.mark.parametrize("n", range(2, 9), ids=n_id)
def test_main_devices_rotate_as_tf(n):
    lo, hi = tf_halves(n)
    for i in range(3 * n + 1):
        m0, m1 = main_positions(i, n)
        assert m0 == i % n, f"pack {i}: group 0's main must be i % N"
        if n % 2 == 0:
            assert (m0, m1) == tf_mains(i, n), f"pack {i}"
        own, other = (lo, hi) if m0 in lo else (hi, lo)
        assert m0 in own
        assert m1 in other, f"pack {i}: group 1's main {m1} is not in the other half {other}"
        if (i + n // 2) % n in other:
            assert m1 == (i + n // 2) % n, f"pack {i}: TF's (i + G) % N lies in the other half"


@pytest.mark.parametrize(
    "n, expected",
    [
        pytest.param(3, [(0, 1), (1, 0), (2, 0)], id="N3"),
        pytest.param(5, [(0, 2), (1, 3), (2, 0), (3, 0), (4, 1)], id="N5"),
        pytest.param(7, [(0, 3), (1, 4), (2, 5), (3, 0), (4, 0), (5, 1), (6, 2)], id="N7"),
    ],
)
def test_main_devices_odd_n_examples(n, expected):
    assert [main_positions(i, n) for i in range(n)] == expected


# --------------------------------------------------------------------------
# Packing.


@pytest.mark.parametrize(
    "elements, k",
    [
        ([10], 0),
        ([10], 1),
        ([10], 2),
        ([10], 3),
        ([10], 11),
        ([10], 25),
        ([3, 4], 0),
        ([3, 4], 1),
        ([3, 4], 2),
        ([3, 4], 3),
        ([3, 4], 8),
        ([5, 0, 7, 1], 0),
        ([5, 0, 7, 1], 3),
        ([5, 0, 7, 1], 14),
        ([0], 2),
        ([1, 1, 1], 2),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, list) else f"k{v}",
)
def test_pack_sizes_follow_tf_split(elements, k):
    packs = split_packs(elements, k)
    assert [p.elements for p in packs] == tf_pack_sizes(elements, k)
    assert [p.index for p in packs] == list(range(len(packs)))
    for p in packs:
        assert sum(s.stop - s.start for s in p.segments) == p.elements


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7, 20, 50], ids=lambda k: f"k{k}")
def test_segments_cover_every_element_once_in_order(k):
    elements = [6, 0, 1, 9, 4]
    packs = split_packs(elements, k)
    covered = [(s.tensor, e) for p in packs for s in p.segments for e in range(s.start, s.stop)]
    assert covered == [(t, e) for t, n in enumerate(elements) for e in range(n)]
    for p in packs:
        for s in p.segments:
            assert 0 <= s.start <= s.stop <= elements[s.tensor]
            if k > 0:
                assert s.start < s.stop, f"pack {p.index} holds an empty segment {s}"


def test_split_packs_k_zero_is_one_pack_per_tensor():
    assert split_packs([3, 0, 2], 0) == (
        Pack(0, (Segment(0, 0, 3),), 3),
        Pack(1, (Segment(1, 0, 0),), 0),
        Pack(2, (Segment(2, 0, 2),), 2),
    )


def test_split_packs_spans_tensors():
    assert split_packs([3, 4], 2) == (
        Pack(0, (Segment(0, 0, 3),), 3),
        Pack(1, (Segment(1, 0, 4),), 4),
    )
    assert split_packs([3, 4], 3) == (
        Pack(0, (Segment(0, 0, 2),), 2),
        Pack(1, (Segment(0, 2, 3), Segment(1, 0, 1)), 2),
        Pack(2, (Segment(1, 1, 4),), 3),
    )


def test_more_packs_than_elements_leaves_leading_packs_empty():
    packs = split_packs([2, 1], 5)
    assert [p.elements for p in packs] == [0, 0, 0, 0, 3]
    assert [p.segments for p in packs[:4]] == [()] * 4
    assert packs[4].segments == (Segment(0, 0, 2), Segment(1, 0, 1))


@pytest.mark.parametrize("k", [-1, -5], ids=lambda k: f"k{k}")
def test_negative_num_packs_raises(k):
    with pytest.raises(ValueError, match=f"num_packs must be >= 0; got num_packs={k}"):
        split_packs([4], k)
    with pytest.raises(ValueError, match="num_packs"):
        hierarchical_copy([0, 1], [4], 4, num_packs=k)


def test_pack_bytes_mixes_itemsizes():
    pack = split_packs([3, 4], 3)[1]  # 1 element of tensor 0, 1 of tensor 1
    assert pack_bytes(pack, [4, 8]) == 12
    plan = hierarchical_copy([0, 1], [3, 4], [4, 8], num_packs=3)
    assert [plan.pack_bytes(p) for p in plan.packs] == [8, 12, 24]


# --------------------------------------------------------------------------
# Hierarchical copy plans.


HC_CASES = [
    pytest.param(list(range(n)), elements, k, id=f"N{n}-{'x'.join(map(str, elements))}-k{k}")
    for n in NS
    for elements, k in [([8], 1), ([5, 3, 0], 0), ([5, 3, 0], 2), ([5, 3], 3), ([2], 4)]
] + [
    pytest.param([3, 1, 0, 2], [6], 4, id="permuted-3102-k4"),
    pytest.param([6, 4, 2], [5, 2], 0, id="sparse-642-k0"),
    pytest.param([7, 0, 5, 1, 2], [9], 5, id="permuted-70512-k5"),
]


@pytest.mark.parametrize("devices, elements, k", HC_CASES)
def test_hierarchical_copy_every_device_gets_the_total(devices, elements, k):
    plan = hierarchical_copy(devices, elements, 4, num_packs=k)
    n = len(devices)
    assert plan.devices == plan.destinations == tuple(devices)
    held = simulate(plan)
    want = tf_hc_expression(n)
    for pack in plan.packs:
        for d in devices:
            assert held[pack.index][d].get(plan.result) == want, (
                f"pack {pack.index}, device {d}: {plan.result} is "
                f"{held[pack.index][d].get(plan.result)}, want {want}"
            )
    if n == 1:
        assert plan.algorithm == IDENTITY
        assert plan.steps == ()
        assert plan.result == f"in@{devices[0]}"
    else:
        assert plan.algorithm == HIERARCHICAL_COPY
        assert plan.result == "total"


@pytest.mark.parametrize("devices, elements, k", [c for c in HC_CASES if len(c.values[0]) > 1])
def test_hierarchical_copy_placement(devices, elements, k):
    """Group sums on the group's main, the total on group 0's main, lower half's partial first."""
    n = len(devices)
    plan = hierarchical_copy(devices, elements, 4, num_packs=k)
    lo, hi = tf_halves(n)
    for pack in plan.packs:
        p0, p1 = main_positions(pack.index, n)
        m0, m1 = devices[p0], devices[p1]
        steps = [s for s in plan.steps if s.pack == pack.index]
        sums = [s for s in steps if isinstance(s, Sum)]
        total = [s for s in sums if s.out == "total"]
        assert len(total) == 1
        assert total[0].device == m0
        assert sums[-1] is total[0]
        lo_main, hi_main = (m0, m1) if p0 in lo else (m1, m0)
        lo_partial = f"in@{devices[lo[0]]}" if len(lo) == 1 else f"partial@{lo_main}"
        hi_partial = f"in@{devices[hi[0]]}" if len(hi) == 1 else f"partial@{hi_main}"
        assert total[0].inputs == (lo_partial, hi_partial)
        for s in sums[:-1]:
            assert s.device in (m0, m1)
            half = lo if s.device == lo_main else hi
            assert s.inputs == tuple(f"in@{devices[p]}" for p in half)
        # Only the two main devices talk across the halves.
        side = {devices[p]: 0 for p in lo} | {devices[p]: 1 for p in hi}
        for c in (s for s in steps if isinstance(s, Copy)):
            if side[c.src] != side[c.dst]:
                assert {c.src, c.dst} == {m0, m1}, f"pack {pack.index}: {c} crosses the halves"


@pytest.mark.parametrize("n", [2, 4, 6, 8], ids=n_id)
def test_hierarchical_copy_uses_dgx1_links_only(n):
    from xreduced.backends import dgx1_peer_matrix

    peer = dgx1_peer_matrix(n)
    plan = hierarchical_copy(range(n), [16], 4, num_packs=2 * n)
    for c in (s for s in plan.steps if isinstance(s, Copy)):
        assert peer[c.src][c.dst], f"{c} is not a DGX-1 link"


@pytest.mark.parametrize("n", range(2, 9), ids=n_id)
@pytest.mark.parametrize("itemsize", [2, 4, 8], ids=lambda s: f"{s}B")
def test_hierarchical_copy_byte_counts(n, itemsize):
    elements = [7, 5]
    plan = hierarchical_copy(range(n), elements, itemsize, num_packs=3)
    sizes = tf_pack_sizes(elements, 3)
    for pack, size in zip(plan.packs, sizes):
        copies = [s for s in plan.steps if isinstance(s, Copy) and s.pack == pack.index]
        # (members - 1) in and out of each half, one partial across, one total back.
        assert len(copies) == 2 * (n - 2) + 2
        assert {c.nbytes for c in copies} == {size * itemsize}
    assert plan.copied_bytes == (2 * n - 2) * sum(sizes) * itemsize
    assert plan.itemsizes == (itemsize, itemsize)


def test_hierarchical_copy_four_devices_exact_steps():
    plan = hierarchical_copy(range(4), [8], 4, num_packs=2)
    assert plan.steps == (
        Copy(0, "in@1", 1, 0, 16),
        Sum(0, 0, ("in@0", "in@1"), "partial@0"),
        Copy(0, "in@3", 3, 2, 16),
        Sum(0, 2, ("in@2", "in@3"), "partial@2"),
        Copy(0, "partial@2", 2, 0, 16),
        Sum(0, 0, ("partial@0", "partial@2"), "total"),
        Copy(0, "total", 0, 2, 16),
        Copy(0, "total", 0, 1, 16),
        Copy(0, "total", 2, 3, 16),
        Copy(1, "in@0", 0, 1, 16),
        Sum(1, 1, ("in@0", "in@1"), "partial@1"),
        Copy(1, "in@2", 2, 3, 16),
        Sum(1, 3, ("in@2", "in@3"), "partial@3"),
        Copy(1, "partial@3", 3, 1, 16),
        Sum(1, 1, ("partial@1", "partial@3"), "total"),
        Copy(1, "total", 1, 3, 16),
        Copy(1, "total", 1, 0, 16),
        Copy(1, "total", 3, 2, 16),
    )


def test_hierarchical_copy_upper_main_adds_lower_partial_first():
    # Pack 2 of 4 devices: group 0 is the upper half (main 2), group 1's main is 0.
    plan = hierarchical_copy(range(4), [1, 1, 1], 4, num_packs=0)
    total = [s for s in plan.steps if isinstance(s, Sum) and s.pack == 2 and s.out == "total"]
    assert total == [Sum(2, 2, ("partial@0", "partial@2"), "total")]


# --------------------------------------------------------------------------
# Reduction to one device, broadcast, routing.


@pytest.mark.parametrize(
    "devices, dests, reduce_to, target",
    [
        ([0, 1, 2], [3], None, 3),
        ([0, 1, 2], [1, 3], None, 1),
        ([0, 1, 2], [2, 0], None, 2),
        ([0, 1, 2, 3], [5, 6, 7], 6, 6),
        ([0, 1, 2, 3], [5, 6], 0, 0),
        ([4], [1, 2], None, 1),
        ([2, 0, 1], [0], None, 0),
    ],
    ids=["one-dest-outside", "first-dest-member", "dest-order", "reduce-to-dest",
         "reduce-to-outside-dests", "single-component", "permuted-value"],
)
def test_reduction_to_one_device(devices, dests, reduce_to, target):
    plan = reduction_to_one_device(devices, dests, [5, 2], 8, reduce_to=reduce_to)
    assert plan.algorithm == REDUCTION_TO_ONE_DEVICE
    assert plan.devices == tuple(devices) and plan.destinations == tuple(dests)
    assert [p.elements for p in plan.packs] == [5, 2]
    held = simulate(plan)
    want = left_fold([("x", p) for p in range(len(devices))])
    for pack in plan.packs:
        steps = [s for s in plan.steps if s.pack == pack.index]
        sums = [s for s in steps if isinstance(s, Sum)]
        assert sums == [Sum(pack.index, target, tuple(f"in@{d}" for d in devices), "total")]
        gathers = [(s.src, s.dst) for s in steps[: steps.index(sums[0])]]
        assert gathers == [(d, target) for d in devices if d != target]
        scatters = [(s.src, s.dst) for s in steps[steps.index(sums[0]) + 1:]]
        assert scatters == [(target, d) for d in dests if d != target]
        for s in steps:
            if isinstance(s, Copy):
                assert s.nbytes == pack.elements * 8
        for d in dests:
            assert held[pack.index][d]["total"] == want


def test_reduction_to_one_device_needs_a_destination():
    with pytest.raises(ValueError, match=r"destinations must name at least one device; got \[\]"):
        reduction_to_one_device([0, 1], [], [4], 4)


@pytest.mark.parametrize(
    "source, dests, copies",
    [(0, [0, 2], [(0, 2)]), (3, [1, 2, 3], [(3, 1), (3, 2)]), (1, [1], []), (5, [0, 7], [(5, 0), (5, 7)])],
    ids=["source-in-dests", "three-dests", "only-source", "source-outside"],
)
def test_broadcast_plan(source, dests, copies):
    plan = broadcast(source, dests, 6, 2)
    assert plan.algorithm == IDENTITY
    assert plan.devices == (source,) and plan.destinations == tuple(dests)
    assert plan.result == f"in@{source}"
    assert [(s.src, s.dst) for s in plan.steps] == copies
    assert all(isinstance(s, Copy) and s.buffer == f"in@{source}" and s.nbytes == 12 for s in plan.steps)
    held = simulate(plan)
    for d in dests:
        assert held[0][d][plan.result] == ("x", 0)


@pytest.mark.parametrize(
    "devices, dests, expected",
    [([0, 1], None, True), ([0, 1], [], True), ([0, 1], [1, 0], True), ([0, 1], [0], False),
     ([0, 1], [0, 1, 2], False), ([2], [2], True)],
    ids=["none", "empty", "same-set", "subset", "superset", "single"],
)
def test_is_all_reduce(devices, dests, expected):
    assert is_all_reduce(devices, dests) is expected


# --------------------------------------------------------------------------
# describe()


def test_describe_hierarchical_copy_exact():
    text = describe(hierarchical_copy(range(4), [8], 4, num_packs=1))
    assert text == "\n".join([
        "hierarchical_copy over 4 devices [0, 1, 2, 3], 1 pack(s), 32 B per device",
        "pack 0 (8 elements, 32 B): main devices 0 and 2",
        "  copy in@1: 1 -> 0 (32 B)",
        "  sum on 0: in@0 + in@1 -> partial@0",
        "  copy in@3: 3 -> 2 (32 B)",
        "  sum on 2: in@2 + in@3 -> partial@2",
        "  copy partial@2: 2 -> 0 (32 B)",
        "  sum on 0: partial@0 + partial@2 -> total",
        "  copy total: 0 -> 2 (32 B)",
        "  copy total: 0 -> 1 (32 B)",
        "  copy total: 2 -> 3 (32 B)",
        "total copied: 192 B",
    ])


def test_describe_names_every_step():
    plan = hierarchical_copy([3, 1, 0, 2, 5], [4, 4], 2, num_packs=3)
    lines = describe(plan).splitlines()
    for s in plan.steps:
        if isinstance(s, Copy):
            line = f"  copy {s.buffer}: {s.src} -> {s.dst} ({s.nbytes} B)"
        else:
            line = f"  sum on {s.device}: {' + '.join(s.inputs)} -> {s.out}"
        assert line in lines
    for p in plan.packs:
        m0, m1 = main_positions(p.index, 5)
        assert any(
            line.startswith(f"pack {p.index} ({p.elements} elements") and
            line.endswith(f"main devices {plan.devices[m0]} and {plan.devices[m1]}")
            for line in lines
        )
    assert lines[-1] == f"total copied: {plan.copied_bytes} B"


def test_describe_reduction_to_one_device_and_identity():
    text = describe(reduction_to_one_device([0, 1], [2, 0], [3], 4))
    assert "pack 0 (3 elements, 12 B): sum on device 2" in text
    assert "  sum on 2: in@0 + in@1 -> total" in text
    assert "  copy total: 2 -> 0 (12 B)" in text
    assert "total copied: 36 B" in text
    ident = describe(hierarchical_copy([5], [2], 4))
    assert ident.splitlines() == ["identity over 1 devices [5], 1 pack(s), 8 B per device",
                                  "pack 0 (2 elements, 8 B)"]


def test_describe_uses_binary_units():
    text = describe(hierarchical_copy([0, 1], [1 << 18], 4))
    assert "1 MiB per device" in text
    assert "copy in@1: 1 -> 0 (1 MiB)" in text
    assert "total copied: 2 MiB" in text


# --------------------------------------------------------------------------
# The executor on the numpy backend.

SHAPES = [(3, 4), (5,), (), (0, 2), (2, 1, 3)]


def random_batch(rng, n: int, dtype, shapes=SHAPES) -> list[list[np.ndarray]]:
    def one(shape):
        if dtype == np.float32:
            return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)
        if dtype == np.float16:
            return rng.uniform(-60, 60, shape).astype(np.float16)
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)

    return [[one(s) for s in shapes] for _ in range(n)]


def reference_all_reduce(xs: list[np.ndarray]) -> np.ndarray:
    """``(x0 + .. + x[G-1]) + (x[G] + .. + x[N-1])``, every add in the dtype."""
    n = len(xs)
    if n == 1:
        return xs[0]
    g = n // 2

    def fold(part):
        acc = part[0].copy()
        for x in part[1:]:
            acc = np.add(acc, x, dtype=acc.dtype)
        return acc

    return np.add(fold(xs[:g]), fold(xs[g:]), dtype=xs[0].dtype)


def assert_bit_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{what}: {got!r} != {want!r}"


@pytest.mark.parametrize("k", [0, 1, 2, 3], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", NS, ids=n_id)
def test_execute_matches_reference_fold(n, dtype, k):
    rng = np.random.default_rng([n, k, np.dtype(dtype).num])
    inputs = random_batch(rng, n, dtype)
    plan = hierarchical_copy(range(n), [int(np.prod(s)) for s in SHAPES], np.dtype(dtype).itemsize, k)
    out = execute(plan, NumpyBackend(n), inputs)
    assert sorted(out) == list(range(n))
    for t in range(len(SHAPES)):
        want = reference_all_reduce([inputs[p][t] for p in range(n)])
        for d in range(n):
            assert_bit_equal(out[d][t], want, f"tensor {t} on device {d}")


def test_execute_keeps_tf_association():
    # A left fold gives 1 here; TF's (x0 + x1) + (x2 + x3) gives 0.
    x = [np.array([v], np.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    out = execute(hierarchical_copy(range(4), [1], 4), NumpyBackend(4), [[a] for a in x])
    for d in range(4):
        assert out[d][0].tolist() == [0.0]


def test_execute_permuted_devices_folds_in_value_order():
    devices = [5, 2, 7, 0, 3]
    rng = np.random.default_rng(7)
    inputs = random_batch(rng, len(devices), np.float32, [(4, 3)])
    plan = hierarchical_copy(devices, [12], 4, num_packs=2)
    out = execute(plan, NumpyBackend(8), inputs)
    want = reference_all_reduce([c[0] for c in inputs])
    for d in devices:
        assert_bit_equal(out[d][0], want, f"device {d}")


@pytest.mark.parametrize("n", [2, 3, 5], ids=n_id)
def test_execute_mixed_dtypes_without_packing(n):
    rng = np.random.default_rng(n)
    inputs = [
        [rng.standard_normal(4).astype(np.float32), rng.integers(-100, 100, (2, 2)).astype(np.int64),
         rng.standard_normal(3).astype(np.float16)]
        for _ in range(n)
    ]
    plan = hierarchical_copy(range(n), [4, 4, 3], [4, 8, 2], num_packs=0)
    out = execute(plan, NumpyBackend(n), inputs)
    for t in range(3):
        want = reference_all_reduce([c[t] for c in inputs])
        for d in range(n):
            assert_bit_equal(out[d][t], want, f"tensor {t} on device {d}")


def test_execute_inputs_are_not_modified():
    inputs = [[np.arange(6, dtype=np.float32).reshape(2, 3) + p] for p in range(4)]
    before = [c[0].copy() for c in inputs]
    execute(hierarchical_copy(range(4), [6], 4, 2), NumpyBackend(4), inputs)
    for c, b in zip(inputs, before):
        assert_bit_equal(c[0], b, "input")


MEAN_DTYPES = [
    ("int8", "float32"), ("uint8", "float32"), ("int16", "float32"), ("uint16", "float32"),
    ("int32", "float64"), ("uint32", "float64"), ("int64", "float64"), ("uint64", "float64"),
    ("float16", "float16"), ("float32", "float32"), ("float64", "float64"),
    ("complex64", "complex64"), ("complex128", "complex128"),
]


def reference_mean(total: np.ndarray, n: int, out_dtype: np.dtype) -> np.ndarray:
    if total.dtype.kind in "iu":
        return total.astype(out_dtype) / out_dtype.type(n)
    if total.dtype.kind == "c":
        part = np.finfo(total.dtype).dtype
        out = np.empty(total.shape, total.dtype)
        out.real = total.real / part.type(n)
        out.imag = total.imag / part.type(n)
        return out
    return total / total.dtype.type(n)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8], ids=n_id)
@pytest.mark.parametrize("dtype, out_dtype", MEAN_DTYPES, ids=[d for d, _ in MEAN_DTYPES])
def test_execute_mean_promotes_and_divides(n, dtype, out_dtype):
    dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
    rng = np.random.default_rng([n, dtype.num])
    shape = (3, 5)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        inputs = [rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True) for _ in range(n)]
    elif dtype.kind == "c":
        inputs = [(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype) for _ in range(n)]
    else:
        inputs = [rng.standard_normal(shape).astype(dtype) for _ in range(n)]
    out = execute(hierarchical_copy(range(n), [15], dtype.itemsize, 1), NumpyBackend(n),
                  [[x] for x in inputs], mean=True)
    want = reference_mean(reference_all_reduce(inputs), n, out_dtype)
    assert want.dtype == out_dtype
    for d in range(n):
        assert_bit_equal(out[d][0], want, f"device {d}")


def test_complex_mean_is_not_complex_division():
    # The rule divides the parts; numpy's complex division rounds differently.
    rng = np.random.default_rng(3)
    z = (rng.standard_normal(200) + 1j * rng.standard_normal(200)).astype(np.complex64)
    inputs = [[z], [z], [z]]
    out = execute(hierarchical_copy(range(3), [200], 8, 1), NumpyBackend(3), inputs, mean=True)[0][0]
    total = reference_all_reduce([z, z, z])
    assert_bit_equal(out, reference_mean(total, 3, np.dtype(np.complex64)), "mean")
    naive = total / np.complex64(3)
    assert out.tobytes() != naive.tobytes(), "pick data where complex division differs"


@pytest.mark.parametrize(
    "devices, dests, reduce_to",
    [([0, 1, 2], [3], None), ([0, 1, 2, 3, 4], [4, 1], None), ([2, 0, 1], [5, 6], 6)],
    ids=["outside", "member-first", "reduce-to"],
)
def test_execute_reduction_to_one_device_left_fold(devices, dests, reduce_to):
    rng = np.random.default_rng(len(devices))
    xs = [(rng.standard_normal(7) * 10.0 ** rng.uniform(-4, 4, 7)).astype(np.float32) for _ in devices]
    plan = reduction_to_one_device(devices, dests, [7], 4, reduce_to)
    out = execute(plan, NumpyBackend(8), [[x] for x in xs])
    want = xs[0]
    for x in xs[1:]:
        want = want + x
    assert sorted(out) == sorted(dests)
    for d in dests:
        assert_bit_equal(out[d][0], want, f"device {d}")


def test_execute_broadcast():
    x = np.arange(6, dtype=np.int16).reshape(3, 2)
    out = execute(broadcast(2, [0, 2, 5], 6, 2), NumpyBackend(8), [[x]])
    for d in (0, 2, 5):
        assert_bit_equal(out[d][0], x, f"device {d}")
