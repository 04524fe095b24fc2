"""What the installs pull in: the container images carry no torch and the CPU image nothing of CUDA, and
the benchmark guide installs a CPU-only torch before the ``bench`` extra (PyPI's Linux torch is the CUDA
build, with about 17 ``nvidia-*`` packages, GPU or not)."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib

import pytest
from deploy_files import ROOT, instruction

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
CUDA = re.compile(r"^(torch|nvidia-.*|cupy.*|jax.*)$")
_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _names(requirements: list[str]) -> set[str]:
    return {_NAME.match(r)[0].lower().replace("_", "-") for r in requirements}


def _installed_by(dockerfile: str) -> set[str]:
    """The distributions the ``pip install`` lines of a Dockerfile ask for: the project's (``.`` with its
    extras) resolved through pyproject.toml, and any named one."""
    names: set[str] = set()
    for run in instruction(dockerfile, "RUN"):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            for word in (w for w in words[2:] if not w.startswith("-")):
                project = re.fullmatch(r"\.(?:\[(?P<extras>[\w,-]+)\])?", word)
                if project is None:
                    names |= _names([word])
                    continue
                names |= _names(PYPROJECT["dependencies"]) | {"xreduce"}
                for extra in (project["extras"] or "").split(","):
                    names |= _names(PYPROJECT["optional-dependencies"][extra]) if extra else set()
    return names


def test_the_cpu_image_installs_nothing_of_cuda():
    installed = _installed_by("Dockerfile")
    assert "xreduce" in installed, "deploy/Dockerfile no longer installs the project with pip"
    assert {n for n in installed if CUDA.match(n)} == set()


def test_the_gpu_image_installs_cupy_and_no_torch():
    installed = _installed_by("Dockerfile.gpu")
    assert {n for n in installed if CUDA.match(n)} == {"cupy-cuda12x"}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_the_images_leave_the_bench_tooling_out(dockerfile):
    copied = " ".join(instruction(dockerfile, "COPY"))
    assert "bench" not in copied and "bench" not in " ".join(instruction(dockerfile, "RUN"))


def test_the_bench_extra_is_where_torch_comes_from():
    assert "torch" in _names(PYPROJECT["optional-dependencies"]["bench"])
    assert {n for n in _names(PYPROJECT["dependencies"]) if CUDA.match(n)} == set()


def test_the_benchmark_guide_installs_a_cpu_only_torch_before_the_extra():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    installs = [b for b in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S) if "[bench]" in b]
    assert len(installs) == 1, "docs/benchmarks.md has one block that installs the bench extra"
    lines = installs[0].splitlines()
    extra = next(i for i, line in enumerate(lines) if "[bench]" in line)
    torch = [line for line in lines[:extra] if re.match(r"pip install torch\b", line)]
    assert torch and "--index-url" in torch[0] and "CPU" in torch[0], (
        "docs/benchmarks.md must install a CPU-only torch from PyTorch's CPU index before the bench extra")
    assert "https://pytorch.org/get-started/locally/" in text, (
        "docs/benchmarks.md points to PyTorch's install selector for the CPU index")


def test_no_package_index_address_is_written_into_the_project():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    index = re.compile(rb"(--(extra-)?index-url|--find-links|-f)[ =]+https?://|download\.pytorch\.org")
    offending = []
    for name in filter(None, tracked.split(b"\0")):
        path = ROOT / name.decode()
        if path.is_file() and path.suffix in {".md", ".py", ".sh", ".toml", ".txt", ".yml", ".yaml", ""}:
            if index.search(path.read_bytes()):
                offending.append(name.decode())
    assert offending == []
