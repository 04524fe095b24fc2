"""``bench/torch_ddp.py`` with 2 ranks and one step: its table, its JSON, and its check that every job's ranks end
with the same weights. Never how fast anything is."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_bench_prints_each_backend_and_the_ratios(tmp_path):
    out = tmp_path / "jobs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "torch_ddp.py"), "--models", "mlp", "--rounds", "1",
                           "--ranks", "2", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("DDP training step, 2 ranks on one machine")
    assert re.fullmatch(r"mlp +1 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+x +[0-9.]+x", lines[2]), lines[2]
    jobs = json.loads(out.read_text())
    assert [j["backend"] for j in jobs] == ["xreduce", "gloo", "hook"]
    assert all(j["model"] == "mlp" and j["step_s"] > 0 for j in jobs)
    # Two ranks add in the same order on every backend: the same weights bit for bit.
    assert len({j["weights"] for j in jobs}) == 1
