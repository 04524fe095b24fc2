"""One process of a Keras ``model.fit`` under a ``tf.distribute`` strategy: the tests' and the benchmark's job.

Usage::

    python -m xreduce_bench.keras_job --strategy xreduce --replicas 2 --steps 20 --out weights.npz

Strategies (``--strategy``):

* ``tf-hcar``, ``tf-rtod``: ``tf.distribute.MirroredStrategy`` with TF's own
  ``HierarchicalCopyAllReduce`` or ``ReductionToOneDevice`` (the oracle);
* ``xreduce-ops``: ``tf.distribute.MirroredStrategy`` with
  ``xreduce.tensorflow.HierarchicalCopyAllReduce()`` (one process);
* ``xreduce``: ``xreduce.tensorflow.MirroredStrategy()``, after
  ``xreduce.distribution.initialize(num_processes=P, process_id=p)`` when ``--processes`` > 1
  (``KERAS_DISTRIBUTION_JOB_ADDRESSES`` as the environment says);
* ``mwms``: TF's ``MultiWorkerMirroredStrategy`` (RING), one replica per process, workers at
  ``--mwms-ports`` on 127.0.0.1 (the peer of the benchmark).

Every process builds the same model from ``--seed`` (process ``p`` adds ``p`` to it, so that
only a broadcast of the initial values makes them equal) and fits the same global data,
``--batch`` rows a step, unshuffled, with SGD and momentum (a wrong gradient scale shows).
It prints one JSON line per event on stdout (``{"event": "ready"}``, ``{"event": "fit", ...}``
with the history and the steady seconds per step, ``{"event": "training"}`` once the first step has run,
``{"event": "error", ...}``) and writes the
weights to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MODELS = ("mlp", "mlp1m", "embedding")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's options (see the module)."""
    p = argparse.ArgumentParser(prog="python -m xreduce_bench.keras_job", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=("tf-hcar", "tf-rtod", "xreduce-ops", "xreduce", "mwms"), required=True)
    p.add_argument("--replicas", type=int, default=2, help="logical CPUs of this process, one replica each")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--batch", type=int, default=64, help="the global batch's rows")
    p.add_argument("--steps", type=int, default=20, help="steps of an epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--extra-rows", type=int, default=0, help="rows past the last full batch: a partial one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-arithmetic-optimization", action="store_true",
                   help="turn off Grappler's arithmetic optimizer, which reorders TF's own sums at 4+ replicas")
    p.add_argument("--jit-compile", action="store_true")
    p.add_argument("--timed-epochs", type=int, default=0,
                   help="after the first fit, fit this many epochs more and report seconds per step")
    p.add_argument("--mwms-ports", default="", help="comma-separated ports of the MWMS workers")
    p.add_argument("--out", default="", help="where to write the weights (.npz)")
    return p.parse_args(argv)


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def data(model: str, rows: int):
    """The global data: the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    if model == "embedding":
        x = rng.integers(0, 1000, (rows, 8)).astype("int32")
    else:
        x = rng.standard_normal((rows, 64)).astype("float32")
    return x, rng.standard_normal((rows, 1)).astype("float32")


def build(keras, model: str):
    """The model: an MLP of 82,689 parameters, one of about 1.07 M, or an embedding (sparse gradients)."""
    if model == "embedding":
        layers = [keras.Input((8,), dtype="int32"), keras.layers.Embedding(1000, 16),
                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)]
    else:
        width = 256 if model == "mlp" else 1000
        layers = [keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                  keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)]
    return keras.Sequential(layers)


def _Training(keras):
    """A callback that says ``{"event": "training"}`` once the first step has run."""

    class Training(keras.callbacks.Callback):
        said = False

        def on_train_batch_end(self, batch, logs=None):
            if not self.said:
                self.said = True
                emit(event="training")

    return Training()


def strategy_of(args: argparse.Namespace, tf):
    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    if args.strategy == "tf-hcar":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())
    if args.strategy == "tf-rtod":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    if args.strategy == "mwms":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import xreduce.tensorflow

    if args.strategy == "xreduce-ops":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce())
    if args.processes > 1:
        xreduce.distribution.initialize(num_processes=args.processes, process_id=args.process_id)
    return xreduce.tensorflow.MirroredStrategy()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.strategy == "mwms":
        ports = args.mwms_ports.split(",")
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": args.process_id}})
    import numpy as np
    import tensorflow as tf

    if args.strategy != "mwms":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    if args.no_arithmetic_optimization:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    import keras

    emit(event="ready", pid=os.getpid())
    try:
        strategy = strategy_of(args, tf)
        x, y = data(args.model, args.batch * args.steps + args.extra_rows)
        with strategy.scope():
            keras.utils.set_random_seed(args.seed + args.process_id)
            model = build(keras, args.model)
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"],
                          jit_compile=args.jit_compile)
        if args.strategy == "mwms":  # keras-team/keras#20585: MWMS needs a built model and local metrics
            model(x[:1])
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0,
                            callbacks=[_Training(keras)])
        seconds = None
        if args.timed_epochs:
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch, epochs=args.timed_epochs, shuffle=False, verbose=0)
            seconds = (time.perf_counter() - start) / (args.timed_epochs * -(-len(x) // args.batch))
        emit(event="fit", history=history.history, seconds_per_step=seconds,
             replicas=strategy.num_replicas_in_sync, parameters=model.count_params())
        if args.out:
            np.savez(args.out, *[np.asarray(w) for w in model.get_weights()])
    except Exception as e:  # the launcher reads it
        emit(event="error", type=type(e).__name__, module=type(e).__module__, message=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
