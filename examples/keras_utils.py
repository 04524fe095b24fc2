"""keras.distribution-style data parallelism with xreduce: a tiny numpy linear model.

Lists the daemon's devices, initializes a one-process job, splits each global
batch across the devices with ``DataParallel.distribute_batch``, computes each
replica's gradients with numpy and averages them with
``DataParallel.all_reduce_gradients`` (the daemon's hierarchical copy
all-reduce), checking every step against numpy's mean of the same gradients.

    python examples/keras_utils.py --embedded       # an in-process daemon, 4 host devices
    python examples/keras_utils.py                  # the daemon at XREDUCE_ADDRESS (or the default)

Without ``--embedded`` it starts nothing; a ``KERAS_DISTRIBUTION_*`` environment
feeds ``initialize()`` as in Keras.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
import xreduce
from xreduce import distribution

TRUE_W = np.array([2.0, -3.0, 0.5])
TRUE_B = 1.0


def replica_gradients(w: np.ndarray, b: float, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of the mean squared error of ``x @ w + b`` against ``y`` on one replica's rows."""
    err = x @ w + b - y
    return 2.0 * x.T @ err / len(y), np.array(2.0 * err.mean())


def first(value):
    """One copy of an all-reduced value: a Mirrored's copies are identical (checked), one device gives an array."""
    if isinstance(value, xreduce.distribute.Mirrored):
        copies = value.values
        assert all(np.array_equal(c, copies[0]) for c in copies), "the copies of an all-reduce differ"
        return copies[0]
    return np.asarray(value)


def train(steps: int, batch: int, lr: float) -> None:
    print(f"daemon: {xreduce.resolve_address()}")
    print(f"list_devices(): {distribution.list_devices()}")
    print(f"get_device_count(): {distribution.get_device_count()}")

    info = distribution.initialize()
    print(f"initialize(): process_id={info.process_id} num_processes={info.num_processes} "
          f"daemon devices={list(info.devices)}")

    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(batch * steps, 3))
    y_all = x_all @ TRUE_W + TRUE_B + rng.normal(scale=0.01, size=batch * steps)
    w, b = np.zeros(3), 0.0

    with distribution.DataParallel().scope() as dp:
        print(f"DataParallel mesh: {dp.device_mesh} devices={dp.device_mesh.devices.tolist()}")
        print(f"distribution(): {distribution.distribution()}")
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            xs, ys = dp.distribute_batch((x_all[rows], y_all[rows]))
            if step == 0:
                print(f"global batch of {batch} rows -> rows per device {[len(v) for v in ys.values]}")
            grads = [replica_gradients(w, b, xi, yi) for xi, yi in zip(xs.values, ys.values)]
            per_replica_w = xreduce.distribute.PerReplica([g[0] for g in grads], devices=xs.devices)
            per_replica_b = xreduce.distribute.PerReplica([g[1] for g in grads], devices=xs.devices)
            mean_w, mean_b = (first(v) for v in dp.all_reduce_gradients([per_replica_w, per_replica_b], "mean"))
            gap = max(np.abs(mean_w - np.mean([g[0] for g in grads], axis=0)).max(),
                      abs(float(mean_b) - float(np.mean([g[1] for g in grads]))))
            loss = float(np.mean((x_all[rows] @ w + b - y_all[rows]) ** 2))
            print(f"step {step + 1}: loss {loss:9.5f}  grad_w {np.round(mean_w, 4)}  "
                  f"|all-reduce - numpy mean| {gap:.1e}")
            w, b = w - lr * mean_w, b - lr * float(mean_b)

    print(f"learned w={np.round(w, 3)} b={b:.3f} (true w={TRUE_W} b={TRUE_B})")
    print(f"distribution() after the scope: {distribution.distribution()}")
    distribution.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedded", action="store_true", help="run an in-process daemon (xreduce.serve_embedded)")
    parser.add_argument("--devices", type=int, default=4, help="host devices of the embedded daemon (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--batch", type=int, default=30, help="global batch size (default 30)")
    parser.add_argument("--lr", type=float, default=0.2, help="learning rate (default 0.2)")
    args = parser.parse_args(argv)
    daemon = xreduce.serve_embedded(virtual_devices=args.devices) if args.embedded else contextlib.nullcontext()
    try:
        with daemon:
            train(args.steps, args.batch, args.lr)
    except xreduce.UnavailableError as e:
        print(f"keras_utils: {e}\n(start one with `xreduced`, set XREDUCE_ADDRESS, or pass --embedded)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
