"""``bench/keras_step.py`` in a tiny run (8 steps a job): TF's own strategy timed in turn in xreduce's process
(``--alternate-with``), MWMS in processes of its own, each round's line and the table. Never how fast anything is."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMBER = r"-?[0-9.]+"


def test_the_bench_times_both_comparisons_and_prints_the_ratios(tmp_path):
    kept = tmp_path / "pairs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "keras_step.py"), "--rounds", "1", "--steps", "8",
                           "--models", "mlp", "--alternations", "2", "--json", str(kept)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rounds = [line for line in lines if " round " in line]
    labels = [re.match(r"mlp +(one process, 2 replicas|two processes x 1 replica) +round ([0-9.]+):", line).groups()
              for line in rounds]
    # Two turns in the one-process job (the peer in the same process), one round of the two-process jobs.
    assert labels == [("one process, 2 replicas", "0.0"), ("one process, 2 replicas", "0.1"),
                      ("two processes x 1 replica", "0")], rounds
    # One process: xreduce's TF kernel, its parts (no Python to time in the step); two: the kernel's parts and the
    # tf.numpy_function bridge of the calls around an epoch's ends, either or both.
    kernel = r"xreduce's TF kernel: copy in [0-9.]+ ms, exchange [0-9.]+ ms, copy out [0-9.]+ ms"
    bridge = r"bridge [0-9.]+ ms, SDK call [0-9.]+ ms"
    where = [kernel] * 2 + [rf"(?:{kernel}; {bridge}|{kernel}|{bridge})"]
    for line, inside in zip(rounds, where):
        assert re.search(rf"xreduce +{NUMBER} / +{NUMBER} / +{NUMBER} ms, peer +{NUMBER} / +{NUMBER} / +{NUMBER} ms, "
                         rf"ratio {NUMBER} / {NUMBER} / {NUMBER} \({inside}, daemon's reduction [0-9.]+ ms\)",
                         line), line
    table = [line for line in lines if line.startswith("| mlp |")]
    assert [row.split(" | ")[1] for row in table] == [
        "one process, 2 replicas vs TF's HierarchicalCopyAllReduce",
        "two processes x 1 replica vs MultiWorkerMirroredStrategy"], table
    # The pooled verdict: every pair of the run, its interval over rounds; kept, and pooled again from the file.
    pooled = [line for line in lines if line.startswith("pooled: ")]
    pattern = (r"pooled: mlp {}: {} pairs in 1 rounds, median ratio of median steps [0-9.]+ \(95% interval over "
               r"rounds [0-9.]+-[0-9.]+\); [0-9]+ pair\(s\) over the target {}")
    cases = [("one process, 2 replicas", 2, "1.1"), ("two processes x 1 replica", 1, "0.5")]
    assert [bool(re.fullmatch(pattern.format(*case), line)) for case, line in zip(cases, pooled)] == [True] * 2, pooled
    pairs = json.loads(kept.read_text())["pairs"]
    assert [(p["comparison"], p["turn"], p["first"]) for p in pairs] == [
        ("one process, 2 replicas", 0, "xreduce"), ("one process, 2 replicas", 1, "peer"),
        ("two processes x 1 replica", 0, "xreduce")], pairs  # the one-process turns alternate in order (ABBA)
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "keras_step.py"), "--pool", str(kept)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 0 and again.stdout.splitlines() == pooled, again.stdout + again.stderr
