"""``xreduce bench --big-tensors`` with tiny sizes: its output, its JSON, its checks of the results and its skips.

It starts its own daemon and worker processes. These tests check what it prints and writes, and that every
result was verified; never how fast anything is, nor how much memory it took.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (the bench extra)")
SIZES = [1 << 20, 4 << 20]
TOO_BIG = 1 << 40  # 1 TiB per replica: skipped by the fit rule on any machine these tests run on
TARGETS = ["steady <= 0.5x gloo at every size", "first call <= 2x steady at every size",
           "peak footprint above baseline <= 1.2x gloo's at every size", "s/GiB at 4 MiB within 1.2x of 1 MiB"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xreduce._cli", "bench", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))


def check_system(system: dict, processes: int, iters: int) -> None:
    assert system["failed"] is None
    fields = {"samples", "peak", "median", "shm", "processes", "shm_low", "disturbed"}
    names = {f"process {k}" for k in range(processes)} | ({"daemon"} if system["name"] == "xreduce" else set())
    baseline = system["baseline"]
    assert set(baseline) == fields
    assert [s["size"] for s in system["sizes"]] == SIZES
    for s in system["sizes"]:
        assert s["wrong"] == 0  # a few elements of every call, every element of the last
        assert len(s["times_s"]) == iters and s["first_s"] == s["times_s"][0]
        assert s["s_per_gib"] == pytest.approx(s["steady_s"] / (s["size"] / (1 << 30)))
        memory = s["memory"]
        assert set(memory) == fields and set(memory["processes"]) == names
        # The sampler's thread may find no moment in a window on a busy machine: then nothing is claimed. The
        # footprint's /dev/shm part moves with other processes' shared memory: no claim on its sign.
        if memory["samples"] and baseline["samples"]:
            assert s["peak_above_baseline"] == memory["peak"] - baseline["median"]
            assert memory["peak"] >= memory["median"] and memory["shm"] >= memory["shm_low"]
            assert memory["disturbed"] == (memory["shm_low"] < 0)
            assert all(p["rss_anon"] > 0 for p in memory["processes"].values())
        else:
            assert s["peak_above_baseline"] is None


@TORCH
@pytest.mark.parametrize("form", ["in-place", "no-in-place", "shared-array"])
def test_a_tiny_sweep_prints_the_table_and_writes_verified_json(tmp_path, form):
    out_json = tmp_path / "big.json"
    sizes = "1MiB,4MiB,1TiB"
    in_place = form != "no-in-place"
    result = bench("--big-tensors", "--sizes", sizes, "--processes", "2", "--iters", "2", "--peers", "gloo",
                   "--json", str(out_json), *([] if form == "in-place" else [f"--{form}"]))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("# xreduce bench --big-tensors: all-reduce, float32, sum, one replica per process ("
                          + ("out=v, in place" if in_place else "no out=: the SDK allocates each result")
                          + ("; v an xreduce.shared_array" if form == "shared-array" else "; v a numpy array")
                          + "); sizes 1 MiB, 4 MiB, 1024 GiB; processes 2; 2 calls per size; peers: gloo\n")
    assert "\n## 2 processes\n" in out
    assert re.search(r"^# 1024 GiB: skipped: needs ~4506\.6 GiB, MemAvailable [\d.]+ GiB$", out, re.MULTILINE)
    call = 'reduce("sum", v, v, out=v)' if in_place else 'reduce("sum", v, v) (not in place)'
    call += " of an xreduce.shared_array" if form == "shared-array" else " of a numpy array"
    assert f"# xreduce: 2 processes x 1 replica, HierarchicalCopyAllReduce().{call}; daemon unix:" in out
    assert re.search(r"^# gloo: torch \S+, 2 processes, dist\.all_reduce\(t\) in place$", out, re.MULTILINE)
    rows = [line.split() for line in out.splitlines() if re.match(r" +[14] MiB +[\d.]+ ", line)]
    assert [r[:2] for r in rows] == [["1", "MiB"], ["4", "MiB"]]
    assert [r[-2:] for r in rows] == [["4", "0/0"], ["16", "0/0"]]  # 2PS in MiB, #wrong of xreduce and gloo
    lines = out.splitlines()
    for target in TARGETS:
        assert any(re.fullmatch(rf"2 processes: {re.escape(target)}: (PASS|FAIL) \(.+\)", line) for line in lines)

    data = json.loads(out_json.read_text())
    assert data["about"]["in_place"] is in_place and data["about"]["iters"] == 2
    assert data["about"]["shared_array"] is (form == "shared-array")
    assert data["about"]["sizes"] == [*SIZES, TOO_BIG]
    (run,) = data["runs"]
    assert run["processes"] == 2 and run["sizes"] == [*SIZES, TOO_BIG]
    assert list(run["skipped"]) == [str(TOO_BIG)]
    assert run["bounds_2ps"][str(SIZES[1])] == 4 * SIZES[1]
    check_system(run["xreduce"], 2, 2)
    check_system(run["gloo"], 2, 2)
    assert [t["target"] for t in run["targets"]] == TARGETS
    assert all(t["verdict"] in ("PASS", "FAIL") for t in run["targets"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "6"], "--sizes: every size must be a whole number of float32 elements (4 bytes); got '6'"),
    (["--sizes", "lots"], "--sizes: comma-separated sizes such as 64MiB,1MiB; got 'lots'"),
    (["--processes", "1"], "--processes: comma-separated integers in [2, 64] without repeats; got '1'"),
    (["--processes", "2,2"], "--processes: comma-separated integers in [2, 64] without repeats; got '2,2'"),
    (["--iters", "1"], "--iters must be >= 2 with --big-tensors (call 1 is the first call, the others the steady "
                       "state); got 1"),
    (["--peers", "mpi"], "--peers: --big-tensors compares with gloo alone (gloo, or none); got 'mpi'"),
    (["--dtype", "float64"], "--dtype does not apply with --big-tensors"),
    (["--warmup", "1"], "--warmup does not apply with --big-tensors"),
    (["--nodes", "2"], "--big-tensors and --nodes are two benchmarks: run one at a time"),
])
def test_bad_options_name_the_option_and_the_value(argv, message):
    result = bench("--big-tensors", *argv)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "1MiB"], "--sizes needs --big-tensors"),
    (["--no-in-place"], "--no-in-place needs --big-tensors"),
    (["--shared-array"], "--shared-array needs --big-tensors"),
    (["--processes", "2,4"], "--processes: a whole number >= 1 (several counts need --big-tensors); got '2,4'"),
])
def test_big_tensor_options_need_the_mode(argv, message):
    result = bench("--embedded", *argv)
    assert result.returncode == 2
    assert message in result.stderr
