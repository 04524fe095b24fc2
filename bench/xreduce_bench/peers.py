"""The peers ``xreduce bench`` compares with: gloo, Open MPI and a raw grpcio echo.

gloo (torch.distributed) and the echo run in the worker pool of
``workers``; MPI runs under ``mpirun``, which starts this module as
``python -m xreduce_bench.peers mpi-worker CONFIG``, and the echo's server is
``python -m xreduce_bench.peers echo-server LISTEN WORKERS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import queue as queue_mod
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from xreduce_bench import oracle
from xreduce_bench.sweep import PEERS, BenchError, Sweep, SystemResult, numpy_dtype
from xreduce_bench.table import _Reporter
from xreduce_bench.workers import _collect, _nothing, _popen, _run_pool, _stop, _timed_sweep
from xreduce_bench.workloads import ddp_buckets

ECHO_METHOD = "/xreduce.bench.Echo/Echo"
_THIS_MODULE = "xreduce_bench.peers"  # mpirun and the echo server start it with -m
_MPI_LINE = "XREDUCE-BENCH "
_BENCH_EXTRA = "pip install 'xreduce[bench]'"
_OPEN_MPI_DEBIAN = "apt-get install openmpi-bin libopenmpi-dev"
_MESSAGE_OPTIONS = (("grpc.max_receive_message_length", (1 << 31) - 1),
                    ("grpc.max_send_message_length", (1 << 31) - 1))


def peer_unavailable(peer: str, dtype: str = "float32") -> str | None:
    """Why a peer cannot run here (naming what to install), or None.

    Example:
        >>> peer_unavailable("nccl")
        "unknown peer 'nccl' (peers: gloo, mpi)"
        >>> peer_unavailable("mpi", "bfloat16")
        'MPI has no bfloat16 datatype'
    """
    if peer == "mpi" and dtype in ("float16", "bfloat16"):
        return f"MPI has no {dtype} datatype"
    if peer == "gloo":
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed ({_BENCH_EXTRA})"
        return None
    if peer == "mpi":
        if shutil.which("mpirun") is None:
            return f"mpirun is not on PATH (Debian: {_OPEN_MPI_DEBIAN})"
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed ({_BENCH_EXTRA}; it needs an MPI library: {_OPEN_MPI_DEBIAN})"
        return None
    return f"unknown peer {peer!r} (peers: {', '.join(PEERS)})"


# --------------------------------------------------------------------------- in the workers


def _divides(sweep: Sweep, rank: int, floating: bool) -> bool:
    """Whether ``rank`` divides its result by n: gloo and MPI have no mean, so they
    sum, and the ranks that hold a floating-point reduction divide it."""
    return (sweep.reduce_op == "mean" and floating and sweep.op != "broadcast"
            and (sweep.op == "all_reduce" or rank == 0))


def _gloo_start(sweep: Sweep, rank: int) -> tuple[Callable, Callable]:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["XREDUCE_BENCH_STORE"], rank=rank,
                            world_size=sweep.ranks, timeout=datetime.timedelta(seconds=sweep.timeout))
    n = sweep.ranks
    dtype = getattr(torch, sweep.dtype)
    divide = _divides(sweep, rank, dtype.is_floating_point)

    def prepare(size: int):
        if sweep.workload is not None:
            return _gloo_workload(sweep, rank, divide)
        source = torch.full((sweep.count(size),), rank + 1, dtype=dtype)
        buf = torch.empty_like(source)

        def run():
            if sweep.op == "all_reduce":
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            elif sweep.op == "reduce":
                dist.reduce(buf, dst=0, op=dist.ReduceOp.SUM)
            else:
                dist.broadcast(buf, src=0)
            if divide:
                buf.div_(n)
            return buf

        return (lambda: buf.copy_(source)), run, lambda result: None

    return prepare, dist.destroy_process_group


def _gloo_workload(sweep: Sweep, rank: int, divide: bool):
    """The workload as DistributedDataParallel all-reduces it: the gradients are views of one flat buffer
    laid out bucket by bucket (``gradient_as_bucket_view``), DDP's buckets (:func:`ddp_buckets`) are
    all-reduced asynchronously in order, then waited for; no copy is counted."""
    import torch
    import torch.distributed as dist

    shapes = sweep.workload.shapes
    counts = sweep.workload.sizes(1)
    buckets = ddp_buckets(sweep.workload.sizes(numpy_dtype(sweep.dtype).itemsize))
    offsets, spans, at = {}, [], 0
    for bucket in buckets:
        start = at
        for t in bucket:
            offsets[t] = at
            at += counts[t]
        spans.append((start, at))
    flat = torch.empty(at, dtype=getattr(torch, sweep.dtype))
    source = torch.empty_like(flat)
    for t, values in enumerate(oracle.workload_inputs(sweep, rank)):
        source[offsets[t]:offsets[t] + counts[t]] = torch.from_numpy(values.reshape(-1))
    views = [flat[a:b] for a, b in spans]

    def run():
        for work in [dist.all_reduce(v, op=dist.ReduceOp.SUM, async_op=True) for v in views]:
            work.wait()
        if divide:
            flat.div_(sweep.ranks)
        return flat

    def check(result) -> int:
        return oracle.workload_wrong([(result[offsets[t]:offsets[t] + counts[t]].numpy().reshape(shape),)
                                      for t, shape in enumerate(shapes)], sweep)

    return (lambda: flat.copy_(source)), run, check


def _mpi_workload(sweep: Sweep, rank: int, divide: bool, comm, mpi):
    """The workload as Horovod's tensor fusion all-reduces it: each gradient copied into one fusion buffer,
    one ``Allreduce`` in place, each result copied out into its own array; the copies are counted."""
    grads = oracle.workload_inputs(sweep, rank)
    outs = [np.empty_like(g) for g in grads]
    fused = np.empty(sum(g.size for g in grads), grads[0].dtype)
    flat_grads = [g.reshape(-1) for g in grads]
    bounds = np.cumsum([0] + [g.size for g in grads])

    def run():
        np.concatenate(flat_grads, out=fused)
        comm.Allreduce(mpi.IN_PLACE, fused, op=mpi.SUM)
        if divide:
            np.divide(fused, sweep.ranks, out=fused)
        for out, a, b in zip(outs, bounds[:-1], bounds[1:]):
            out.reshape(-1)[...] = fused[a:b]
        return outs

    def check(result) -> int:
        return oracle.workload_wrong([(a,) for a in result], sweep)

    return _nothing, run, check


@dataclasses.dataclass(frozen=True)
class _EchoSpec:
    sweep: Sweep
    address: str


def _echo_start(spec: _EchoSpec, rank: int) -> tuple[Callable, Callable]:
    import grpc

    channel = grpc.insecure_channel(spec.address, options=_MESSAGE_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=spec.sweep.timeout)
    echo = channel.unary_unary(ECHO_METHOD)  # no serializers: bytes in, bytes out

    def prepare(size: int):
        payload = bytes(size * spec.sweep.devices)  # what one process sends the daemon

        def run():
            return echo(payload, timeout=spec.sweep.timeout)

        return _nothing, run, lambda result: int(result != payload) * size

    return prepare, channel.close


def _mpi_main(config: str) -> int:
    """Runs under ``mpirun``: the MPI peer; rank 0 prints each size's per-iteration maxima."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    sweep = Sweep.from_dict(json.loads(config))
    dtype = numpy_dtype(sweep.dtype)
    divide = _divides(sweep, rank, dtype.kind in "fc")

    def emit(message: dict) -> None:
        print(_MPI_LINE + json.dumps(message), flush=True)

    if rank == 0:
        library = MPI.Get_library_version().replace("\0", "").split(",")[0].strip()  # "Open MPI v4.1.4"
        emit({"hello": library, "ranks": n})

    def prepare(size: int):
        if sweep.workload is not None:
            return _mpi_workload(sweep, rank, divide, comm, MPI)
        send = np.full(sweep.count(size), rank + 1, dtype)
        recv = np.empty_like(send)

        def run():
            if sweep.op == "all_reduce":
                comm.Allreduce(send, recv, op=MPI.SUM)
            elif sweep.op == "reduce":
                comm.Reduce(send, recv if rank == 0 else None, op=MPI.SUM, root=0)
            else:
                comm.Bcast(send, root=0)
            if divide:
                np.divide(recv, n, out=recv)
            return recv

        return _nothing, run, lambda result: None

    def report(index: int, times: list[float], wrong: int | None) -> None:
        gathered = comm.gather((times, wrong), root=0)
        if rank == 0:
            wrongs = [w for _, w in gathered if w is not None]
            emit({"size": index, "times": [max(t) for t in zip(*(t for t, _ in gathered))],
                  "wrong": sum(wrongs) if wrongs else None})

    try:
        _timed_sweep(sweep, comm.Barrier, prepare, report)
    except Exception as e:  # noqa: BLE001 -- reported, then every rank is stopped
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        comm.Abort(1)
    if rank == 0:
        emit({"done": True})
    return 0


def _echo_server_main(listen: str, workers: int) -> int:
    """The raw gRPC echo: a generic unary handler that returns its request's bytes.

    Prints ``serving ADDRESS`` once listening and serves until stdin closes.
    """
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        ECHO_METHOD.split("/")[1], {ECHO_METHOD.split("/")[2]: grpc.unary_unary_rpc_method_handler(
            lambda request, context: request)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), handlers=[handler],
                         options=[*_MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)])
    port = server.add_insecure_port(listen)
    server.start()
    address = listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"
    print(f"serving {address}", flush=True)
    sys.stdin.read()
    server.stop(0).wait()
    return 0


# --------------------------------------------------------------------------- in the parent


def _run_peer(system: SystemResult, sweep: Sweep, address: str, reporter: _Reporter, tmp: str) -> None:
    """Runs the peer ``system.name`` (``gloo``, ``mpi`` or ``echo``) on the sweep's sizes."""
    if system.name == "gloo":
        _run_gloo(system, sweep, reporter, tmp)
    elif system.name == "mpi":
        _run_mpi(system, sweep, reporter, tmp)
    else:
        _run_echo(system, sweep, address, reporter, tmp)


_stores = itertools.count()


def gloo_env(tmp: str, ranks: int) -> list[dict[str, str]]:
    """The environment of each of ``ranks`` gloo workers on this host: a new file store in ``tmp``
    (``XREDUCE_BENCH_STORE``), and connections on loopback.

    Example:
        >>> envs = gloo_env("/tmp/x", 2)
        >>> len(envs), envs[0]["XREDUCE_BENCH_STORE"].startswith("file:///tmp/x/gloo-store-")
        (2, True)
    """
    env = {"XREDUCE_BENCH_STORE": f"file://{tmp}/gloo-store-{next(_stores)}"}
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # one host: keep gloo's connections on loopback
    return [env] * ranks


def _run_gloo(system: SystemResult, sweep: Sweep, reporter: _Reporter, tmp: str) -> None:
    import torch

    system.about = f"torch {torch.__version__}, {sweep.ranks} processes, one rank each"
    reporter.header(system)
    _run_pool(system, _gloo_start, sweep, sweep.ranks, gloo_env(tmp, sweep.ranks), sweep, reporter)


def _run_mpi(system: SystemResult, sweep: Sweep, reporter: _Reporter, tmp: str) -> None:
    """Runs the MPI peer under ``mpirun`` (shared memory between the ranks)."""
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=60).stdout
    command = ["mpirun", "-np", str(sweep.ranks)]
    match = re.search(r"Open MPI\)? (\d+)\.", version)
    if match:  # Open MPI: its shared-memory transport is "vader" before 5.0 and "sm" from 5.0
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
        command += ["--oversubscribe", "--bind-to", "none", "--mca", "btl",
                    "self,vader" if int(match.group(1)) < 5 else "self,sm"]
    command += [sys.executable, "-m", _THIS_MODULE, "mpi-worker", json.dumps(sweep.to_dict())]
    system.about = f"{sweep.ranks} ranks, mpirun {' '.join(command[3:command.index(sys.executable)])}"
    messages: queue_mod.Queue = queue_mod.Queue()
    with open(os.path.join(tmp, "mpi.stderr"), "w+") as stderr:
        proc = _popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)

        def read() -> None:
            for line in proc.stdout:
                if not line.startswith(_MPI_LINE):
                    continue
                message = json.loads(line[len(_MPI_LINE):])
                if "hello" in message:
                    messages.put(("header", f"{message['hello']}, {system.about}"))
                elif "size" in message:
                    messages.put(("size", 0, message["size"], message["times"], message.get("wrong")))
                elif message.get("done"):
                    messages.put(("done", 0))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def alive() -> str | None:
            if proc.poll() in (None, 0):
                return None
            stderr.seek(0)
            lines = [line.strip() for line in stderr.read().splitlines() if line.strip()]
            ranks = {re.sub(r"^rank \d+: ", "", line): None for line in lines if re.match(r"rank \d+: ", line)}
            why = "; ".join(ranks) if ranks else "; ".join(lines[-6:])
            return f"{why} (mpirun exited with status {proc.returncode})"

        try:
            _collect(system, messages, 1, alive, sweep, reporter)
            proc.wait(30)
        finally:
            if proc.poll() is None:  # mpirun's ranks are in its session: stop them all
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            reader.join(5)


def _run_echo(system: SystemResult, sweep: Sweep, address: str, reporter: _Reporter, tmp: str) -> None:
    with _echo_server(address, tmp, max(4, sweep.processes), sweep.timeout) as echo_address:
        system.about = (f"grpcio unary echo at {echo_address}, {sweep.processes} processes each sending "
                        f"{sweep.devices} x size bytes (what each sends the daemon) and getting them back")
        reporter.header(system)
        _run_pool(system, _echo_start, _EchoSpec(sweep, echo_address), sweep.processes, [{}] * sweep.processes,
                  sweep, reporter)


@contextlib.contextmanager
def _echo_server(daemon_address: str, tmp: str, workers: int, timeout: float) -> Iterator[str]:
    """The raw gRPC echo server in its own process, on the daemon's transport."""
    listen = f"unix:{tmp}/echo.sock" if daemon_address.startswith("unix:") else "127.0.0.1:0"
    proc = _popen([sys.executable, "-m", _THIS_MODULE, "echo-server", listen, str(workers)],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines: queue_mod.Queue = queue_mod.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        try:
            first = lines.get(timeout=timeout)
        except queue_mod.Empty:
            raise BenchError(f"the echo server did not start within {timeout:g}s") from None
        if not first.startswith("serving "):
            raise BenchError(f"the echo server did not start (status {proc.wait(10)})")
        yield first.split()[1]
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the server's cue to stop
        _stop(proc, 10)


def _main(argv: Sequence[str]) -> int:
    if argv[:1] == ["mpi-worker"] and len(argv) == 2:
        return _mpi_main(argv[1])
    if argv[:1] == ["echo-server"] and len(argv) == 3:
        return _echo_server_main(argv[1], int(argv[2]))
    print("usage: python -m xreduce_bench.peers mpi-worker CONFIG | echo-server LISTEN WORKERS "
          "(the workers of `xreduce bench`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
