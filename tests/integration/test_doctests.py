"""Every public docstring example runs and shows what it says.

``xreduce.tensorflow``'s run in tests/tensorflow/test_tf_doctests.py, in a process whose TensorFlow has the
TF tests' logical CPUs (TF sets them once per process)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import xreduce
import xreduce_bench
import xreduced

MODULES = ["xreduce", "xreduced", "xreduce_bench"] + sorted(
    name
    for package in (xreduce, xreduced, xreduce_bench)
    for _, name, _ in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if ".v1." not in name and not name.endswith("__main__") and not name.startswith("xreduce.tensorflow")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
