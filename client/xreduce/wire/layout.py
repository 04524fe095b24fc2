"""Where the daemon writes results in an output region the caller named.

A request with an ``output`` slice (shared memory or CUDA IPC) gets its
results written there, not sent back: each result's components, one per
destination, in request order, each starting at a multiple of
:data:`OUTPUT_ALIGNMENT` from the slice's start. The SDK sizes the slice it
sends with :func:`output_layout` and the daemon places the components with
it, so the two cannot disagree.

Example:
    >>> output_layout([(2, np.dtype("float32"), (3,)), (1, np.dtype("int8"), (5,))])
    OutputLayout(offsets=[[0, 64], [128]], nbytes=133)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

OUTPUT_ALIGNMENT = 64
"""Every result component in an output region starts at a multiple of this, and so must the slice."""


class OutputLayout(NamedTuple):
    """The places of results in an output slice.

    Example:
        >>> output_layout([(1, np.dtype("float64"), ())]).nbytes
        8
    """

    offsets: list[list[int]]
    """Per result, per destination: the component's byte offset from the slice's start."""
    nbytes: int
    """Bytes the slice needs: the end of the last component."""


def output_layout(results: Sequence[tuple[int, np.dtype, Sequence[int]]]) -> OutputLayout:
    """Places result components in an output slice, aligned and in order.

    Args:
        results: per result, (number of destinations, dtype, shape); every
            destination gets a component of that dtype and shape.

    Returns:
        Each component's offset, and the bytes the slice needs.

    Example:
        >>> output_layout([(2, np.dtype("float32"), (3,))])
        OutputLayout(offsets=[[0, 64]], nbytes=76)
    """
    offsets, total = [], 0
    for count, dtype, shape in results:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        places = []
        for _ in range(count):
            total += -total % OUTPUT_ALIGNMENT
            places.append(total)
            total += nbytes
        offsets.append(places)
    return OutputLayout(offsets, total)
