"""The one normalised call the ``tf.distribute`` front hands to the transport layer.

The front (:mod:`xreduce._ops`) has validated the arguments, resolved every
device name and taken the collective's sequence number; what is left is data:
which op, which values on which devices to which destinations, how the daemon
should reduce, and how long it may take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from xreduce._values import DistributedValues
from xreduce.v1 import xreduce_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How the daemon reduces: TF's algorithm and its one setting.

    Example:
        >>> Algorithm("hierarchical_copy", num_packs=2).num_packs
        2
    """

    name: Literal["hierarchical_copy", "reduction_to_one_device", "nccl"]
    num_packs: int | None = None
    """Packs of a hierarchical copy or NCCL all-reduce (0: no packing); None for a reduction to one device,
    which has none."""
    reduce_to_device: str = ""
    """Where a reduction to one device sums ("": the first destination)."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """One value to reduce: its arrays, the device of each, and where the result goes.

    Example:
        >>> from xreduce._values import PerReplica
        >>> pair = Pair(PerReplica([np.ones(2), np.ones(2)]), ("CPU:0", "CPU:1"), ("CPU:0",))
        >>> len(pair.value), pair.destinations
        (2, ('CPU:0',))
    """

    value: DistributedValues
    """The arrays as the caller gave them (``values``) and as host arrays (``hosts()``)."""
    devices: tuple[str, ...]
    """Canonical name of each array's device."""
    destinations: tuple[str, ...]
    """Canonical names of the devices the result goes to."""


@dataclasses.dataclass(frozen=True)
class ReduceCall:
    """A reduce or batch reduce, ready for a transport.

    Example:
        >>> ReduceCall("MEAN", (), Algorithm("hierarchical_copy", 1)).timeout_seconds is None
        True
    """

    op: Literal["SUM", "MEAN"]
    pairs: tuple[Pair, ...]
    algorithm: Algorithm
    timeout_seconds: float | None = None
    """The caller's bound on the call (``CommunicationOptions.timeout_seconds``)."""
    collective: pb.CollectiveSpec | None = None
    """This process's place in a multi-process collective, or None for a single-process call."""
    single: bool = False
    """One pair from ``reduce`` (the ``Reduce`` RPC) rather than a batch (``BatchReduce``)."""
    out: np.ndarray | None = None
    """Where the caller wants the result of a one-pair call with one destination, if a path can have the
    daemon write it there (shared memory, an ``out`` in a :func:`xreduce.shared_array`); else it is copied."""


@dataclasses.dataclass(frozen=True)
class BroadcastCall:
    """A broadcast, ready for a transport.

    Example:
        >>> call = BroadcastCall(np.arange(2), lambda a: a, "CPU:0", ("CPU:1", "CPU:2"))
        >>> call.tensor.tolist(), call.destinations
        ([0, 1], ('CPU:1', 'CPU:2'))
    """

    tensor: np.ndarray | None
    """The host array this process sends; None when another process of the collective is the source."""
    restore: Callable[[np.ndarray], Any]
    """Turns a result back into the caller's array type."""
    source_device: str
    """The tensor's device ("" when this process is not the source)."""
    destinations: tuple[str, ...]
    collective: pb.CollectiveSpec | None = None
