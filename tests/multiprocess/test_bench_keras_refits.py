"""``bench/keras_refits.py`` in a short run: one two-process job of 3 fits, each job's line and the count. The
bench's long runs count the TF processes that die of a signal between fits (TF's MultiDeviceIterator, about once
in a hundred dropped iterators: docs/benchmarks.md); this checks the bench itself."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_short_run_prints_each_job_and_no_process_dies():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "keras_refits.py"), "--jobs", "1", "--fits", "3",
                           "--steps", "2"], capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "# bench/keras_refits.py: 1 two-process jobs of 3 fits x 2 steps"
    assert re.fullmatch(r"job 0: exit statuses \[0, 0\] in [0-9.]+ s", lines[1]), lines
    assert lines[-1] == "# 0 of 1 jobs had a process die of a signal (6 fits in all)"
