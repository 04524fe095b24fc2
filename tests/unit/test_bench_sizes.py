"""The sizes ``xreduce bench`` sweeps: from --min-bytes by --step-factor, always ending at --max-bytes."""

from __future__ import annotations

import pytest
from xreduce_bench.sweep import size_ladder
from xreduced.cli import parse_bytes


def test_a_step_that_jumps_over_the_max_still_measures_the_max():
    # --max-bytes 1MiB --step-factor 16 stopped at 256 KiB.
    sizes = size_ladder(4, parse_bytes("1MiB"), 16, 4)
    assert sizes == (4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20)


@pytest.mark.parametrize("min_bytes", [1, 7, 1000])
@pytest.mark.parametrize("max_bytes", [1000, 5000, (1 << 20) + 3])
@pytest.mark.parametrize("step_factor", [2, 3, 16, 1 << 30])
@pytest.mark.parametrize("itemsize", [1, 8])
def test_the_ladder_rises_from_the_min_to_the_max_in_whole_elements(min_bytes, max_bytes, step_factor, itemsize):
    sizes = size_ladder(min_bytes, max_bytes, step_factor, itemsize)
    assert sizes[-1] == max_bytes // itemsize * itemsize
    assert list(sizes) == sorted(set(sizes)) and all(size > 0 and size % itemsize == 0 for size in sizes)
    steps = {min_bytes * step_factor**k // itemsize * itemsize for k in range(64)}
    assert set(sizes[:-1]) <= steps
