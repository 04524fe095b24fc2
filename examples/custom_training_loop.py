"""A TF-style custom training loop, ported by replacing ``tf.distribute`` with ``xreduce.distribute``.

The loop is the one of TF's "Custom training with tf.distribute.Strategy" guide: the
global batches go through ``strategy.experimental_distribute_dataset``; inside
``strategy.run`` each replica computes its loss scaled by the global batch size and
its gradients, and all-reduces the gradients with
``get_replica_context().all_reduce(SUM, ...)``; the loss is summed with
``strategy.reduce``. The model is a small two-layer perceptron in numpy.

Every process applies the same all-reduced gradients, so the weights stay identical
everywhere, and the loss at every step matches a single-process run on the whole
batch (``--reference``) within float32 rounding. The launcher runs the job and the
reference and checks that::

    python examples/custom_training_loop.py --embedded                 # a daemon, 1 process
    python examples/custom_training_loop.py --embedded --processes 2   # a daemon, 2 processes
    python examples/custom_training_loop.py --reference                # one process, no daemon
    python examples/custom_training_loop.py --process-id 1 --processes 2   # one worker, by hand
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
from multiprocess_train import start_daemon  # the same daemon launcher
from xreduce import distribution
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, ReduceOp, get_replica_context

STEP = re.compile(r"^step +(\d+) +loss (\S+)$", re.M)
TOLERANCE = 1e-5
"""Relative: the replicas add their partial sums in another order than one process does."""


def dataset(args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batches, the same in every process: ``y = sin(x @ a) + noise``, float32."""
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((args.features, 1)).astype(np.float32)
    batches = []
    for _ in range(args.steps):
        x = rng.standard_normal((args.global_batch, args.features)).astype(np.float32)
        y = (np.sin(x @ a) + np.float32(0.1) * rng.standard_normal((args.global_batch, 1))).astype(np.float32)
        batches.append((x, y))
    return batches


def initial_weights(args: argparse.Namespace) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(args.seed + 1)
    return {
        "w1": (rng.standard_normal((args.features, args.hidden)) / np.sqrt(args.features)).astype(np.float32),
        "b1": np.zeros(args.hidden, np.float32),
        "w2": (rng.standard_normal((args.hidden, 1)) / np.sqrt(args.hidden)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def loss_and_gradients(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                       global_batch: int) -> tuple[np.float32, dict[str, np.ndarray]]:
    """The squared error summed over these rows and divided by the global batch size (TF's
    ``compute_average_loss``), and its gradients: summed over replicas, they are the whole batch's."""
    scale = np.float32(1.0 / global_batch)
    h = np.tanh(x @ weights["w1"] + weights["b1"])
    err = h @ weights["w2"] + weights["b2"] - y
    loss = np.float32((err * err).sum() * scale)
    d_out = np.float32(2.0) * err * scale
    d_h = (d_out @ weights["w2"].T) * (np.float32(1.0) - h * h)
    return loss, {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}


def apply(weights: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
    return {k: (w - np.float32(lr) * np.asarray(grads[k], np.float32)).astype(np.float32) for k, w in weights.items()}


def train(args: argparse.Namespace) -> None:
    """Worker: the distributed loop; prints the global loss per step."""
    info = distribution.initialize(num_processes=args.processes, process_id=args.process_id)
    strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
    print(f"process {info.process_id} of {info.num_processes}: {strategy.num_replicas_in_sync} replicas in sync, "
          f"{len(strategy.extended.worker_devices)} here", flush=True)
    weights = initial_weights(args)

    def replica_step(inputs):
        x, y = inputs
        loss, grads = loss_and_gradients(weights, x, y, args.global_batch)
        grads = get_replica_context().all_reduce(ReduceOp.SUM, grads)
        return loss, grads

    with strategy.scope():
        for step, inputs in enumerate(strategy.experimental_distribute_dataset(dataset(args))):
            per_replica_loss, grads = strategy.run(replica_step, args=(inputs,))
            # Every replica holds the same all-reduced gradients: apply this process's first copy.
            weights = apply(weights, {k: strategy.experimental_local_results(g)[0] for k, g in grads.items()},
                            args.lr)
            loss = strategy.reduce(ReduceOp.SUM, per_replica_loss, axis=None)
            print(f"step {step:3d}  loss {float(loss):.9g}", flush=True)
    distribution.shutdown()


def reference(args: argparse.Namespace) -> None:
    """The same model trained in one process on each whole global batch, without xreduce."""
    weights = initial_weights(args)
    for step, (x, y) in enumerate(dataset(args)):
        loss, grads = loss_and_gradients(weights, x, y, args.global_batch)
        weights = apply(weights, grads, args.lr)
        print(f"step {step:3d}  loss {float(loss):.9g}", flush=True)


def run(command: list[str], env: dict[str, str], count: int, timeout: float) -> list[tuple[int | None, str]]:
    """Runs ``count`` copies of ``command`` (the i-th with ``--process-id i``), bounded by ``timeout``."""
    procs = [subprocess.Popen([*command, "--process-id", str(i)] if count > 1 else command, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(count)]
    results = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n(killed: still running after {timeout:g}s)"
        results.append((p.returncode, out))
    return results


def launch(args: argparse.Namespace) -> int:
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("steps", "seed", "global_batch", "features", "hidden", "lr")]
    me = [sys.executable, __file__, *common]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XREDUCE_GROUP", f"custom-training-loop-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="xreduce-") as tmp:
        with embedded_daemon(args, env, tmp):
            workers = run([*me, "--worker", f"--processes={args.processes}"], env, args.processes, args.timeout)
    [(_, expected)] = run([*me, "--reference"], env, 1, args.timeout)
    for i, (_, out) in enumerate(workers):
        for line in out.splitlines():
            print(f"[p{i}] {line}")
    ok, line = verdict(workers, expected, args.steps)
    print(line)
    return 0 if ok else 1


@contextlib.contextmanager
def embedded_daemon(args: argparse.Namespace, env: dict[str, str], tmp: str) -> Iterator[None]:
    """With ``--embedded``, a daemon of the job's own for the block (its address put in ``env``'s
    ``XREDUCE_ADDRESS``), stopped after it; without, nothing (the job uses the daemon already running)."""
    if not args.embedded:
        yield
        return
    daemon, env["XREDUCE_ADDRESS"], _ = start_daemon(tmp, args.virtual_devices, args.timeout)
    print(f"daemon: {env['XREDUCE_ADDRESS']} ({args.virtual_devices} devices)")
    try:
        yield
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


def verdict(workers: list[tuple[int | None, str]], expected: str, steps: int) -> tuple[bool, str]:
    """Whether every worker printed every step's loss, and each matches the single-process run's."""
    failed = [f"p{i} exited {rc}" for i, (rc, _) in enumerate(workers) if rc != 0]
    if failed:
        return False, f"FAIL: {', '.join(failed)}"
    want = [float(loss) for _, loss in STEP.findall(expected)]
    for i, (_, out) in enumerate(workers):
        got = [float(loss) for _, loss in STEP.findall(out)]
        if len(got) != steps or len(want) != steps:
            return False, f"FAIL: p{i} printed {len(got)} steps, the reference {len(want)}; expected {steps}"
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        if worst > TOLERANCE:
            return False, f"FAIL: p{i}'s loss is {worst:.3g} (relative) away from the single-process run's"
    return True, (f"OK: {len(workers)} process(es) match the single-process loss at all {steps} steps within "
                  f"{TOLERANCE:g} (relative); loss {want[0]:.6g} -> {want[-1]:.6g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--processes", type=int, default=1, help="processes in the job (default 1)")
    p.add_argument("--process-id", type=int, help="run as this worker of --processes")
    p.add_argument("--worker", action="store_true", help="run as the job's only worker (with --processes 1)")
    p.add_argument("--reference", action="store_true", help="train in this process alone, without xreduce")
    p.add_argument("--embedded", action="store_true", help="start a daemon subprocess for the job first")
    p.add_argument("--virtual-devices", type=int, default=8, help="the embedded daemon's devices (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=64, help="rows per step over all replicas")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each run may take (launcher)")
    args = p.parse_args()
    if args.reference:
        reference(args)
    elif args.process_id is not None or args.worker:
        train(args)
    else:
        return launch(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
