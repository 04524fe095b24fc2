"""Keras ``model.fit`` on ``xreduce.tensorflow.MirroredStrategy``: one process or several, one daemon.

The training script is a plain Keras one; the only xreduce lines are ``initialize`` (with
several processes) and the strategy::

    xreduce.distribution.initialize(num_processes=P, process_id=p)   # several processes only
    strategy = xreduce.tensorflow.MirroredStrategy()                  # was: tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([...]); model.compile(...)
    model.fit(x, y, batch_size=GLOBAL_BATCH)                           # the same global data in every process

Each process runs ``--replicas`` replicas on logical CPUs. The launcher runs the job, then TF's own
``MirroredStrategy`` over all the job's replicas in one process (``--reference``, no daemon), and checks
that every process ends with those weights, bit for bit::

    python examples/keras_fit.py --embedded                  # a daemon, 1 process of 2 replicas
    python examples/keras_fit.py --embedded --processes 2    # a daemon, 2 processes of 2 replicas
    python examples/keras_fit.py --process-id 1 --processes 2   # one worker, by hand (XREDUCE_ADDRESS)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
from custom_training_loop import embedded_daemon, run  # the same job runner and daemon

TF_NOTICES = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",)
"""What TensorFlow writes to stderr when it starts on some CPUs whatever TF_CPP_MIN_LOG_LEVEL says (with its
``port.cc`` oneDNN notice): left out of the processes' output."""


def tensorflow(replicas: int):
    """TensorFlow with ``replicas`` logical CPUs, quiet. Grappler's arithmetic optimizer is off so that TF's own
    all-reduce at 4+ replicas adds in the hierarchical copy's order, as the daemon does (docs/tensorflow.md)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    return tf


def data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The global data, the same in every process: y = sin(x @ a) + noise."""
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.rows, 16)).astype(np.float32)
    a = rng.standard_normal((16, 1)).astype(np.float32)
    return x, (np.sin(x @ a) + 0.1 * rng.standard_normal((args.rows, 1))).astype(np.float32)


def fit(args: argparse.Namespace, strategy, keras) -> None:
    x, y = data(args)
    with strategy.scope():
        keras.utils.set_random_seed(args.seed)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    history = model.fit(x, y, batch_size=args.global_batch, epochs=args.epochs, shuffle=False, verbose=0)
    for epoch, loss in enumerate(history.history["loss"]):
        print(f"epoch {epoch}  loss {loss:.6f}", flush=True)
    name = "reference" if args.reference else f"p{args.process_id}"
    np.savez(os.path.join(args.out_dir, f"{name}.npz"), *model.get_weights())


def worker(args: argparse.Namespace) -> None:
    tf = tensorflow(args.replicas)
    import keras
    import xreduce
    import xreduce.tensorflow

    if args.processes > 1:
        xreduce.distribution.initialize(num_processes=args.processes, process_id=args.process_id)
    strategy = xreduce.tensorflow.MirroredStrategy()
    print(f"process {args.process_id} of {args.processes}: {strategy.num_replicas_in_sync} replicas in sync, "
          f"{len(strategy.extended.worker_devices)} here", flush=True)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    fit(args, strategy, keras)


def reference(args: argparse.Namespace) -> None:
    """TF's own MirroredStrategy over all the job's replicas, in this one process; no daemon."""
    tf = tensorflow(args.replicas)
    import keras

    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    fit(args, tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()),
        keras)


def launch(args: argparse.Namespace) -> int:
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("replicas", "epochs", "rows", "global_batch",
                                                                        "seed")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XREDUCE_GROUP", f"keras-fit-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="xreduce-") as tmp:
        with embedded_daemon(args, env, tmp):
            outputs = run([sys.executable, __file__, *common, "--worker", f"--processes={args.processes}",
                           f"--out-dir={tmp}"], env, args.processes, args.timeout)
        total = args.replicas * args.processes
        [(code, _)] = run([sys.executable, __file__, *common, f"--replicas={total}", "--reference",
                           f"--out-dir={tmp}"], env, 1, args.timeout)
        for p, (_, out) in enumerate(outputs):
            for line in out.splitlines():
                if not line.startswith(TF_NOTICES) and "port.cc" not in line:
                    print(f"[p{p}] {line}")
        failed = [f"p{p} exited {rc}" for p, (rc, _) in enumerate(outputs) if rc != 0]
        if failed or code != 0:
            print(f"FAIL: {', '.join(failed) or f'the reference exited {code}'}")
            return 1
        with np.load(f"{tmp}/reference.npz") as ref:
            want = [ref[k].tobytes() for k in ref.files]
        for p in range(args.processes):
            with np.load(f"{tmp}/p{p}.npz") as w:
                if [w[k].tobytes() for k in w.files] != want:
                    print(f"FAIL: p{p}'s weights differ from TF's own MirroredStrategy over {total} replicas")
                    return 1
    print(f"OK: {args.processes} process(es) x {args.replicas} replicas end with the weights of TF's own "
          f"MirroredStrategy over {total} replicas in one process, bit for bit")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=1, help="processes in the job (default 1)")
    p.add_argument("--process-id", type=int, help="run as this worker of --processes")
    p.add_argument("--worker", action="store_true", help="run as the job's only worker (with --processes 1)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (logical CPUs) per process (default 2)")
    p.add_argument("--reference", action="store_true", help="TF's own MirroredStrategy in this process, no daemon")
    p.add_argument("--embedded", action="store_true", help="start a daemon subprocess for the job first")
    p.add_argument("--virtual-devices", type=int, default=8, help="the embedded daemon's devices (default 8)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=640, help="rows of the global data")
    p.add_argument("--global-batch", type=int, default=64, help="rows per step over all replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=".", help="where a worker writes its weights (pN.npz, reference.npz)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds each run may take (launcher)")
    args = p.parse_args()
    if args.reference:
        reference(args)
    elif args.process_id is not None or args.worker:
        args.process_id = args.process_id or 0
        worker(args)
    else:
        return launch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
