"""``bench/tf_allreduce_step.py`` in a tiny run: the three ways timed and printed with their ratios to TF's (never
how fast anything is)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_bench_times_the_kernel_the_bridge_and_tfs_own():
    env = {k: v for k, v in os.environ.items() if k != "XREDUCE_ADDRESS"}  # the bench starts its own daemon
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tf_allreduce_step.py"), "--rounds", "2", "--steps",
                           "3", "--elements", "10"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# bench/tf_allreduce_step.py: 10 float32 over 2 logical CPUs, 2 rounds of 3 steps")
    names = [re.fullmatch(r"(\w+) +[0-9.]+ ms \([0-9.]+-[0-9.]+\), [0-9.]+x TF's", line).group(1)
             for line in lines[1:4]]
    assert names == ["kernel", "bridge", "tf"]
    parts = re.fullmatch(r"kernel's call \(mean\): copy in ([0-9.]+) ms, exchange with the daemon ([0-9.]+) ms, "
                         r"copy out ([0-9.]+) ms", lines[4])
    assert parts is not None and float(parts.group(2)) > 0, lines[4:]  # every call waited for the daemon
