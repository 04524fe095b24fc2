"""Big tensors: the memory of a job stays near its tensors, whatever sizes came before.

Real worker processes (this module run as a script) join a real daemon's group
and all-reduce hundreds of MiB per replica, one size after another: up, down and
up again, with a fresh result (the default) and in place (``out=``, in a numpy
array and in an :func:`xreduce.shared_array`). This test samples the job's
footprint from ``/proc`` meanwhile: the resident anonymous memory of every
worker and of the daemon, plus what ``/dev/shm`` holds beyond its start (shared
memory counted once: the segments of the workers). docs/operations.md states the bound checked here:

    footprint - footprint at the start <= 2·P·S + P·PER_PROCESS + DAEMON_SLACK

(the caller's input and its result, per process; ``P·S`` with ``out=``).
Every worker checks every element of every result. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from children import Started, child_env
from xreduce import _chunks, _segments
from xreduce_bench.daemon_memory import Sampler, status_kib

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

MiB = 1 << 20
PER_PROCESS = _chunks.PROCESS_OVERHEAD_BYTES
"""A process's share of the documented constant: its chunks' segments and the SDK's working memory."""
DAEMON_SLACK = _chunks.DAEMON_OVERHEAD_BYTES
SIZES = [256 * MiB, 768 * MiB, 256 * MiB, 768 * MiB]
"""Bytes per replica, in this order in the same processes: up, down, up."""
JOB_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def started():
    s = Started()
    yield s
    s.end_all()


@pytest.fixture(scope="module")
def daemon2(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")


def shm_of(pids: list[int]) -> int:
    """Bytes of /dev/shm held by the SDK segments of ``pids`` (named ``PREFIX-PID-TOKEN``): other tests' segments,
    which a parallel run makes meanwhile, do not count."""
    marks = {f"-{p}-" for p in pids}
    total = 0
    for entry in os.scandir("/dev/shm"):
        if any(m in entry.name for m in marks):
            try:
                total += entry.stat().st_blocks * 512
            except OSError:
                pass  # unlinked meanwhile
    return total


def rss_anon(pid: int) -> int:
    try:
        return status_kib(pid)["RssAnon"] * 1024
    except OSError:  # it has ended
        return 0


class Footprint(Sampler):
    """Samples Σ RssAnon(pids) + their segments in /dev/shm every 10 ms, with the time of each sample."""

    def __init__(self, pids: list[int]):
        super().__init__(0.01)
        self.pids = pids
        self.samples: list[tuple[float, int]] = []

    def _sample(self) -> None:
        self.samples.append((time.time(), sum(rss_anon(p) for p in self.pids) + shm_of(self.pids)))

    def peak(self, start: float, stop: float) -> int:
        return max((v for t, v in self.samples if start <= t <= stop), default=0)

    def before(self, t: float) -> int:
        return [v for s, v in self.samples if s < t][-1]


def run_job(address: str, processes: int, form: str, sizes: list[int], started: Started,
            env=None) -> list[subprocess.Popen]:
    """Starts the workers (:func:`finish` collects their reports)."""
    group = f"big-{form}-{time.time_ns()}"
    procs = [started.popen([sys.executable, __file__, json.dumps({"address": address, "processes": processes,
                                                                  "process_id": k, "form": form, "sizes": sizes,
                                                                  "group": group})],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env())
             for k in range(processes)]
    return procs


def finish(procs) -> list[dict]:
    """Each worker's report (its steps' times and what it checked), once all have ended well."""
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=JOB_TIMEOUT)
        assert p.returncode == 0, err[-4000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.mark.parametrize("form", ["new", "out", "shared"])
def test_the_footprint_stays_within_the_bound_whatever_came_before(daemon2, started, form):
    procs = run_job(daemon2.address, 2, form, SIZES, started)
    with Footprint([p.pid for p in procs] + [daemon2.proc.pid]) as fp:
        reports = finish(procs)
    steps = list(zip(*[r["steps"] for r in reports]))
    baseline = fp.before(min(s["start"] for s in steps[0]))
    floor = 1 if form in ("out", "shared") else 2
    for size, step in zip(SIZES, steps):
        assert all(s["checked"] for s in step)
        peak = fp.peak(min(s["start"] for s in step), max(s["stop"] for s in step)) - baseline
        bound = 2 * 2 * size + 2 * PER_PROCESS + DAEMON_SLACK
        print(f"{form} {size // MiB} MiB: peak above the start {peak / MiB:.0f} MiB; bound {bound / MiB:.0f} MiB; "
              f"{floor}·P·S = {floor * 2 * size / MiB:.0f} MiB")
        assert peak <= bound, f"{form}, {size // MiB} MiB a replica: {peak / MiB:.0f} MiB over the bound"
        if form == "shared":  # written in place, nothing staged: the floor itself and the daemon's slack
            assert peak <= 2 * size + DAEMON_SLACK + 2 * 16 * MiB


@pytest.mark.parametrize("shapes", [[[300_000], [300_001]], [[300_000], [1000]]], ids=["other-size", "unchunked"])
def test_processes_whose_chunks_differ_fail_together_and_clearly(daemon2, started, shapes):
    """1 MiB chunks: one process reduces a tensor the other's does not match; both fail, neither hangs."""
    env = dict(child_env(), XREDUCE_CHUNK_BYTES=str(MiB))
    group = f"mismatch-{time.time_ns()}"
    procs = [started.popen([sys.executable, __file__, json.dumps({"address": daemon2.address, "processes": 2,
                                                                  "process_id": k, "form": "shape",
                                                                  "shape": shapes[k], "group": group})],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for k in range(2)]
    reports = finish(procs)
    for r in reports:
        assert r["error"], r
    if shapes[1][0] > 100_000:  # both chunked: the agreement names the mismatch in each process
        for r in reports:
            assert "reduce different values" in r["error"] and "[((300000,), 'float32')]" in r["error"] + str(
                reports), r


# --- the worker ---------------------------------------------------------------------------------------------------


BLOCK = 1 << 20
"""Elements filled and checked at once: the test's own arrays stay small beside the tensors."""


def fill(v: np.ndarray, k: int) -> None:
    """Process ``k``'s value: ``i mod 1024 + k + 1`` at element ``i`` (exact in float32 when summed)."""
    pattern = np.arange(BLOCK, dtype=np.float32) % 1024 + (k + 1)
    for at in range(0, v.size, BLOCK):
        part = v[at:at + BLOCK]
        part[:] = pattern[:part.size]


def matches(r: np.ndarray, n: int) -> bool:
    """Whether ``r`` is the sum of :func:`fill`'s values over ``n`` processes, at every element."""
    want = (np.arange(BLOCK, dtype=np.float32) % 1024) * n + n * (n + 1) // 2
    return all(np.array_equal(r[at:at + BLOCK], want[:min(BLOCK, r.size - at)]) for at in range(0, r.size, BLOCK))


def worker(args: dict) -> dict:
    import xreduce
    from xreduce import distribution
    from xreduce.distribute import HierarchicalCopyAllReduce

    os.environ["XREDUCE_ADDRESS"] = args["address"]
    os.environ["XREDUCE_GROUP"] = args["group"]
    distribution.initialize(num_processes=args["processes"], process_id=args["process_id"])
    ops = HierarchicalCopyAllReduce()
    k, n = args["process_id"], args["processes"]
    if args["form"] == "shape":
        try:
            x = np.ones(args["shape"], np.float32)
            ops.reduce("sum", x, x)
            return {"error": ""}
        except Exception as e:  # the test checks it
            return {"error": f"{type(e).__name__}: {e}"}
    steps = []
    time.sleep(0.5)  # the parent's baseline: the job started, nothing allocated yet
    for size in args["sizes"]:
        start = time.time()
        elements = size // 4
        v = xreduce.shared_array(elements, np.float32) if args["form"] == "shared" else np.empty(elements, np.float32)
        fill(v, k)
        if args["form"] == "new":
            r = ops.reduce("sum", v, v)
        else:
            r = ops.reduce("sum", v, v, out=v)
            assert r is v
        checked = matches(r, n)
        del r, v
        steps.append({"size": size, "start": start, "stop": time.time(), "checked": checked})
        time.sleep(0.2)
    return {"steps": steps}


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
