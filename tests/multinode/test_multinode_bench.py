"""``xreduce bench --nodes`` on real network-namespace nodes: the settings, the three systems, the tables, --json.

Sizes stay tiny (64 KiB, one iteration): these tests check what is run, printed and computed, never how
fast anything is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from netns import PREFIX, needs_namespaces
from xreduce_bench.command import main

COLUMNS = ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "link%", "#wrong"]


def bench(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Runs ``xreduce bench ARGS``; returns its result and its process id (which its nodes' names carry)."""
    with subprocess.Popen([sys.executable, "-m", "xreduce._cli", "bench", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def settings(out: str) -> dict[str, dict[str, list[str]]]:
    """Each ``## SETTING`` block's sections (``# NAME: ...`` and the lines under it), by title and name."""
    found: dict[str, dict[str, list[str]]] = {}
    block: dict[str, list[str]] | None = None
    current = None
    for line in out.splitlines():
        if line.startswith("## "):
            block = found.setdefault(line[3:], {})
            current = None
        elif (m := re.match(r"# (flat gloo|leader gloo|xreduce|ratios|scaling|targets)\b", line)) and block is not None:
            current = m.group(1)
            block[current] = [line]
        elif current is not None and line.strip():
            block[current].append(line)
    return found


def rows(lines: list[str]) -> list[dict[str, str]]:
    assert lines[1].lstrip("#").split() == COLUMNS, lines
    return [dict(zip(COLUMNS, line.split())) for line in lines[2:] if not line.startswith("#")]


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "0"], "--nodes: comma-separated integers in [1, 253] without repeats; got '0'"),
    (["--nodes", "2,2"], "--nodes: comma-separated integers in [1, 253] without repeats; got '2,2'"),
    (["--nodes", "2", "--embedded"], "--embedded does not apply with --nodes"),
    (["--nodes", "2", "--processes", "4"], "--processes does not apply with --nodes"),
    (["--nodes", "2", "--procs-per-node", "0"], "--procs-per-node must be >= 1; got 0"),
    (["--nodes", "1", "--procs-per-node", "1"], "a collective needs 2 processes or more; got --nodes 1"),
    (["--nodes", "2", "--size", "6"], "--size: every size must be a whole number of float32 elements (4 bytes); "
                                      "got '6'"),
    (["--nodes", "2", "--size", "lots"], "--size: comma-separated sizes such as 64MiB,1MiB; got 'lots'"),
    (["--nodes", "2", "--shape", "1gbit,fast"], "--shape must be a tc rate such as 1gbit, 100mbit or 125mbps; "
                                                "got 'fast'"),
    (["--procs-per-node", "2"], "--procs-per-node needs --nodes"),
    (["--shape", "1gbit"], "--shape needs --nodes"),
])
def test_bad_options_name_the_option_and_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@needs_namespaces
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (the bench extra)")
@pytest.mark.slow
def test_one_and_two_shaped_nodes_run_the_three_systems_and_print_the_tables(tmp_path):
    result, pid = bench("--nodes", "1,2", "--procs-per-node", "2", "--size", "64KiB", "--shape", "1gbit",
                        "--iters", "1", "--warmup", "0", "--json", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("# xreduce bench --nodes: all_reduce, float32, sum; 64 KiB per process; nodes 1,2 x "
                          "2 processes; links 1gbit; 1 iterations after 0 warm-up\n")
    found = settings(out)
    assert list(found) == ["1 node x 2 processes, links: tbf 1gbit both ways",
                           "2 nodes x 2 processes, links: tbf 1gbit both ways"]
    one, two = found.values()

    assert one["leader gloo"] == ["# leader gloo: skipped: one node: no link to cross"]
    for name in ("flat gloo", "xreduce"):
        (row,) = rows(one[name])
        assert (row["size(B)"], row["count"], row["busbw(GB/s)"], row["link%"]) == ("65536", "16384", "-", "-")
    assert re.match(r"# flat gloo: torch \S+, 2 processes \(2 per node, ranks contiguous per node\)",
                    one["flat gloo"][0])

    assert re.match(r"# flat gloo: torch \S+, 4 processes \(2 per node", two["flat gloo"][0])
    assert re.match(r"# leader gloo: torch \S+, 2 processes \(1 per node", two["leader gloo"][0])
    assert two["xreduce"][0].startswith("# xreduce: an xreduced per node (2 devices, --listen 127.0.0.1:50551, "
                                        "--node-address 10.0.0.k), 4 processes of one device each")
    for name in ("flat gloo", "leader gloo", "xreduce"):
        (row,) = rows(two[name])
        algbw, busbw = float(row["algbw(GB/s)"]), float(row["busbw(GB/s)"])
        assert algbw == pytest.approx(65536 / (float(row["time(us)"]) * 1e3), rel=2e-3)
        assert busbw == pytest.approx(algbw, rel=2e-3)  # 2(N-1)/N = 1 for two nodes
        assert float(row["link%"]) == pytest.approx(busbw * 8 * 100, rel=6e-3)  # of 1 Gbit/s, to 3 digits
    assert rows(two["xreduce"])[0]["#wrong"] == "0"  # every element of every process's result checked
    (engine,) = [line for line in two["xreduce"] if line.startswith("# the daemons' GetStatus")]
    assert re.match(r"# the daemons' GetStatus, warm-up included: node 1: 1 collective across nodes on gloo, "
                    r"0\.1 MiB sent and received, \S+ s in the engine, \S+ ms each; node 2: 1 collective", engine)
    assert two["ratios"][1].split() == ["#", "size(B)", "xreduce/flat", "gloo", "xreduce/leader", "gloo"]
    assert two["ratios"][2].split()[0] == "65536"

    scaling = out[out.index("# scaling\n"):].splitlines()
    assert scaling[1] == "# time(us) [busbw per link, GB/s] of 64 KiB by nodes"
    assert [line.split()[:2] for line in scaling[3:6]] == [["flat", "gloo"], ["leader", "gloo"], ["xreduce", "1gbit"]]
    assert "# targets" not in out  # measured at 64 MiB only

    data = json.loads((tmp_path / "out.json").read_text())
    assert data["run"]["nodes"] == [1, 2] and data["run"]["shapes"] == ["1gbit"]
    assert [(s["nodes"], s["rate_bits_per_s"], s["link_factor"]) for s in data["settings"]] == [
        (1, 1e9, 0.0), (2, 1e9, 1.0)]
    assert [s["name"] for s in data["settings"][1]["systems"]] == ["flat gloo", "leader gloo", "xreduce"]
    assert data["settings"][1]["systems"][2]["rows"][0]["wrong"] == 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{PREFIX}-{pid}-" not in listed  # the bench removed its nodes
