"""examples/custom_training_loop.py: a TF-style custom loop on 1 and 2 processes matches one process's
training on the whole batch, step by step."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_training_loop.py"
STEP = re.compile(r"^(?:\[p(\d+)\] )?step +(\d+) +loss (\S+)$", re.M)
STEPS = 4


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), f"--steps={STEPS}", *args], capture_output=True, text=True,
                          timeout=180)


def losses(out: str) -> dict[int, list[float]]:
    """{process: [loss at each step]}; the reference run's lines have no ``[pN]`` prefix (process 0)."""
    runs: dict[int, list[float]] = {}
    for p, step, loss in STEP.findall(out):
        got = runs.setdefault(int(p or 0), [])
        assert int(step) == len(got), out
        got.append(float(loss))
    return runs


@pytest.fixture(scope="module")
def reference() -> list[float]:
    result = run_example("--reference")
    assert result.returncode == 0, result.stdout + result.stderr
    return losses(result.stdout)[0]


@pytest.mark.parametrize("processes", [1, 2])
def test_the_loop_matches_one_process_on_the_whole_batch(processes, reference):
    result = run_example("--embedded", f"--processes={processes}", "--virtual-devices=4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{4 // processes} here" in result.stdout and "4 replicas in sync" in result.stdout, result.stdout
    runs = losses(result.stdout)
    assert sorted(runs) == list(range(processes))
    for run in runs.values():
        assert run == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0]
    assert result.stdout.rstrip().splitlines()[-1].startswith(f"OK: {processes} process(es) match")


def test_the_verdict_catches_a_worker_that_drifts(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # the example imports its _project_env neighbour
    spec = importlib.util.spec_from_file_location("custom_training_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    expected = "step   0  loss 1.0\nstep   1  loss 0.5\n"
    ok, _ = example.verdict([(0, expected)], expected, 2)
    assert ok
    ok, line = example.verdict([(0, expected.replace("0.5", "0.5001"))], expected, 2)
    assert not ok and "away from the single-process run's" in line
    ok, line = example.verdict([(1, "")], expected, 2)
    assert not ok and "p0 exited 1" in line
