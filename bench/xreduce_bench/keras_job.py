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

With ``--alternate-with STRATEGY`` (one process) the same model is also fitted under that strategy in this
process, and the two are timed in turn ``--alternations`` times, each turn printed as ``{"event": "round", ...}``:
a peer in the same process (``bench/keras_step.py``'s one-process comparison).

Every process builds the same model from ``--seed`` (process ``p`` adds ``p`` to it, so that
only a broadcast of the initial values makes them equal) and fits the same global data,
``--batch`` rows a step, unshuffled, with SGD and momentum (a wrong gradient scale shows).
It prints one JSON line per event on stdout (``{"event": "ready"}``, ``{"event": "fit", ...}``
with the history, the seconds per step of the timed epochs (all in, and the median step's),
``{"event": "training"}`` once the first step has run,
``{"event": "error", ...}``; with xreduce, ``prepared_calls``: the calls its bridge made as prepared batches in
Python, ``kernel_calls``: those xreduce's TF kernel made)
and writes the
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
                   help="after the first fit, fit this many epochs more and report seconds per step; then one epoch "
                        "of a quarter of the steps, for the cost of a step without the epoch's own (the slope)")
    p.add_argument("--alternate-with", choices=("tf-hcar", "tf-rtod", "xreduce-ops"), default=None,
                   help="one process only: also fit the same model under this strategy in this process, and time "
                        "the two in turn (--alternations times) after the first fits: a peer in the same process")
    p.add_argument("--alternations", type=int, default=3)
    p.add_argument("--mwms-ports", default="", help="comma-separated ports of the MWMS workers")
    p.add_argument("--profile", action="store_true",
                   help="with --timed-epochs: the seconds spent in xreduce's bridge and in its SDK calls")
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


class Profile:
    """Seconds spent in xreduce's bridge (the Python function a traced step calls: numpy in, the SDK call,
    results out) and, within it, in the SDK's calls (transport and daemon), from when :meth:`reset` was called; for
    steps that take xreduce's TF kernel instead, its calls' parts (``kernel``: copying in, the exchange with the
    daemon, copying out; :func:`xreduce.tensorflow._kernel.times`)."""

    def __init__(self):
        self.bridge = self.sdk = 0.0
        self.calls = 0
        self.kernel = (0.0, 0.0, 0.0)
        self._kernel_at = (0.0, 0.0, 0.0)
        self.installed = False

    def install(self) -> None:
        from xreduce import _ops, _prepared
        from xreduce.tensorflow import _bridge

        numpy_call, batch_reduce = _bridge.numpy_call, _ops.CrossDeviceOps.batch_reduce
        prepared_call = _prepared.PreparedBatch.__call__

        def timed_numpy_call(fn, *args, **kwargs):
            def timed(arrays):
                start = time.perf_counter()
                try:
                    return fn(arrays)
                finally:
                    self.bridge += time.perf_counter() - start
                    self.calls += 1
            return numpy_call(timed, *args, **kwargs)

        def timed_batch_reduce(ops, *args, **kwargs):
            start = time.perf_counter()
            try:
                return batch_reduce(ops, *args, **kwargs)
            finally:
                self.sdk += time.perf_counter() - start

        def timed_prepared_call(prepared, *args, **kwargs):
            start, fast = time.perf_counter(), prepared.fast_calls
            try:
                return prepared_call(prepared, *args, **kwargs)
            finally:
                if prepared.fast_calls > fast:  # else the batch_reduce it made was timed
                    self.sdk += time.perf_counter() - start

        _bridge.numpy_call = timed_numpy_call
        _ops.CrossDeviceOps.batch_reduce = timed_batch_reduce
        _prepared.PreparedBatch.__call__ = timed_prepared_call
        self.installed = True

    def reset(self) -> None:
        self.bridge = self.sdk = 0.0
        self.calls = 0
        self.kernel, self._kernel_at = (0.0, 0.0, 0.0), self._kernel_times()

    def stop(self) -> None:
        """Keeps the kernel's parts since :meth:`reset`."""
        self.kernel = tuple(b - a for a, b in zip(self._kernel_at, self._kernel_times()))

    def _kernel_times(self) -> tuple[float, float, float]:
        if not self.installed:
            return (0.0, 0.0, 0.0)
        from xreduce.tensorflow import _kernel

        return tuple(_kernel.times())

    def per_step(self, steps: int) -> dict[str, float | None]:
        """The profile's seconds per step, as a job's events carry them."""
        if not steps:
            return dict.fromkeys(("bridge_seconds_per_step", "sdk_seconds_per_step", "bridge_calls_per_step",
                                  *KERNEL_PARTS))
        return dict(bridge_seconds_per_step=self.bridge / steps, sdk_seconds_per_step=self.sdk / steps,
                    bridge_calls_per_step=self.calls / steps,
                    **{k: t / steps for k, t in zip(KERNEL_PARTS, self.kernel)})


KERNEL_PARTS = ("kernel_copy_in_seconds_per_step", "kernel_exchange_seconds_per_step",
                "kernel_copy_out_seconds_per_step")
"""The kernel's parts of a step, as a job's events name them."""


def count_prepared_calls() -> list[int]:
    """Counts the calls that take a prepared batch's path (``xreduce._prepared``) in Python; the one-item list it
    returns holds the count. Calls that xreduce's TF kernel made are counted by :func:`kernel_calls`."""
    from xreduce import _prepared

    count = [0]
    call = _prepared.PreparedBatch.__call__

    def counted(prepared, *args, **kwargs):
        fast = prepared.fast_calls
        try:
            return call(prepared, *args, **kwargs)
        finally:
            count[0] += prepared.fast_calls - fast

    _prepared.PreparedBatch.__call__ = counted
    return count


def kernel_calls(strategy: str) -> int:
    """The calls xreduce's TF kernel made in this process (``xreduce.tensorflow._kernel``), 0 for TF's own."""
    if not strategy.startswith("xreduce"):
        return 0
    from xreduce.tensorflow import _kernel

    return _kernel.calls()


def _Training(keras):
    """A callback that says ``{"event": "training"}`` once the first step has run, and keeps when each step ended."""

    class Training(keras.callbacks.Callback):
        said = False
        ends: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            if not self.said:
                self.said = True
                emit(event="training")

    return Training()


def strategy_of(args: argparse.Namespace, tf, name: str | None = None):
    """The strategy ``name`` (``--strategy`` by default)."""
    name = name or args.strategy
    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    if name == "tf-hcar":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())
    if name == "tf-rtod":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    if name == "mwms":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import xreduce.tensorflow

    if name == "xreduce-ops":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=xreduce.tensorflow.HierarchicalCopyAllReduce())
    if args.processes > 1:
        xreduce.distribution.initialize(num_processes=args.processes, process_id=args.process_id)
    return xreduce.tensorflow.MirroredStrategy()


def timed(args: argparse.Namespace, model, profile: Profile, training, x, y) -> tuple[float, float, float, int]:
    """(seconds per step of ``--timed-epochs`` epochs, the median step's, the steady step's, steps), the steady
    step being the slope between those epochs and one of a quarter of the steps; ``profile`` keeps the first's."""
    import numpy as np

    profile.reset()
    training.ends = []
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=args.timed_epochs, shuffle=False, verbose=0, callbacks=[training])
    elapsed = time.perf_counter() - start
    profile.stop()
    steps = args.timed_epochs * -(-len(x) // args.batch)
    median = float(np.median(np.diff(training.ends)))
    bridge, sdk, calls, kernel = profile.bridge, profile.sdk, profile.calls, profile.kernel
    few = max(1, args.steps // 4)
    start = time.perf_counter()
    model.fit(x[:few * args.batch], y[:few * args.batch], batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    short = time.perf_counter() - start
    slope = (elapsed / args.timed_epochs - short) / (args.steps - few)
    profile.bridge, profile.sdk, profile.calls, profile.kernel = bridge, sdk, calls, kernel
    return elapsed / steps, median, slope, steps


def alternate(args: argparse.Namespace, keras, tf, model, profile: Profile, x, y) -> None:
    """``--alternate-with``: the same model under that strategy too, in this process; then ``--alternations``
    rounds, each timing both (:func:`timed`, one epoch each) in turn, each printed as ``{"event": "round", ...}``
    (``first``: which was timed first). The order alternates, xreduce's first in even rounds and the peer's in odd
    ones (ABBA), so that a drift of the machine's speed within the process, or what one fit leaves the next,
    weighs on both alike."""
    strategy = strategy_of(args, tf, args.alternate_with)
    with strategy.scope():
        keras.utils.set_random_seed(args.seed)
        peer = build(keras, args.model)
        peer.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    peer.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    one = argparse.Namespace(**{**vars(args), "timed_epochs": 1})
    quiet = Profile()
    for r in range(args.alternations):
        if r % 2 == 0:
            mine = timed(one, model, profile, _Training(keras), x, y)
            theirs = timed(one, peer, quiet, _Training(keras), x, y)
        else:
            theirs = timed(one, peer, quiet, _Training(keras), x, y)
            mine = timed(one, model, profile, _Training(keras), x, y)
        emit(event="round", round=r, first="xreduce" if r % 2 == 0 else "peer",
             seconds_per_step=mine[0], steady_step_seconds=mine[2],
             median_step_seconds=mine[1], peer_seconds_per_step=theirs[0], peer_steady_step_seconds=theirs[2],
             peer_median_step_seconds=theirs[1], **profile.per_step(mine[3]))


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
    prepared = count_prepared_calls() if args.strategy.startswith("xreduce") else [0]
    profile = Profile()
    if args.profile and args.strategy.startswith("xreduce"):
        profile.install()
    try:
        strategy = strategy_of(args, tf)
        x, y = data(args.model, args.batch * args.steps + args.extra_rows)
        with strategy.scope():
            keras.utils.set_random_seed(args.seed + args.process_id)
            model = build(keras, args.model)
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"],
                          jit_compile=args.jit_compile)
        if args.strategy == "mwms":
            # keras-team/keras#20585: Keras 3's fit reduces its first batch with strategy.reduce, and each step's
            # scalar metrics with strategy.reduce(..., axis=0), both of which MultiWorkerMirroredStrategy refuses:
            # build from a local batch, and reduce the logged metrics per worker.
            from keras.src.backend.tensorflow import trainer

            with strategy.scope():
                model._symbolic_build(data_batch=(x[:args.batch], y[:args.batch]))
            model._maybe_symbolic_build = lambda *a, **k: None
            trainer._collective_all_reduce_multi_worker = lambda strategy: False
        training = _Training(keras)
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0,
                            callbacks=[training])
        seconds = median = slope = None
        steps = None
        if args.alternate_with:
            alternate(args, keras, tf, model, profile, x, y)
        elif args.timed_epochs:
            seconds, median, slope, steps = timed(args, model, profile, training, x, y)
        emit(event="fit", history=history.history, seconds_per_step=seconds, median_step_seconds=median,
             steady_step_seconds=slope,
             replicas=strategy.num_replicas_in_sync, parameters=model.count_params(),
             **profile.per_step(steps), prepared_calls=prepared[0],
             kernel_calls=kernel_calls(args.strategy))
        if args.out:
            np.savez(args.out, *[np.asarray(w) for w in model.get_weights()])
    except Exception as e:  # the launcher reads it
        emit(event="error", type=type(e).__name__, module=type(e).__module__, message=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
