"""A few of ``bench/fault_trials.py``'s trials in CI: a link cut, and a link that flaps, between two
network-namespace nodes in the middle of collectives. The bench runs 20 of each (docs/benchmarks.md); here
two, checked for what must hold in every trial, never for how fast: nothing partial, node 0's daemon still
serves, and the job forms a new epoch that reduces correctly once the link is back."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from netns import needs_namespaces

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fault_trials.py"

pytestmark = [needs_namespaces, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_after_a_link_cut_or_flap_the_job_rejoins_and_nothing_partial_is_received(tmp_path):
    out = tmp_path / "trials.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--trials", "2", "--modes", "link-down,link-flap",
                           "--distinct-jobs", "0", "--json", str(out)], capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    modes = json.loads(out.read_text())["modes"]
    for mode in ("link-down", "link-flap"):
        summary = modes[mode]["summary"]
        assert modes[mode]["calibration"]["completed_collectives"] == 6, (mode, proc.stdout[-3000:])
        assert summary["partial"] == 0, (mode, summary)
        assert summary["survivor_served"] == summary["rejoined"] == 2, (mode, summary, [
            t.get("rejoin_errors") for t in modes[mode]["trials"]])
