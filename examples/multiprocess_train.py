"""Multi-process data-parallel training: P processes, one all-reduce over all their devices.

Each process joins the job (``xreduce.distribution.initialize``), gets its share
of the daemon's devices and runs one replica per device through
``MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())``. Every
replica draws its own shard of each step's batch from the shared seed and its
global replica id; the gradients of a linear regression are all-reduced (MEAN)
across every process, and so is the loss. Each process prints, per step, the
global loss and a checksum of its weights and bias (sha256 of their float32 bytes); the
launcher checks they are identical in every process at every step.

    python examples/multiprocess_train.py --embedded             # starts a daemon and 4 workers
    xreduced &  python examples/multiprocess_train.py --processes 2   # XREDUCE_ADDRESS or the default
    python examples/multiprocess_train.py --process-id 1 --processes 2  # one worker, by hand
      (or KERAS_DISTRIBUTION_PROCESS_ID=1 KERAS_DISTRIBUTION_NUM_PROCESSES=2 ... with no flags)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
import xreduce
from xreduce import distribution
from xreduce.distribute import DistributedValues, HierarchicalCopyAllReduce, MirroredStrategy, ReduceOp

STEP = re.compile(r"^step +(\d+) +loss (\S+) +weights ([0-9a-f]{16})$", re.M)


def local(value):
    """This process's copy of a reduced value (a plain array when it has one device)."""
    return value.values[0] if isinstance(value, DistributedValues) else value


def train(args: argparse.Namespace) -> None:
    """Worker: joins the job, trains ``y = X @ w_true + 0.5`` and prints loss and checksum per step."""
    info = distribution.initialize(num_processes=args.processes, process_id=args.process_id)
    strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
    n = strategy.num_replicas_in_sync
    local_devices = [xreduce.DeviceName.parse(d).short for d in strategy.extended.worker_devices]
    print(f"process {info.process_id} of {info.num_processes}: replicas {n}, local {', '.join(local_devices)}")
    w_true = np.random.default_rng(args.seed).standard_normal(args.features).astype(np.float32)
    weights, bias = np.zeros(args.features, np.float32), np.float32(0.0)

    def shard(ctx, step):  # this replica's rows of the step's global batch, the same in any process layout
        rng = np.random.default_rng([args.seed, step, ctx.replica_id_in_sync_group])
        x = rng.standard_normal((args.batch, args.features)).astype(np.float32)
        return x, x @ w_true + np.float32(0.5)

    def replica_step(data, w, b):
        x, y = data
        err = x @ w + b - y
        grad_w = ((2.0 / len(y)) * x.T @ err).astype(np.float32)
        return grad_w, np.float32(2.0 * err.mean()), np.float32((err**2).mean())

    here = list(strategy.extended.worker_devices)  # reduced values land on this process's devices
    for step in range(args.steps):
        data = strategy.experimental_distribute_values_from_function(lambda ctx, s=step: shard(ctx, s))
        grad_w, grad_b, loss = strategy.run(replica_step, args=(data, weights, bias))
        reduced_w, reduced_b = strategy.extended.batch_reduce_to(
            ReduceOp.MEAN, [(grad_w, here), (grad_b, here)])
        weights = weights - np.float32(args.lr) * local(reduced_w)
        bias = np.float32(bias - np.float32(args.lr) * local(reduced_b))
        global_loss = float(strategy.reduce(ReduceOp.MEAN, loss, axis=None))
        checksum = hashlib.sha256(weights.tobytes() + bias.tobytes()).hexdigest()[:16]
        print(f"step {step:3d}  loss {global_loss:<11.9g} weights {checksum}", flush=True)
    distribution.shutdown()


def start_daemon(tmp: str, virtual_devices: int, timeout: float) -> tuple[subprocess.Popen, str, str]:
    """Starts ``python -m xreduced`` on a unix socket; returns it, its address and its log file."""
    log = os.path.join(tmp, "xreduced.log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "xreduced", "--listen", f"unix:{tmp}/xreduced.sock",
                                 "--virtual-devices", str(virtual_devices)], stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log) as f:
            m = re.search(r"event=serving address=(\S+)", f.read())
        if m:
            return proc, m.group(1), log
        time.sleep(0.05)
    proc.kill()
    with open(log) as f:
        raise RuntimeError(f"xreduced did not start within {timeout}s:\n{f.read()}")


def run_workers(args: argparse.Namespace, address: str | None, tmp: str) -> list[tuple[int | None, str]]:
    """Runs the P workers (bounded by --timeout); on a failure kills the rest. Returns (status, output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XREDUCE_GROUP", f"multiprocess-train-{os.getpid()}")  # jobs may share a daemon
    if address:
        env["XREDUCE_ADDRESS"] = address
    outs = [open(os.path.join(tmp, f"p{p}.out"), "w+") for p in range(args.processes)]
    common = [f"--{k}={getattr(args, k)}" for k in ("processes", "steps", "seed", "batch", "features", "lr")]
    procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(p), *common],
                              stdout=outs[p], stderr=subprocess.STDOUT, env=env) for p in range(args.processes)]
    deadline = time.monotonic() + args.timeout
    while None in (codes := [p.poll() for p in procs]):
        timed_out = time.monotonic() > deadline
        if timed_out or any(codes):
            late = [i for i, c in enumerate(codes) if c is None]
            why = f"still running after {args.timeout:g}s" if timed_out else "a worker failed"
            print(f"stopping {', '.join(f'p{i}' for i in late)}: {why}")
            for i in late:
                procs[i].kill()
            break
        time.sleep(0.05)
    results = []
    for p, out in zip(procs, outs):
        p.wait(10)
        out.seek(0)
        results.append((p.returncode, out.read()))
        out.close()
    return results


def verdict(results: list[tuple[int | None, str]], steps: int) -> tuple[bool, str]:
    """Whether every worker succeeded, printed every step, agreed with the others, and the loss fell."""
    failed = [f"p{i} exited {rc}" for i, (rc, _) in enumerate(results) if rc != 0]
    if failed:
        return False, f"FAIL: {', '.join(failed)}"
    runs = [[(loss, checksum) for _, loss, checksum in STEP.findall(out)] for _, out in results]
    if any(len(r) != steps for r in runs):
        return False, f"FAIL: expected {steps} steps from each process, got {[len(r) for r in runs]}"
    for step in range(steps):
        if len({r[step] for r in runs}) != 1:
            return False, f"FAIL: processes disagree at step {step}: {[r[step] for r in runs]}"
    first, last = float(runs[0][0][0]), float(runs[0][-1][0])
    if not last < first:
        return False, f"FAIL: the loss did not fall ({first:.6g} -> {last:.6g})"
    return True, (f"OK: {len(runs)} processes agree on the loss and the weights checksum at all {steps} steps; "
                  f"loss {first:.6g} -> {last:.6g}")


def launch(args: argparse.Namespace) -> int:
    args.processes = args.processes or 4
    with tempfile.TemporaryDirectory(prefix="xreduce-") as tmp:
        daemon, address = None, None
        if args.embedded:
            daemon, address, log = start_daemon(tmp, args.virtual_devices, args.timeout)
            print(f"daemon: {address} ({args.virtual_devices} devices)")
        try:
            results = run_workers(args, address, tmp)
        finally:
            if daemon is not None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        for i, (_, out) in enumerate(results):
            for line in out.splitlines():
                print(f"[p{i}] {line}")
        ok, line = verdict(results, args.steps)
        print(line)
        if not ok and daemon is not None:
            with open(log) as f:
                print(f"daemon log:\n{f.read()}", file=sys.stderr)
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--processes", type=int, help="processes (default 4, or KERAS_DISTRIBUTION_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="run as this worker (or KERAS_DISTRIBUTION_PROCESS_ID)")
    p.add_argument("--launch", action="store_true", help="start the workers (the default without --process-id)")
    p.add_argument("--embedded", action="store_true", help="start a daemon subprocess for the job first")
    p.add_argument("--virtual-devices", type=int, default=8, help="the embedded daemon's devices (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="rows per replica per step")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the whole job may take (launcher)")
    args = p.parse_args()
    worker = args.process_id is not None or os.environ.get("KERAS_DISTRIBUTION_PROCESS_ID")
    if worker and not args.launch:
        train(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
