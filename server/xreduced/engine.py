"""The engine: TF's routing over validated values, then plan and execute.

The service decodes requests into :class:`Value` objects (device indices and
numpy arrays) and calls :class:`Engine`; everything here is independent of
the wire format. Routing follows TF 2.21's HierarchicalCopyAllReduce and
ReductionToOneDevice with the project's fixes (DESIGN.md §3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from xreduced import planner
from xreduced.backends import Backend
from xreduced.errors import InvalidArgument
from xreduced.executor import Deadline, execute

SUM = "SUM"
MEAN = "MEAN"
MAX_NUM_PACKS = 65536
"""More packs than this are refused: each pack is a separate reduction."""


@dataclasses.dataclass(frozen=True)
class Value:
    """A per-replica value: ``arrays[p]`` lives on device ``devices[p]``.

    ``field`` is where it came from in the request, for error messages.
    """

    devices: tuple[int, ...]
    arrays: tuple[np.ndarray, ...]
    field: str = "value"


@dataclasses.dataclass(frozen=True)
class Result:
    """A reduced value: ``arrays[p]`` on ``devices[p]``; ``route`` is what ran."""

    devices: tuple[int, ...]
    arrays: tuple[np.ndarray, ...]
    route: str


def check_value(value: Value, label=str) -> None:
    """Rejects an empty value, a duplicated device, replicas that disagree.

    ``label(d)`` names device ``d`` in messages.

    Raises:
        InvalidArgument: naming the field and the values received.
    """
    f = value.field
    if not value.devices:
        raise InvalidArgument(f"{f}.components: a value needs at least one component; got none")
    seen: dict[int, int] = {}
    for p, d in enumerate(value.devices):
        if d in seen:
            raise InvalidArgument(
                f"{f}.components[{p}].device: {label(d)} already holds components[{seen[d]}]; "
                "each device may hold one component"
            )
        seen[d] = p
    first = value.arrays[0]
    for p, arr in enumerate(value.arrays[1:], 1):
        if arr.dtype != first.dtype or arr.shape != first.shape:
            raise InvalidArgument(
                f"{f}.components[{p}].tensor: replicas must agree in dtype and shape; got "
                f"{_label(arr)} but components[0] is {_label(first)}"
            )


def check_destinations(destinations: Sequence[int], field: str, label=str) -> None:
    """Rejects a destination named twice."""
    seen = set()
    for i, d in enumerate(destinations):
        if d in seen:
            raise InvalidArgument(f"{field}[{i}]: {label(d)} is listed twice in {field}")
        seen.add(d)


def _label(arr: np.ndarray) -> str:
    return f"{arr.dtype.name}{list(arr.shape)}"


class Engine:
    """Reduces values on a backend's devices.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> e = Engine(NumpyBackend(2))
        >>> v = Value((0, 1), (np.array([1.0, 2.0]), np.array([10.0, 20.0])))
        >>> r = e.reduce(SUM, v, ())
        >>> r.route, r.arrays[1]
        ('hierarchical_copy', array([11., 22.]))
    """

    def __init__(self, backend: Backend):
        self.backend = backend
        self._names = [f"{i.device_type}:{i.index}" for i in backend.devices()]

    def label(self, device: int) -> str:
        """The short name of device ``device``, e.g. ``GPU:3``."""
        return self._names[device]

    def reduce(
        self,
        op: str,
        value: Value,
        destinations: Sequence[int],
        *,
        num_packs: int = 1,
        algorithm: str = planner.HIERARCHICAL_COPY,
        reduce_to: int | None = None,
        deadline: Deadline | None = None,
    ) -> Result:
        """Reduces one value; empty ``destinations`` mean the value's devices."""
        return self.batch_reduce(
            op, [(value, destinations)], num_packs=num_packs, algorithm=algorithm,
            reduce_to=reduce_to, deadline=deadline, dest_fields=["destinations"],
        )[0]

    def batch_reduce(
        self,
        op: str,
        pairs: Sequence[tuple[Value, Sequence[int]]],
        *,
        num_packs: int = 1,
        algorithm: str = planner.HIERARCHICAL_COPY,
        reduce_to: int | None = None,
        deadline: Deadline | None = None,
        dest_fields: Sequence[str] | None = None,
    ) -> list[Result]:
        """Reduces every (value, destinations) pair.

        When every pair all-reduces over the first value's device set, values
        are reordered to the first value's device order and the whole batch is
        packed into ``num_packs`` packs; otherwise each pair is reduced alone.
        """
        resolved = self.validate(op, pairs, num_packs, dest_fields)
        if not resolved:
            return []
        deadline = deadline or Deadline(None)
        mean = op == MEAN
        if algorithm == planner.REDUCTION_TO_ONE_DEVICE:
            return [self._to_one(v, d, mean, reduce_to, deadline) for v, d in resolved]
        ref = resolved[0][0].devices
        if all(set(d) == set(v.devices) == set(ref) for v, d in resolved):
            return self._all_reduce([v for v, _ in resolved], mean, num_packs, deadline)
        return [
            self._all_reduce([v], mean, num_packs, deadline)[0]
            if set(d) == set(v.devices)
            else self._to_one(v, d, mean, None, deadline)
            for v, d in resolved
        ]

    def validate(
        self, op: str, pairs: Sequence[tuple[Value, Sequence[int]]], num_packs: int,
        dest_fields: Sequence[str] | None = None,
    ) -> list[tuple[Value, tuple[int, ...]]]:
        """Checks a batch and returns it with empty destinations replaced by the
        value's devices.

        Raises:
            InvalidArgument: a bad op or ``num_packs``, an empty value, a device
                given twice, replicas that disagree.
        """
        if op not in (SUM, MEAN):
            raise InvalidArgument(f"reduce_op must be SUM or MEAN; got {op!r}")
        if not 0 <= num_packs <= MAX_NUM_PACKS:
            raise InvalidArgument(f"num_packs must be in [0, {MAX_NUM_PACKS}]; got num_packs={num_packs}")
        fields = dest_fields or [f"pairs[{i}].destinations" for i in range(len(pairs))]
        resolved = []
        for (value, dests), field in zip(pairs, fields):
            check_value(value, self.label)
            check_destinations(dests, field, self.label)
            resolved.append((value, tuple(dests) or value.devices))
        return resolved

    def broadcast(
        self, array: np.ndarray, source: int, destinations: Sequence[int],
        deadline: Deadline | None = None,
    ) -> Result:
        """Copies ``array`` from ``source`` to every destination."""
        if not destinations:
            raise InvalidArgument("destinations: broadcast needs at least one destination; got none")
        check_destinations(destinations, "destinations", self.label)
        plan = planner.broadcast(source, destinations, array.size, array.dtype.itemsize)
        out = execute(plan, self.backend, [[array]], deadline=deadline)
        return Result(tuple(destinations), tuple(out[d][0] for d in destinations), planner.IDENTITY)

    def _all_reduce(self, values: list[Value], mean: bool, num_packs: int, deadline: Deadline) -> list[Result]:
        ref = values[0].devices
        if len(ref) == 1:
            # TF's shortcut: one replica is returned as is, even for MEAN.
            return [Result(ref, v.arrays, planner.IDENTITY) for v in values]
        if num_packs > 0:
            dtypes = {v.arrays[0].dtype for v in values}
            if len(dtypes) > 1:
                first = values[0]
                odd = next(v for v in values if v.arrays[0].dtype != first.arrays[0].dtype)
                raise InvalidArgument(
                    f"num_packs={num_packs} packs the batch into one buffer, so every value must "
                    f"share one dtype; got {first.field} {first.arrays[0].dtype.name} and "
                    f"{odd.field} {odd.arrays[0].dtype.name} (num_packs=0 reduces mixed dtypes)"
                )
        inputs = [[v.arrays[v.devices.index(d)] for v in values] for d in ref]
        templates = inputs[0]
        plan = planner.hierarchical_copy(
            ref, [a.size for a in templates], [a.dtype.itemsize for a in templates], num_packs
        )
        out = execute(plan, self.backend, inputs, mean=mean, deadline=deadline)
        return [
            Result(ref, tuple(out[d][t] for d in ref), planner.HIERARCHICAL_COPY)
            for t in range(len(values))
        ]

    def _to_one(self, value: Value, dests: tuple[int, ...], mean: bool, reduce_to: int | None,
                deadline: Deadline) -> Result:
        if len(value.devices) == 1 and set(dests) == set(value.devices):
            return Result(value.devices, value.arrays, planner.IDENTITY)
        a = value.arrays[0]
        plan = planner.reduction_to_one_device(value.devices, dests, [a.size], a.dtype.itemsize, reduce_to)
        out = execute(plan, self.backend, [[x] for x in value.arrays], mean=mean, deadline=deadline)
        return Result(dests, tuple(out[d][0] for d in dests), planner.REDUCTION_TO_ONE_DEVICE)
