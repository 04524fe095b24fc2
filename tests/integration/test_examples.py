"""The example programs run as a user runs them, and do what they say."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mirrored_numpy_loss_falls_every_few_steps():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mirrored_numpy.py"), "--embedded", "--steps", "8"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert out.splitlines()[0].startswith("replicas: 8 on CPU:0, CPU:1")
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 8
    assert losses[-1] < losses[0] / 10


PLAN_COMMANDS = {"xreduced plan": ["xreduced"], "xreduce plan": ["xreduce._cli"]}
"""The daemon's command, and the SDK's, which runs it."""


@pytest.mark.parametrize("command", PLAN_COMMANDS)
def test_xreduce_plan_prints_the_steps(command):
    out = subprocess.run(
        [sys.executable, "-m", *PLAN_COMMANDS[command], "plan",
         "--devices", "8", "--num-packs", "2", "--bytes", "1MiB"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0] == "hierarchical_copy over 8 devices [0, 1, 2, 3, 4, 5, 6, 7], 2 pack(s), 1 MiB per device"
    assert "pack 1 (131072 elements, 512 KiB): main devices 1 and 5" in lines
    assert "  sum on 1: in@0 + in@1 + in@2 + in@3 -> partial@1" in lines
    assert "  copy partial@5: 5 -> 1 (512 KiB)" in lines
    assert lines[-1] == "total copied: 14 MiB"


@pytest.mark.parametrize("command", PLAN_COMMANDS)
@pytest.mark.parametrize(("args", "message"), [
    (["--bytes", "3"], "--bytes 3 is not a multiple of float32's 4 bytes"),
    (["--devices", "0"], "--devices must be >= 1; got 0"),
    (["--dtype", "str"], "argument --dtype: 'str' is not a dtype the daemon reduces; use one of float16, bfloat16"),
])
def test_xreduce_plan_rejects_bad_arguments(command, args, message):
    result = subprocess.run(
        [sys.executable, "-m", *PLAN_COMMANDS[command], "plan", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr


def _option_help(usage: str, option: str) -> str:
    """What argparse's help prints after ``option`` and its metavar, joined into one line."""
    found = re.search(rf"^  {option}(?: \S+)?(.*(?:\n {{20,}}\S.*)*)", usage, re.MULTILINE)
    assert found, f"{option} is not in the help:\n{usage}"
    return " ".join(found.group(1).split())


@pytest.mark.parametrize("command", PLAN_COMMANDS)
def test_xreduce_plan_help_names_the_command_run_and_every_option(command):
    out = subprocess.run([sys.executable, "-m", *PLAN_COMMANDS[command], "plan", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith(f"usage: {command} "), out
    for option in ("--devices", "--num-packs", "--bytes", "--tensors", "--dtype", "--algorithm"):
        assert _option_help(out, option), f"{option} has no help:\n{out}"
