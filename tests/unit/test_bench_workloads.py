"""``xreduce bench --workload``: the built-in gradient sets, workload files, DDP's buckets and the oracle."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from xreduce_bench import oracle, workloads
from xreduce_bench.sweep import Sweep
from xreduce_bench.workloads import Workload


def test_resnet50_has_torchvisions_161_parameters():
    shapes = workloads.RESNET50_SHAPES
    assert len(shapes) == 161 and sum(math.prod(s) for s in shapes) == 25_557_032
    # the stem first, the classifier last, as model.parameters() yields them
    assert shapes[:3] == ((64, 3, 7, 7), (64,), (64,)) and shapes[-2:] == ((1000, 2048), (1000,))
    # 4 stages of 3, 4, 6 and 3 bottlenecks (9 parameters each), a downsampling conv and norm in each first one
    assert sum(1 for s in shapes if len(s) == 4 and s[2:] == (3, 3)) == 16
    assert sum(1 for s in shapes if len(s) == 4) == 1 + 16 * 3 + 4


def test_a_workload_file_is_a_list_of_shapes(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps([[2, 3], [5], []]))
    w = workloads.from_file(str(path))
    assert w == Workload("tiny", ((2, 3), (5,), ())) and w.elements == 12 and w.nbytes(4) == 48


@pytest.mark.parametrize("text, message", [
    ("[[2, 3], [4, -1]]", r"tiny.json\[1\]: a shape is a list of whole numbers >= 0; got \[4, -1\]"),
    ('[[2], "x"]', r"tiny.json\[1\]: a shape is a list of whole numbers >= 0; got 'x'"),
    ("[]", r"tiny.json: must be a non-empty JSON list of shapes"),
    ("[[0], [2, 0]]", r"every shape holds 0 elements"),
    ("[[2], [3]", r"tiny.json: not JSON"),
])
def test_a_bad_workload_file_is_named_with_the_entry(tmp_path, text, message):
    path = tmp_path / "tiny.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        workloads.from_file(str(path))


def test_ddp_buckets_follow_reverse_order_and_the_caps():
    # DDP: reverse registration order; a bucket closes once it holds the cap or more (1 MiB for the first)
    sizes = workloads.built_in("resnet50").sizes(4)
    buckets = workloads.ddp_buckets(sizes)
    assert [t for b in buckets for t in b] == list(reversed(range(161)))
    assert buckets[0] == [160, 159]  # the classifier's bias and its 8 MB weight pass 1 MiB at once
    for b in buckets[1:-1]:
        assert sum(sizes[t] for t in b) >= 25 << 20 > sum(sizes[t] for t in b[:-1])


@pytest.mark.parametrize("dtype, op, ranks", [("float32", "mean", 4), ("bfloat16", "mean", 3), ("int32", "sum", 2)])
def test_the_workload_oracle_is_exact(dtype, op, ranks):
    s = Sweep("all_reduce", dtype, op, (0,), processes=ranks, devices=1, iters=1, warmup=0,
              workload=Workload("w", ((3, 2), (5,))))
    inputs = [oracle.workload_inputs(s, g) for g in range(ranks)]
    for t in range(2):
        total = sum(np.asarray(x[t], np.float64) for x in inputs)
        want = total / ranks if op == "mean" else total
        np.testing.assert_array_equal(oracle.workload_expected(s, t), want)
    good = [[(want := oracle.workload_expected(s, t)).astype(np.float32)] for t in range(2)]
    assert oracle.workload_wrong(good, s) == 0
    good[1][0][2] += 1
    assert oracle.workload_wrong(good, s) == 1
