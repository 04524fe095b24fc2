"""``xreduce bench --nodes``: all-reduce across nodes (network namespaces), xreduce against gloo, in one run.

For every link shape of ``--shape`` (unshaped, or a tc rate on both
directions of every node's link) and every node count N of ``--nodes``,
:class:`~xreduce_bench.netns.Nodes` makes the nodes (node k at 10.0.0.k) and
three systems all-reduce the same values, one after the other:

- ``flat gloo``: torch.distributed's gloo among all N x P processes, ranks
  contiguous per node, the TCP store on node 1: a job without a node level;
- ``leader gloo``: gloo among one process per node: only what must cross the
  links (from 2 nodes);
- ``xreduce``: one ``xreduced --listen 127.0.0.1:PORT --virtual-devices P
  --node-address 10.0.0.k`` per node; P processes per node, each driving one
  device of its node's daemon (``XREDUCE_ADDRESS``, the node's own loopback,
  as a deployment has it: the daemon lends shared memory to callers on
  loopback or a unix socket only, and the nodes reach each other on
  ``--node-address``), call
  ``xreduce.distribution.initialize`` with the coordinator on node 1
  (``KERAS_DISTRIBUTION_JOB_ADDRESSES``), then
  ``HierarchicalCopyAllReduce().batch_reduce``.

Every process lives in its node's namespace from its first instruction (the
spawn executable is :attr:`Nodes.python <xreduce_bench.netns.Nodes.python>`),
so all its sockets are the node's. Timing is ``xreduce bench``'s: each
iteration starts at a barrier of all the processes, an iteration's time is
its slowest process's, a row is the median (``workers``); this module runs
the settings, ``multinode_report`` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing import resource_tracker, spawn
from typing import Any, TextIO

import xreduce

from xreduce_bench import multinode_report as report
from xreduce_bench.netns import INTERFACE, Node, Nodes, NodesError, namespaces_unavailable, parse_rate
from xreduce_bench.peers import _gloo_start, peer_unavailable
from xreduce_bench.sweep import BenchError, Row, Sweep, SystemResult, given, human_size, int_list, size_list
from xreduce_bench.table import Progress, _Reporter
from xreduce_bench.workers import _python_path, _run_pool, _stop, _xreduce_start, _XreduceSpec

DAEMON_PORT = 50551
COORDINATOR_PORT = 50552
STORE_PORT = 29500
"""Fixed ports are safe: every setting's namespaces are new, so nothing else listens in them."""
_LOG_TAIL = 8
DEFAULT_PROCS_PER_NODE = 4
DEFAULT_SIZE = 64 << 20
DEFAULT_ITERS = 5
DEFAULT_TIMEOUT = 300.0
CONFLICTS = ("address", "embedded", "op", "processes", "devices", "transport", "peers", "echo", "plot",
             "min_bytes", "max_bytes", "step_factor", "sizes", "no_in_place",
             "shared_array")
"""Options of the one-daemon sweep that mean nothing across nodes."""


@contextlib.contextmanager
def _spawn_in_nodes(nodes: Nodes) -> Iterator[None]:
    """multiprocessing's spawn starts its children through ``nodes.python`` inside the block.

    The resource tracker starts first, with the plain interpreter: it must
    not land in a node (nor fail for want of one).
    """
    resource_tracker.ensure_running()
    saved = spawn.get_executable()
    multiprocessing.get_context("spawn").set_executable(nodes.python)
    try:
        yield
    finally:
        multiprocessing.get_context("spawn").set_executable(saved)


def _sweep(args: argparse.Namespace, processes: int) -> Sweep:
    return Sweep("all_reduce", args.dtype, args.reduce_op, tuple(args.size), processes, 1, args.iters, args.warmup,
                 args.timeout)


class _NodesReporter(_Reporter):
    """Prints a setting's tables with the per-link columns of ``multinode_report``."""

    def __init__(self, sweep: Sweep, setting: report.Setting, progress: Progress, out: TextIO):
        super().__init__(sweep, progress, out)
        self.setting = setting

    def header(self, system: SystemResult) -> None:
        self.line(f"\n# {system.name}: {system.about}")
        self.line(report.TABLE_HEADER)

    def row(self, system: SystemResult, row: Row) -> None:
        self.line(report.format_row(row, self.setting, self.sweep.dtype, self.sweep.reduce_op))
        self.progress.advance(f"{self.setting.nodes}n {self.setting.shape or 'unshaped'} {system.name} "
                              f"{human_size(row.size)}")


def _placement(nodes: Nodes, per_node: int) -> list[Node]:
    """Each rank's node: ranks contiguous per node (node 1 holds ranks 0 .. P-1)."""
    return [node for node in nodes for _ in range(per_node)]


def _run_gloo(system: SystemResult, nodes: Nodes, placement: list[Node], port: int, args: argparse.Namespace,
              setting: report.Setting, progress: Progress, out: TextIO) -> None:
    import torch

    sweep = _sweep(args, len(placement))
    env = {"XREDUCE_BENCH_STORE": f"tcp://{nodes[1].address}:{port}", "GLOO_SOCKET_IFNAME": INTERFACE}
    envs = [{**node.env(), **env} for node in placement]
    per_node = len(placement) // len(nodes)
    system.about = (f"torch {torch.__version__}, {report.count(len(placement), 'process')} ({per_node} per node, "
                    f"ranks contiguous per node), TCP store on node 1, sockets on {INTERFACE}")
    reporter = _NodesReporter(sweep, setting, progress, out)
    reporter.header(system)
    with _spawn_in_nodes(nodes):
        _run_pool(system, _gloo_start, sweep, sweep.ranks, envs, sweep, reporter)


@contextlib.contextmanager
def _daemons(nodes: Nodes, per_node: int, tmp: str, timeout: float) -> Iterator[list[str]]:
    """An ``xreduced`` on every node, listening on the node's loopback; yields their addresses, node by node."""
    procs, logs = [], []
    env = {**os.environ, "PYTHONPATH": _python_path(), "PYTHONUNBUFFERED": "1"}
    try:
        for node in nodes:
            log = os.path.join(tmp, f"xreduced-{node.index}.log")
            logs.append(log)
            with open(log, "w") as f:
                procs.append(node.popen([sys.executable, "-m", "xreduced", "--listen", f"127.0.0.1:{DAEMON_PORT}",
                                         "--virtual-devices", str(per_node), "--node-address", node.address],
                                        stdout=subprocess.DEVNULL, stderr=f, env=env))
        deadline = time.monotonic() + timeout
        for node, proc, log in zip(nodes, procs, logs):
            while True:
                with open(log) as f:
                    text = f.read()
                if re.search(r"event=serving address=", text):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"exited with status {proc.returncode}" if proc.poll() is not None else "did not serve"
                    last = "\n".join(text.strip().splitlines()[-5:])  # argparse's usage would bury the error
                    raise BenchError(f"the daemon of node {node.index} {why}:\n{last}")
                time.sleep(0.05)
        try:
            yield [f"127.0.0.1:{DAEMON_PORT}" for _ in nodes]
        except BenchError as e:  # the daemons' logs go with the run's temporary folder: keep their last words
            tails = []
            for node, log in zip(nodes, logs):
                with open(log) as f:
                    lines = f.read().strip().splitlines()[-_LOG_TAIL:]
                tails.append(f"the daemon of node {node.index}, its log's last lines:\n" + "\n".join(lines))
            raise BenchError("\n".join([str(e), *tails])) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            _stop(proc, 30)


def _device_names(node: Node, address: str, timeout: float) -> list[str]:
    """The short device names of the daemon at ``address``, asked from inside ``node``."""
    code = ("import sys, xreduce\n"
            "with xreduce.Client(sys.argv[1], timeout=float(sys.argv[2])) as c:\n"
            "    print(' '.join(xreduce.DeviceName.parse(d.name).short for d in c.list_devices().devices))\n")
    done = node.run([sys.executable, "-c", code, address, str(timeout)], capture_output=True, text=True,
                    timeout=timeout + 30, env={**os.environ, "PYTHONPATH": _python_path()})
    if done.returncode != 0:
        raise BenchError(f"cannot list the devices of the daemon at {address}: {done.stderr.strip()}")
    return done.stdout.split()


def _engine_use(node: Node, address: str, group: str, timeout: float) -> str:
    """What the daemon at ``address`` says its node spent crossing nodes for ``group`` (``GetStatus``), in words."""
    code = ("import sys, xreduce\n"
            "with xreduce.Client(sys.argv[1], timeout=float(sys.argv[2])) as c:\n"
            "    for g in c.get_status().groups:\n"
            "        if g.group.split('@')[0] == sys.argv[3]:\n"
            "            print(g.cross_node_collectives, g.cross_node_bytes, g.cross_node_seconds, g.engine)\n")
    done = node.run([sys.executable, "-c", code, address, str(timeout), group], capture_output=True, text=True,
                    timeout=timeout + 30, env={**os.environ, "PYTHONPATH": _python_path()})
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 4:
        return f"node {node.index}: no status ({(done.stderr.strip().splitlines() or ['no such group'])[-1]})"
    collectives, moved, seconds = int(fields[0]), int(fields[1]), float(fields[2])
    each = f", {seconds / collectives * 1e3:.1f} ms each" if collectives else ""
    return (f"node {node.index}: {report.count(collectives, 'collective')} across nodes on {fields[3]}, "
            f"{moved / (1 << 20):.1f} MiB sent and received, {seconds:.3f} s in the engine{each}")


def _run_xreduce(system: SystemResult, nodes: Nodes, per_node: int, tmp: str, args: argparse.Namespace,
                 setting: report.Setting, progress: Progress, out: TextIO) -> None:
    placement = _placement(nodes, per_node)
    sweep = _sweep(args, len(placement))
    reporter = _NodesReporter(sweep, setting, progress, out)
    with _daemons(nodes, per_node, tmp, args.timeout) as addresses:
        names = _device_names(nodes[1], addresses[0], args.timeout)[:per_node]
        if len(names) < per_node:
            raise BenchError(f"the daemon at {addresses[0]} has {len(names)} devices; {per_node} are needed")
        devices = tuple((names[rank % per_node],) for rank in range(len(placement)))
        spec = _XreduceSpec(sweep, devices, devices[0][0], "auto")
        coordinator = f"{nodes[1].address}:{COORDINATOR_PORT}"
        group = f"xreduce-bench-nodes-{os.getpid()}-{nodes.token}"
        envs = [{**node.env(), "XREDUCE_ADDRESS": addresses[node.index - 1], "XREDUCE_TRANSPORT": "auto",
                 "XREDUCE_GROUP": group, "XREDUCE_LOCAL_DEVICES": devices[rank][0],
                 "KERAS_DISTRIBUTION_JOB_ADDRESSES": coordinator} for rank, node in enumerate(placement)]
        system.about = (f"an xreduced per node ({report.count(per_node, 'device')}, --listen 127.0.0.1:{DAEMON_PORT}, "
                        f"--node-address 10.0.0.k), {report.count(len(placement), 'process')} of one device each, "
                        f"transport auto, coordinator {coordinator}, HierarchicalCopyAllReduce().batch_reduce")
        reporter.header(system)
        with _spawn_in_nodes(nodes):
            _run_pool(system, _xreduce_start, spec, len(placement), envs, sweep, reporter)
        if len(nodes) > 1:
            reporter.line("# the daemons' GetStatus, warm-up included: " + "; ".join(
                _engine_use(node, address, group, args.timeout) for node, address in zip(nodes, addresses)))


def _run_setting(setting: report.Setting, args: argparse.Namespace, tmp: str, progress: Progress,
                 out: TextIO) -> bool:
    """Runs the three systems of one setting; returns whether xreduce failed."""
    setting.systems = [SystemResult(name, "") for name in report.SYSTEMS]
    flat, leader, ours = setting.systems
    gloo_missing = peer_unavailable("gloo", args.dtype)
    flat.skipped = leader.skipped = gloo_missing
    if setting.nodes == 1:
        leader.skipped = "one node: no link to cross"
    if setting.nodes * setting.procs_per_node == 1:
        flat.skipped = ours.skipped = "one process: nothing to reduce"
    print(f"\n## {setting.title}", file=out, flush=True)
    failed = False
    with Nodes(setting.nodes, shape=setting.shape) as nodes:
        for port, system in enumerate(setting.systems, start=STORE_PORT):
            if system.skipped is not None:
                print(f"\n# {system.name}: skipped: {system.skipped}", file=out, flush=True)
                continue
            progress.show(f"{setting.nodes}n {setting.shape or 'unshaped'} {system.name}: starting")
            try:
                if system.name == report.XREDUCE:
                    _run_xreduce(system, nodes, setting.procs_per_node, tmp, args, setting, progress, out)
                else:
                    per_node = setting.procs_per_node if system.name == report.FLAT else 1
                    _run_gloo(system, nodes, _placement(nodes, per_node), port, args, setting, progress, out)
            except (BenchError, NodesError) as e:
                system.failed = str(e)
                failed = failed or system.name == report.XREDUCE
                progress.clear()
                print(f"# {system.name}: FAILED: {e}", file=out, flush=True)
                progress.done += len(args.size) - len(system.rows)
    progress.clear()
    lines = report.format_ratios(setting, args.size)
    if lines:
        print("\n# ratios: time of xreduce / time of the gloo (< 1: xreduce is faster)", file=out)
        print("\n".join(lines), file=out, flush=True)
    return failed


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks and completes ``args`` for ``--nodes``: lists parsed, defaults filled (``p.error`` on bad input).

    Example:
        >>> from xreduce_bench.command import add_arguments
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> args = p.parse_args(["--nodes", "1,2", "--shape", "none,1gbit"])
        >>> validate(p, args)
        >>> args.nodes, args.procs_per_node, args.size, args.shape, args.iters
        ([1, 2], 4, [67108864], [None, '1gbit'], 5)
    """
    flag = given(p, args, CONFLICTS)
    if flag:
        p.error(f"{flag} does not apply with --nodes (it runs its own daemons, one per node, and its own peers; "
                "sizes come from --size)")
    try:
        args.nodes = int_list("--nodes", args.nodes, 1, 253)
    except ValueError as e:
        p.error(str(e))
    if args.dtype not in xreduce.SUPPORTED_DTYPES:
        p.error(f"--dtype: {args.dtype!r} is not one the wire carries; supported: "
                f"{', '.join(xreduce.SUPPORTED_DTYPES)}")
    args.procs_per_node = DEFAULT_PROCS_PER_NODE if args.procs_per_node is None else args.procs_per_node
    if args.procs_per_node < 1:
        p.error(f"--procs-per-node must be >= 1; got {args.procs_per_node}")
    if max(args.nodes) * args.procs_per_node < 2:
        p.error(f"a collective needs 2 processes or more; got --nodes {max(args.nodes)} --procs-per-node "
                f"{args.procs_per_node}")
    try:
        args.size = size_list("--size", args.size or str(DEFAULT_SIZE), args.dtype)
    except ValueError as e:
        p.error(str(e))
    shapes = [x.strip() for x in (args.shape or "none").split(",") if x.strip()]
    try:
        for x in shapes:
            if x != "none":
                parse_rate(x)
    except ValueError as e:
        p.error(f"--{e}")
    if not shapes or len(set(shapes)) != len(shapes):
        p.error(f"--shape: comma-separated tc rates (1gbit) or none, without repeats; got {args.shape!r}")
    args.shape = [None if x == "none" else x for x in shapes]
    args.iters = DEFAULT_ITERS if args.iters is None else args.iters
    for name, low in (("iters", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}; got {getattr(args, name)}")
    args.timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    if not args.timeout > 0:
        p.error(f"--timeout must be positive; got {args.timeout}")


def run(p: argparse.ArgumentParser, args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs ``xreduce bench --nodes``; returns the exit status.

    0 when xreduce ran in every setting (a missing gloo is skipped with the
    reason), 1 when it failed or the nodes cannot be made, 2 for bad arguments
    (through ``p.error``), 130 when interrupted.

    Example (shell, as root):
        $ xreduce bench --nodes 1,2,3 --procs-per-node 4 --size 64MiB --shape none,1gbit --json nodes.json
    """
    out = out or sys.stdout
    validate(p, args)
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"xreduce bench: --nodes makes network namespaces: {reason}", file=sys.stderr)
        return 1
    settings = [report.Setting(n, args.procs_per_node, shape, None if shape is None else parse_rate(shape))
                for shape in args.shape for n in args.nodes]
    steps = sum(len(report.SYSTEMS) * len(args.size) for _ in settings)
    progress = Progress(steps, sys.stderr, args.progress or sys.stderr.isatty())
    redop = f"{args.dtype}, {args.reduce_op}"
    print(f"# xreduce bench --nodes: all_reduce, {redop}; {', '.join(human_size(s) for s in args.size)} per process; "
          f"nodes {','.join(map(str, args.nodes))} x {report.count(args.procs_per_node, 'process')}; links "
          f"{', '.join(s or 'unshaped' for s in args.shape)}; {args.iters} iterations after {args.warmup} warm-up",
          file=out)
    print("# nodes: network namespaces on one bridge, node k at 10.0.0.k; a shaped link has tc tbf on both ends",
          file=out)
    print("# time: median over iterations of the slowest process, each iteration started at a barrier; "
          "algbw = size / time; busbw = algbw x 2(N-1)/N, N = nodes: what each node's link carries at least, each "
          "way; link% = busbw / link rate", file=out, flush=True)
    failed = False
    try:
        with tempfile.TemporaryDirectory(prefix="xreduce-bench-nodes-") as tmp:
            for setting in settings:
                failed = _run_setting(setting, args, tmp, progress, out) or failed
    except NodesError as e:
        progress.clear()
        print(f"xreduce bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.clear()
        print("xreduce bench: interrupted", file=sys.stderr)
        return 130
    progress.clear()
    _summary(settings, args, out)
    return 1 if failed else 0


def _summary(settings: Sequence[report.Setting], args: argparse.Namespace, out: TextIO) -> None:
    if len(args.nodes) > 1:
        print("\n# scaling", file=out)
        for size in args.size:
            print("\n".join(report.format_scaling(settings, size)), file=out)
    checks = report.targets(settings, args.dtype)
    if checks:
        print("\n# targets (medians from this run)", file=out)
        for c in checks:
            print(c["text"], file=out)
    if args.json:
        about: dict[str, Any] = {"dtype": args.dtype, "reduce_op": args.reduce_op, "sizes": args.size,
                                 "nodes": args.nodes, "procs_per_node": args.procs_per_node, "shapes": args.shape,
                                 "iters": args.iters, "warmup": args.warmup, "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump(report.to_json(settings, about, checks), f, indent=1)
    out.flush()
