"""``bench/torch_faults.py`` with one trial of 2 ranks: its table, and what its trials record. Never how fast
anything fails (the bench reports that)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_bench_kills_a_rank_of_each_backend_and_tabulates_what_the_other_saw(tmp_path):
    out = tmp_path / "trials.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "torch_faults.py"), "--trials", "1", "--ranks", "2",
                           "--warmup", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("A rank SIGKILLed at a random moment of DDP training"), lines
    assert lines[1].split() == ["backend", "ranks", "trials", "survivors", "min", "s", "median", "s", "p90", "s",
                                "max", "s", "<=", "3", "s", "named", "hung"]
    number = r" +([0-9.]+|nan)"
    assert re.fullmatch(r"xreduce +2 +1 +1" + number * 4 + r" +[01] +1 +0", lines[2]), lines[2]
    assert re.fullmatch(r"gloo +2 +1 +1" + number * 4 + r" +[01] +[01] +0", lines[3]), lines[3]
    assert lines[4].startswith("the daemon after the first trials and at the end: threads ")
    data = json.loads(out.read_text())
    assert [t["backend"] for t in data["trials"]] == ["xreduce", "gloo"]
    for t in data["trials"]:
        (survivor,) = t["survivors"]
        assert survivor["rank"] == 1 - t["victim"] and not survivor["hung"] and survivor["exit"] == 1, t
        assert survivor["failed_after_s"] is not None, t
    ours = data["trials"][0]["survivors"][0]
    assert ours["names_victim"] and "DistBackendError" in ours["message"], ours
