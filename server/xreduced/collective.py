"""Collectives of several processes: agreement checks, one reduction over the
union of their devices, and each process's share of the result.

Process ``p``'s contribution is what its request would reduce alone; the
daemon joins pair ``i`` of every process into one value whose components are
in global device order (process 0's components first, each process's in its
own order, as ``list_devices()`` lists them), reduces the batch once, and
answers each process on its own destinations (its value's devices when it
named none).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Container, Mapping
from typing import Any

import numpy as np
from xreduce.wire.sparse import Slices

from xreduced.deadline import Deadline
from xreduced.engine import Engine, PreparedReduction, Result, Value
from xreduced.errors import InvalidArgument
from xreduced.prepared import Recent

log = logging.getLogger("xreduced.collective")


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One process's share of a Reduce or BatchReduce collective, validated."""

    kind: str
    op: str
    num_packs: int
    algorithm: str
    reduce_to: int | None
    pairs: tuple[tuple[Value, tuple[int, ...]], ...]
    """(value, destinations); empty destinations already replaced by the value's devices."""
    out: tuple[Mapping[int, np.ndarray] | None, ...] | None = None
    """Where this process wants its results: one entry per pair, None or destination device -> a
    writable array (see :meth:`Engine.batch_reduce`)."""
    shape: bytes | None = None
    """The request's shape (:func:`xreduced.prepared.shape_of`) when it has one: every tensor dense, no ``out``."""


@dataclasses.dataclass(frozen=True)
class BroadcastShare:
    """One process's share of a Broadcast collective."""

    source_process: int
    array: np.ndarray | None
    source: int | None
    destinations: tuple[int, ...]
    out: Mapping[int, np.ndarray] | None = None
    """Where this process wants its results: destination device -> a writable array of the tensor's
    dtype and shape."""


def _shape(arr: np.ndarray | Slices) -> str:
    return repr(arr) if isinstance(arr, Slices) else f"{arr.dtype.name}{list(arr.shape)}"


def _spec(arr: np.ndarray | Slices) -> tuple:
    """What the processes must agree on for one tensor: dtype and shape; for a sparse one, the values'
    dtype, the rows' shape and the dense shape (each process sends its own number of rows)."""
    return ("sparse", *arr.spec()) if isinstance(arr, Slices) else ("dense", arr.dtype, arr.shape)


def reduce_together(engine: Engine, shares: Mapping[int, Contribution], what: str,
                    deadline: Deadline) -> dict[int, list[Result]]:
    """Checks the processes agree, reduces once, and splits the results.

    Each process's results go into its own ``out`` arrays (the reduction writes
    straight into them; a destination two processes both give arrays for is
    copied into the second).

    Raises:
        InvalidArgument: naming the processes and what differs, e.g.
            ``process 2 sent float32[10] but process 0 sent float32[12] for
            tensor 3 of collective 17 in group "train"``.
    """
    joint = _joint_shape(shares)
    joints = _joints(engine)
    checked = joint is not None and joints.get(joint) is not None
    if not checked:
        check_shares(engine, shares, what)
    ref = shares[min(shares)]
    joined, outs = join_shares(engine, shares, what)
    results = engine.batch_reduce(
        ref.op, joined, num_packs=ref.num_packs, algorithm=ref.algorithm, reduce_to=ref.reduce_to,
        deadline=deadline, dest_fields=tensor_dest_fields(len(joined)),
        out=outs if any(outs) else None, checked=checked,
    )
    if joint is not None and not checked:  # everything checked passed: the next collective of these shapes skips
        joints.put(joint, Joint(shares, joined))  # the checks, and the express lane takes its layout
    return {
        pid: [share_of(engine, r, dests, None if c.out is None else c.out[t])
              for t, (r, (_, dests)) in enumerate(zip(results, c.pairs))]
        for pid, c in shares.items()
    }


class Joint:
    """A collective laid out once, from ``joined``, what :func:`join_shares` made of ``shares``: where each
    component of each joined value comes from (process, its component) and which of the results each process
    gets. :func:`reduce_together` keeps one per joint shape that passed its checks (:func:`laid_out`);
    :meth:`reduce` then runs the engine exactly as :func:`reduce_together` does (the same joined values, the
    same plan), without joining and checking again.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> engine = Engine(NumpyBackend(2))
        >>> def share(pid, x):
        ...     value = Value((pid,), (np.float32([x]),), "pairs[0].value", ((0, (1,)),))
        ...     return Contribution("BatchReduce", "SUM", 1, "hierarchical_copy", None, ((value, (pid,)),))
        >>> shares = {0: share(0, 1), 1: share(1, 2)}
        >>> joint = Joint(shares, join_shares(engine, shares, "collective 1")[0])
        >>> arrays = {0: [(np.float32([3]),)], 1: [(np.float32([4]),)]}
        >>> [r[0].arrays for r in joint.reduce(engine, arrays, "collective 2", Deadline(None)).values()]
        [(array([7.], dtype=float32),), (array([7.], dtype=float32),)]
    """

    def __init__(self, shares: Mapping[int, Contribution], joined: list[tuple[Value, tuple[int, ...]]]):
        ref = shares[min(shares)]
        self.op, self.num_packs, self.algorithm, self.reduce_to = ref.op, ref.num_packs, ref.algorithm, ref.reduce_to
        self.pairs = []
        """Per pair: (devices, where each component comes from: (process, its component), destinations, parts)."""
        for t, (value, dests) in enumerate(joined):
            source = {d: (pid, k) for pid, c in shares.items() for k, d in enumerate(c.pairs[t][0].devices)}
            self.pairs.append((value.devices, tuple(source[d] for d in value.devices), dests, value.parts))
        self.dest_fields = tensor_dest_fields(len(joined))
        self.destinations = {pid: [dests for _, dests in c.pairs] for pid, c in shares.items()}
        """Each process's destinations, pair by pair."""
        self.replies: dict[int, Any] = {}
        """What a caller derives from the layout, kept with it: the service's encoded replies to refill."""

    def reduce(self, engine: Engine, arrays: Mapping[int, list[tuple[np.ndarray, ...]]], what: str,
               deadline: Deadline) -> dict[int, list[Result]]:
        """Each process's results, from each process's arrays (pair by pair, its components in order)."""
        joined = [
            (Value(devices, tuple(arrays[pid][t][k] for pid, k in fetch), f"tensor {t} of {what}", parts), dests)
            for t, (devices, fetch, dests, parts) in enumerate(self.pairs)
        ]
        results = engine.batch_reduce(self.op, joined, num_packs=self.num_packs, algorithm=self.algorithm,
                                      reduce_to=self.reduce_to, deadline=deadline, dest_fields=self.dest_fields,
                                      checked=True)
        return {pid: [share_of(engine, r, dests, None) for r, dests in zip(results, mine)]
                for pid, mine in self.destinations.items()}


JOINTS_KEPT = 256
"""Joint shapes remembered as checked (with their layouts), per engine."""

_JOINTS: weakref.WeakKeyDictionary[Engine, Recent[tuple, Joint]] = weakref.WeakKeyDictionary()
_JOINTS_LOCK = threading.Lock()


def laid_out(engine: Engine, kind: str, shapes: Mapping[int, bytes]) -> Joint | None:
    """The layout of a collective of ``kind`` calls whose processes' request shapes are ``shapes`` (by process),
    if such a collective passed :func:`reduce_together`'s checks on ``engine`` lately, else None."""
    return _joints(engine).get(tuple((pid, kind, shapes[pid]) for pid in sorted(shapes)))


def _joints(engine: Engine) -> Recent[tuple, Joint]:
    """The processes' request shapes, together, that passed :func:`check_shares` and the engine's checks on
    ``engine`` (a daemon's devices and backend decide what passes): whatever those checks look at is in the
    shapes."""
    found = _JOINTS.get(engine)
    if found is None:
        with _JOINTS_LOCK:
            found = _JOINTS.setdefault(engine, Recent(JOINTS_KEPT))
    return found


def _joint_shape(shares: Mapping[int, Contribution]) -> tuple | None:
    """Every process's (id, call, request shape), or None when one has no shape (see :attr:`Contribution.shape`).

    Example:
        >>> _joint_shape({1: Contribution("Reduce", "SUM", 1, "hierarchical_copy", None, (), shape=b"s")})
        ((1, 'Reduce', b's'),)
    """
    joint = []
    for pid in sorted(shares):
        c = shares[pid]
        if c.shape is None:
            return None
        joint.append((pid, c.kind, c.shape))
    return tuple(joint)


def check_shares(engine: Engine, shares: Mapping[int, Contribution], what: str) -> None:
    """Checks the processes' contributions agree: kind, op, options, and each tensor's dtype and shape.

    Raises:
        InvalidArgument: naming the processes and what differs.
    """
    ref_pid = min(shares)
    ref = shares[ref_pid]
    ref_options = _options(ref)
    for pid in sorted(shares):
        c = shares[pid]
        if c is not ref and _options(c) != ref_options:
            _options_differ(pid, c, ref_pid, ref, what)
        if len(c.pairs) != len(ref.pairs):
            raise InvalidArgument(
                f"process {pid} sent {len(c.pairs)} values but process {ref_pid} sent {len(ref.pairs)} for {what}"
            )
        if c.out is not None and len(c.out) != len(c.pairs):
            raise InvalidArgument(f"process {pid}'s out has {len(c.out)} entries for {len(c.pairs)} values of {what}")
        for t, ((_, dests), mine) in enumerate(zip(c.pairs, c.out or ())):
            check_out_devices(engine, mine, dests, f"process {pid}'s out for tensor {t} of {what}")
        if c is ref:
            continue
        for t, ((value, _), (ref_value, _)) in enumerate(zip(c.pairs, ref.pairs)):
            mine, theirs = value.arrays[0], ref_value.arrays[0]
            if value.parts != ref_value.parts:
                raise InvalidArgument(_parts_differ(pid, value, ref_pid, ref_value, t, what))
            if _spec(mine) != _spec(theirs):
                raise InvalidArgument(
                    f"process {pid} sent {_shape(mine)} but process {ref_pid} sent {_shape(theirs)} "
                    f"for tensor {t} of {what}"
                )


def _options(c: Contribution) -> tuple:
    """What the processes of a collective must call alike, besides the tensors."""
    return c.kind, c.op, c.num_packs, c.algorithm, c.reduce_to


def _options_differ(pid: int, c: Contribution, ref_pid: int, ref: Contribution, what: str) -> None:
    """Raises the InvalidArgument naming the first of :func:`_options` that two processes disagree on."""
    if c.kind != ref.kind:
        raise InvalidArgument(f"process {pid} called {c.kind} but process {ref_pid} called {ref.kind} for {what}")
    for field in ("op", "num_packs", "algorithm", "reduce_to"):
        mine, theirs = getattr(c, field), getattr(ref, field)
        if mine != theirs:
            raise InvalidArgument(
                f"process {pid} sent {field}={mine!r} but process {ref_pid} sent {field}={theirs!r} for {what}"
            )


def _parts_differ(pid: int, value: Value, ref_pid: int, ref_value: Value, t: int, what: str) -> str:
    """Why two processes' fused values differ: the first value whose shape differs, named by its place in
    the callers' batch, or which values each fused."""
    dtype = value.arrays[0].dtype.name
    for (i, shape), (j, ref_shape) in zip(value.parts, ref_value.parts):
        if i == j and shape != ref_shape:
            return (f"process {pid} sent {dtype}{list(shape)} but process {ref_pid} sent {dtype}{list(ref_shape)} "
                    f"for tensor {i} of {what}")
    return (f"process {pid} fused tensors {[i for i, _ in value.parts]} but process {ref_pid} fused "
            f"{[i for i, _ in ref_value.parts]} into tensor {t} of {what}; the processes' batches differ")


def prepared_together(engine: Engine, shares: Mapping[int, Contribution], what: str) -> PreparedReduction | None:
    """:func:`reduce_together`'s reduction of ``shares`` prepared (:meth:`~xreduced.engine.Engine.prepare`) for
    shares whose arrays stay where they are, collective after collective (a group's held repeats, their views of
    the same regions): run it on :func:`join_shares` of each later collective's shares. None when the engine
    cannot prepare it, or when two processes give ``out`` arrays for one destination (:func:`reduce_together`
    copies into the second). The shares must have passed :func:`reduce_together` first.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> engine = Engine(NumpyBackend(2))
        >>> def share(pid, x):
        ...     value = Value((pid,), (x,), "pairs[0].value")
        ...     return Contribution("BatchReduce", "SUM", 1, "hierarchical_copy", None, ((value, (pid,)),),
        ...                         out=({pid: np.empty(1, np.float32)},))
        >>> shares = {0: share(0, np.float32([1])), 1: share(1, np.float32([2]))}
        >>> prepared = prepared_together(engine, shares, "collective 1")
        >>> shares[1].pairs[0][0].arrays[0][0] = 5
        >>> prepared.run(*join_shares(engine, shares, "collective 2")); shares[0].out[0][0]
        array([6.], dtype=float32)
    """
    joined, outs = join_shares(engine, shares, what)
    for t, out in enumerate(outs):
        given = sum(len(c.out[t]) for c in shares.values() if c.out is not None and c.out[t] is not None)
        if out is None or len(out) != given:
            return None
    ref = shares[min(shares)]
    return engine.prepare(ref.op, joined, num_packs=ref.num_packs, algorithm=ref.algorithm, reduce_to=ref.reduce_to,
                          dest_fields=tensor_dest_fields(len(joined)), out=outs)


class Reductions:
    """:func:`reduce_together` for a group's collectives whose shares come back at the same places again and again
    (a group's held repeats, :mod:`xreduced.repeated`), identified by the objects that fix those places: the
    first collective of a combination of them is reduced by :func:`reduce_together` and then prepared
    (:func:`prepared_together`); later ones run what was prepared. The ``kept`` most recent combinations are kept.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> engine, reductions = Engine(NumpyBackend(2)), Reductions()
        >>> def share(pid, x):
        ...     value = Value((pid,), (x,), "pairs[0].value")
        ...     return Contribution("BatchReduce", "SUM", 1, "hierarchical_copy", None, ((value, (pid,)),),
        ...                         out=({pid: np.empty(1, np.float32)},))
        >>> shares, owners = {0: share(0, np.float32([1])), 1: share(1, np.float32([2]))}, ("a", "b")
        >>> reductions.reduce(engine, shares, owners, "collective 1", Deadline(None))
        >>> shares[1].pairs[0][0].arrays[0][0] = 5
        >>> reductions.reduce(engine, shares, owners, "collective 2", Deadline(None)); shares[0].out[0][0]
        array([6.], dtype=float32)
    """

    def __init__(self, kept: int = 64):
        self._kept: Recent[tuple[int, ...], tuple[tuple, PreparedReduction | None]] = Recent(kept)

    def reduce(self, engine: Engine, shares: Mapping[int, Contribution], owners: tuple, what: str,
               deadline: Deadline) -> None:
        """Reduces ``shares`` into their ``out`` arrays; ``owners``: the objects their places come from."""
        key = tuple(map(id, owners))
        kept = self._kept.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], owners)):
            if kept[1] is not None:
                kept[1].run(*join_shares(engine, shares, what), deadline)
            else:
                reduce_together(engine, shares, what, deadline)
            return
        reduce_together(engine, shares, what, deadline)
        try:  # reduced: nothing raised from here may have the caller reduce these shares again
            prepared = prepared_together(engine, shares, what)
        except Exception:  # a bug: this combination keeps reducing through reduce_together
            log.exception("event=prepare_failed collective=%s", what)
            prepared = None
        self._kept.put(key, (owners, prepared))


def join_shares(engine: Engine, shares: Mapping[int, Contribution], what: str
                ) -> tuple[list[tuple[Value, tuple[int, ...]]], list[dict[int, np.ndarray] | None]]:
    """Pair ``t`` of every process joined into one value over all their devices (global device order),
    with the union of their destinations, and where the processes want the results.

    Raises:
        InvalidArgument: two processes sent a component on one device.
    """
    ref = shares[min(shares)]
    joined, outs = [], []
    for t in range(len(ref.pairs)):
        owner: dict[int, int] = {}
        arrays: dict[int, np.ndarray] = {}  # insertion order is the global order
        dests: dict[int, None] = {}
        out: dict[int, np.ndarray] = {}
        for pid in sorted(shares):
            value, pair_dests = shares[pid].pairs[t]
            mine = shares[pid].out[t] if shares[pid].out is not None else None
            for d, target in (mine or {}).items():
                out.setdefault(d, target)
            for d, arr in zip(value.devices, value.arrays):
                if d in owner:
                    raise InvalidArgument(
                        f"process {pid} and process {owner[d]} both sent a component on "
                        f"{engine.label(d)} for tensor {t} of {what}; processes must use disjoint devices"
                    )
                owner[d] = pid
                arrays[d] = arr
            dests.update(dict.fromkeys(pair_dests))
        joined.append((Value(tuple(arrays), tuple(arrays.values()), f"tensor {t} of {what}", ref.pairs[t][0].parts),
                       tuple(dests)))
        outs.append(out or None)
    return joined, outs


def broadcast_together(engine: Engine, shares: Mapping[int, BroadcastShare], what: str,
                       deadline: Deadline) -> dict[int, Result]:
    """Broadcasts the source process's tensor to every process's destinations,
    each process's into its own ``out`` arrays."""
    source = shares[check_broadcast_shares(engine, shares, what, shares)]
    origin = source.source if source.source is not None else source.destinations[0]
    return broadcast_shares(engine, shares, source.array, origin, deadline)


def check_broadcast_shares(engine: Engine, shares: Mapping[int, BroadcastShare], what: str,
                           processes: Container[int]) -> int:
    """The source process every share names, checked against ``processes`` (the collective's: this daemon's, or
    every node's), with each share's ``out`` devices.

    Raises:
        InvalidArgument: the processes disagree on the source, it is not one of ``processes``, it is here and
            sent no tensor, or an ``out`` array is on a device that is not one of its process's destinations.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> share = BroadcastShare(1, np.zeros(2), None, (0, 1))
        >>> check_broadcast_shares(Engine(NumpyBackend(2)), {1: share}, "collective 0", {0, 1})
        1
    """
    first = min(shares)
    source_pid = shares[first].source_process
    for pid, share in sorted(shares.items()):
        if share.source_process != source_pid:
            raise InvalidArgument(f"process {pid} sent source_process={share.source_process} but process {first} "
                                  f"sent source_process={source_pid} for {what}")
        check_out_devices(engine, share.out, share.destinations, f"process {pid}'s out for {what}")
    if source_pid not in processes:
        raise InvalidArgument(f"source_process={source_pid} is not a process of {what}")
    if source_pid in shares and shares[source_pid].array is None:
        raise InvalidArgument(f"process {source_pid} is the source of {what} but sent no tensor")
    return source_pid


def broadcast_shares(engine: Engine, shares: Mapping[int, BroadcastShare], array: Any, origin: int,
                     deadline: Deadline) -> dict[int, Result]:
    """``array`` (on device ``origin``) to every share's destinations, each process's part in its own ``out``
    arrays (the first given for a device, in process order).

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> shares = {0: BroadcastShare(0, np.arange(2.0), None, (0,)), 1: BroadcastShare(0, None, None, (1,))}
        >>> broadcast_shares(Engine(NumpyBackend(2)), shares, np.arange(2.0), 0, Deadline(None))[1].arrays
        (array([0., 1.]),)
    """
    out: dict[int, np.ndarray] = {}
    for _, share in sorted(shares.items()):
        for d, target in (share.out or {}).items():
            out.setdefault(d, target)
    dests = sorted({d for share in shares.values() for d in share.destinations})
    result = engine.broadcast(array, origin, dests, deadline, out=out or None)
    return {pid: share_of(engine, result, share.destinations, share.out) for pid, share in shares.items()}


def tensor_dest_fields(count: int) -> list[str]:
    """The fields a joined batch's destinations are named by in messages, tensor by tensor.

    Example:
        >>> tensor_dest_fields(2)
        ['destinations of tensor 0', 'destinations of tensor 1']
    """
    return [f"destinations of tensor {t}" for t in range(count)]


def check_out_devices(engine: Engine, out: Mapping[int, np.ndarray] | None, dests: tuple[int, ...],
                       what: str) -> None:
    for d in out or {}:
        if d not in dests:
            raise InvalidArgument(f"{what}: {engine.label(d)} is not one of its destinations "
                                  f"{[engine.label(x) for x in dests]}")


def share_of(engine: Engine, result: Result, destinations: tuple[int, ...],
             out: Mapping[int, np.ndarray] | None) -> Result:
    """One process's part of ``result``, in its own ``out`` arrays where it gave some.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> r = Result((0, 1), (np.zeros(1), np.ones(1)), "identity")
        >>> share_of(Engine(NumpyBackend(2)), r, (1,), None).arrays
        (array([1.]),)
    """
    where = dict(zip(result.devices, result.arrays))
    arrays = []
    for d in destinations:
        array = where[d]
        if out is not None and d in out and out[d] is not array:
            engine.backend.write(out[d], array)  # another process's array got the reduction's write
            array = out[d]
        arrays.append(array)
    return Result(destinations, tuple(arrays), result.route)


def assign_devices(requested: Mapping[int, tuple[int, ...]], num_devices: int, labels, what: str
                   ) -> dict[int, tuple[int, ...]]:
    """Each process's devices: those it asked for, else its block of the daemon's
    devices split into ``len(requested)`` contiguous blocks, process 0 first.

    Raises:
        InvalidArgument: more processes than devices to split, or two processes
            on one device.

    Example:
        >>> assign_devices({0: (), 1: ()}, 8, str, "the join")
        {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    """
    count = len(requested)
    blocks = [tuple(int(d) for d in b) for b in np.array_split(np.arange(num_devices), count)]
    assigned = {}
    for pid in sorted(requested):
        devices = requested[pid] or blocks[pid]
        if not devices:
            raise InvalidArgument(
                f"num_processes={count} but the daemon has {num_devices} devices to split; process {pid} "
                f"got none in {what} (name each process's devices)"
            )
        assigned[pid] = devices
    owner: dict[int, int] = {}
    for pid in sorted(assigned):
        for d in assigned[pid]:
            if d in owner:
                raise InvalidArgument(
                    f"process {pid} and process {owner[d]} both use {labels(d)} in {what}; processes must use "
                    "disjoint devices"
                )
            owner[d] = pid
    return assigned
