"""The planner: pure routing, packing and placement; no numpy, no cupy.

From the device indices of a value, the element counts of a batch's tensors
and ``num_packs`` it builds a :class:`Plan`: for every pack, which device sums
which inputs and which copies cross which links. Numbers never depend on the
plan (additions keep TF's association: ``(x0+..+x[G-1]) + (x[G]+..+x[N-1])``
for hierarchical copy, a left fold for reduction to one device); only where the
work happens does.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


class Route(enum.StrEnum):
    """How a value is all-reduced: the request's algorithm, or none at all (a value on one device). Members are
    strings, equal to their values.

    Example:
        >>> Route("nccl") is Route.NCCL, Route.HIERARCHICAL_COPY == "hierarchical_copy", f"{Route.IDENTITY}"
        (True, True, 'identity')
    """

    HIERARCHICAL_COPY = "hierarchical_copy"
    REDUCTION_TO_ONE_DEVICE = "reduction_to_one_device"
    IDENTITY = "identity"
    """A value on one device: nothing to add."""
    NCCL = "nccl"
    """The all-reduce route of ALGORITHM_NCCL: packed as hierarchical copy, each pack summed by NCCL."""


HIERARCHICAL_COPY = Route.HIERARCHICAL_COPY
REDUCTION_TO_ONE_DEVICE = Route.REDUCTION_TO_ONE_DEVICE
IDENTITY = Route.IDENTITY
NCCL = Route.NCCL


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of the flattened tensor ``tensor`` of a batch."""

    tensor: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Pack:
    """One pack: a run of the concatenated, flattened batch.

    Example:
        >>> split_packs([10], 3)[2]
        Pack(index=2, segments=(Segment(tensor=0, start=6, stop=10),), elements=4)
    """

    index: int
    segments: tuple[Segment, ...]
    elements: int


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy buffer ``buffer`` of ``pack`` from device ``src`` to ``dst``.

    Buffers are named ``in@D`` (device D's input), ``partial@D`` (a group's sum,
    made on D) and ``total``.
    """

    pack: int
    buffer: str
    src: int
    dst: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Sum:
    """On ``device``: ``out = inputs[0] + inputs[1] + ...`` (a left fold).

    Every input buffer is already on ``device`` (its own, or copied there by an
    earlier :class:`Copy`).
    """

    pack: int
    device: int
    inputs: tuple[str, ...]
    out: str


Step = Copy | Sum


@dataclasses.dataclass(frozen=True)
class Plan:
    """A reduction plan; print it with :func:`describe`.

    Example:
        >>> p = hierarchical_copy(range(4), [8], 4, num_packs=1)
        >>> [s for s in p.steps if isinstance(s, Sum)][0]
        Sum(pack=0, device=0, inputs=('in@0', 'in@1'), out='partial@0')
    """

    algorithm: str
    devices: tuple[int, ...]
    destinations: tuple[int, ...]
    packs: tuple[Pack, ...]
    steps: tuple[Step, ...]
    itemsizes: tuple[int, ...]
    """Bytes per element of each tensor of the batch."""
    result: str = "total"
    """The buffer that holds the result on every destination."""

    def pack_bytes(self, pack: Pack) -> int:
        """Bytes of one device's share of ``pack``."""
        return pack_bytes(pack, self.itemsizes)

    @property
    def copied_bytes(self) -> int:
        """Bytes moved between devices by the plan."""
        return sum(s.nbytes for s in self.steps if isinstance(s, Copy))


def pack_bytes(pack: Pack, itemsizes: Sequence[int]) -> int:
    """Bytes of ``pack`` given each tensor's bytes per element.

    Example:
        >>> pack_bytes(split_packs([2, 3], 0)[1], [4, 8])
        24
    """
    return sum((s.stop - s.start) * itemsizes[s.tensor] for s in pack.segments)


def _itemsizes(itemsize: int | Sequence[int], count: int) -> tuple[int, ...]:
    return tuple(itemsize) if isinstance(itemsize, Sequence) else (itemsize,) * count


def split_packs(elements: Sequence[int], num_packs: int) -> tuple[Pack, ...]:
    """Splits a batch of tensors (element counts) into packs, as TF does.

    ``num_packs = 0``: one pack per tensor. ``k > 0``: the concatenation of all
    tensors is split into ``k`` packs of ``total // k`` elements, the last taking
    the remainder (so with ``k > total`` the first ``k - 1`` packs are empty).

    Raises:
        ValueError: ``num_packs`` is negative.

    Example:
        >>> [p.elements for p in split_packs([3, 4], 3)]
        [2, 2, 3]
    """
    if num_packs < 0:
        raise ValueError(f"num_packs must be >= 0; got num_packs={num_packs}")
    if num_packs == 0:
        return tuple(
            Pack(i, (Segment(i, 0, n),), n) for i, n in enumerate(elements)
        )
    total = sum(elements)
    size = total // num_packs
    bounds = [i * size for i in range(num_packs)] + [total]
    starts = [0]
    for n in elements:
        starts.append(starts[-1] + n)
    packs = []
    for i in range(num_packs):
        lo, hi = bounds[i], bounds[i + 1]
        segments = tuple(
            Segment(t, max(lo, starts[t]) - starts[t], min(hi, starts[t + 1]) - starts[t])
            for t in range(len(elements))
            if max(lo, starts[t]) < min(hi, starts[t + 1])
        )
        packs.append(Pack(i, segments, hi - lo))
    return tuple(packs)


def groups(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two halves of ``n`` positions: ``[0, n//2)`` and ``[n//2, n)``.

    The second half takes the extra position when ``n`` is odd (TF drops it).

    Example:
        >>> groups(5)
        ((0, 1), (2, 3, 4))
    """
    half = n // 2
    return tuple(range(half)), tuple(range(half, n))


def main_positions(pack: int, n: int) -> tuple[int, int]:
    """Positions of the main devices of pack ``pack``: (group 0's, group 1's).

    Group 0 is the half that holds position ``pack % n`` (TF's rotation); group
    1's main is ``(pack + n//2) % n`` when that lies in the other half, as it
    always does for even ``n``; otherwise (odd ``n``) the other half's
    ``pack % size``-th position, so each main stays inside its own group.

    Example:
        >>> [main_positions(i, 8) for i in range(3)]
        [(0, 4), (1, 5), (2, 6)]
        >>> main_positions(1, 3)
        (1, 0)
    """
    if n == 1:
        return 0, 0
    half = n // 2
    lo, hi = groups(n)
    main0 = pack % n
    other = hi if main0 < half else lo
    main1 = (pack + half) % n
    if main1 not in other:
        main1 = other[pack % len(other)]
    return main0, main1


def hierarchical_copy(
    devices: Sequence[int],
    elements: Sequence[int],
    itemsize: int | Sequence[int],
    num_packs: int = 1,
) -> Plan:
    """Plans TF's hierarchical copy all-reduce over ``devices`` (in value order).

    Per pack: each half sums its inputs on its main device, group 1's partial
    sum is copied to group 0's main and added there (lower half's sum first),
    the total goes back to group 1's main, and each main copies it to the
    members of its group. One device: no steps (the input is the result).

    Example:
        >>> p = hierarchical_copy([0, 1], [4], 4, num_packs=1)
        >>> print(describe(p))  # doctest: +NORMALIZE_WHITESPACE
        hierarchical_copy over 2 devices [0, 1], 1 pack(s), 16 B per device
        pack 0 (4 elements, 16 B): main devices 0 and 1
          copy in@1: 1 -> 0 (16 B)
          sum on 0: in@0 + in@1 -> total
          copy total: 0 -> 1 (16 B)
        total copied: 32 B
    """
    devs = tuple(devices)
    sizes = _itemsizes(itemsize, len(elements))
    packs = split_packs(elements, num_packs)
    if len(devs) == 1:
        return Plan(IDENTITY, devs, devs, packs, (), sizes, f"in@{devs[0]}")
    steps = [s for pack in packs for s in _hc_pack(devs, pack, pack_bytes(pack, sizes))]
    return Plan(HIERARCHICAL_COPY, devs, devs, packs, tuple(steps), sizes)


def nccl_all_reduce(
    devices: Sequence[int],
    elements: Sequence[int],
    itemsize: int | Sequence[int],
    num_packs: int = 1,
) -> Plan:
    """Plans TF's NCCL all-reduce over ``devices``: packed as :func:`hierarchical_copy` is, with no
    steps: NCCL sums each pack among the devices itself (the executor hands it the packs).

    Example:
        >>> p = nccl_all_reduce([0, 1], [4, 4], 4, num_packs=2)
        >>> p.algorithm, [pk.elements for pk in p.packs], p.steps
        (<Route.NCCL: 'nccl'>, [4, 4], ())
    """
    devs = tuple(devices)
    return Plan(NCCL, devs, devs, split_packs(elements, num_packs), (), _itemsizes(itemsize, len(elements)))


def _hc_pack(devs: tuple[int, ...], pack: Pack, nbytes: int) -> list[Step]:
    p0, p1 = main_positions(pack.index, len(devs))
    lo, hi = groups(len(devs))
    halves = (lo, hi) if p0 in lo else (hi, lo)
    mains = (devs[p0], devs[p1])
    steps: list[Step] = []
    partial: list[str] = []
    for half, main in zip(halves, mains):
        members = [devs[p] for p in half]
        if len(members) == 1:
            partial.append(f"in@{main}")
            continue
        steps.extend(Copy(pack.index, f"in@{d}", d, main, nbytes) for d in members if d != main)
        partial.append(f"partial@{main}")
        steps.append(Sum(pack.index, main, tuple(f"in@{d}" for d in members), partial[-1]))
    m0, m1 = mains
    steps.append(Copy(pack.index, partial[1], m1, m0, nbytes))
    # The lower half's sum comes first whichever half holds the main device.
    ordered = tuple(partial) if halves[0] == lo else (partial[1], partial[0])
    steps.append(Sum(pack.index, m0, ordered, "total"))
    steps.append(Copy(pack.index, "total", m0, m1, nbytes))
    for half, main in zip(halves, mains):
        steps.extend(
            Copy(pack.index, "total", main, devs[p], nbytes) for p in half if devs[p] != main
        )
    return steps


def reduction_to_one_device(
    devices: Sequence[int],
    destinations: Sequence[int],
    elements: Sequence[int],
    itemsize: int | Sequence[int],
    reduce_to: int | None = None,
) -> Plan:
    """Plans TF's reduction to one device: a left fold on ``reduce_to`` (default
    the first destination), then a copy to every other destination.

    Every tensor of the batch is its own pack.

    Example:
        >>> p = reduction_to_one_device([0, 1, 2], [3], [2], 4)
        >>> print(describe(p))  # doctest: +NORMALIZE_WHITESPACE
        reduction_to_one_device over 3 devices [0, 1, 2], 1 pack(s), 8 B per device
        pack 0 (2 elements, 8 B): sum on device 3
          copy in@0: 0 -> 3 (8 B)
          copy in@1: 1 -> 3 (8 B)
          copy in@2: 2 -> 3 (8 B)
          sum on 3: in@0 + in@1 + in@2 -> total
        total copied: 24 B
    """
    devs, dests = tuple(devices), tuple(destinations)
    if not dests:
        raise ValueError("destinations must name at least one device; got []")
    target = dests[0] if reduce_to is None else reduce_to
    sizes = _itemsizes(itemsize, len(elements))
    packs = split_packs(elements, 0)
    steps: list[Step] = []
    for pack in packs:
        nbytes = pack_bytes(pack, sizes)
        steps.extend(Copy(pack.index, f"in@{d}", d, target, nbytes) for d in devs if d != target)
        steps.append(Sum(pack.index, target, tuple(f"in@{d}" for d in devs), "total"))
        steps.extend(Copy(pack.index, "total", target, d, nbytes) for d in dests if d != target)
    return Plan(REDUCTION_TO_ONE_DEVICE, devs, dests, packs, tuple(steps), sizes)


def broadcast(
    source: int, destinations: Sequence[int], elements: int, itemsize: int
) -> Plan:
    """Plans a broadcast: a copy from ``source`` to every other destination.

    Example:
        >>> [(s.src, s.dst) for s in broadcast(0, [0, 2], 3, 4).steps]
        [(0, 2)]
    """
    dests = tuple(destinations)
    packs = split_packs([elements], 0)
    nbytes = elements * itemsize
    steps = tuple(Copy(0, f"in@{source}", source, d, nbytes) for d in dests if d != source)
    return Plan(IDENTITY, (source,), dests, packs, steps, (itemsize,), f"in@{source}")


def is_all_reduce(devices: Sequence[int], destinations: Sequence[int] | None) -> bool:
    """TF's routing test: do the destinations name the value's device set?

    ``None`` (or empty) destinations mean the value's own devices.

    Example:
        >>> is_all_reduce([0, 1], [1, 0]), is_all_reduce([0, 1], [0])
        (True, False)
    """
    return not destinations or set(destinations) == set(devices)


def describe(plan: Plan) -> str:
    """Renders a plan as readable steps: sums with their inputs, copies with
    source, destination and bytes.

    Example:
        >>> print(describe(hierarchical_copy([0], [2], 4)).splitlines()[0])
        identity over 1 devices [0], 1 pack(s), 8 B per device
    """
    per_device = sum(plan.pack_bytes(p) for p in plan.packs)
    lines = [
        f"{plan.algorithm} over {len(plan.devices)} devices {list(plan.devices)}, "
        f"{len(plan.packs)} pack(s), {_bytes(per_device)} per device"
    ]
    by_pack: dict[int, list[Step]] = {}
    for step in plan.steps:
        by_pack.setdefault(step.pack, []).append(step)
    for pack in plan.packs:
        steps = by_pack.get(pack.index, [])
        head = f"pack {pack.index} ({pack.elements} elements, {_bytes(plan.pack_bytes(pack))})"
        sums = [s for s in steps if isinstance(s, Sum)]
        if plan.algorithm == HIERARCHICAL_COPY:
            m0, m1 = main_positions(pack.index, len(plan.devices))
            head += f": main devices {plan.devices[m0]} and {plan.devices[m1]}"
        elif sums:
            head += f": sum on device {sums[-1].device}"
        lines.append(head)
        for s in steps:
            if isinstance(s, Copy):
                lines.append(f"  copy {s.buffer}: {s.src} -> {s.dst} ({_bytes(s.nbytes)})")
            else:
                lines.append(f"  sum on {s.device}: {' + '.join(s.inputs)} -> {s.out}")
    if plan.steps:
        lines.append(f"total copied: {_bytes(plan.copied_bytes)}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    """Binary units when exact to three decimals, else plain bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and (n * 1000) % size == 0:
            return f"{n / size:g} {unit}"
    return f"{n} B"
