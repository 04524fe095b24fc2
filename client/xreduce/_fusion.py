"""Tensor fusion on the shared-memory path: a batch's small values travel as one tensor per device.

A training step reduces every gradient of a model in one ``batch_reduce``: a
ResNet-50 sends 161 tensors, most of them small. Each tensor costs the SDK
and the daemon the same fixed work whatever its size (a component in the
request, a region to pin and check, a plan segment, a result to place and
decode), so the batch's small values of one kind (same devices, destinations
and dtype) are sent as one flat tensor per device, as Horovod's tensor fusion
sends them, and the result is split back into views. A reduction is
element by element, so the numbers are those of the values sent one by one,
bit for bit, whatever the packing.

Which values fuse depends on the batch's shapes, dtypes and devices alone, never
on where the arrays lie, so every process of a collective sends the same
tensors. Values above :data:`FUSE_UP_TO` bytes are sent on their own: copying
them would cost more than their fixed work. A fused tensor whose parts already
lie back to back in one shared-memory segment (views of one gradient buffer)
is sent where it lies; otherwise its parts are copied back to back into the
staging segment, which the SDK does for arrays outside shared memory anyway.

A fused value carries its parts' shapes and places in the batch
(``DistributedValue.fused_parts``): the daemon checks that every process of a
collective fused the same values of the same shapes, and names the value that
differs, as it does for values sent on their own. ``XREDUCE_FUSION=0`` sends
every value on its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce._arrays import HostArray
from xreduce._call import Pair, ReduceCall
from xreduce._values import Mirrored
from xreduce.v1 import xreduce_pb2 as pb

FUSE_UP_TO = 1 << 20
"""Values of up to this many bytes (per device) are fused with the others of their kind. Above it, a value's
fixed cost (about 0.1 ms of SDK and daemon time per process, measured on the 2-core machine of
docs/benchmarks.md) is below that of copying it when it is not already where the fused tensor lies."""

FUSION_VARIABLE = "XREDUCE_FUSION"
"""``0`` turns fusion off (every value sent on its own); anything else, or unset, leaves it on."""

COPY_PIECES_UP_TO = 64 << 10
"""Results up to this size are copied out of a fused result, so that a small result kept for long does not
pin the whole output segment (the shared-memory path's rule for results)."""


@dataclasses.dataclass(frozen=True)
class Fused:
    """Arrays of one dtype sent as one flat tensor, back to back in order.

    Example:
        >>> f = Fused((np.zeros((2, 3), np.float32), np.zeros(4, np.float32)))
        >>> f.shape, f.nbytes, f.dtype
        ((10,), 40, dtype('float32'))
    """

    parts: tuple[np.ndarray, ...]

    @property
    def dtype(self) -> np.dtype:
        """The parts' dtype."""
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int]:
        """One dimension: every element of every part."""
        return (sum(a.size for a in self.parts),)

    @property
    def nbytes(self) -> int:
        """Bytes of all the parts."""
        return sum(a.nbytes for a in self.parts)


class _FusedValue:
    """What a transport reads of a fused pair: one host array (a :class:`Fused`) per device, and each
    part's place in the batch and shape."""

    def __init__(self, hosts: tuple[HostArray, ...], parts: tuple[tuple[int, tuple[int, ...]], ...]):
        self._hosts = hosts
        self.parts = parts

    def hosts(self) -> tuple[HostArray, ...]:
        return self._hosts


def fused_parts(value: Any) -> list[pb.FusedPart]:
    """``DistributedValue.fused_parts`` for a pair's value: the parts of a fused one, else none. The daemon
    checks that every process fused the same values of the same shapes, and names the value that differs.

    Example:
        >>> fused_parts(_FusedValue((), ((0, (2,)), (3, (1, 4)))))[1]
        shape: 1
        shape: 4
        index: 3
        <BLANKLINE>
        >>> fused_parts(object())
        []
    """
    if not isinstance(value, _FusedValue):
        return []
    return [pb.FusedPart(shape=shape, index=i) for i, shape in value.parts]


def groups(pairs: Sequence[Pair]) -> list[tuple[int, ...]] | None:
    """The pairs' indices grouped for sending: the dense values of up to :data:`FUSE_UP_TO` bytes of one kind
    (devices, destinations, dtypes) together, in order of first appearance; every other pair alone. None when
    no two pairs fuse, or :data:`FUSION_VARIABLE` is ``0``.

    Example:
        >>> from xreduce._values import PerReplica
        >>> def pair(n, dtype=np.float32):
        ...     return Pair(PerReplica([np.zeros(n, dtype)]), ("CPU:0",), ("CPU:0",))
        >>> groups([pair(4), pair(1 << 20), pair(2), pair(2, np.int32), pair(8)])
        [(0, 2, 4), (1,), (3,)]
        >>> groups([pair(4), pair(4, np.int32)]) is None
        True
    """
    if os.environ.get(FUSION_VARIABLE, "").strip() == "0":
        return None
    keyed: dict[Any, list[int]] = {}
    for i, p in enumerate(pairs):
        hosts = p.value.hosts()
        dense = all(isinstance(h, HostArray) for h in hosts)
        if (dense and hosts and max(h.array.nbytes for h in hosts) <= FUSE_UP_TO
                and len({h.array.shape for h in hosts}) == 1):
            key: Any = (p.devices, p.destinations, tuple(h.array.dtype for h in hosts))
        else:
            key = i
        keyed.setdefault(key, []).append(i)
    if all(len(g) == 1 for g in keyed.values()):
        return None
    return [tuple(g) for g in keyed.values()]


def fuse(call: ReduceCall, plan: list[tuple[int, ...]]) -> tuple[ReduceCall, Callable[[list[Any]], list[Any]]]:
    """The call to send for ``plan`` (from :func:`groups`): one pair per group, a fused group's values made
    :class:`Fused`; and the function that turns that call's results into one result per pair of ``call``.

    Example:
        >>> from xreduce._call import Algorithm
        >>> from xreduce._values import PerReplica
        >>> pairs = tuple(Pair(PerReplica([np.full(n, n, np.float32)]), ("CPU:0",), ("CPU:0",)) for n in (2, 3))
        >>> sent, finish = fuse(ReduceCall("SUM", pairs, Algorithm("hierarchical_copy", 1)), [(0, 1)])
        >>> sent.pairs[0].value.hosts()[0].array.shape
        (5,)
        >>> [r.tolist() for r in finish([np.arange(5, dtype=np.float32)])]
        [[0.0, 1.0], [2.0, 3.0, 4.0]]
    """
    sent = []
    for g in plan:
        first = call.pairs[g[0]]
        if len(g) == 1:
            sent.append(first)
            continue
        hosts = [call.pairs[i].value.hosts() for i in g]
        fused = tuple(HostArray(Fused(tuple(h[k].array for h in hosts)), None, _same)  # type: ignore[arg-type]
                      for k in range(len(first.devices)))
        parts = tuple((i, tuple(call.pairs[i].value.hosts()[0].array.shape)) for i in g)
        sent.append(Pair(_FusedValue(fused, parts), first.devices, first.destinations))  # type: ignore[arg-type]

    def finish(results: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(call.pairs)
        for g, result in zip(plan, results):
            if len(g) == 1:
                out[g[0]] = result
                continue
            flats, devices = (result.values, result.devices) if isinstance(result, Mirrored) else ((result,), None)
            shapes = [call.pairs[i].value.hosts()[0].array.shape for i in g]
            pieces = [split(flat, shapes) for flat in flats]
            for j, i in enumerate(g):
                restore = call.pairs[i].value.hosts()[0].restore
                arrays = [restore(p[j]) for p in pieces]
                out[i] = arrays[0] if devices is None else Mirrored(arrays, devices=devices)
        return out

    return dataclasses.replace(call, pairs=tuple(sent)), finish


def split(flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """``flat`` cut into consecutive arrays of ``shapes``: views, small ones (up to
    :data:`COPY_PIECES_UP_TO` bytes) copied.

    Example:
        >>> [a.tolist() for a in split(np.arange(5), [(2, 1), (3,)])]
        [[[0], [1]], [2, 3, 4]]
    """
    pieces, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        piece = flat[at:at + n].reshape(shape)
        pieces.append(piece.copy() if piece.nbytes <= COPY_PIECES_UP_TO else piece)
        at += n
    return pieces


def _same(a: np.ndarray) -> np.ndarray:
    return a
