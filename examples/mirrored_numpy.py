"""Data-parallel linear regression in numpy with MirroredStrategy + HierarchicalCopyAllReduce.

Each replica computes the gradient of its shard of the batch; the daemon
all-reduces the gradients (MEAN) with TF's hierarchical copy; every replica
applies the same update. The loss is printed per step and falls.

    xreduced &                                # or: python examples/mirrored_numpy.py --embedded
    python examples/mirrored_numpy.py --steps 10
"""

from __future__ import annotations

import argparse
import contextlib

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
import xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, ReduceOp


def train(steps: int, batch: int, features: int, lr: float, seed: int) -> list[float]:
    """Trains ``y = X @ w_true + b`` over every daemon device; returns the losses."""
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(features).astype(np.float32)
    strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce(num_packs=2))
    n = strategy.num_replicas_in_sync
    print(f"replicas: {n} on {', '.join(xreduce.DeviceName.parse(d).short for d in strategy.extended.worker_devices)}")
    weights = np.zeros(features, np.float32)
    bias = np.float32(0.0)
    losses = []
    for step in range(steps):
        x = rng.standard_normal((batch, features)).astype(np.float32)
        y = x @ w_true + np.float32(0.5)
        x_parts, y_parts = np.array_split(x, n), np.array_split(y, n)
        shards = strategy.experimental_distribute_values_from_function(
            lambda ctx, xs=x_parts, ys=y_parts: (xs[ctx.replica_id_in_sync_group], ys[ctx.replica_id_in_sync_group]))

        def replica_step(shard, w=weights, b=bias):
            xs, ys = shard
            err = xs @ w + b - ys
            grad_w = (2.0 / len(ys)) * xs.T @ err
            grad_b = np.float32(2.0 * err.mean())
            return grad_w.astype(np.float32), grad_b, np.float32((err**2).mean())

        grad_w, grad_b, loss = strategy.run(replica_step, args=(shards,))
        reduced_w, reduced_b = strategy.extended.batch_reduce_to(
            ReduceOp.MEAN, [(grad_w, grad_w), (grad_b, grad_b)])
        weights = weights - np.float32(lr) * reduced_w.values[0]
        bias = np.float32(bias - lr * reduced_b.values[0])
        losses.append(float(strategy.reduce(ReduceOp.MEAN, loss, axis=None)))
        print(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embedded", action="store_true", help="start an in-process daemon (8 host devices)")
    args = p.parse_args()
    ctx = xreduce.serve_embedded() if args.embedded else contextlib.nullcontext()
    with ctx:
        losses = train(args.steps, args.batch, args.features, args.lr, args.seed)
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
