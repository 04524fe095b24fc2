"""What ``xreduce bench --nodes`` prints: per-link rows, the ratios, the scaling table, the targets, ``--json``.

A run measures one :class:`Setting` per node count and link shape; each holds
the rows of the three systems (``flat gloo``, ``leader gloo``, ``xreduce``).
The bus bandwidth here is per node link: ``busbw = algbw x 2(N-1)/N`` with N
the nodes, the bytes each node's link must carry at least, each way, for an
all-reduce across N nodes, per second: the figure to hold against the link's
rate (``link%``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from xreduce_bench.sweep import Row, SystemResult, human_size

FLAT, LEADER, XREDUCE = "flat gloo", "leader gloo", "xreduce"
SYSTEMS = (FLAT, LEADER, XREDUCE)
TARGET_SIZE = 64 << 20
FLAT_BOUND, FLAT_RATE = 0.7, 1e9
"""xreduce / flat gloo <= 0.7 with every link shaped to 1 Gbit/s."""
LEADER_BOUND = 1.3
"""xreduce / leader gloo <= 1.3, shaped and unshaped."""

TABLE_HEADER = (f"#{'size(B)':>11} {'count':>12} {'type':>9} {'redop':>6} {'time(us)':>12} {'algbw(GB/s)':>12} "
                f"{'busbw(GB/s)':>12} {'link%':>6} {'#wrong':>7}")


def count(n: int, noun: str) -> str:
    """``n noun``, the noun in the plural unless n is 1 (``process`` takes ``es``).

    Example:
        >>> count(1, "node"), count(3, "node"), count(2, "process")
        ('1 node', '3 nodes', '2 processes')
    """
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


@dataclasses.dataclass
class Setting:
    """One node count and link shape of a run, and what each system measured there.

    Attributes:
        nodes: N, the nodes.
        procs_per_node: P, the processes on each.
        shape: the tc rate of every link (both ways), or None: unshaped.
        rate: that rate in bits per second, or None.
        systems: ``flat gloo``, ``leader gloo`` and ``xreduce``, in the order they ran.

    Example:
        >>> s = Setting(2, 4, "1gbit", 1e9)
        >>> s.links, s.link_factor, s.title
        ('tbf 1gbit both ways', 1.0, '2 nodes x 4 processes, links: tbf 1gbit both ways')
    """

    nodes: int
    procs_per_node: int
    shape: str | None
    rate: float | None
    systems: list[SystemResult] = dataclasses.field(default_factory=list)

    @property
    def links(self) -> str:
        """``unshaped`` or ``tbf RATE both ways``."""
        return "unshaped" if self.shape is None else f"tbf {self.shape} both ways"

    @property
    def link_factor(self) -> float:
        """2(N-1)/N: the share of the size each node's link carries at least, each way."""
        return 2 * (self.nodes - 1) / self.nodes

    @property
    def title(self) -> str:
        """What heads this setting's tables."""
        return f"{count(self.nodes, 'node')} x {count(self.procs_per_node, 'process')}, links: {self.links}"

    def system(self, name: str) -> SystemResult | None:
        """The system called ``name`` when it measured something, else None."""
        return next((s for s in self.systems if s.name == name and s.rows), None)


def format_row(row: Row, setting: Setting, dtype: str, reduce_op: str) -> str:
    """One row: size, count, type, redop, time, algbw, busbw per link, its share of the link rate, #wrong.

    One node has no link: its busbw and link% are ``-``, as is link% on unshaped links.

    Example:
        >>> row = Row(64 << 20, 16 << 20, [0.6], 0)
        >>> format_row(row, Setting(2, 4, "1gbit", 1e9), "float32", "sum").split()
        ['67108864', '16777216', 'float32', 'sum', '600000.0', '0.1118', '0.1118', '89.5', '0']
        >>> format_row(row, Setting(1, 4, None, None), "float32", "sum").split()[-3:]
        ['-', '-', '0']
    """
    busbw = row.busbw(setting.link_factor)
    bus = f"{busbw:.4g}" if setting.nodes > 1 else "-"
    share = f"{busbw * 8e9 / setting.rate * 100:.3g}" if setting.rate and setting.nodes > 1 else "-"
    wrong = "-" if row.wrong is None else str(row.wrong)
    return (f"{row.size:>12} {row.count:>12} {dtype:>9} {reduce_op:>6} {row.time * 1e6:>12.1f} {row.algbw:>12.4g} "
            f"{bus:>12} {share:>6} {wrong:>7}")


def ratios(setting: Setting, sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Per size, xreduce's time over each gloo's (< 1: xreduce is faster).

    Example:
        >>> s = Setting(2, 4, None, None, [SystemResult("flat gloo", "", [Row(8, 2, [2.0])]),
        ...                                 SystemResult("xreduce", "", [Row(8, 2, [1.0])])])
        >>> ratios(s, [8])
        [{'size': 8, 'xreduce/flat gloo': 0.5}]
    """
    ours = setting.system(XREDUCE)
    table = []
    for size in sizes:
        entry: dict[str, Any] = {"size": size}
        for peer in (FLAT, LEADER):
            other = setting.system(peer)
            a, b = (ours.row(size) if ours else None), (other.row(size) if other else None)
            if a and b:
                entry[f"{XREDUCE}/{peer}"] = a.time / b.time
        if len(entry) > 1:
            table.append(entry)
    return table


def format_ratios(setting: Setting, sizes: Sequence[int]) -> list[str]:
    """The ratio table of :func:`ratios`, one line per size (none when xreduce or both gloos did not run).

    Example:
        >>> s = Setting(2, 4, None, None, [SystemResult("flat gloo", "", [Row(8, 2, [2.0])]),
        ...                                 SystemResult("xreduce", "", [Row(8, 2, [1.0])])])
        >>> for line in format_ratios(s, [8]):
        ...     print(line)
        #    size(B)  xreduce/flat gloo  xreduce/leader gloo
                   8                0.5                    -
    """
    rows = ratios(setting, sizes)
    if not rows:
        return []
    columns = [f"{XREDUCE}/{peer}" for peer in (FLAT, LEADER)]
    lines = ["#" + f"{'size(B)':>11} " + " ".join(f"{c:>{len(c) + 1}}" for c in columns)]
    for entry in rows:
        cells = [f"{entry[c]:>{len(c) + 1}.3g}" if c in entry else f"{'-':>{len(c) + 1}}" for c in columns]
        lines.append(f"{entry['size']:>12} " + " ".join(cells))
    return lines


def format_scaling(settings: Sequence[Setting], size: int) -> list[str]:
    """Each system's time and busbw per link at ``size`` as the nodes grow, one line per system and link shape.

    Example:
        >>> one = Setting(1, 2, None, None, [SystemResult("flat gloo", "", [Row(8, 2, [1e-3])])])
        >>> two = Setting(2, 2, None, None, [SystemResult("flat gloo", "", [Row(8, 2, [2e-3])])])
        >>> for line in format_scaling([one, two], 8):
        ...     print(line)
        # time(us) [busbw per link, GB/s] of 8 B by nodes
        #     system       links              1 node             2 nodes
           flat gloo    unshaped          1000.0 [-]      2000.0 [4e-06]
    """
    counts = sorted({s.nodes for s in settings})
    header = "#" + f"{'system':>11} {'links':>11} " + " ".join(
        f"{f'{n} node' + ('s' if n > 1 else ''):>19}" for n in counts)
    lines = [f"# time(us) [busbw per link, GB/s] of {human_size(size)} by nodes", header]
    shapes = list(dict.fromkeys(s.shape for s in settings))
    for name in SYSTEMS:
        for shape in shapes:
            cells, measured = [], False
            for n in counts:
                setting = next((s for s in settings if s.nodes == n and s.shape == shape), None)
                result = setting.system(name) if setting else None
                row = result.row(size) if result else None
                if row is None:
                    cells.append(f"{'-':>19}")
                    continue
                measured = True
                bus = f"{row.busbw(setting.link_factor):.4g}" if n > 1 else "-"
                cells.append(f"{f'{row.time * 1e6:.1f} [{bus}]':>19}")
            if measured:
                lines.append(f"{name:>12} {shape or 'unshaped':>11} " + " ".join(cells))
    return lines


def targets(settings: Sequence[Setting], dtype: str) -> list[dict[str, Any]]:
    """The targets this run measured: 64 MiB float32 across 2 nodes or more.

    - xreduce <= 0.7 x flat gloo, every link shaped to 1 Gbit/s;
    - xreduce <= 1.3 x leader gloo, shaped or not.

    Example:
        >>> s = Setting(2, 4, "1gbit", 1e9, [SystemResult("flat gloo", "", [Row(64 << 20, 1, [1.0])]),
        ...                                  SystemResult("leader gloo", "", [Row(64 << 20, 1, [0.5])]),
        ...                                  SystemResult("xreduce", "", [Row(64 << 20, 1, [0.6])])])
        >>> for c in targets([s], "float32"):
        ...     print(c["text"])  # doctest: +NORMALIZE_WHITESPACE
        2 nodes x 4 processes x 64 MiB float32 all-reduce, links tbf 1gbit both ways: xreduce 0.600 s,
        flat gloo 1.000 s, ratio 0.60 (target <= 0.7): met
        2 nodes x 4 processes x 64 MiB float32 all-reduce, links tbf 1gbit both ways: xreduce 0.600 s,
        leader gloo 0.500 s, ratio 1.20 (target <= 1.3): met
    """
    checks: list[dict[str, Any]] = []
    if dtype != "float32":
        return checks
    for s in settings:
        ours = s.system(XREDUCE)
        mine = ours.row(TARGET_SIZE) if ours and s.nodes > 1 else None
        if mine is None:
            continue
        bounds = [(LEADER, LEADER_BOUND)]
        if s.rate == FLAT_RATE:
            bounds.insert(0, (FLAT, FLAT_BOUND))
        for peer, bound in bounds:
            other = s.system(peer)
            theirs = other.row(TARGET_SIZE) if other else None
            if theirs is None:
                continue
            ratio = mine.time / theirs.time
            what = (f"{count(s.nodes, 'node')} x {count(s.procs_per_node, 'process')} x 64 MiB float32 all-reduce, "
                    f"links {s.links}")
            text = (f"{what}: xreduce {mine.time:.3f} s, {peer} {theirs.time:.3f} s, ratio {ratio:.2f} "
                    f"(target <= {bound:g}): {'met' if ratio <= bound else 'not met'}")
            checks.append({"what": what, "nodes": s.nodes, "shape": s.shape, "peer": peer, "xreduce_s": mine.time,
                           "peer_s": theirs.time, "ratio": ratio, "bound": bound, "met": ratio <= bound,
                           "text": text})
    return checks


def to_json(settings: Sequence[Setting], about: dict[str, Any], checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything a run measured, for ``--json``: times in microseconds, bandwidths in GB/s.

    Example:
        >>> s = Setting(2, 1, None, None, [SystemResult("leader gloo", "", [Row(8, 2, [1e-3])])])
        >>> d = to_json([s], {"dtype": "float32"}, [])
        >>> d["settings"][0]["systems"][0]["rows"][0]["busbw_per_link_gbps"]
        8e-06
    """
    return {
        "run": about,
        "settings": [{
            "nodes": s.nodes, "procs_per_node": s.procs_per_node, "shape": s.shape, "rate_bits_per_s": s.rate,
            "link_factor": s.link_factor,
            "systems": [{
                "name": r.name, "about": r.about, "skipped": r.skipped, "failed": r.failed,
                "rows": [{"size": row.size, "count": row.count, "time_us": row.time * 1e6, "algbw_gbps": row.algbw,
                          "busbw_per_link_gbps": row.busbw(s.link_factor) if s.nodes > 1 else None,
                          "wrong": row.wrong, "times_us": [t * 1e6 for t in row.times]} for row in r.rows],
            } for r in s.systems],
            "ratios": ratios(s, sorted({row.size for r in s.systems for row in r.rows})),
        } for s in settings],
        "targets": checks,
    }
