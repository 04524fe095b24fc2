"""The xreduce_bench package: outside what ``import xreduce`` loads, on the SDK's public API, with its own oracle."""

from __future__ import annotations

import ast
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest
import xreduce_bench
from xreduce import _cli
from xreduce_bench import oracle
from xreduce_bench.sweep import Sweep

PACKAGE = pathlib.Path(xreduce_bench.__file__).parent
COMMAND_MODULES = ("command", "oracle", "peers", "sweep", "table", "workers", "workloads", "daemon_memory", "floor",
                   "big", "big_report", "big_workers", "footprint")


def sweep(op: str, dtype: str, reduce_op: str, ranks: int) -> Sweep:
    return Sweep(op, dtype, reduce_op, (4,), processes=ranks, devices=1, iters=1, warmup=0)


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_the_bench_command_uses_only_public_sdk_names(module):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "xreduce":
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            private += [n for n in names if any(part.startswith("_") for part in n.split("."))]
        elif isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("xreduce._")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "xreduce":
            private += [f"xreduce.{node.attr}"] if node.attr.startswith("_") else []
    assert private == []


def test_xreduce_bench_without_the_package_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xreduce_bench", None)
    assert _cli.main(["bench", "--embedded"]) == 2
    assert "pip install '.[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint32"])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_an_integer_mean_is_the_exact_mean(dtype, ranks):
    s = sweep("all_reduce", dtype, "mean", ranks)
    exact = (ranks + 1) / 2
    assert oracle.expected(s) == exact and oracle.tolerance(s) == 0.0
    promoted = np.full(5, exact, np.float32 if np.dtype(dtype).itemsize <= 2 else np.float64)
    assert oracle.wrong_elements([promoted, promoted], s) == 0


@pytest.mark.parametrize("dtype", ["int16", "int32", "uint8"])
def test_a_mean_rule_that_keeps_integers_shows_as_wrong_elements(dtype):
    """TF promotes an integer MEAN; a rule that kept the dtype would truncate 1.5 and 2.5."""
    for ranks in (2, 4):
        s = sweep("reduce", dtype, "mean", ranks)
        truncated = np.full(7, sum(range(1, ranks + 1)) // ranks, dtype)
        assert oracle.wrong_elements([truncated], s) == 7


def test_an_integer_sum_wraps_as_the_dtype_does():
    s = Sweep("all_reduce", "int8", "sum", (1,), processes=1, devices=16, iters=1, warmup=0)
    total = np.sum(np.arange(1, 17, dtype=np.int8), dtype=np.int8)  # 136 wraps to -120
    assert oracle.expected(s) == -120.0
    assert oracle.wrong_elements([np.full(3, total)], s) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
def test_floating_results_are_checked_against_the_float64_answer(dtype):
    s = sweep("all_reduce", dtype, "mean", 4)
    right = np.full(4, 2.5).astype(np.dtype(dtype))
    off = right.copy()
    off[1] = np.asarray(2.5 * (1 + 64 * float(ml_dtypes.finfo(right.dtype).eps))).astype(right.dtype)
    off[2] = np.nan
    assert oracle.wrong_elements([right], s) == 0
    assert oracle.wrong_elements([off], s) == 2


def test_a_broadcast_delivers_the_first_device_value():
    s = sweep("broadcast", "float32", "sum", 4)
    assert oracle.expected(s) == 1.0
    assert oracle.wrong_elements([np.ones(3, np.float32), np.full(3, 2.0, np.float32)], s) == 3
