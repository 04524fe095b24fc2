"""examples/multiprocess_train.py: P processes train as one job and stay identical step by step."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multiprocess_train.py"
STEP = re.compile(r"^(?:\[p(\d+)\] )?step +(\d+) +loss (\S+) +weights ([0-9a-f]{16})$", re.M)
STEPS = 3


def run_example(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


def per_process(out: str) -> dict[int, list[tuple[str, str]]]:
    """{process: [(loss, checksum) for each step]} from the launcher's ``[pN]``-prefixed lines."""
    runs: dict[int, list[tuple[str, str]]] = {}
    for p, step, loss, checksum in STEP.findall(out):
        assert int(step) == len(runs.setdefault(int(p), [])), out
        runs[int(p)].append((loss, checksum))
    return runs


def assert_one_job(runs: dict[int, list[tuple[str, str]]], processes: int) -> list[tuple[str, str]]:
    """Every process printed every step, all identical, and the loss fell; returns the common steps."""
    assert sorted(runs) == list(range(processes))
    assert all(len(r) == STEPS for r in runs.values()), runs
    for step in range(STEPS):
        assert len({r[step] for r in runs.values()}) == 1, f"step {step}: {[r[step] for r in runs.values()]}"
    losses = [float(loss) for loss, _ in runs[0]]
    assert losses[-1] < losses[0]
    assert len({checksum for _, checksum in runs[0]}) == STEPS  # the weights change every step
    return runs[0]


@pytest.fixture(scope="module")
def embedded_runs() -> dict[int, tuple[subprocess.CompletedProcess, list[tuple[str, str]]]]:
    runs = {}
    for processes in (4, 2):
        result = run_example("--embedded", "--processes", str(processes), "--steps", str(STEPS))
        assert result.returncode == 0, result.stdout + result.stderr
        runs[processes] = (result, assert_one_job(per_process(result.stdout), processes))
    return runs


@pytest.mark.parametrize("processes", [4, 2])
@pytest.mark.slow
def test_embedded_job_agrees_every_step(embedded_runs, processes):
    result, _ = embedded_runs[processes]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("daemon: unix:")
    share = 8 // processes
    local = ", ".join(f"CPU:{i}" for i in range(share, 2 * share))
    assert f"[p1] process 1 of {processes}: replicas 8, local {local}" in lines
    assert lines[-1].startswith(f"OK: {processes} processes agree on the loss and the weights checksum "
                                f"at all {STEPS} steps")


@pytest.mark.slow
def test_process_layout_does_not_change_the_numbers(embedded_runs):
    # Shards follow the global replica id, and the daemon reduces over the same 8 devices.
    assert embedded_runs[4][1] == embedded_runs[2][1]


@pytest.mark.slow
def test_workers_started_by_hand_against_a_running_daemon(daemon, embedded_runs):
    """Worker mode from KERAS_DISTRIBUTION_* alone, against a separately started xreduced."""
    env = {**os.environ, "XREDUCE_ADDRESS": daemon.address, "XREDUCE_GROUP": f"by-hand-{os.getpid()}",
           "KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", str(STEPS)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(p)}) for p in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1].splitlines()[0] == "process 1 of 2: replicas 8, local CPU:4, CPU:5, CPU:6, CPU:7"
    runs = {i: [(loss, c) for _, _, loss, c in STEP.findall(out)] for i, out in enumerate(outs)}
    assert assert_one_job(runs, 2) == embedded_runs[2][1]


@pytest.mark.slow
def test_launcher_uses_xreduce_address(daemon):
    result = run_example("--processes", "2", "--steps", str(STEPS), env={"XREDUCE_ADDRESS": daemon.address})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "daemon:" not in result.stdout
    assert_one_job(per_process(result.stdout), 2)


@pytest.mark.slow
def test_launcher_fails_when_a_worker_fails():
    result = run_example("--processes", "2", "--steps", "1", "--timeout", "60",
                         env={"XREDUCE_ADDRESS": "unix:/nonexistent/xreduced.sock"})
    assert result.returncode == 1
    assert "UnavailableError" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("FAIL: p")


@pytest.mark.slow
def test_one_device_per_process():
    result = run_example("--embedded", "--processes", "8", "--steps", str(STEPS))
    assert result.returncode == 0, result.stdout
