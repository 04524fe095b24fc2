"""The engine: TF's routing over validated values, then plan and execute.

The service decodes requests into :class:`Value` objects (device indices and
numpy arrays) and calls :class:`Engine`; everything here is independent of
the wire format. Routing follows TF 2.21's HierarchicalCopyAllReduce and
ReductionToOneDevice with the project's fixes (DESIGN.md §3); NcclAllReduce
routes as HierarchicalCopyAllReduce (both are TF's AllReduceCrossDeviceOps),
its all-reduces summed by the backend's NCCL. Sparse values
(:class:`~xreduce.wire.sparse.Slices`, TF's IndexedSlices) are split from a
batch as TF splits them and concatenated (:meth:`Engine.batch_reduce`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from xreduce.wire.contract import mean_dtype
from xreduce.wire.sparse import Slices, concat

from xreduced import planner
from xreduced.backends import Backend, HostMemory
from xreduced.backends.numpy_backend import divide
from xreduced.deadline import Deadline
from xreduced.errors import InvalidArgument
from xreduced.executor import Bound, Fused, check_out, execute


class Op(enum.StrEnum):
    """A reduction's operation (the request's ``reduce_op``). Members are strings, equal to their values.

    Example:
        >>> Op("MEAN") is Op.MEAN, Op.SUM == "SUM", f"{Op.SUM}"
        (True, True, 'SUM')
    """

    SUM = "SUM"
    MEAN = "MEAN"
    """The sum divided by the number of replicas (an integer dtype's mean is a float: ``mean_dtype``)."""


SUM = Op.SUM
MEAN = Op.MEAN
MAX_NUM_PACKS = 65536
"""More packs than this are refused: each pack is a separate reduction."""


@dataclasses.dataclass(frozen=True)
class Value:
    """A per-replica value: ``arrays[p]`` lives on device ``devices[p]``; every array a
    :class:`~xreduce.wire.sparse.Slices` for a sparse value (host arrays, whatever the backend).

    ``field`` is where it came from in the request, for error messages. ``parts`` are the
    ``(index, shape)`` of the values a fused value holds (``DistributedValue.fused_parts``), which
    the processes of a collective must agree on; empty for a value sent on its own.
    """

    devices: tuple[int, ...]
    arrays: tuple[np.ndarray, ...]
    field: str = "value"
    parts: tuple[tuple[int, tuple[int, ...]], ...] = dataclasses.field(default=(), repr=False)


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
    if any(isinstance(a, Slices) for a in value.arrays):
        _check_sparse(value)
        return
    for p, arr in enumerate(value.arrays[1:], 1):
        if arr.dtype != first.dtype or arr.shape != first.shape:
            raise InvalidArgument(
                f"{f}.components[{p}].tensor: replicas must agree in dtype and shape; got "
                f"{_label(arr)} but components[0] is {_label(first)}"
            )


def _check_sparse(value: Value) -> None:
    f, first = value.field, value.arrays[0]
    for p, arr in enumerate(value.arrays):
        if not isinstance(arr, Slices):
            raise InvalidArgument(
                f"{f}.components[{p}]: a value's components are all tensors or all indexed_slices; got a tensor "
                f"{_label(arr)} beside indexed_slices {next(a for a in value.arrays if isinstance(a, Slices))!r}")
        if arr.spec() != first.spec():
            raise InvalidArgument(
                f"{f}.components[{p}].indexed_slices: replicas must agree in the values' dtype, the rows' shape "
                f"and dense_shape; got {arr!r} but components[0] is {first!r}")


def is_sparse(value: Value) -> bool:
    """Whether a (checked) value is sparse.

    Example:
        >>> is_sparse(Value((0,), (Slices(np.ones((1, 2)), np.array([0]), (3, 2)),)))
        True
    """
    return isinstance(value.arrays[0], Slices)


def check_destinations(destinations: Sequence[int], field: str, label=str, *, required: str | None = None) -> None:
    """Rejects a destination named twice, and, when ``required`` names the call
    (e.g. ``"broadcast"``), no destination at all.

    ``label(d)`` names device ``d`` in messages.

    Raises:
        InvalidArgument: naming the field and the device.

    Example:
        >>> check_destinations([1, 2, 1], "destinations")
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: destinations[2]: 1 is listed twice in destinations
        >>> check_destinations([], "destinations", required="broadcast")
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: destinations: broadcast needs at least one destination; got none
    """
    if required and not destinations:
        raise InvalidArgument(f"{field}: {required} needs at least one destination; got none")
    seen = set()
    for i, d in enumerate(destinations):
        if d in seen:
            raise InvalidArgument(f"{field}[{i}]: {label(d)} is listed twice in {field}")
        seen.add(d)


def _label(arr: np.ndarray) -> str:
    return f"{arr.dtype.name}{list(arr.shape)}"


def result_dtype(op: str, dtype: np.dtype, route: str) -> np.dtype:
    """The dtype of a reduction's result: MEAN promotes integers, except on the
    identity route, which returns the value as it is.

    Example:
        >>> i32 = np.dtype(np.int32)
        >>> result_dtype(MEAN, i32, planner.HIERARCHICAL_COPY).name, result_dtype(MEAN, i32, planner.IDENTITY).name
        ('float64', 'int32')
    """
    return mean_dtype(dtype) if op == MEAN and route != planner.IDENTITY else np.dtype(dtype)


class Engine:
    """Reduces values on a backend's devices.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> e = Engine(NumpyBackend(2))
        >>> v = Value((0, 1), (np.array([1.0, 2.0]), np.array([10.0, 20.0])))
        >>> r = e.reduce(SUM, v, ())
        >>> r.route, r.arrays[1]
        (<Route.HIERARCHICAL_COPY: 'hierarchical_copy'>, array([11., 22.]))
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
        out: Mapping[int, np.ndarray] | None = None,
    ) -> Result:
        """Reduces one value; empty ``destinations`` mean the value's devices.

        ``out`` is :meth:`batch_reduce`'s for this one pair.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> e = Engine(NumpyBackend(3))
            >>> mine = np.zeros(2, np.float32)
            >>> r = e.reduce(SUM, Value((0, 1), (np.ones(2, np.float32),) * 2), [2], out={2: mine})
            >>> r.arrays[0] is mine, mine
            (True, array([2., 2.], dtype=float32))
        """
        return self.batch_reduce(
            op, [(value, destinations)], num_packs=num_packs, algorithm=algorithm,
            reduce_to=reduce_to, deadline=deadline, dest_fields=["destinations"],
            out=None if out is None else [out],
        )[0]

    def batch_reduce(  # noqa: PLR0913
        self,
        op: str,
        pairs: Sequence[tuple[Value, Sequence[int]]],
        *,
        num_packs: int = 1,
        algorithm: str = planner.HIERARCHICAL_COPY,
        reduce_to: int | None = None,
        deadline: Deadline | None = None,
        dest_fields: Sequence[str] | None = None,
        out: Sequence[Mapping[int, np.ndarray] | None] | None = None,
        checked: bool = False,
    ) -> list[Result]:
        """Reduces every (value, destinations) pair.

        When every pair all-reduces over the first value's device set, values
        are reordered to the first value's device order and the whole batch is
        packed into ``num_packs`` packs; otherwise each pair is reduced alone.
        :meth:`routes` says which route each pair takes.

        Args:
            out: one entry per pair: None, or destination device -> a writable
                array of the result's dtype (:func:`result_dtype`: the value's,
                or for MEAN of integers :func:`~xreduce.wire.contract.mean_dtype`'s,
                except on the identity route) and the value's shape. Results go
                straight into those arrays, and the pair's :class:`Result`
                holds them; destinations it leaves out get fresh arrays.
            checked: a batch of dense values without ``out`` whose very shape (devices, dtypes, shapes,
                destinations, options) the caller has had through this method before, and that passed:
                the checks are skipped (:func:`xreduced.collective.reduce_together` knows such batches).

        Raises:
            InvalidArgument: see :meth:`validate` and :meth:`routes`; an ``out``
                entry for a device that is not a destination, or an array of
                the wrong dtype or shape, or read-only.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> e = Engine(NumpyBackend(2))
            >>> v = Value((0, 1), (np.array([1, 2], np.int32), np.array([3, 4], np.int32)))
            >>> mine = np.empty(2, np.float64)
            >>> r = e.batch_reduce(MEAN, [(v, ())], out=[{1: mine}])[0]
            >>> r.arrays[0], r.arrays[1] is mine, mine
            (array([2., 3.]), True, array([2., 3.]))
        """
        if checked and out is None:
            resolved = [(v, tuple(d) or v.devices) for v, d in pairs]
        else:
            resolved = self.validate(op, pairs, num_packs, dest_fields)
            checked = False
        if not resolved:
            return []
        if not checked:
            self._check_algorithm(resolved, algorithm)
            sparse = [i for i, (v, _) in enumerate(resolved) if is_sparse(v)]
            if sparse:
                return self._split_by_sparsity(op, resolved, sparse, num_packs=num_packs, algorithm=algorithm,
                                               reduce_to=reduce_to, deadline=deadline, dest_fields=dest_fields,
                                               out=out)
        together = algorithm != planner.REDUCTION_TO_ONE_DEVICE and self._together(resolved)
        if checked and together:
            outs = [None] * len(resolved)
        else:
            routes = self._routes(resolved, algorithm, num_packs, together)
            outs = self._check_outs(op, resolved, routes, out)
        deadline = deadline or Deadline(None)
        mean = op == MEAN
        if together:
            return self._all_reduce([v for v, _ in resolved], outs, mean, num_packs, deadline, algorithm)
        if algorithm != planner.REDUCTION_TO_ONE_DEVICE:
            reduce_to = None  # a pair that falls back to reduction to one device sums on its first destination
        results = []
        for (value, dests), o, route in zip(resolved, outs, routes):
            if route == planner.IDENTITY:
                results.append(self._identity(value, o))
            elif route in (planner.HIERARCHICAL_COPY, planner.NCCL):
                results.append(self._all_reduce([value], [o], mean, num_packs, deadline, algorithm)[0])
            else:
                results.append(self._to_one(value, dests, o, mean, reduce_to, deadline))
        return results

    def prepare(self, op: str, pairs: Sequence[tuple[Value, Sequence[int]]], *, num_packs: int = 1,
                algorithm: str = planner.HIERARCHICAL_COPY, reduce_to: int | None = None,
                dest_fields: Sequence[str] | None = None,
                out: Sequence[Mapping[int, np.ndarray]]) -> PreparedReduction | None:
        """:meth:`batch_reduce` of this batch worked out once, for a caller that reduces arrays of the same shape
        at the same places again and again (a kept repeat, :mod:`xreduced.repeated`): the checks, the route,
        the plan and the fused execution's layout. None when it is not one fused all-reduce on host memory
        with every result in an ``out`` array (the caller then calls :meth:`batch_reduce`).

        Raises:
            InvalidArgument: what :meth:`batch_reduce` raises for the batch.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> e = Engine(NumpyBackend(2))
            >>> v = Value((0, 1), (np.float32([1, 2]), np.float32([3, 4])))
            >>> outs = [{0: np.empty(2, np.float32), 1: np.empty(2, np.float32)}]
            >>> prepared = e.prepare(SUM, [(v, ())], out=outs)
            >>> prepared.run([(v, ())], outs); outs[0][1]
            array([4., 6.], dtype=float32)
        """
        resolved = self.validate(op, pairs, num_packs, dest_fields)
        if not resolved or not isinstance(self.backend, HostMemory) or algorithm == planner.NCCL or \
                any(is_sparse(v) for v, _ in resolved):
            return None
        together = algorithm != planner.REDUCTION_TO_ONE_DEVICE and self._together(resolved)
        if not together or len(resolved[0][0].devices) < 2:
            return None
        routes = self._routes(resolved, algorithm, num_packs, together)
        outs = self._check_outs(op, resolved, routes, out)
        values = [v for v, _ in resolved]
        devices = values[0].devices
        inputs = [[v.arrays[v.devices.index(d)] for v in values] for d in devices]
        templates = inputs[0]
        plan = _planned(planner.hierarchical_copy, devices, tuple(a.size for a in templates),
                        tuple(a.dtype.itemsize for a in templates), num_packs)
        mean = op == MEAN
        sinks = {}
        for d in plan.destinations:
            arrays = [o.get(d) if o is not None else None for o in outs]
            if any(a is None or not a.flags.c_contiguous or a.dtype != (mean_dtype(t.dtype) if mean else t.dtype)
                   for a, t in zip(arrays, templates)):
                return None
            sinks[d] = arrays
        return PreparedReduction(devices, plan.destinations, mean, Fused(plan, inputs, sinks))

    def _split_by_sparsity(self, op: str, resolved: list[tuple[Value, tuple[int, ...]]], sparse: list[int], *,
                           dest_fields: Sequence[str] | None, out: Sequence[Mapping[int, np.ndarray] | None] | None,
                           **options) -> list[Result]:
        """TF's ``_split_by_sparsity``: the dense pairs reduced as a batch of their own (packed together
        when they all-reduce over one device set), each sparse pair concatenated (:meth:`_concat`)."""
        for i in sparse:
            if out is not None and out[i] is not None:
                raise InvalidArgument(f"out[{i}]: pairs[{i}] is sparse; its size is known only once reduced, so it "
                                      "cannot go to an out array")
        dense = [i for i in range(len(resolved)) if i not in sparse]
        fields = dest_fields or [f"pairs[{i}].destinations" for i in range(len(resolved))]
        results: list[Result | None] = [None] * len(resolved)
        if dense:
            reduced = self.batch_reduce(op, [resolved[i] for i in dense], dest_fields=[fields[i] for i in dense],
                                        out=None if out is None else [out[i] for i in dense], **options)
            for i, result in zip(dense, reduced):
                results[i] = result
        for i in sparse:
            results[i] = self._concat(op, *resolved[i])
        return results

    def _concat(self, op: str, value: Value, dests: tuple[int, ...]) -> Result:
        """TF's reduction of a sparse value (``ReductionToOneDevice``): the replicas' values and indices
        concatenated in device order, MEAN dividing the values by the replica count; the same result on every
        destination. One replica onto its own device is TF's shortcut: returned as it is, even for MEAN.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> a, b = (Slices(np.array([[v]]), np.array([i]), (4, 1)) for v, i in ((1.0, 3), (3.0, 0)))
            >>> r = Engine(NumpyBackend(2))._concat(MEAN, Value((0, 1), (a, b)), (1,))
            >>> r.route, r.arrays[0].values.tolist(), r.arrays[0].indices.tolist()
            (<Route.REDUCTION_TO_ONE_DEVICE: 'reduction_to_one_device'>, [[0.5], [1.5]], [3, 0])
        """
        route = _sparse_route(value, dests)
        if route == planner.IDENTITY:
            return Result(value.devices, value.arrays, route)
        total = concat(value.arrays)
        if op == MEAN:
            total = Slices(divide(np, total.values, len(value.devices)), total.indices, total.dense_shape)
        return Result(dests, (total,) * len(dests), route)

    def routes(
        self,
        op: str,
        pairs: Sequence[tuple[Value, Sequence[int]]],
        *,
        algorithm: str = planner.HIERARCHICAL_COPY,
        num_packs: int = 1,
        dest_fields: Sequence[str] | None = None,
    ) -> list[str]:
        """The route :meth:`batch_reduce` takes for each pair, without reducing:
        ``planner.IDENTITY``, ``planner.HIERARCHICAL_COPY`` (``planner.NCCL`` with that
        algorithm) or ``planner.REDUCTION_TO_ONE_DEVICE``.

        Raises:
            InvalidArgument: what :meth:`batch_reduce` would raise before
                reducing: see :meth:`validate`; NCCL on a backend that cannot
                run it over a pair's devices; a batch packed together
                (``num_packs > 0``) whose values mix dtypes.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> e = Engine(NumpyBackend(4))
            >>> x = np.ones(3, np.float32)
            >>> e.routes(SUM, [(Value((0, 1), (x, x)), ()), (Value((2,), (x,)), ()), (Value((2,), (x,)), [3])])
            [<Route.HIERARCHICAL_COPY: 'hierarchical_copy'>, <Route.IDENTITY: 'identity'>,
             <Route.REDUCTION_TO_ONE_DEVICE: 'reduction_to_one_device'>]
        """
        resolved = self.validate(op, pairs, num_packs, dest_fields)
        self._check_algorithm(resolved, algorithm)
        return self._routes(resolved, algorithm, num_packs) if resolved else []

    def fold_devices(self, pairs: Sequence[tuple[Value, Sequence[int]]], *,
                     algorithm: str = planner.HIERARCHICAL_COPY) -> list[tuple[int, ...]]:
        """Per pair, the device order in which :meth:`batch_reduce` adds its replicas: the first
        value's for a batch that all-reduces over one device set, else the value's own.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> x = np.ones(1)
            >>> Engine(NumpyBackend(2)).fold_devices([(Value((0, 1), (x, x)), ()), (Value((1, 0), (x, x)), ())])
            [(0, 1), (0, 1)]
        """
        resolved = [(v, tuple(d) or v.devices) for v, d in pairs]
        if resolved and algorithm != planner.REDUCTION_TO_ONE_DEVICE and self._together(resolved):
            return [resolved[0][0].devices] * len(resolved)
        return [v.devices for v, _ in resolved]

    def _together(self, resolved: list[tuple[Value, tuple[int, ...]]]) -> bool:
        """Does the whole batch all-reduce over one device set (so it is packed together)?"""
        ref = set(resolved[0][0].devices)
        return all(set(d) == set(v.devices) == ref for v, d in resolved)

    def _routes(self, resolved, algorithm: str, num_packs: int, together: bool | None = None) -> list[str]:
        """Each pair's route; ``together`` is :meth:`_together`'s answer for a batch without sparse values,
        when the caller has it."""
        sparse = {i for i, (v, _) in enumerate(resolved) if is_sparse(v)}
        if sparse:
            dense = iter(self._routes([p for i, p in enumerate(resolved) if i not in sparse], algorithm, num_packs)
                         if len(sparse) < len(resolved) else ())
            return [_sparse_route(*p) if i in sparse else next(dense) for i, p in enumerate(resolved)]
        if together is None:
            together = algorithm != planner.REDUCTION_TO_ONE_DEVICE and self._together(resolved)
        if together:
            if len(resolved[0][0].devices) > 1 and num_packs > 0:
                _check_one_dtype([v for v, _ in resolved], num_packs)
        routes = []
        for value, dests in resolved:
            same = set(dests) == set(value.devices)
            if same and len(value.devices) == 1:
                routes.append(planner.IDENTITY)
            elif same and algorithm != planner.REDUCTION_TO_ONE_DEVICE:
                routes.append(planner.NCCL if algorithm == planner.NCCL else planner.HIERARCHICAL_COPY)
            else:
                routes.append(planner.REDUCTION_TO_ONE_DEVICE)
        return routes

    def _check_algorithm(self, resolved: list[tuple[Value, tuple[int, ...]]], algorithm: str) -> None:
        """Refuses NCCL where the backend cannot run it over a pair's devices (host memory, logical
        devices sharing a GPU), before anything is reduced."""
        if algorithm != planner.NCCL:
            return
        for value, dests in resolved:
            summed = len(value.devices) > 1 and set(dests) == set(value.devices) and not is_sparse(value)
            refusal = self.backend.nccl_refusal(tuple(dict.fromkeys(value.devices + dests)),
                                                value.arrays[0].dtype if summed else None)
            if refusal is not None:
                where = f" ({value.field})" if len(resolved) > 1 else ""
                raise InvalidArgument(f"algorithm: ALGORITHM_NCCL cannot run on this daemon{where}: {refusal}; "
                                      "ALGORITHM_HIERARCHICAL_COPY reduces on any devices")

    def _check_outs(self, op, resolved, routes, out) -> list[Mapping[int, np.ndarray] | None]:
        if out is None:
            return [None] * len(resolved)
        if len(out) != len(resolved):
            raise InvalidArgument(f"out: one entry per pair; got {len(out)} for {len(resolved)} pairs")
        for i, ((value, dests), route, mine) in enumerate(zip(resolved, routes, out)):
            if mine is None:
                continue
            first = value.arrays[0]
            dtype = result_dtype(op, first.dtype, route)
            for d, array in mine.items():
                if d not in dests:
                    raise InvalidArgument(
                        f"out[{i}]: {self.label(d)} is not a destination of pairs[{i}]; its destinations are "
                        f"{[self.label(x) for x in dests]}")
                check_out(array, dtype, first.shape, f"out[{i}][{self.label(d)}]", self.backend)
        return list(out)

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
            raise InvalidArgument(f"num_packs: must be in [0, {MAX_NUM_PACKS}]; got num_packs={num_packs}")
        fields = dest_fields or [f"pairs[{i}].destinations" for i in range(len(pairs))]
        resolved = []
        for (value, dests), field in zip(pairs, fields):
            check_value(value, self.label)
            check_destinations(dests, field, self.label)
            resolved.append((value, tuple(dests) or value.devices))
        return resolved

    def broadcast(
        self, array: np.ndarray, source: int, destinations: Sequence[int],
        deadline: Deadline | None = None, out: Mapping[int, np.ndarray] | None = None,
    ) -> Result:
        """Copies ``array`` from ``source`` to every destination.

        Args:
            out: destination device -> a writable array of ``array``'s dtype and
                shape to copy into (the result holds it); others get fresh arrays.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> mine = np.zeros(2, np.int8)
            >>> r = Engine(NumpyBackend(3)).broadcast(np.array([5, 6], np.int8), 0, [1, 2], out={2: mine})
            >>> r.arrays[1] is mine, mine
            (True, array([5, 6], dtype=int8))
        """
        check_destinations(destinations, "destinations", self.label, required="broadcast")
        for d, target in (out or {}).items():
            if d not in destinations:
                raise InvalidArgument(f"out: {self.label(d)} is not a destination; the destinations are "
                                      f"{[self.label(x) for x in destinations]}")
            check_out(target, array.dtype, array.shape, f"out[{self.label(d)}]", self.backend)
        plan = planner.broadcast(source, destinations, array.size, array.dtype.itemsize)
        results = execute(plan, self.backend, [[array]], deadline=deadline, out=_per_tensor([out]))
        return Result(tuple(destinations), tuple(results[d][0] for d in destinations), planner.IDENTITY)

    def _identity(self, value: Value, out: Mapping[int, np.ndarray] | None) -> Result:
        """TF's shortcut: one replica onto its own device is returned as is, even for MEAN."""
        (device,) = value.devices
        if out is None or device not in out:
            return Result(value.devices, value.arrays, planner.IDENTITY)
        self.backend.write(out[device], value.arrays[0])
        return Result(value.devices, (out[device],), planner.IDENTITY)

    def _all_reduce(self, values: list[Value], outs: list, mean: bool, num_packs: int,
                    deadline: Deadline, algorithm: str) -> list[Result]:
        ref = values[0].devices
        if len(ref) == 1:
            return [self._identity(v, o) for v, o in zip(values, outs)]
        inputs = [[v.arrays[v.devices.index(d)] for v in values] for d in ref]
        templates = inputs[0]
        make = planner.nccl_all_reduce if algorithm == planner.NCCL else planner.hierarchical_copy
        plan = _planned(make, ref, tuple(a.size for a in templates), tuple(a.dtype.itemsize for a in templates),
                        num_packs)
        results = execute(plan, self.backend, inputs, mean=mean, deadline=deadline, out=_per_tensor(outs))
        return [
            Result(ref, tuple(results[d][t] for d in ref), plan.algorithm)
            for t in range(len(values))
        ]

    def _to_one(self, value: Value, dests: tuple[int, ...], out: Mapping[int, np.ndarray] | None, mean: bool,
                reduce_to: int | None, deadline: Deadline) -> Result:
        a = value.arrays[0]
        plan = planner.reduction_to_one_device(value.devices, dests, [a.size], a.dtype.itemsize, reduce_to)
        results = execute(plan, self.backend, [[x] for x in value.arrays], mean=mean, deadline=deadline,
                          out=_per_tensor([out]))
        return Result(dests, tuple(results[d][0] for d in dests), planner.REDUCTION_TO_ONE_DEVICE)


class PreparedReduction:
    """A batch :meth:`Engine.prepare` worked out: :meth:`run` reduces arrays of its shape into ``out`` arrays of
    its shape, as :meth:`Engine.batch_reduce` would, bit for bit, without checking or planning again."""

    def __init__(self, devices: tuple[int, ...], destinations: Sequence[int], mean: bool, fused: Fused):
        self.devices, self.destinations, self.mean, self.fused = devices, tuple(destinations), mean, fused

    def run(self, pairs: Sequence[tuple[Value, Sequence[int]]], out: Sequence[Mapping[int, np.ndarray]],
            deadline: Deadline | None = None) -> None:
        """Reduces ``pairs`` into ``out``: the same devices, dtypes, shapes and destinations as the batch it was
        prepared from, and ``out`` arrays at the same places relative to the inputs (nothing here checks it)."""
        self.fused.run(*self._arrays(pairs, out), self.mean, deadline)

    def bind(self, pairs: Sequence[tuple[Value, Sequence[int]]], out: Sequence[Mapping[int, np.ndarray]]) -> Bound:
        """:meth:`run` of these very arrays, worked out once (:meth:`xreduced.executor.Fused.bind`): a kept
        repeat's views of its regions, reduced step after step.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> v = Value((0, 1), (np.float32([1, 2]), np.float32([3, 4])))
            >>> outs = [{0: np.empty(2, np.float32), 1: np.empty(2, np.float32)}]
            >>> bound = Engine(NumpyBackend(2)).prepare(SUM, [(v, ())], out=outs).bind([(v, ())], outs)
            >>> v.arrays[0][:] = 10; bound.run(), outs[0][0]
            (True, array([13., 14.], dtype=float32))
        """
        return self.fused.bind(*self._arrays(pairs, out), self.mean)

    def _arrays(self, pairs, out) -> tuple[list[list[np.ndarray]], dict[int, list[np.ndarray]]]:
        """The fused run's inputs (``inputs[p][t]``) and sinks (destination -> one array per tensor)."""
        inputs = [[v.arrays[v.devices.index(d)] for v, _ in pairs] for d in self.devices]
        return inputs, {d: [o[d] for o in out] for d in self.destinations}


@functools.lru_cache(maxsize=128)
def _planned(make: Callable[..., planner.Plan], devices: tuple[int, ...], elements: tuple[int, ...],
             itemsizes: tuple[int, ...], num_packs: int) -> planner.Plan:
    """``make(devices, elements, itemsizes, num_packs)``, remembered: the planner is pure, and a training loop
    reduces the same shapes step after step."""
    return make(devices, elements, itemsizes, num_packs)


def _sparse_route(value: Value, dests: Sequence[int]) -> str:
    """A sparse value's route: TF's one-replica shortcut, else reduction to one device (its concatenation)."""
    if len(value.devices) == 1 and set(dests) == set(value.devices):
        return planner.IDENTITY
    return planner.REDUCTION_TO_ONE_DEVICE


def _check_one_dtype(values: list[Value], num_packs: int) -> None:
    first = values[0]
    odd = next((v for v in values if v.arrays[0].dtype != first.arrays[0].dtype), None)
    if odd is not None:
        raise InvalidArgument(
            f"num_packs={num_packs} packs the batch into one buffer, so every value must "
            f"share one dtype; got {first.field} {first.arrays[0].dtype.name} and "
            f"{odd.field} {odd.arrays[0].dtype.name} (num_packs=0 reduces mixed dtypes)"
        )


def _per_tensor(outs: Sequence[Mapping[int, np.ndarray] | None]) -> dict[int, list[np.ndarray | None]] | None:
    """Per-pair ``out`` mappings as the executor takes them: device -> one array (or None) per tensor."""
    if all(o is None for o in outs):
        return None
    devices = {d for o in outs if o is not None for d in o}
    return {d: [None if o is None else o.get(d) for o in outs] for d in devices}
