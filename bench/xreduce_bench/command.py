"""``xreduce bench``: nccl-tests-style sweeps of the daemon's collectives, with peers in the same run.

For every size from ``--min-bytes`` to ``--max-bytes`` (times ``--step-factor``),
``--processes`` worker processes, each driving ``--devices`` devices, run one
collective through the SDK as a training job does
(``HierarchicalCopyAllReduce().batch_reduce``/``reduce``/``broadcast`` on
``PerReplica`` values, after ``xreduce.distribution.initialize`` when there are
several processes). Every iteration starts at a barrier of all the workers; an
iteration's time is its slowest worker's, and a row reports the median over
``--iters`` iterations after ``--warmup``. ``--peers`` runs the same sweep with
torch.distributed's gloo backend and with mpi4py under Open MPI's ``mpirun``
(shared memory), ``--echo`` with a raw grpcio unary echo on the daemon's
transport, all timed the same way, and prints the ratios.

The workers run in fresh interpreters (multiprocessing's ``spawn``; ``mpirun``
for MPI), so nothing of this process leaks into what is measured.

This module parses the options, starts the daemon with ``--embedded``, runs
each system in turn and judges the targets; ``sweep`` holds what a run
measures, ``oracle`` the answers results are checked against, ``table`` what
it prints, ``workers`` the worker processes and the xreduce workers, ``peers``
gloo, MPI and the echo.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TextIO

import xreduce
from xreduced.cli import parse_bytes

from xreduce_bench import big, daemon_memory, floor, multinode, workloads
from xreduce_bench.daemon import device_names, embedded_daemon
from xreduce_bench.peers import _BENCH_EXTRA, _run_peer, peer_unavailable
from xreduce_bench.sweep import (
    OPS,
    PEERS,
    TRANSPORTS,
    BenchError,
    Sweep,
    SystemResult,
    given,
    human_size,
    int_list,
    numpy_dtype,
    size_ladder,
)
from xreduce_bench.table import Progress, _Reporter, format_ratios, plot, plot_workload, ratios, to_json
from xreduce_bench.workers import _run_xreduce

DESCRIPTION = (
    "Sweeps a collective of the daemon over sizes with P worker processes of D devices each and prints "
    "nccl-tests-style rows: size, count, type, redop, time (median over iterations of the slowest process), "
    "algbw = size / time and busbw = algbw x 2(n-1)/n for all_reduce (x 1 for reduce and broadcast), n = P x D. "
    "--peers runs torch.distributed gloo and mpi4py under mpirun on the same sizes with n ranks, --echo a raw "
    "grpcio unary echo on the daemon's transport, and prints time ratios.")


def main(argv: Sequence[str] | None = None, prog: str = "xreduce bench") -> int:
    """Parses ``argv`` (default: this process's arguments) as ``xreduce bench``'s and runs it.

    Returns the exit status (see :func:`run`); bad arguments exit with status 2.

    Example:
        >>> main(["--embedded", "--peers", "nccl"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return run(p, p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the options of ``xreduce bench`` to ``p``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> args = p.parse_args(["--processes", "4", "--peers", "--max-bytes", "64MiB"])
        >>> args.processes, args.peers, args.transport, args.max_bytes == 64 << 20
        ('4', 'gloo,mpi', 'auto', True)
    """
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", default=None,
                       help="the daemon (host:port or unix:PATH; default XREDUCE_ADDRESS, else 127.0.0.1:50551)")
    where.add_argument("--embedded", action="store_true",
                       help="start a daemon (python -m xreduced on a private unix socket) for this run")
    p.add_argument("--op", choices=OPS, default="all_reduce",
                   help="all_reduce (default), reduce (to the first device of process 0; every process names it "
                   "as the destination) or broadcast (from that device)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--reduce-op", choices=("sum", "mean"), default="sum", help="default sum")
    p.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest size per device (default 4)")
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20,
                   help="largest size per device (default 256MiB)")
    p.add_argument("--step-factor", type=int, default=2, help="each size is the last times this, up to --max-bytes, "
                   "which is always measured (default 2)")
    work = p.add_mutually_exclusive_group()
    work.add_argument("--workload", choices=tuple(workloads.BUILT_IN), default=None,
                      help="instead of the sizes, all-reduce a training step's gradients in one batch: resnet50 "
                      "(torchvision's 161 ResNet-50 parameters, 25.6 M elements); gloo then all-reduces them in "
                      "DDP's buckets, MPI fused into one buffer (the copies counted)")
    work.add_argument("--workload-file", metavar="FILE.json", default=None,
                      help="as --workload, the shapes in FILE.json: a JSON list of shapes, e.g. [[64, 3, 7, 7], [64]]")
    p.add_argument("--num-packs", default=None, metavar="K[,K...]",
                   help="HierarchicalCopyAllReduce(num_packs=K) for the xreduce runs; several run one after the "
                   "other, named TRANSPORT:pK (default 1)")
    p.add_argument("--processes", default=None, metavar="P",
                   help="xreduce worker processes (default 1); with --big-tensors, counts to run one after the "
                   "other (default 2,4)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices per process (default 1 with several processes, else all the daemon's)")
    p.add_argument("--transport", default="auto",
                   help="xreduce transports to run one after the other, comma-separated: wire, shm, auto (default "
                   "auto: shared memory when the daemon shares this host, else the wire)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default 20; 5 with --nodes)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before them (default 2)")
    p.add_argument("--peers", nargs="?", const="gloo,mpi", default=None,
                   help="also run peers on the same sizes with processes x devices ranks: gloo, mpi "
                   "(default both)")
    p.add_argument("--echo", action="store_true",
                   help="also time a raw grpcio unary echo of the same bytes on the daemon's transport")
    p.add_argument("--plot", metavar="FILE.png", help="draw time and bandwidth against size (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is no tty")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any one wait may last: a worker's start, one size (default 300; 900 with "
                   "--big-tensors)")
    big = p.add_argument_group(
        "big tensors", "--big-tensors runs the big-tensors benchmark instead: per --processes count, a daemon "
        "started for it and one replica per process; the sizes one after the other in the same processes; "
        "call 1 (first) and the steady state apart; the memory of every process; gloo in place after xreduce")
    big.add_argument("--big-tensors", action="store_true",
                     help="all-reduce HierarchicalCopyAllReduce().reduce('sum', v, v, out=v) of big float32 arrays")
    big.add_argument("--sizes", default=None, metavar="S[,S...]",
                     help="bytes per replica, one after the other (default 64MiB,256MiB,1GiB,4GiB)")
    big.add_argument("--no-in-place", action="store_true",
                     help="reduce without out=: the SDK allocates each result")
    big.add_argument("--shared-array", action="store_true",
                     help="v = xreduce.shared_array(...) instead of a numpy array: the daemon reads and writes it "
                          "where it lies, nothing staged or copied")
    nodes = p.add_argument_group(
        "across nodes", "--nodes runs the multi-node benchmark instead (root: the nodes are network namespaces on "
        "one bridge): flat gloo among all processes, gloo among the node leaders and xreduce with a daemon per "
        "node, on the same values")
    nodes.add_argument("--nodes", metavar="N[,N...]", default=None,
                       help="node counts to run, one after the other (e.g. 2, or 1,2,3 for the scaling)")
    nodes.add_argument("--procs-per-node", type=int, default=None, help="processes per node (default 4)")
    nodes.add_argument("--size", default=None, help="bytes each process reduces, comma-separated (default 64MiB)")
    nodes.add_argument("--shape", default=None,
                       help="link rates to run, comma-separated: a tc rate (1gbit) shapes both directions of every "
                       "node's link, none leaves them unshaped (default none)")


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.dtype not in xreduce.SUPPORTED_DTYPES:
        p.error(f"--dtype: {args.dtype!r} is not one the wire carries; supported: "
                f"{', '.join(xreduce.SUPPORTED_DTYPES)}")
    for name, low in (("processes", 1), ("iters", 1), ("warmup", 0), ("step_factor", 2)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(args, name)}")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices must be >= 1; got {args.devices}")
    if not args.timeout > 0:
        p.error(f"--timeout must be positive; got {args.timeout}")
    if not 1 <= args.min_bytes <= args.max_bytes:
        p.error(f"need 1 <= --min-bytes <= --max-bytes; got {args.min_bytes} and {args.max_bytes}")
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports or len(set(transports)) != len(transports):
        p.error(f"--transport: a comma-separated list of {', '.join(TRANSPORTS)} without repeats; "
                f"got {args.transport!r}")
    peers = [x.strip() for x in (args.peers or "").split(",") if x.strip()]
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown peer(s) {', '.join(bad)}; peers: {', '.join(PEERS)}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(f"--plot needs matplotlib ({_BENCH_EXTRA})")
    if (args.workload or args.workload_file) and args.op != "all_reduce":
        p.error(f"--workload and --workload-file all-reduce a batch; got --op {args.op}")
    return transports, peers


def _num_packs(p: argparse.ArgumentParser, text: str | None) -> list[int]:
    if text is None:
        return [1]
    try:
        packs = [int(k) for k in text.split(",")]
    except ValueError:
        packs = []
    if not packs or any(k < 0 for k in packs) or len(set(packs)) != len(packs):
        p.error(f"--num-packs: a comma-separated list of whole numbers >= 0 without repeats; got {text!r}")
    return packs


def _workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> workloads.Workload | None:
    try:
        if args.workload:
            return workloads.built_in(args.workload)
        if args.workload_file:
            return workloads.from_file(args.workload_file)
    except (OSError, ValueError) as e:
        p.error(str(e) if isinstance(e, ValueError) else f"--workload-file {args.workload_file}: {e}")
    return None


def run(p: argparse.ArgumentParser, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs ``xreduce bench`` with parsed ``args``; returns the exit status.

    0 when every xreduce transport ran (missing peers are skipped with the
    reason), 1 when one failed or the daemon cannot be reached, 2 for bad
    arguments (through ``p.error``), 130 when interrupted.

    Example (shell):
        $ xreduce bench --embedded --processes 4 --max-bytes 64MiB --transport shm,wire --peers --plot bw.png
    """
    out = out or sys.stdout
    if args.nodes is not None:
        if args.big_tensors:
            p.error("--big-tensors and --nodes are two benchmarks: run one at a time")
        return multinode.run(p, args, out)
    for name in ("procs_per_node", "size", "shape"):
        if getattr(args, name) is not None:
            p.error(f"--{name.replace('_', '-')} needs --nodes")
    if args.big_tensors:
        return big.run(p, args, out)
    flag = given(p, args, ("sizes", "no_in_place", "shared_array"))
    if flag:
        p.error(f"{flag} needs --big-tensors")
    args.iters = 20 if args.iters is None else args.iters
    args.timeout = 300.0 if args.timeout is None else args.timeout
    try:
        counts = [1] if args.processes is None else int_list("--processes", args.processes, 1, 1 << 20)
    except ValueError:
        counts = []
    if len(counts) != 1:
        p.error(f"--processes: a whole number >= 1 (several counts need --big-tensors); got {args.processes!r}")
    args.processes = counts[0]
    transports, peers = _validate(p, args)
    packs = _num_packs(p, args.num_packs)
    if args.num_packs is not None:
        transports = [f"{t}:p{k}" for t in transports for k in packs]
    if args.embedded:  # before starting a daemon for nothing
        _need_two_devices(p, args.processes, args.devices or 8)
    try:
        with tempfile.TemporaryDirectory(prefix="xreduce-bench-") as tmp:
            os.chmod(tmp, 0o700)
            with contextlib.ExitStack() as stack:
                if args.embedded:
                    devices = args.devices or (1 if args.processes > 1 else 8)
                    address, pid = stack.enter_context(embedded_daemon(tmp, args.processes * devices, args.timeout))
                    watch = stack.enter_context(daemon_memory.MemoryWatch(pid))
                    names, backend = device_names(address, args.timeout)
                    where = f"{address} (started for this run: {len(names)} devices, {backend} backend)"
                else:
                    watch = None
                    address = xreduce.resolve_address(args.address)
                    try:
                        names, backend = device_names(address, args.timeout)
                    except Exception as e:  # noqa: BLE001 -- any failure to reach it is the same message
                        raise BenchError(f"cannot list the devices of the daemon at {address}: {e}") from None
                    devices = args.devices or (1 if args.processes > 1 else len(names))
                    where = f"{address} ({len(names)} devices, {backend} backend)"
                sweep = _sweep(p, args, devices, address, len(names))
                return _run_all(sweep, address, where, names, transports, peers, args, tmp, out, watch)
    except BenchError as e:
        print(f"xreduce bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xreduce bench: interrupted", file=sys.stderr)
        return 130


def _sweep(p: argparse.ArgumentParser, args: argparse.Namespace, devices: int, address: str, available: int
           ) -> Sweep:
    if args.processes * devices > available:
        p.error(f"--processes {args.processes} x --devices {devices} needs {args.processes * devices} devices; "
                f"the daemon at {address} has {available}")
    _need_two_devices(p, args.processes, devices)
    itemsize = numpy_dtype(args.dtype).itemsize
    workload = _workload(p, args)
    if workload is not None:
        return Sweep(args.op, args.dtype, args.reduce_op, (workload.nbytes(itemsize),), args.processes, devices,
                     args.iters, args.warmup, args.timeout, workload)
    sizes = size_ladder(args.min_bytes, args.max_bytes, args.step_factor, itemsize)
    if not sizes:
        p.error(f"no size from --min-bytes {args.min_bytes} to --max-bytes {args.max_bytes} holds one "
                f"{args.dtype} ({itemsize} bytes)")
    return Sweep(args.op, args.dtype, args.reduce_op, sizes, args.processes, devices, args.iters, args.warmup,
                 args.timeout)


def _need_two_devices(p: argparse.ArgumentParser, processes: int, devices: int) -> None:
    if processes * devices < 2:
        p.error(f"a collective needs 2 devices or more in all; got --processes {processes} --devices {devices} "
                "(with one device the SDK returns the value without calling the daemon)")


def _run_all(sweep: Sweep, address: str, where: str, names: list[str], transports: list[str], peers: list[str],
             args: argparse.Namespace, tmp: str, out: TextIO,
             watch: daemon_memory.MemoryWatch | None = None) -> int:
    systems = [SystemResult(f"xreduce {t}", "") for t in transports]
    for s in systems:
        s.about = (f"{sweep.processes} process(es) x {sweep.devices} device(s), XREDUCE_TRANSPORT={s.transport}"
                   + (f", num_packs={s.num_packs}" if args.num_packs is not None else ""))
    systems += [SystemResult(peer, "") for peer in peers]
    if args.echo:
        systems.append(SystemResult("echo", ""))
    for s in systems:
        if s.is_xreduce and s.transport == "shm" and not hasattr(xreduce, "shared_array"):
            s.skipped = "shm transport not available in this SDK (xreduce.shared_array is missing)"
        elif not s.is_xreduce and s.name != "echo":
            s.skipped = peer_unavailable(s.name, sweep.dtype)
    runnable = sum(1 for s in systems if s.skipped is None)
    progress = Progress(runnable * len(sweep.sizes), sys.stderr, args.progress or sys.stderr.isatty())
    reporter = _Reporter(sweep, progress, out)
    redop = f", {sweep.reduce_op}" if sweep.op != "broadcast" else ""
    if sweep.workload is None:
        what = f"{human_size(sweep.sizes[0])} to {human_size(sweep.sizes[-1])}"
    else:
        w = sweep.workload
        what = (f"workload {w.name}: {len(w.shapes)} tensors, {w.elements} elements, "
                f"{sweep.sizes[0] / (1 << 20):.1f} MiB per device, in one batch")
    reporter.line(f"# xreduce bench: {sweep.op}, {sweep.dtype}{redop}, {sweep.processes} process(es) x "
                  f"{sweep.devices} device(s): n = {sweep.ranks} ranks; {what}; {sweep.iters} iterations after "
                  f"{sweep.warmup} warm-up")
    reporter.line(f"# daemon: {where}")
    reporter.line(f"# time: median over iterations of the slowest process, each iteration started at a barrier; "
                  f"algbw = size / time; busbw = algbw x {_factor_text(sweep)}")
    if peers and sweep.reduce_op == "mean":
        reporter.line("# peers compute mean as a sum, then divide floating-point results by n")
    failed = False
    for s in systems:
        if s.skipped is not None:
            reporter.line(f"\n# {s.name}: skipped: {s.skipped}")
            continue
        progress.show(f"{s.name}: starting")
        try:
            if s.is_xreduce:
                _run_xreduce(s, sweep, address, names, reporter, s.num_packs)
            else:
                _run_peer(s, sweep, address, reporter, tmp)
        except BenchError as e:
            s.failed = str(e)
            failed = failed or s.is_xreduce
            reporter.line(f"# {s.name}: FAILED: {e}")
            progress.done += len(sweep.sizes) - len(s.rows)
    progress.clear()
    if watch is not None:
        watch.stop()
        with open(os.path.join(tmp, "xreduced.log")) as f:
            print("\n" + daemon_memory.report(watch, f.read()), file=out)
    measured = {s.short: s.row(sweep.sizes[-1]).time for s in systems
                if s.is_xreduce and s.transport != "wire" and s.row(sweep.sizes[-1]) is not None}
    if sweep.op == "all_reduce" and measured:  # through shared memory only the plan's own traffic moves
        print("\n" + floor.floor_line(sweep.ranks, sweep.sizes[-1], floor.copy_bandwidth(), measured), file=out)
    ratio_rows = ratios(systems, sweep)
    if ratio_rows:
        print("\n# ratios: time of xreduce / time of the peer (< 1: xreduce is faster)", file=out)
        for line in format_ratios(ratio_rows):
            print(line, file=out)
    checks = targets(systems, sweep)
    if checks:
        print("\n# targets (medians from this run)", file=out)
        for c in checks:
            print(c["text"], file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(systems, sweep, where, ratio_rows, checks), f, indent=1)
    if args.plot:
        (plot if sweep.workload is None else plot_workload)(systems, sweep, args.plot)
        print(f"\n# plot: {args.plot}", file=out)
    return 1 if failed else 0


def _factor_text(sweep: Sweep) -> str:
    if sweep.op == "all_reduce":
        return f"2(n-1)/n = {sweep.bus_factor:.4g}"
    return "1"


def targets(results: Sequence[SystemResult], sweep: Sweep) -> list[dict[str, Any]]:
    """The issue's targets that this run measured, each with its ratio and verdict.

    - 4 processes x 64 MiB float32 all-reduce through shared memory: <= 0.5x
      Open MPI (shared memory) and <= 0.5x gloo;
    - a workload (a gradient step): <= 0.6x gloo in DDP's buckets and <= 0.6x
      one Open MPI ``Allreduce`` of a fused buffer, at any devices per process;
    - a 4-byte all-reduce across 2 processes: <= 1.2x a raw gRPC unary echo
      over the same transport.

    The first is checked for the ``shm`` and ``auto`` transports, the second
    for every transport (the echo runs over the daemon's own socket).

    Example:
        >>> from xreduce_bench.sweep import Row
        >>> s = Sweep("all_reduce", "float32", "sum", (4,), processes=2, devices=1, iters=1, warmup=0)
        >>> x = SystemResult("xreduce wire", "", [Row(4, 1, [0.0003])])
        >>> e = SystemResult("echo", "", [Row(4, 1, [0.0002])])
        >>> print(targets([x, e], s)[0]["text"])  # doctest: +NORMALIZE_WHITESPACE
        2 processes x 4 B float32 all-reduce, wire: xreduce 300.0 us, gRPC echo 200.0 us,
        ratio 1.50 (target <= 1.2): not met
    """
    by_name = {r.short: r for r in results if r.rows}
    checks = []

    def check(x: SystemResult, peer: str, label: str, size: int, bound: float, what: str, unit: str) -> None:
        a, b = x.row(size), by_name[peer].row(size) if peer in by_name else None
        if a is None or b is None:
            return
        scale, digits = (1e6, 1) if unit == "us" else (1.0, 3)
        ratio = a.time / b.time
        verdict = "met" if ratio <= bound else "not met"
        text = (f"{what}, {x.short}: xreduce {a.time * scale:.{digits}f} {unit}, {label} "
                f"{b.time * scale:.{digits}f} {unit}, ratio {ratio:.2f} (target <= {bound:g}): {verdict}")
        checks.append({"what": what, "transport": x.short, "peer": peer, "size": size, "xreduce_s": a.time,
                       "peer_s": b.time, "ratio": ratio, "bound": bound, "met": ratio <= bound, "text": text})

    ours = sorted((r for r in results if r.is_xreduce and r.rows), key=lambda r: r.transport != "shm")
    if sweep.workload is not None:
        w = sweep.workload
        what = (f"{sweep.processes} processes x {sweep.devices} device(s) {w.name} gradient step "
                f"({len(w.shapes)} tensors) {sweep.dtype} {sweep.reduce_op}")
        for x in ours:
            check(x, "gloo", "gloo (DDP buckets)", sweep.sizes[0], 0.6, what, "s")
            check(x, "mpi", "Open MPI (fused)", sweep.sizes[0], 0.6, what, "s")
        return checks
    if sweep.op != "all_reduce" or sweep.devices != 1:
        return checks
    for x in ours:
        if sweep.processes == 4 and sweep.dtype == "float32" and x.transport != "wire":
            what = "4 processes x 64 MiB float32 all-reduce"
            check(x, "mpi", "Open MPI", 64 << 20, 0.5, what, "s")
            check(x, "gloo", "gloo", 64 << 20, 0.5, what, "s")
        if sweep.processes == 2:
            check(x, "echo", "gRPC echo", 4, 1.2, f"2 processes x 4 B {sweep.dtype} all-reduce", "us")
    return checks
