"""The worker processes of ``xreduce bench``, and the xreduce workers among them.

Every system but MPI runs in a pool of spawned workers (:func:`_run_pool`):
each times its sweep with :func:`_timed_sweep` and reports every size to the
parent, which turns the reports into rows with :func:`_collect`. What a worker
measures comes from its ``start(spec, rank) -> (prepare, close)`` function:
:func:`_xreduce_start` here, the peers' in ``peers``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import multiprocessing
import os
import queue as queue_mod
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import numpy as np

from xreduce_bench import oracle
from xreduce_bench.sweep import BenchError, Row, Sweep, SystemResult, numpy_dtype
from xreduce_bench.table import _Reporter

_Start = Callable[[Any, int], tuple[Callable, Callable]]
"""``start(spec, rank) -> (prepare, close)``: readies one worker; ``prepare(size) -> (reset, run, check)``."""


# --------------------------------------------------------------------------- in the workers


def _timed_sweep(sweep: Sweep, barrier: Callable[[], None], prepare: Callable,
                 report: Callable[[int, list[float], int | None], None]) -> None:
    """Runs every size: ``prepare(size) -> (reset, run, check)``; ``reset`` runs
    before the barrier, untimed; each iteration times ``run`` alone."""
    for index, size in enumerate(sweep.sizes):
        reset, run, check = prepare(size)
        times, result = [], None
        for i in range(sweep.warmup + sweep.iters):
            result = None
            reset()
            barrier()
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            if i >= sweep.warmup:
                times.append(elapsed)
        report(index, times, check(result))


def _nothing() -> None:
    return None


def _worker(start: _Start, spec: Any, sweep: Sweep, rank: int, barrier, queue) -> None:
    """A worker process of one system: runs the sweep and reports each size to the parent."""
    try:
        prepare, close = start(spec, rank)
        queue.put(("ready", rank))
        _timed_sweep(sweep, lambda: barrier.wait(sweep.timeout), prepare,
                     lambda i, times, wrong: queue.put(("size", rank, i, times, wrong)))
        close()
        queue.put(("done", rank))
    except BaseException as e:  # noqa: BLE001 -- everything goes to the parent, which decides
        _fail(e, rank, barrier, queue)


def _fail(e: BaseException, rank: int, barrier, queue) -> NoReturn:
    """A worker's end after ``e``: the error to the parent (secondary: a barrier another process broke), the
    barrier broken for the others, exit status 1."""
    secondary = isinstance(e, threading.BrokenBarrierError)
    text = f"{type(e).__name__}: {e}" if str(e) else traceback.format_exc(limit=3).strip()
    queue.put(("error", rank, f"process {rank}: {text}", secondary))
    with contextlib.suppress(Exception):
        barrier.abort()
    raise SystemExit(1) from None


@dataclasses.dataclass(frozen=True)
class _XreduceSpec:
    sweep: Sweep
    devices: tuple[tuple[str, ...], ...]
    """Each process's device names."""
    root: str
    transport: str
    num_packs: int = 1


def _xreduce_start(spec: _XreduceSpec, rank: int) -> tuple[Callable, Callable]:
    import xreduce
    from xreduce import distribute, distribution

    if spec.sweep.processes > 1:
        distribution.initialize(num_processes=spec.sweep.processes, process_id=rank)

    sweep = spec.sweep
    # In a job, the job's names of this process's devices (on node 1 its daemon's CPU:0 is the job's cpu:k).
    names = distribution.process_info().local_devices if spec.sweep.processes > 1 else spec.devices[rank]
    first = rank * sweep.devices  # global index of this process's first device
    values = oracle.inputs(sweep)
    dtype = numpy_dtype(sweep.dtype)
    shared = spec.transport in ("shm", "auto") and hasattr(xreduce, "shared_array")
    ops = distribute.HierarchicalCopyAllReduce(num_packs=spec.num_packs)

    def alloc(count: int, fill: float) -> np.ndarray:
        a = xreduce.shared_array((count,), dtype) if shared else np.empty(count, dtype)
        a[...] = fill
        return a

    def prepare_workload():
        # Each device's gradients are views of one buffer, as a framework's gradient arena (and DDP's
        # bucket views) keeps them: in shared memory for the shm transport, so they travel without a copy.
        per_device = [_views(oracle.workload_inputs(sweep, first + i), alloc) for i in range(len(names))]
        values = [distribute.PerReplica(list(tensors), devices=names) for tensors in zip(*per_device)]
        pairs = [(v, v) for v in values]

        def run():
            return ops.batch_reduce(sweep.reduce_op, pairs)

        def check(results) -> int:
            return oracle.workload_wrong([r.values if isinstance(r, distribute.DistributedValues) else (r,)
                                          for r in results], sweep)

        return _nothing, run, check

    def prepare(size: int):
        if sweep.workload is not None:
            return prepare_workload()
        inputs = [alloc(sweep.count(size), values[first + i]) for i in range(len(names))]
        value = distribute.PerReplica(inputs, devices=names)
        if sweep.op == "all_reduce":
            def run():
                return ops.batch_reduce(sweep.reduce_op, [(value, value)])[0]
        elif sweep.op == "reduce":
            def run():
                return ops.reduce(sweep.reduce_op, value, spec.root)
        else:
            source = inputs[0] if rank == 0 else None

            def run():
                return ops.broadcast(source, list(names))

        def check(result) -> int:
            arrays = result.values if isinstance(result, distribute.DistributedValues) else (result,)
            return oracle.wrong_elements(arrays, sweep)

        return _nothing, run, check

    def close() -> None:
        ops.close()
        distribution.shutdown()

    return prepare, close


def _views(tensors: Sequence[np.ndarray], alloc: Callable[[int, float], np.ndarray]) -> list[np.ndarray]:
    """``tensors`` copied into one buffer from ``alloc(elements, fill)``, each at a 64-byte aligned offset;
    the views of it, in order."""
    align = max(1, 64 // tensors[0].dtype.itemsize)
    offsets, at = [], 0
    for t in tensors:
        at += -at % align
        offsets.append(at)
        at += t.size
    flat = alloc(max(at, 1), 0)
    views = []
    for t, start in zip(tensors, offsets):
        view = flat[start:start + t.size].reshape(t.shape)
        view[...] = t
        views.append(view)
    return views


# --------------------------------------------------------------------------- in the parent


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the children started inside the block."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _python_path() -> str:
    """PYTHONPATH for children: where this SDK and the daemon come from (a checkout works uninstalled)."""
    paths = []
    for name in ("xreduce", "xreduced", "xreduce_bench"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            paths.append(os.path.dirname(os.path.dirname(spec.origin)))
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(paths))


def _popen(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` of a child that imports this SDK or the daemon (see :func:`_python_path`)."""
    with _environ({"PYTHONPATH": _python_path()}):
        return subprocess.Popen(command, **kwargs)


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """Waits ``grace`` seconds for a child that was asked to exit, then kills it."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _collect(system: SystemResult, messages: queue_mod.Queue, senders: int, alive: Callable[[], str | None],
             sweep: Sweep, reporter: _Reporter, on_message: Callable[[tuple], None] | None = None) -> None:
    """Gathers the workers' reports into rows until all are done; raises BenchError
    on a worker's error or death, or when nothing arrives for ``sweep.timeout``.

    A message of another kind than those of :func:`_worker` goes to ``on_message``, if given."""
    pending: dict[int, list[tuple[list[float], int | None]]] = {}
    done, secondary = 0, None
    deadline = time.monotonic() + sweep.timeout
    while done < senders:
        try:
            message = messages.get(timeout=0.2)
        except queue_mod.Empty:
            dead = alive()
            if dead or time.monotonic() > deadline:
                # a dying worker's last words may still be on their way
                with contextlib.suppress(queue_mod.Empty):
                    message = messages.get(timeout=1.0)
                    if message[0] == "error" and not message[3]:
                        raise BenchError(message[2]) from None
                raise BenchError(secondary or dead or f"no progress for {sweep.timeout:g}s (--timeout)") from None
            continue
        deadline = time.monotonic() + sweep.timeout
        kind = message[0]
        if kind == "header":
            system.about = message[1]
            reporter.header(system)
        elif kind == "error":
            if not message[3]:
                raise BenchError(message[2])
            secondary = secondary or message[2]
        elif kind == "done":
            done += 1
        elif kind == "size":
            _, _, index, times, wrong = message
            pending.setdefault(index, []).append((times, wrong))
            if len(pending[index]) == senders:
                reports = pending.pop(index)
                slowest = [max(column) for column in zip(*(t for t, _ in reports))]
                wrongs = [w for _, w in reports if w is not None]
                size = sweep.sizes[index]
                row = Row(size, sweep.count(size), slowest, sum(wrongs) if wrongs else None)
                system.rows.append(row)
                reporter.row(system, row)
        elif on_message is not None:
            on_message(message)


def _run_pool(system: SystemResult, start: _Start, spec: Any, processes: int, envs: Sequence[dict[str, str]],
              sweep: Sweep, reporter: _Reporter, worker: Callable = _worker,
              on_message: Callable[[tuple], None] | None = None) -> None:
    """Runs ``processes`` spawned workers of one system and collects their rows.

    Each runs ``worker(start, spec, sweep, rank, barrier, queue)`` (default :func:`_worker`); messages
    :func:`_collect` does not know go to ``on_message``."""
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    barrier = ctx.Barrier(processes)
    procs = []
    finished = False
    try:
        for rank in range(processes):
            with _environ({"PYTHONPATH": _python_path(), **envs[rank]}):
                proc = ctx.Process(target=worker, args=(start, spec, sweep, rank, barrier, messages), daemon=True,
                                   name=f"xreduce-bench-{system.name.replace(' ', ':')}-{rank}")
                proc.start()
            procs.append(proc)

        def alive() -> str | None:
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0):
                    return f"process {rank} exited with status {p.exitcode}"
            return None

        _collect(system, messages, processes, alive, sweep, reporter, on_message)
        finished = True
    finally:
        for p in procs:  # after a failure the others may wait in a collective: stop them at once
            p.join(10 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join(5)
        messages.close()


_groups = itertools.count()


def _run_xreduce(system: SystemResult, sweep: Sweep, address: str, names: list[str], reporter: _Reporter,
                 num_packs: int = 1) -> None:
    """Runs one xreduce transport (``system.transport``) with ``sweep.processes`` workers on the daemon's
    ``names``, ``HierarchicalCopyAllReduce(num_packs=num_packs)``."""
    transport = system.transport
    per_process = tuple(tuple(names[p * sweep.devices:(p + 1) * sweep.devices]) for p in range(sweep.processes))
    spec = _XreduceSpec(sweep, per_process, per_process[0][0], transport, num_packs)
    envs = xreduce_envs(address, per_process, transport)
    reporter.header(system)
    _run_pool(system, _xreduce_start, spec, sweep.processes, envs, sweep, reporter)


def xreduce_envs(address: str, per_process: Sequence[Sequence[str]], transport: str = "auto") -> list[dict[str, str]]:
    """The environment of each xreduce worker of one job: its daemon, its transport, a group of its own
    (a new name each call) and its devices.

    Example:
        >>> envs = xreduce_envs("unix:/tmp/x.sock", [["cpu:0"], ["cpu:1"]], "shm")
        >>> envs[1]["XREDUCE_LOCAL_DEVICES"], envs[0]["XREDUCE_GROUP"] == envs[1]["XREDUCE_GROUP"]
        ('cpu:1', True)
    """
    group = f"xreduce-bench-{os.getpid()}-{transport}-{next(_groups)}"
    return [{"XREDUCE_ADDRESS": address, "XREDUCE_TRANSPORT": transport, "XREDUCE_GROUP": group,
             "XREDUCE_LOCAL_DEVICES": ",".join(devices)} for devices in per_process]
