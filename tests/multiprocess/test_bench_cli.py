"""``xreduce bench`` against real daemons: the tables, the bus factor, --json, --plot and the peers.

Sizes stay tiny (4 B to 4 KiB, 2 iterations): these tests check what is printed and how it is
computed, never how fast anything is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

COLUMNS = ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
SIZES = [4 << i for i in range(11)]  # 4 B .. 4 KiB
TINY = ["--min-bytes", "4", "--max-bytes", "4KiB", "--iters", "2", "--warmup", "1"]


def bench(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "xreduce._cli", "bench", *args], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def sections(out: str) -> dict[str, list[str]]:
    """Each ``# NAME: ...`` section's lines (header comments dropped, rows kept)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"# (xreduce [\w:]+|gloo|mpi|echo|ratios|targets)\b", line)
        if m:
            current = m.group(1)
            found[current] = [line]
        elif re.match(r"# [a-z]", line):  # another section (the daemon's memory, the plot)
            current = None
        elif current is not None and line.strip():
            found[current].append(line)
    return found


def table(lines: list[str]) -> list[dict[str, str]]:
    """The rows of one system's table, keyed by the column names of its header."""
    header = lines[1].lstrip("#").split()
    assert header == COLUMNS
    return [dict(zip(header, line.split())) for line in lines[2:]]


def check_rows(rows: list[dict[str, str]], dtype: str, factor: float, echo: bool = False) -> None:
    assert [int(r["size(B)"]) for r in rows] == SIZES
    for r in rows:
        size, time_us, algbw = int(r["size(B)"]), float(r["time(us)"]), float(r["algbw(GB/s)"])
        assert int(r["count"]) == size // 4 and r["type"] == dtype
        assert time_us > 0
        # printed to four significant digits, the time to 0.1 us
        assert algbw == pytest.approx(size / (time_us * 1e3), rel=2e-3 + 0.06 / time_us)
        if echo:
            assert r["busbw(GB/s)"] == "-"
        else:
            assert float(r["busbw(GB/s)"]) / algbw == pytest.approx(factor, rel=2e-3)
        assert r["#wrong"] in ("0", "-")


@pytest.mark.slow
def test_two_processes_print_the_table_the_ratios_and_json(daemon, tmp_path):
    # the default transport, auto: shared memory here, where the daemon shares the host
    out = bench("--address", daemon.address, "--processes", "2", "--echo", "--json", str(tmp_path / "out.json"),
                *TINY).stdout
    assert out.startswith("# xreduce bench: all_reduce, float32, sum, 2 process(es) x 1 device(s): n = 2 ranks; "
                          "4 B to 4 KiB; 2 iterations after 1 warm-up\n")
    assert "busbw = algbw x 2(n-1)/n = 1\n" in out
    found = sections(out)
    auto = table(found["xreduce auto"])
    check_rows(auto, "float32", 1.0)
    assert all(r["#wrong"] == "0" and r["redop"] == "sum" for r in auto)
    check_rows(table(found["echo"]), "float32", 1.0, echo=True)
    ratios = found["ratios"]
    assert ratios[1].lstrip("#").split() == ["size(B)", "auto/echo"]
    auto_time = {int(r["size(B)"]): float(r["time(us)"]) for r in auto}
    echo_time = {int(r["size(B)"]): float(r["time(us)"]) for r in table(found["echo"])}
    for line in ratios[2:]:
        size, ratio = line.split()
        assert float(ratio) == pytest.approx(auto_time[int(size)] / echo_time[int(size)], rel=5e-3)
    assert re.fullmatch(r"2 processes x 4 B float32 all-reduce, auto: xreduce [\d.]+ us, gRPC echo [\d.]+ us, "
                        r"ratio [\d.]+ \(target <= 1\.2\): (met|not met)", found["targets"][1])

    data = json.loads((tmp_path / "out.json").read_text())
    assert data["sweep"]["ranks"] == 2 and data["sweep"]["bus_factor"] == 1.0
    assert data["sweep"]["sizes"] == SIZES
    systems = {s["name"]: s for s in data["systems"]}
    assert set(systems) == {"xreduce auto", "echo"}
    rows = systems["xreduce auto"]["rows"]
    assert [r["size"] for r in rows] == SIZES
    assert all(len(r["times_us"]) == 2 and r["wrong"] == 0 for r in rows)
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"]) for r in rows)
    assert data["targets"][0]["bound"] == 1.2


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the bench extra)")
def test_plot_writes_a_png(tmp_path):
    plot = tmp_path / "bw.png"
    out = bench("--embedded", "--devices", "2", "--max-bytes", "64", "--iters", "2", "--plot", str(plot)).stdout
    assert f"# plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the daemon started for the run was watched: its peak RSS against its stated bound
    assert re.search(r"^# daemon memory over the run \(\d+ samples, 50 ms\): idle RSS [\d.]+ MiB; peak RSS [\d.]+ MiB "
                     r"\(its own memory [\d.]+ MiB, .*\), VmHWM [\d.]+ MiB; bound: idle \+ "
                     r"--max-inflight-bytes 4096.0 MiB \+ 6 x largest message \d+ B = [\d.]+ MiB: within$",
                     out, re.MULTILINE)


def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    # matplotlib is a dev dependency: hide it from the bench's interpreter (a None entry in
    # sys.modules is how Python marks a module as not importable).
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["matplotlib"] = None\n')
    result = bench("--embedded", "--plot", str(tmp_path / "x.png"), *TINY, check=False,
                   env={"PYTHONPATH": str(hide)})
    assert result.returncode == 2
    assert "--plot needs matplotlib (pip install 'xreduce[bench]')" in result.stderr


@pytest.mark.slow
def test_one_process_odd_device_count_and_a_missing_peer():
    # three devices in one process: busbw = algbw x 2(n-1)/n = 4/3; mpirun is not on this PATH
    out = bench("--embedded", "--devices", "3", "--transport", "wire", "--peers", "mpi", *TINY,
                env={"PATH": ""}).stdout
    assert "1 process(es) x 3 device(s): n = 3 ranks" in out
    assert "busbw = algbw x 2(n-1)/n = 1.333\n" in out
    found = sections(out)
    check_rows(table(found["xreduce wire"]), "float32", 4 / 3)
    assert found["mpi"] == ["# mpi: skipped: mpirun is not on PATH (Debian: apt-get install openmpi-bin "
                            "libopenmpi-dev)"]
    assert "ratios" not in found


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (the bench extra)")
def test_gloo_peer_runs_the_same_sizes(daemon):
    out = bench("--address", daemon.address, "--processes", "2", "--peers", "gloo", *TINY).stdout
    found = sections(out)
    assert re.match(r"# gloo: torch \S+, 2 processes, one rank each$", found["gloo"][0])
    check_rows(table(found["gloo"]), "float32", 1.0)
    assert found["ratios"][1].lstrip("#").split() == ["size(B)", "auto/gloo"]
    assert [int(line.split()[0]) for line in found["ratios"][2:]] == SIZES


@pytest.mark.slow
def test_bad_arguments_name_the_values(daemon):
    result = bench("--address", daemon.address, "--processes", "3", "--devices", "3", *TINY, check=False)
    assert result.returncode == 2
    assert f"--processes 3 x --devices 3 needs 9 devices; the daemon at {daemon.address} has 8" in result.stderr
    result = bench("--address", daemon.address, "--peers", "nccl", check=False)
    assert result.returncode == 2 and "--peers: unknown peer(s) nccl; peers: gloo, mpi" in result.stderr
    result = bench("--address", daemon.address, "--transport", "wire,tcp", check=False)
    assert result.returncode == 2 and "--transport: a comma-separated list of wire, shm, auto" in result.stderr


def test_a_workload_file_runs_as_one_batch_checked_exact_with_its_peers(daemon, tmp_path):
    # three small gradients and one of 2 x 300 elements, 2 processes; gloo in DDP's buckets and MPI over a
    # fused buffer where they are installed; every result element checked against the oracle
    shapes = [[4, 3], [7], [2, 300], [1]]
    workload = tmp_path / "tiny.json"
    workload.write_text(json.dumps(shapes))
    peers = [p for p, module in (("gloo", "torch"), ("mpi", "mpi4py")) if importlib.util.find_spec(module)]
    out = bench("--address", daemon.address, "--processes", "2", "--workload-file", str(workload), "--reduce-op",
                "mean", "--num-packs", "0,1", "--iters", "2", "--warmup", "1", "--json", str(tmp_path / "w.json"),
                *(["--peers", ",".join(peers)] if peers else [])).stdout
    elements = 12 + 7 + 600 + 1
    assert out.startswith(f"# xreduce bench: all_reduce, float32, mean, 2 process(es) x 1 device(s): n = 2 ranks; "
                          f"workload tiny: 4 tensors, {elements} elements, 0.0 MiB per device, in one batch; ")
    found = sections(out)
    for name in ("xreduce auto:p0", "xreduce auto:p1"):
        assert found[name][0].endswith("XREDUCE_TRANSPORT=auto, num_packs=" + name[-1])
        (row,) = table(found[name])
        assert row["size(B)"] == str(4 * elements) and row["count"] == str(elements) and row["#wrong"] == "0"
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["sweep"]["workload"] == {"name": "tiny", "shapes": shapes}
    for peer in peers:
        (row,) = table(found[peer])
        assert row["#wrong"] == "0"
        assert any(t["peer"] == peer and t["bound"] == 0.6 for t in data["targets"])
    if peers:
        assert found["ratios"][1].lstrip("#").split() == ["size(B)", *(f"auto:p{k}/{p}" for k in (0, 1)
                                                                         for p in peers)]


def test_bad_workload_arguments_name_the_values(daemon, tmp_path):
    result = bench("--address", daemon.address, "--workload-file", str(tmp_path / "missing.json"), check=False)
    assert result.returncode == 2 and f"--workload-file {tmp_path / 'missing.json'}: " in result.stderr
    result = bench("--address", daemon.address, "--workload", "resnet50", "--op", "broadcast", check=False)
    assert result.returncode == 2 and "--workload and --workload-file all-reduce a batch; got --op broadcast" \
        in result.stderr
    result = bench("--address", daemon.address, "--workload", "resnet50", "--num-packs", "1,x", check=False)
    assert result.returncode == 2 and "--num-packs: a comma-separated list of whole numbers >= 0 without repeats; " \
        "got '1,x'" in result.stderr
