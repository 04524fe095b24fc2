"""What ``xreduce bench`` prints: nccl-tests-style rows, the ratios, ``--json`` and ``--plot``.

Rows reach the terminal as they are measured (:class:`_Reporter`), under a
progress bar on stderr that steps aside for them (:class:`Progress`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, TextIO

from xreduce_bench.sweep import Row, Sweep, SystemResult, human_size


class Progress:
    """A dependency-free progress bar redrawn in place on one line.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> p = Progress(4, out, enabled=True, width=8)
        >>> p.advance("gloo 4 KiB")
        >>> out.getvalue().split("\\r")[-1].split("  ")[:3]
        ['[##......]', '1/4', 'gloo 4 KiB']
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool, width: int = 30):
        self.total, self.done = max(total, 1), 0
        self._stream, self._enabled, self._width = stream, enabled, width
        self._start = time.monotonic()
        self._label = ""
        self._shown = 0

    def advance(self, label: str) -> None:
        """Counts one step done and redraws."""
        self.done += 1
        self.show(label)

    def show(self, label: str) -> None:
        """Redraws with ``label`` as what is running."""
        if not self._enabled:
            return
        self._label = label
        filled = self._width * min(self.done, self.total) // self.total
        elapsed = int(time.monotonic() - self._start)
        line = (f"[{'#' * filled}{'.' * (self._width - filled)}]  {self.done}/{self.total}  {label}  "
                f"{elapsed // 60}:{elapsed % 60:02d}")
        self._stream.write("\r" + line.ljust(self._shown))
        self._shown = len(line)
        self._stream.flush()

    def clear(self) -> None:
        """Erases the bar (before other output); :meth:`show` brings it back."""
        if self._enabled and self._shown:
            self._stream.write("\r" + " " * self._shown + "\r")
            self._stream.flush()
            self._shown = 0


class _Reporter:
    """Prints each system's table as its rows arrive, keeping the bar out of the way."""

    def __init__(self, sweep: Sweep, progress: Progress, out: TextIO):
        self.sweep, self.progress, self.out = sweep, progress, out

    def line(self, text: str) -> None:
        self.progress.clear()
        print(text, file=self.out, flush=True)
        self.progress.show(self.progress._label)

    def header(self, system: SystemResult) -> None:
        self.line(f"\n# {system.name}: {system.about}")
        self.line("#" + _TABLE_HEADER[1:])

    def row(self, system: SystemResult, row: Row) -> None:
        self.line(format_row(row, self.sweep, echo=system.name == "echo"))
        self.progress.advance(f"{system.name} {human_size(row.size)}")


_TABLE_HEADER = (f"{'size(B)':>12} {'count':>12} {'type':>9} {'redop':>6} {'time(us)':>12} {'algbw(GB/s)':>12} "
                 f"{'busbw(GB/s)':>12} {'#wrong':>7}")


def format_row(row: Row, sweep: Sweep, echo: bool = False) -> str:
    """One nccl-tests-style row: size, count, type, redop, time, algbw, busbw, #wrong.

    Bandwidths keep four significant digits, so busbw/algbw can be checked from
    the printed numbers; the echo has no bus bandwidth (``-``).

    Example:
        >>> s = Sweep("all_reduce", "float32", "sum", (4096,), processes=4, devices=1, iters=1, warmup=0)
        >>> format_row(Row(4096, 1024, [0.0005], 0), s).split()
        ['4096', '1024', 'float32', 'sum', '500.0', '0.008192', '0.01229', '0']
    """
    redop = sweep.reduce_op if sweep.op != "broadcast" and not echo else "-"
    wrong = "-" if row.wrong is None else str(row.wrong)
    busbw = "-" if echo else f"{row.busbw(sweep.bus_factor):.4g}"
    return (f"{row.size:>12} {row.count:>12} {sweep.dtype:>9} {redop:>6} {row.time * 1e6:>12.1f} "
            f"{row.algbw:>12.4g} {busbw:>12} {wrong:>7}")


def ratios(results: Sequence[SystemResult], sweep: Sweep) -> list[dict[str, Any]]:
    """Per size, each xreduce system's time over each peer's (< 1: xreduce is faster).

    Example:
        >>> s = Sweep("all_reduce", "float32", "sum", (4,), processes=2, devices=1, iters=1, warmup=0)
        >>> x = SystemResult("xreduce wire", "", [Row(4, 1, [0.003])])
        >>> e = SystemResult("echo", "", [Row(4, 1, [0.002])])
        >>> ratios([x, e], s)
        [{'size': 4, 'wire/echo': 1.5}]
    """
    ours = [r for r in results if r.is_xreduce and r.rows]
    peers = [r for r in results if not r.is_xreduce and r.rows]
    table = []
    for size in sweep.sizes:
        entry: dict[str, Any] = {"size": size}
        for x, p in itertools.product(ours, peers):
            a, b = x.row(size), p.row(size)
            if a and b:
                entry[f"{x.short}/{p.short}"] = a.time / b.time
        if len(entry) > 1:
            table.append(entry)
    return table


def format_ratios(ratio_rows: list[dict[str, Any]]) -> list[str]:
    """The lines of the ratio table of :func:`ratios`: a header, then one line per size.

    Example:
        >>> for line in format_ratios([{"size": 4, "wire/echo": 1.5}]):
        ...     print(line)
        #    size(B)   wire/echo
                   4         1.5
    """
    columns = [k for k in ratio_rows[0] if k != "size"]
    lines = ["#" + f"{'size(B)':>11} " + " ".join(f"{c:>11}" for c in columns)]
    lines += [f"{entry['size']:>12} " + " ".join(f"{entry[c]:>11.3g}" for c in columns) for entry in ratio_rows]
    return lines


def to_json(systems: Sequence[SystemResult], sweep: Sweep, where: str, ratio_rows: list, checks: list) -> dict:
    """Everything a run measured, for ``--json``: times in microseconds, bandwidths in GB/s.

    Example:
        >>> s = Sweep("all_reduce", "float32", "sum", (4,), processes=2, devices=1, iters=1, warmup=0)
        >>> d = to_json([SystemResult("gloo", "", [Row(4, 1, [0.0005])])], s, "unix:/tmp/x.sock", [], [])
        >>> d["sweep"]["bus_factor"], d["systems"][0]["rows"][0]["time_us"]
        (1.0, 500.0)
    """
    return {
        "sweep": {**sweep.to_dict(), "ranks": sweep.ranks, "bus_factor": sweep.bus_factor},
        "daemon": where,
        "systems": [{
            "name": s.name, "about": s.about, "skipped": s.skipped, "failed": s.failed,
            "rows": [{"size": r.size, "count": r.count, "time_us": r.time * 1e6, "algbw_gbps": r.algbw,
                      "busbw_gbps": None if s.name == "echo" else r.busbw(sweep.bus_factor), "wrong": r.wrong,
                      "times_us": [t * 1e6 for t in r.times]} for r in s.rows],
        } for s in systems],
        "ratios": ratio_rows,
        "targets": checks,
    }


def plot(results: Sequence[SystemResult], sweep: Sweep, path: str) -> None:
    """Draws time and bus bandwidth against size, log-log, one line per system, to ``path``.

    Needs matplotlib (the ``bench`` extra); the echo has a time and no bus bandwidth.

    Example:
        >>> s = Sweep("all_reduce", "float32", "sum", (4, 8), processes=2, devices=1, iters=1, warmup=0)
        >>> x = SystemResult("xreduce shm", "", [Row(4, 1, [0.001]), Row(8, 2, [0.001])])
        >>> plot([x], s, "allreduce.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in results:
        if not r.rows:
            continue
        sizes = [row.size for row in r.rows]
        ax_time.plot(sizes, [row.time * 1e6 for row in r.rows], marker=".", label=r.name)
        if r.name != "echo":
            ax_bw.plot(sizes, [row.busbw(sweep.bus_factor) for row in r.rows], marker=".", label=r.name)
    ticks = [s for i, s in enumerate(sweep.sizes) if i % max(1, len(sweep.sizes) // 8) == 0]
    size_axes(((ax_time, "time (us)"), (ax_bw, "bus bandwidth (GB/s)")), ticks, "size per device")
    fig.suptitle(f"{sweep.op} {sweep.dtype} {sweep.reduce_op}, {sweep.processes} process(es) x "
                 f"{sweep.devices} device(s), n = {sweep.ranks}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def size_axes(axes: Sequence[tuple[Any, str]], ticks: Sequence[int], xlabel: str, legend_size: float | None = None
              ) -> None:
    """Dresses each (matplotlib axes, y label) of ``axes`` as a sweep's plot: log-log, sizes across (base 2,
    ``ticks`` named as :func:`human_size` names them), a grid, the legend.

    Example:
        >>> import matplotlib.pyplot as plt  # doctest: +SKIP
        >>> fig, ax = plt.subplots()  # doctest: +SKIP
        >>> size_axes([(ax, "time (us)")], [4, 4096], "size per device")  # doctest: +SKIP
    """
    for ax, label in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [human_size(s) for s in ticks])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=legend_size)


def plot_workload(results: Sequence[SystemResult], sweep: Sweep, path: str) -> None:
    """Draws a workload run (one batch per iteration): each system's median time as a bar, its iterations
    as dots, to ``path``. Needs matplotlib (the ``bench`` extra).

    Example:
        >>> from xreduce_bench.workloads import Workload
        >>> s = Sweep("all_reduce", "float32", "mean", (8,), processes=2, devices=1, iters=1, warmup=0,
        ...           workload=Workload("w", ((2,),)))
        >>> plot_workload([SystemResult("gloo", "", [Row(8, 2, [0.001])])], s, "step.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shown) + 2), 4.8))
    for i, r in enumerate(shown):
        row = r.rows[0]
        ax.bar(i, row.time * 1e3, color=f"C{i}", alpha=0.6)
        ax.plot([i] * len(row.times), [t * 1e3 for t in row.times], ".", color="black", markersize=3)
        ax.annotate(f"{row.time * 1e3:.1f}", (i, row.time * 1e3), ha="center", va="bottom")
    ax.set_xticks(range(len(shown)), [r.name for r in shown], rotation=20, ha="right")
    ax.set_ylabel("time per step (ms): median (bar), iterations (dots)")
    ax.grid(True, axis="y", alpha=0.3)
    w = sweep.workload
    fig.suptitle(f"{w.name}: {len(w.shapes)} tensors, {human_size(sweep.sizes[0])} per device, {sweep.dtype} "
                 f"{sweep.reduce_op}, {sweep.processes} process(es) x {sweep.devices} device(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
