"""``xreduce bench --big-tensors``: all-reduces of 64 MiB to 4 GiB per replica, xreduce against gloo, with the
memory of every process.

For each process count P of ``--processes`` (2,4), one after the other:

- **xreduce**: a daemon started for this P (``--virtual-devices P``, on a unix
  socket: ``daemon.embedded_daemon``) and P spawned workers, each
  ``xreduce.distribution.initialize(num_processes=P, process_id=k)`` with one
  replica; in the same workers the sizes of ``--sizes`` run one after the
  other, ascending, each ``--iters`` calls (3) of
  ``HierarchicalCopyAllReduce().reduce("sum", v, v, out=v)`` on a float32
  numpy array (``--no-in-place``: without ``out=``; the SDK allocates the
  result; ``--shared-array``: on an ``xreduce.shared_array``, which the daemon
  reads and writes where it lies); see ``big_workers``;
- **gloo** (``--peers gloo``, the default), after xreduce (never both at
  once: memory): P ranks of torch.distributed's gloo, ``dist.all_reduce(t)``
  on a CPU float32 tensor, in place, a fresh tensor per size.

A call's time is the slowest process's, every call started at a barrier;
call 1 is reported as ``first``, the median of the others as ``steady``. A
thread samples every process's memory every 20 ms (``footprint``): the
footprint of the job, its idle baseline and each size's peaks. A size that
would not fit (2.2 x P x size + 1 GiB over ``MemAvailable`` when P starts) is
skipped, saying so. ``big_report`` prints the tables and judges the targets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, TextIO

from xreduce_bench import big_report as report
from xreduce_bench.big_workers import SPOTS, BigSpec, big_worker, gloo_start, xreduce_start
from xreduce_bench.daemon import device_names, embedded_daemon
from xreduce_bench.footprint import PERIOD, Footprint, mem_available
from xreduce_bench.peers import _BENCH_EXTRA, gloo_env, peer_unavailable
from xreduce_bench.sweep import BenchError, Row, Sweep, given, human_size, int_list, size_list
from xreduce_bench.table import Progress, _Reporter
from xreduce_bench.workers import _run_pool, xreduce_envs

DEFAULT_SIZES = "64MiB,256MiB,1GiB,4GiB"
DEFAULT_PROCESSES = "2,4"
DEFAULT_ITERS = 3
DEFAULT_TIMEOUT = 900.0
FIT_FACTOR, FIT_SPARE = 2.2, 1 << 30
"""A size runs when FIT_FACTOR x P x size + FIT_SPARE bytes fit in MemAvailable."""
CONFLICTS = ("address", "op", "dtype", "reduce_op", "min_bytes", "max_bytes", "step_factor", "workload",
             "workload_file", "num_packs", "devices", "transport", "warmup", "echo")
"""Options of the sweep that mean nothing here: one replica per process, float32 sum, no warm-up (call 1 is
measured), the SDK's own transport choice."""
GIB = 1 << 30


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks and completes ``args`` for ``--big-tensors`` (``p.error`` on bad input).

    Example:
        >>> from xreduce_bench.command import add_arguments
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> args = p.parse_args(["--big-tensors", "--sizes", "1MiB,64KiB", "--no-in-place"])
        >>> validate(p, args)
        >>> args.sizes, args.processes, args.peers, args.iters, args.timeout, args.in_place
        ([65536, 1048576], [2, 4], ['gloo'], 3, 900.0, False)
    """
    flag = given(p, args, CONFLICTS)
    if flag:
        p.error(f"{flag} does not apply with --big-tensors (float32 sum, one replica per process, call 1 "
                "measured as the first call)")
    try:
        args.sizes = size_list("--sizes", args.sizes or DEFAULT_SIZES, "float32")
        args.processes = int_list("--processes", args.processes or DEFAULT_PROCESSES, 2, 64)
    except ValueError as e:
        p.error(str(e))
    peers = [x.strip() for x in ("gloo" if args.peers is None else args.peers).split(",") if x.strip()]
    if peers not in ([], ["gloo"], ["none"]):
        p.error(f"--peers: --big-tensors compares with gloo alone (gloo, or none); got {args.peers!r}")
    args.peers = [x for x in peers if x != "none"]
    args.iters = DEFAULT_ITERS if args.iters is None else args.iters
    if args.iters < 2:
        p.error(f"--iters must be >= 2 with --big-tensors (call 1 is the first call, the others the steady "
                f"state); got {args.iters}")
    args.timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    if not args.timeout > 0:
        p.error(f"--timeout must be positive; got {args.timeout}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(f"--plot needs matplotlib ({_BENCH_EXTRA})")
    args.in_place = not args.no_in_place


def fits(processes: int, size: int, available: int) -> str | None:
    """Why ``processes`` x ``size`` is skipped when ``available`` bytes are free (MemAvailable), or None.

    Example:
        >>> fits(4, 4 << 30, 24 << 30)
        'needs ~36.2 GiB, MemAvailable 24.0 GiB'
        >>> fits(2, 4 << 30, 24 << 30) is None
        True
    """
    need = FIT_FACTOR * processes * size + FIT_SPARE
    if need <= available:
        return None
    return f"needs ~{need / GIB:.1f} GiB, MemAvailable {available / GIB:.1f} GiB"


class _BigReporter(_Reporter):
    """Prints a line per size as it is measured: its calls, first and steady, and its memory."""

    def header(self, system: report.BigResult) -> None:
        self.line(f"# {system.name}: {system.about}")

    def row(self, system: report.BigResult, row: Row) -> None:
        w = system.memory.get(row.size)
        above = system.above(row.size)
        memory = ("memory: -" if w is None or above is None else
                  f"peak footprint {w.peak / report.MIB:.1f} MiB ({above / report.MIB:+.1f} above the baseline), "
                  f"{w.samples} samples" + (report.DISTURBED if w.disturbed or system.baseline.disturbed else ""))
        self.line(f"{human_size(row.size):>9}: calls {' '.join(f'{t:.3f}' for t in row.times)} s; first "
                  f"{report.first(row):.3f} s, steady {report.steady(row):.3f} s ({report.per_gib(row):.3f} s/GiB); "
                  f"{memory}; #wrong {row.wrong}")
        self.progress.advance(f"P={self.sweep.processes} {system.name} {human_size(row.size)}")


class _Phases:
    """Turns the workers' windows into the memory of each phase (idle, then each size) of one system."""

    def __init__(self, system: report.BigResult, fp: Footprint, sweep: Sweep, names: Sequence[str]):
        self.system, self.fp, self.sweep, self.names = system, fp, sweep, list(names)
        self.windows: dict[int, list[tuple[float, float]]] = {}

    def __call__(self, message: tuple) -> None:
        kind, rank = message[0], message[1]
        if kind == "ready":
            self.fp.watch(f"process {rank}", message[2])
        elif kind == "window":
            index, begin, end = message[2:]
            spans = self.windows.setdefault(index, [])
            spans.append((begin, end))
            if len(spans) < self.sweep.processes:
                return
            start = min(b for b, _ in spans)
            if index == 0:  # every sample of the whole job before the first allocation: all initialized, idle
                self.system.baseline = self.fp.window(0.0, start, self.names)
            self.system.memory[self.sweep.sizes[index]] = self.fp.window(start, max(e for _, e in spans), self.names)


def _run_system(system: report.BigResult, start: Any, spec: BigSpec, sweep: Sweep, envs: list[dict[str, str]],
                fp: Footprint, names: Sequence[str], reporter: _BigReporter) -> None:
    reporter.header(system)
    try:
        _run_pool(system, start, spec, sweep.processes, envs, sweep, reporter, big_worker,
                  _Phases(system, fp, sweep, names))
    except BenchError as e:
        system.failed = fp.starved or str(e)
        reporter.line(f"# {system.name}: FAILED: {system.failed}")
        reporter.progress.done += len(sweep.sizes) - len(system.rows)


def _run_processes(processes: int, args: argparse.Namespace, tmp: str, progress: Progress, out: TextIO
                   ) -> report.Run:
    available = mem_available()
    skipped = {s: why for s in args.sizes if (why := fits(processes, s, available)) is not None}
    sizes = tuple(s for s in args.sizes if s not in skipped)
    sweep = Sweep("all_reduce", "float32", "sum", sizes, processes, 1, args.iters, 0, args.timeout)
    spec = BigSpec(processes, args.in_place, args.timeout, args.shared_array)
    run = report.Run(processes, list(args.sizes), skipped, report.BigResult("xreduce", ""))
    reporter = _BigReporter(sweep, progress, out)
    reporter.line(f"\n## {run.title}")
    for size, why in skipped.items():
        reporter.line(f"# {human_size(size)}: skipped: {why}")
    progress.done += len(skipped) * (1 + len(args.peers))
    if not sizes:
        return run
    workers = [f"process {k}" for k in range(processes)]
    with Footprint() as fp, embedded_daemon(tmp, processes, args.timeout) as (address, pid):
        fp.watch("daemon", pid, worker=False)
        names, backend = device_names(address, args.timeout)
        call = "reduce(\"sum\", v, v, out=v)" if args.in_place else "reduce(\"sum\", v, v) (not in place)"
        call += " of an xreduce.shared_array" if args.shared_array else " of a numpy array"
        run.xreduce.about = (f"{processes} processes x 1 replica, HierarchicalCopyAllReduce().{call}; daemon "
                             f"{address} (started for this P: {len(names)} devices, {backend} backend)")
        envs = xreduce_envs(address, [[n] for n in names[:processes]])
        _run_system(run.xreduce, xreduce_start, spec, sweep, envs, fp, ["daemon", *workers], reporter)
    if args.peers:
        import torch

        run.gloo = report.BigResult("gloo", f"torch {torch.__version__}, {processes} processes, "
                                            "dist.all_reduce(t) in place")
        with Footprint() as fp:
            _run_system(run.gloo, gloo_start, spec, sweep, gloo_env(tmp, processes), fp, workers, reporter)
    reporter.line("")
    for line in report.table(run) + [""] + report.memory_table(run):
        reporter.line(line)
    reporter.line("")
    for t in report.targets(run):
        reporter.line(t["text"])
    return run


def run(p: argparse.ArgumentParser, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs ``xreduce bench --big-tensors``; returns the exit status.

    0 when xreduce ran at every process count (a size that does not fit is
    skipped, saying so), 1 when it failed, 2 for bad arguments (through
    ``p.error``), 130 when interrupted.

    Example (shell):
        $ xreduce bench --big-tensors --sizes 64MiB,256MiB,1GiB,4GiB --processes 2,4 --json big.json --plot big.png
    """
    out = out or sys.stdout
    validate(p, args)
    if args.peers and peer_unavailable("gloo") is not None:
        print(f"# gloo: skipped: {peer_unavailable('gloo')}", file=out)
        args.peers = []
    steps = sum(len(args.sizes) * (1 + len(args.peers)) for _ in args.processes)
    progress = Progress(steps, sys.stderr, args.progress or sys.stderr.isatty())
    call = "out=v, in place" if args.in_place else "no out=: the SDK allocates each result"
    call += "; v an xreduce.shared_array" if args.shared_array else "; v a numpy array"
    header = [
        f"# xreduce bench --big-tensors: all-reduce, float32, sum, one replica per process ({call}); sizes "
        f"{', '.join(human_size(s) for s in args.sizes)}; processes {', '.join(map(str, args.processes))}; "
        f"{args.iters} calls per size; peers: {', '.join(args.peers) or 'none'}",
        "# time: every call starts at a barrier; a call's time is its slowest process's; first = call 1, steady = "
        "median of calls 2..; s/GiB = steady / size in GiB",
        f"# memory: sampled every {PERIOD * 1e3:.0f} ms; footprint = sum of RssAnon over the job's processes (workers "
        "+ daemon) + growth of /dev/shm's used bytes since the system started (shared memory counted once); "
        "baseline = the median footprint idle after initialize, before the first size; peak+ = peak - baseline "
        "(the xreduce/gloo memory ratio uses peak+)",
        f"# a size runs when {FIT_FACTOR} x P x size + {FIT_SPARE / GIB:g} GiB fits in MemAvailable; machine: "
        f"{os.cpu_count()} cores, MemAvailable {mem_available() / GIB:.1f} GiB at the start",
    ]
    print("\n".join(header), file=out, flush=True)
    runs: list[report.Run] = []
    try:
        with tempfile.TemporaryDirectory(prefix="xreduce-bench-big-") as tmp:
            os.chmod(tmp, 0o700)
            for processes in args.processes:
                runs.append(_run_processes(processes, args, tmp, progress, out))
    except BenchError as e:
        progress.clear()
        print(f"xreduce bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.clear()
        print("xreduce bench: interrupted", file=sys.stderr)
        return 130
    progress.clear()
    if args.json:
        about = {"date": time.strftime("%Y-%m-%d"), "in_place": args.in_place, "shared_array": args.shared_array,
                 "iters": args.iters,
                 "sizes": args.sizes, "processes": args.processes, "peers": args.peers, "cores": os.cpu_count(),
                 "fit": {"factor": FIT_FACTOR, "spare": FIT_SPARE}, "sample_period_s": PERIOD, "header": header,
                 "checked": f"process k holds k + 1; each result but the last checked at {SPOTS} elements, the "
                            "last at every element"}
        with open(args.json, "w") as f:
            json.dump(report.to_json(runs, about), f, indent=1)
    if args.plot:
        report.plot(runs, args.plot)
        print(f"\n# plot: {args.plot}", file=out)
    return 1 if any(r.xreduce.failed for r in runs) else 0
