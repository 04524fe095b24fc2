"""What ``xreduce bench`` measures: the sweep, its sizes, and the rows each system fills.

The other modules of this package build on these; the :class:`Sweep` travels
to every worker process.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy, for numpy_dtype
import numpy as np
import xreduce
from xreduced.cli import parse_bytes

from xreduce_bench.workloads import Workload

OPS = ("all_reduce", "reduce", "broadcast")
TRANSPORTS = ("wire", "shm", "auto")
PEERS = ("gloo", "mpi")


class BenchError(RuntimeError):
    """A system of the benchmark could not run; the message says why.

    Example:
        >>> str(BenchError("process 1 exited with status 1"))
        'process 1 exited with status 1'
    """


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What every system of one run measures; it travels to the workers.

    Attributes:
        op: ``all_reduce``, ``reduce`` (to the first device of process 0) or
            ``broadcast`` (from it).
        dtype: element type name, e.g. ``float32``.
        reduce_op: ``sum`` or ``mean``.
        sizes: bytes per device, one row each.
        processes: xreduce worker processes.
        devices: devices per xreduce worker process.
        iters: timed iterations per size.
        warmup: untimed iterations per size before them.
        timeout: seconds any one wait may last.
        workload: a training step's gradients (``--workload``): each iteration all-reduces every tensor of it
            in one batch, and ``sizes`` holds its bytes per device alone; None: one tensor per size.

    Example:
        >>> s = Sweep("all_reduce", "float32", "sum", (4, 8), processes=2, devices=2, iters=3, warmup=1)
        >>> s.ranks, s.bus_factor, s.count(8)
        (4, 1.5, 2)
    """

    op: str
    dtype: str
    reduce_op: str
    sizes: tuple[int, ...]
    processes: int
    devices: int
    iters: int
    warmup: int
    timeout: float = 300.0
    workload: Workload | None = None

    @property
    def ranks(self) -> int:
        """n: devices across all processes (gloo and MPI run one process per rank)."""
        return self.processes * self.devices

    @property
    def bus_factor(self) -> float:
        """busbw / algbw for this op over :attr:`ranks` (see :func:`bus_factor`)."""
        return bus_factor(self.op, self.ranks)

    def count(self, size: int) -> int:
        """Elements per device for ``size`` bytes."""
        return size // numpy_dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON holds them (``sizes`` a list); :meth:`from_dict` reads them back.

        Example:
            >>> s = Sweep("reduce", "float32", "mean", (4, 8), processes=2, devices=1, iters=3, warmup=1)
            >>> s.to_dict()["sizes"], Sweep.from_dict(s.to_dict()) == s
            ([4, 8], True)
        """
        workload = None if self.workload is None else {
            "name": self.workload.name, "shapes": [list(s) for s in self.workload.shapes]}
        return {**dataclasses.asdict(self), "sizes": list(self.sizes), "workload": workload}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Sweep:
        """The sweep whose :meth:`to_dict` is ``fields``."""
        w = fields.get("workload")
        workload = None if w is None else Workload(w["name"], tuple(tuple(s) for s in w["shapes"]))
        return cls(**{**fields, "sizes": tuple(fields["sizes"]), "workload": workload})


def bus_factor(op: str, ranks: int) -> float:
    """The bus bandwidth factor of nccl-tests: busbw = algbw x this.

    ``2(n-1)/n`` for all-reduce (what each rank must send and receive in an
    optimal ring), 1 for reduce and broadcast.

    Example:
        >>> bus_factor("all_reduce", 4), bus_factor("all_reduce", 2), bus_factor("broadcast", 8)
        (1.5, 1.0, 1.0)
    """
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce", "broadcast"):
        return 1.0
    raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")


def size_ladder(min_bytes: int, max_bytes: int, step_factor: int, itemsize: int) -> tuple[int, ...]:
    """The sizes of a sweep: ``min_bytes`` times ``step_factor`` while below
    ``max_bytes``, then ``max_bytes`` itself, each rounded down to whole
    elements (sizes under one element are dropped).

    The largest size asked for is always measured, even when the steps jump
    over it (``--max-bytes 1MiB --step-factor 16``).

    Example:
        >>> size_ladder(4, 64, 2, 4)
        (4, 8, 16, 32, 64)
        >>> size_ladder(4, 1 << 20, 16, 4)
        (4, 64, 1024, 16384, 262144, 1048576)
        >>> size_ladder(4, 100, 4, 8)
        (16, 64, 96)
    """
    if min_bytes < 1 or max_bytes < min_bytes or step_factor < 2 or itemsize < 1:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and step_factor >= 2; got min_bytes={min_bytes}, "
                         f"max_bytes={max_bytes}, step_factor={step_factor}")
    sizes: list[int] = []
    size = min_bytes
    while True:
        whole = min(size, max_bytes) // itemsize * itemsize
        if whole and whole not in sizes:
            sizes.append(whole)
        if size >= max_bytes:
            return tuple(sizes)
        size *= step_factor


def given(p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> str | None:
    """The first option of ``names`` (``args``' attribute names) that ``args`` holds at another value than its
    default, as the command line spells it (``--min-bytes``); None when all hold their defaults.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--min-bytes", type=int, default=4)
        >>> given(p, p.parse_args(["--min-bytes", "8"]), ["min_bytes"]), given(p, p.parse_args([]), ["min_bytes"])
        ('--min-bytes', None)
    """
    return next((f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != p.get_default(n)), None)


def int_list(field: str, text: str, low: int, high: int) -> list[int]:
    """A comma-separated list of whole numbers in ``[low, high]`` without repeats, as an option gives it.

    Raises:
        ValueError: anything else; the message names ``field`` and repeats ``text``.

    Example:
        >>> int_list("--processes", "2,4", 2, 64)
        [2, 4]
        >>> int_list("--processes", "1", 2, 64)
        Traceback (most recent call last):
        ...
        ValueError: --processes: comma-separated integers in [2, 64] without repeats; got '1'
    """
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not low <= v <= high for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{field}: comma-separated integers in [{low}, {high}] without repeats; got {text!r}")
    return values


def size_list(field: str, text: str, dtype: str) -> list[int]:
    """A comma-separated list of sizes (``64MiB,1GiB``), each a whole number of ``dtype`` elements: sorted,
    without repeats.

    Raises:
        ValueError: anything else; the message names ``field`` and repeats ``text``.

    Example:
        >>> size_list("--sizes", "1GiB, 64MiB", "float32")
        [67108864, 1073741824]
        >>> size_list("--sizes", "6", "float32")
        Traceback (most recent call last):
        ...
        ValueError: --sizes: every size must be a whole number of float32 elements (4 bytes); got '6'
    """
    itemsize = numpy_dtype(dtype).itemsize
    try:
        sizes = [parse_bytes(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"{field}: comma-separated sizes such as 64MiB,1MiB; got {text!r}") from None
    if not sizes or any(s < itemsize or s % itemsize for s in sizes):
        raise ValueError(f"{field}: every size must be a whole number of {dtype} elements ({itemsize} bytes); "
                         f"got {text!r}")
    return sorted(set(sizes))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a name the wire carries (``bfloat16`` through ml_dtypes).

    Example:
        >>> numpy_dtype("bfloat16").name, numpy_dtype("float32").itemsize
        ('bfloat16', 4)
    """
    if name not in xreduce.SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(xreduce.SUPPORTED_DTYPES)}; got {name!r}")
    return np.dtype(name)


def human_size(n: int) -> str:
    """A size as nccl-tests' readers write it.

    Example:
        >>> human_size(4), human_size(4096), human_size(64 << 20), human_size(1536)
        ('4 B', '4 KiB', '64 MiB', '1536 B')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


@dataclasses.dataclass
class Row:
    """One size of one system: the median over iterations of the slowest worker.

    Example:
        >>> r = Row(size=1 << 20, count=262144, times=[0.002, 0.001, 0.003], wrong=0)
        >>> r.time, round(r.algbw, 3), round(r.busbw(1.5), 3)
        (0.002, 0.524, 0.786)
    """

    size: int
    count: int
    times: list[float]
    """Per timed iteration, the slowest worker's seconds."""
    wrong: int | None = None
    """Result elements that differ from the exactly known answer (None: not checked)."""

    @property
    def time(self) -> float:
        """Median seconds over the iterations."""
        return statistics.median(self.times)

    @property
    def algbw(self) -> float:
        """size / time, in GB/s (1e9 bytes)."""
        return self.size / self.time / 1e9

    def busbw(self, factor: float) -> float:
        """algbw x the op's bus factor, in GB/s."""
        return self.algbw * factor


@dataclasses.dataclass
class SystemResult:
    """What one system measured, or why it did not run.

    Example:
        >>> r = SystemResult("xreduce shm", "4 process(es) x 1 device(s)", [Row(4, 1, [0.001])])
        >>> r.short, r.is_xreduce, r.row(4).time, r.row(8)
        ('shm', True, 0.001, None)
        >>> SystemResult("xreduce shm:p4", "").transport, SystemResult("xreduce shm:p4", "").num_packs
        ('shm', 4)
    """

    name: str
    """``xreduce wire``, ``xreduce shm``, ``xreduce auto`` (with ``:pN`` for ``--num-packs N``), ``gloo``,
    ``mpi`` or ``echo``."""
    about: str
    rows: list[Row] = dataclasses.field(default_factory=list)
    skipped: str | None = None
    failed: str | None = None

    @property
    def short(self) -> str:
        """The name in ratio columns: ``wire``, ``shm``, ``gloo``, ..."""
        return self.name.removeprefix("xreduce ")

    @property
    def transport(self) -> str:
        """The xreduce transport: :attr:`short` without its ``:pN`` suffix (``num_packs=N``), if any."""
        return self.short.split(":")[0]

    @property
    def num_packs(self) -> int:
        """The ``num_packs`` of an xreduce run: its ``:pN`` suffix, else 1."""
        return int(self.short.split(":p")[1]) if ":p" in self.short else 1

    @property
    def is_xreduce(self) -> bool:
        """Whether this is one of xreduce's transports (else a peer or the echo)."""
        return self.name.startswith("xreduce ")

    def row(self, size: int) -> Row | None:
        """The row of ``size``, or None when it was not measured."""
        return next((r for r in self.rows if r.size == size), None)
