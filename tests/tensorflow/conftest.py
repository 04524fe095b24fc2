"""The TensorFlow tests' setup: a C++ compiler for xreduce's TF kernel (xreduce.tensorflow._kernel), installed
here when the machine has none, so that the kernel is built and tested rather than skipped."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session", autouse=True)
def cxx_compiler() -> str:
    """A C++ compiler on ``PATH``: Debian's ``g++`` is installed (as root) where there is none."""
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "g++"], env=env, check=True, capture_output=True,
                       timeout=900)
        found = shutil.which("g++")
    assert found, "xreduce's TF kernel needs a C++ compiler (Debian: apt-get install g++)"
    return found
