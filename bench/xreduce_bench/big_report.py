"""What ``xreduce bench --big-tensors`` prints: a table per process count, the targets, ``--json`` and ``--plot``.

A run measures one :class:`Run` per process count P: xreduce and gloo
(:class:`BigResult` each: the times of every call of every size, from
``workers._collect``, and the memory of every size, from ``footprint``).
First call and steady state are apart: ``first`` is call 1, ``steady`` the
median of calls 2 and on; ``s/GiB`` is the steady time per GiB of the size.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from xreduce_bench.footprint import Window
from xreduce_bench.sweep import Row, SystemResult, human_size
from xreduce_bench.table import size_axes

STEADY_BOUND = 0.5
"""xreduce's steady time <= 0.5 x gloo's, at every size."""
FIRST_BOUND = 2.0
"""xreduce's first call <= 2 x its steady time, at every size."""
MEMORY_BOUND = 1.2
"""xreduce's peak footprint above its baseline <= 1.2 x gloo's, at every size."""
FLAT_BOUND = 1.2
"""xreduce's s/GiB at the largest size <= 1.2 x at the smallest."""
MIB = 1 << 20
DISTURBED = " (!: /dev/shm fell below its start: other processes' shared memory went away; this undercounts)"

COLUMNS = ("size", "x first(s)", "x steady(s)", "x s/GiB", "g first(s)", "g steady(s)", "g s/GiB", "steady x/g",
           "x first/steady", "x peak+(MiB)", "g peak+(MiB)", "peak+ x/g", "2PS(MiB)", "#wrong x/g")
WIDTHS = (9, 11, 12, 9, 11, 12, 9, 11, 15, 13, 13, 10, 10, 11)
LEGEND = ("# x: xreduce, g: gloo; first: call 1; steady: median of calls 2..; s/GiB: steady / size in GiB; "
          "peak+: peak footprint - idle baseline (the memory ratio uses it); 2PS: the issue's bound 2 x P x size")


def first(row: Row) -> float:
    """Call 1's time (the slowest process's).

    Example:
        >>> first(Row(4, 1, [0.3, 0.1, 0.2]))
        0.3
    """
    return row.times[0]


def steady(row: Row) -> float:
    """The median of calls 2 and on (call 1 alone: its time).

    Example:
        >>> steady(Row(4, 1, [0.3, 0.1, 0.2]))
        0.15000000000000002
    """
    return statistics.median(row.times[1:] or row.times)


def per_gib(row: Row) -> float:
    """Steady seconds per GiB of the size.

    Example:
        >>> per_gib(Row(1 << 29, 1 << 27, [0.3, 0.1, 0.1]))
        0.2
    """
    return steady(row) / (row.size / (1 << 30))


@dataclasses.dataclass
class BigResult(SystemResult):
    """One system at one process count: its rows (times of every call) and its memory.

    Example:
        >>> idle, w = Window(5, 60 << 20, 50 << 20, 0, {}), Window(5, 300 << 20, 250 << 20, 0, {})
        >>> r = BigResult("gloo", "", [Row(64 << 20, 1 << 24, [0.2, 0.1])], baseline=idle, memory={64 << 20: w})
        >>> r.above(64 << 20) / (1 << 20)
        250.0
    """

    baseline: Window | None = None
    """The idle window: after initialize, before the first size; its median footprint is the baseline."""
    memory: dict[int, Window] = dataclasses.field(default_factory=dict)
    """Each size's window."""

    def above(self, size: int) -> int | None:
        """The peak footprint of ``size`` above the idle baseline, in bytes (None: not measured)."""
        w = self.memory.get(size)
        if w is None or not w.samples or self.baseline is None or not self.baseline.samples:
            return None
        return w.peak - self.baseline.median

    def to_dict(self) -> dict[str, Any]:
        """Everything it measured, as ``--json`` writes it (times in seconds, memory in bytes)."""
        return {"name": self.name, "about": self.about, "failed": self.failed,
                "baseline": None if self.baseline is None else self.baseline.to_dict(),
                "sizes": [{"size": r.size, "times_s": r.times, "first_s": first(r), "steady_s": steady(r),
                           "s_per_gib": per_gib(r), "wrong": r.wrong, "peak_above_baseline": self.above(r.size),
                           "memory": self.memory[r.size].to_dict() if r.size in self.memory else None}
                          for r in self.rows]}


@dataclasses.dataclass
class Run:
    """One process count: the sizes asked, those skipped (and why), xreduce's and gloo's results.

    Example:
        >>> Run(2, [64 << 20], {}, BigResult("xreduce", "")).title
        '2 processes'
    """

    processes: int
    sizes: list[int]
    skipped: dict[int, str]
    xreduce: BigResult
    gloo: BigResult | None = None

    @property
    def title(self) -> str:
        """``P processes``."""
        return f"{self.processes} processes"

    def bound(self, size: int) -> int:
        """The issue's memory bound 2 x P x size, in bytes."""
        return 2 * self.processes * size


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def table(run: Run) -> list[str]:
    """The lines of a process count's table: a header, then a row per size measured or skipped.

    Example:
        >>> x = BigResult("xreduce", "", [Row(1 << 30, 1 << 28, [0.5, 0.2, 0.2], 0)])
        >>> run = Run(2, [1 << 30, 4 << 30], {4 << 30: "needs ~18.6 GiB"}, x)
        >>> for line in table(run):
        ...     print(line.split())  # doctest: +NORMALIZE_WHITESPACE
        ['#', 'size', 'x', 'first(s)', 'x', 'steady(s)', 'x', 's/GiB', 'g', 'first(s)', 'g', 'steady(s)', 'g',
         's/GiB', 'steady', 'x/g', 'x', 'first/steady', 'x', 'peak+(MiB)', 'g', 'peak+(MiB)', 'peak+', 'x/g',
         '2PS(MiB)', '#wrong', 'x/g']
        ['1', 'GiB', '0.500', '0.200', '0.200', '-', '-', '-', '-', '2.50', '-', '-', '-', '4096', '0/-']
        ['4', 'GiB', 'skipped:', 'needs', '~18.6', 'GiB']
    """
    lines = ["#" + " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, WIDTHS))[1:]]
    for size in run.sizes:
        if size in run.skipped:
            lines.append(f"{human_size(size):>{WIDTHS[0]}} skipped: {run.skipped[size]}")
            continue
        x = run.xreduce.row(size)
        g = run.gloo.row(size) if run.gloo is not None else None
        xa, ga = run.xreduce.above(size), run.gloo.above(size) if run.gloo is not None else None
        cells = [human_size(size)]
        for r in (x, g):
            cells += [_cell(first(r)), _cell(steady(r)), _cell(per_gib(r))] if r else ["-"] * 3
        cells += [_cell(_ratio(x and steady(x), g and steady(g)), 2), _cell(_ratio(x and first(x), x and steady(x)), 2),
                  _cell(None if xa is None else xa / MIB, 1), _cell(None if ga is None else ga / MIB, 1),
                  _cell(_ratio(xa, ga), 2), f"{run.bound(size) // MIB}",
                  "/".join("-" if r is None or r.wrong is None else str(r.wrong) for r in (x, g))]
        lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS)))
    return lines


def memory_table(run: Run) -> list[str]:
    """The memory of every size, in MiB: each system's baseline, peak, peak above the baseline, the
    ``/dev/shm`` growth at the peak, and each process's peak ``RssAnon``/``RssShmem``.

    Example:
        >>> w = Window(4, 300 << 20, 250 << 20, 64 << 20, {"process 0": {"rss_anon": 100 << 20, "rss_shmem": 0}})
        >>> x = BigResult("xreduce", "", [Row(64 << 20, 1, [0.1, 0.1])], baseline=w, memory={64 << 20: w})
        >>> print("\\n".join(memory_table(Run(2, [64 << 20], {}, x))))  # doctest: +NORMALIZE_WHITESPACE
        #   size  system  baseline    peak   peak+    shm  per process: peak RssAnon/RssShmem
        64 MiB  xreduce    250.0   300.0    50.0   64.0  process 0 100.0/0.0
    """
    lines = [f"#{'size':>7} {'system':>7} {'baseline':>9} {'peak':>7} {'peak+':>7} {'shm':>6}  per process: peak "
             "RssAnon/RssShmem"]
    for size in run.sizes:
        for system in (run.xreduce, run.gloo):
            w = system.memory.get(size) if system is not None else None
            if w is None or not w.samples or system.baseline is None:
                continue
            procs = "  ".join(f"{name} {p['rss_anon'] / MIB:.1f}/{p['rss_shmem'] / MIB:.1f}"
                              for name, p in w.processes.items())
            flag = DISTURBED if w.disturbed or system.baseline.disturbed else ""
            lines.append(f"{human_size(size):>8} {system.name:>7} {system.baseline.median / MIB:>9.1f} "
                         f"{w.peak / MIB:>7.1f} {system.above(size) / MIB:>7.1f} {w.shm / MIB:>6.1f}  {procs}{flag}")
    return lines


def _verdict(values: list[tuple[int, float]], bound: float) -> tuple[str, str]:
    if not values:
        return "n/a", "not measured"
    size, worst = max(values, key=lambda v: v[1])
    return ("PASS" if worst <= bound else "FAIL"), f"worst {worst:.2f} at {human_size(size)}"


def targets(run: Run) -> list[dict[str, Any]]:
    """The issue's four targets at one process count, each with its ratios per size and its verdict.

    Example:
        >>> x = BigResult("xreduce", "", [Row(1 << 26, 1, [0.2, 0.1, 0.1], 0), Row(1 << 28, 1, [0.9, 0.5, 0.5], 0)])
        >>> g = BigResult("gloo", "", [Row(1 << 26, 1, [0.3, 0.3, 0.3], 0), Row(1 << 28, 1, [1.2, 1.1, 1.1], 0)])
        >>> for t in targets(Run(2, [1 << 26, 1 << 28], {}, x, g)):
        ...     print(t["text"])
        2 processes: steady <= 0.5x gloo at every size: PASS (0.45 at 256 MiB; 0.33 at 64 MiB)
        2 processes: first call <= 2x steady at every size: PASS (worst 2.00 at 64 MiB)
        2 processes: peak footprint above baseline <= 1.2x gloo's at every size: n/a (not measured)
        2 processes: s/GiB at 256 MiB within 1.2x of 64 MiB: FAIL (ratio 1.25)
    """
    measured = [s for s in run.sizes if run.xreduce.row(s) is not None]
    paired = [s for s in measured if run.gloo is not None and run.gloo.row(s) is not None]
    found = []

    def add(name: str, bound: float, values: list[tuple[int, float]], detail: str | None = None) -> None:
        verdict, why = _verdict(values, bound)
        text = f"{run.title}: {name}: {verdict} ({detail or why})"
        found.append({"processes": run.processes, "target": name, "bound": bound, "verdict": verdict,
                      "ratios": {str(s): r for s, r in values}, "text": text})

    x, g = run.xreduce, run.gloo
    ratios = [(s, steady(x.row(s)) / steady(g.row(s))) for s in paired]
    add(f"steady <= {STEADY_BOUND}x gloo at every size", STEADY_BOUND, ratios,
        "; ".join(f"{r:.2f} at {human_size(s)}" for s, r in sorted(ratios, key=lambda v: -v[1])) or None)
    add(f"first call <= {FIRST_BOUND:g}x steady at every size", FIRST_BOUND,
        [(s, first(x.row(s)) / steady(x.row(s))) for s in measured])
    memory = [(s, x.above(s) / g.above(s)) for s in paired
              if x.above(s) is not None and g.above(s) is not None and g.above(s) > 0]
    add(f"peak footprint above baseline <= {MEMORY_BOUND}x gloo's at every size", MEMORY_BOUND, memory)
    if len(measured) >= 2:
        small, large = measured[0], measured[-1]
        ratio = per_gib(x.row(large)) / per_gib(x.row(small))
        add(f"s/GiB at {human_size(large)} within {FLAT_BOUND}x of {human_size(small)}", FLAT_BOUND,
            [(large, ratio)], f"ratio {ratio:.2f}")
    else:
        add(f"s/GiB at the largest size within {FLAT_BOUND}x of the smallest", FLAT_BOUND, [],
            "needs two sizes measured")
    return found


def to_json(runs: Sequence[Run], about: dict[str, Any]) -> dict[str, Any]:
    """Everything a run measured, for ``--json``.

    Example:
        >>> d = to_json([Run(2, [64 << 20], {}, BigResult("xreduce", ""))], {"iters": 3})
        >>> d["about"]["iters"], d["runs"][0]["processes"], d["runs"][0]["gloo"]
        (3, 2, None)
    """
    return {"about": about, "runs": [{
        "processes": r.processes, "sizes": r.sizes, "skipped": {str(s): why for s, why in r.skipped.items()},
        "bounds_2ps": {str(s): r.bound(s) for s in r.sizes},
        "xreduce": r.xreduce.to_dict(), "gloo": None if r.gloo is None else r.gloo.to_dict(),
        "targets": targets(r)} for r in runs]}


def plot(runs: Sequence[Run], path: str) -> None:
    """Draws two panels to ``path``, log-log: seconds per GiB against size (first call and steady, xreduce and
    gloo, every process count) and the peak footprint above the baseline against size (with 2PS).
    Needs matplotlib (the ``bench`` extra).

    Example:
        >>> plot([Run(2, [64 << 20], {}, BigResult("xreduce", ""))], "big.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"xreduce": "C0", "gloo": "C1"}
    for i, run in enumerate(runs):
        line = ("-", "--", ":", "-.")[i % 4]
        for system in (run.xreduce, run.gloo):
            if system is None or not system.rows:
                continue
            sizes = [r.size for r in system.rows]
            gib = [s / (1 << 30) for s in sizes]
            color = styles[system.name]
            ax_time.plot(sizes, [per_gib(r) for r in system.rows], line, color=color, marker="o",
                         label=f"{system.name} steady, P={run.processes}")
            ax_time.plot(sizes, [first(r) / g for r, g in zip(system.rows, gib)], line, color=color, marker="x",
                         alpha=0.5, label=f"{system.name} first call, P={run.processes}")
            above = [(s, system.above(s)) for s in sizes if system.above(s) is not None]
            if above:
                ax_mem.plot([s for s, _ in above], [a / (1 << 30) for _, a in above], line, color=color,
                            marker="o", label=f"{system.name}, P={run.processes}")
        measured = [s for s in run.sizes if s not in run.skipped]
        ax_mem.plot(measured, [run.bound(s) / (1 << 30) for s in measured], line, color="grey",
                    label=f"2PS, P={run.processes}")
    ticks = sorted({s for run in runs for s in run.sizes if s not in run.skipped})
    size_axes(((ax_time, "seconds per GiB"), (ax_mem, "peak footprint above baseline (GiB)")), ticks,
              "size per replica", legend_size=8)
    ax_time.set_title("time per GiB (the slowest process's)")
    ax_mem.set_title("memory: sum of RssAnon + /dev/shm growth")
    fig.suptitle("all-reduce float32 sum, one replica per process: xreduce against gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
