"""Gathering per-replica values over every replica of every process, on the daemon's sums.

The wire contract has no gather, so a gather is a SUM all-reduce of
zero-padded placements: each replica writes its value into zeros of the
gathered shape, at its offset along the axis (replicas in global id order),
and the sum of the placements is the concatenation. Sizes along the axis may
differ between replicas: in a multi-process job one small SUM of every
replica's shape comes first (in one process they are known). Adding zeros
changes no value but the sign of a negative zero, which comes back as ``0.0``.
A batch of values costs one collective per dtype in it besides, each replica
sending the gathered size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce._arrays import HostArray, to_host
from xreduce._ops import ReduceOp
from xreduce._values import DistributedValues, Mirrored, PerReplica


def placements(shapes: Sequence[tuple[int, ...]], axis: int) -> tuple[tuple[int, ...], list[int]]:
    """The gathered shape of values of ``shapes`` (one per replica, in global id order) and
    each one's offset along ``axis``.

    Raises:
        ValueError: ``axis`` out of range, or shapes that differ off ``axis``; the message lists them.

    Example:
        >>> placements([(1, 2), (3, 2)], 0)
        ((4, 2), [0, 1])
        >>> placements([(2, 1), (2, 3)], -1)
        ((2, 4), [0, 1])
    """
    ndim = len(shapes[0])
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis must be in [{-ndim}, {ndim}) for values of shape {tuple(shapes[0])}; got axis={axis}")
    axis %= ndim
    rest = {tuple(s[:axis]) + tuple(s[axis + 1:]) for s in shapes}
    if any(len(s) != ndim for s in shapes) or len(rest) > 1:
        listing = ", ".join(f"replica {i}: {tuple(s)}" for i, s in enumerate(shapes))
        raise ValueError(f"all_gather along axis {axis} needs the replicas' shapes to agree off that axis; "
                         f"got {listing}")
    offsets = np.concatenate([[0], np.cumsum([s[axis] for s in shapes])]).tolist()
    gathered = tuple(shapes[0][:axis]) + (offsets[-1],) + tuple(shapes[0][axis + 1:])
    return gathered, offsets[:-1]


def place(host: np.ndarray, gathered: tuple[int, ...], axis: int, offset: int) -> np.ndarray:
    """``host`` in zeros of shape ``gathered``, from ``offset`` along ``axis``.

    Example:
        >>> place(np.array([[5, 6]]), (3, 2), 0, 1)
        array([[0, 0],
               [5, 6],
               [0, 0]])
    """
    out = np.zeros(gathered, host.dtype)
    axis %= host.ndim
    index = (slice(None),) * axis + (slice(offset, offset + host.shape[axis]),)
    out[index] = host
    return out


def batch_gather(reduce: Callable[[ReduceOp, list[tuple[Any, Any]]], list[Any]], pairs: Sequence[tuple[Any, Any]],
                 axis: int, devices: Sequence[str], first_id: int, num_replicas: int, multi_process: bool) -> list[Any]:
    """Gathers each (value, destinations) pair along ``axis`` to its destinations.

    Args:
        reduce: ``reduce(op, pairs)``: the strategy's batch reduce.
        pairs: per-replica values (one component per local replica) and their destinations.
        axis: the axis to concatenate along.
        devices: the local replicas' devices.
        first_id: the global id of the first local replica.
        num_replicas: every process's replicas.
        multi_process: whether other processes take part (their shapes are then asked for).

    Returns:
        Per pair, what the batch reduce returns (a ``Mirrored`` or one array), in the
        caller's array type.
    """
    hosts = [_hosts(value, len(devices), i) for i, (value, _) in enumerate(pairs)]
    if not hosts:
        return []
    local = [[tuple(h.array.shape) for h in value] for value in hosts]
    shapes = _global_shapes(reduce, local, devices, first_id, num_replicas) if multi_process else local
    padded = []
    for value, value_shapes, (_, destinations) in zip(hosts, shapes, pairs):
        gathered, offsets = placements(value_shapes, axis)
        parts = [place(h.array, gathered, axis, offsets[first_id + i]) for i, h in enumerate(value)]
        padded.append((PerReplica(parts, devices=devices), destinations))
    # One batch per dtype, in one order on every process: a packed batch holds one dtype.
    results: list[Any] = [None] * len(padded)
    for dtype in sorted({value[0].array.dtype.str for value in hosts}):
        chosen = [i for i, value in enumerate(hosts) if value[0].array.dtype.str == dtype]
        for i, r in zip(chosen, reduce(ReduceOp.SUM, [padded[i] for i in chosen])):
            results[i] = r
    return [_restored(r, value[0]) for r, value in zip(results, hosts)]


def _hosts(value: Any, local: int, index: int) -> list[HostArray]:
    components = value.values if isinstance(value, DistributedValues) else (value,)
    if len(components) != local:
        raise ValueError(f"gather value {index}: {len(components)} components for {local} local replicas; pass what "
                         "strategy.run returned")
    hosts = [to_host(c) for c in components]
    dtypes = {h.array.dtype for h in hosts}
    if len(dtypes) > 1:
        raise ValueError(f"gather value {index}: the replicas' dtypes differ: {sorted(map(str, dtypes))}")
    return hosts


def _global_shapes(reduce: Callable, local: list[list[tuple[int, ...]]], devices: Sequence[str], first_id: int,
                   num_replicas: int) -> list[list[tuple[int, ...]]]:
    """Every replica's shape of each value: one SUM of rows each replica fills at its id."""
    tables = []
    for shapes in local:
        rows = []
        for i, shape in enumerate(shapes):
            table = np.zeros((num_replicas, len(shape) + 1), np.int64)
            table[first_id + i] = (len(shape), *shape)
            rows.append(table)
        tables.append((PerReplica(rows, devices=devices), devices[0]))
    summed = reduce(ReduceOp.SUM, tables)
    return [[tuple(int(x) for x in row[1:1 + int(row[0])]) for row in np.asarray(t)] for t in summed]


def _restored(result: Any, host: HostArray) -> Any:
    if isinstance(result, DistributedValues):
        return Mirrored([host.restore(np.asarray(v)) for v in result.values], devices=result.devices)
    return host.restore(np.asarray(result))
