"""Every docstring example of ``xreduce.tensorflow`` runs and shows what it says (with the TF tests' logical CPUs)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
from tf_env import logical_cpus

logical_cpus()
import xreduce.tensorflow  # noqa: E402

MODULES = ["xreduce.tensorflow"] + sorted(
    name for _, name, _ in pkgutil.walk_packages(xreduce.tensorflow.__path__, "xreduce.tensorflow."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    assert result.attempted > 0 or name.endswith("__init__")
