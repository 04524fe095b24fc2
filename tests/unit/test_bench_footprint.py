"""The memory sampler of ``xreduce bench --big-tensors``: its windows, and the guard that stops the workers."""

from __future__ import annotations

import subprocess
import sys
import time

from xreduce_bench.footprint import Footprint


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_when_memory_runs_short_the_workers_are_killed_and_the_daemon_is_not():
    worker, daemon = sleeper(), sleeper()
    try:
        with Footprint(period=0.01, floor=1 << 60) as fp:  # MemAvailable is always under 1 EiB
            fp.watch("process 0", worker.pid)
            fp.watch("daemon", daemon.pid, worker=False)
            assert worker.wait(30) == -9
        assert fp.starved.startswith("MemAvailable fell to ")
        assert fp.starved.endswith("the workers were stopped before the machine ran out")
        assert daemon.poll() is None
    finally:
        for proc in (worker, daemon):
            proc.kill()
            proc.wait(10)


def test_a_window_holds_the_samples_of_the_whole_job_between_its_ends_and_forgets_them():
    one, two = sleeper(), sleeper()
    names = ["process 0", "process 1"]
    try:
        with Footprint(period=0.01) as fp:
            fp.watch("process 0", one.pid)
            start = time.monotonic()
            time.sleep(0.05)
            middle = time.monotonic()
            fp.watch("process 1", two.pid)
        end = time.monotonic()  # stopping took one more sample, of both
        assert fp.window(start, middle, names).samples == 0  # process 1 was not watched yet
        both = fp.window(middle, end, names)
        assert both.samples >= 1 and sorted(both.processes) == names
        assert both.peak >= both.median and all(p["rss_anon"] > 0 for p in both.processes.values())
        assert both.peak - both.shm > 0  # the processes' part: /dev/shm is the machine's, other tests' come and go
        assert fp.window(start, end, names[:1]).samples == 0  # forgotten up to the last window's end
    finally:
        for proc in (one, two):
            proc.kill()
            proc.wait(10)
