"""What the keras.distribution tests share: the KERAS_DISTRIBUTION_* names, eight CPU devices, and a
fixture that leaves no distribution state behind."""

from __future__ import annotations

import pytest
import xreduce
from xreduce import distribution as dist

ENV = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID")
CPU8 = [f"cpu:{i}" for i in range(8)]


def canonical_names(names) -> tuple[str, ...]:
    """Example:
    >>> canonical_names(["cpu:1"])
    ('/job:localhost/replica:0/task:0/device:CPU:1',)
    """
    return tuple(xreduce.canonical(n) for n in names)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No KERAS_DISTRIBUTION_* from the caller's shell; no state left behind."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    dist.shutdown()
    dist.set_distribution(None)
