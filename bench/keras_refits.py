"""Two-process Keras jobs that call ``fit`` again and again: does any TF process die (a signal) between fits?

Each ``fit`` of ``xreduce.tensorflow.MirroredStrategy`` over several processes builds the process's share of
the global data (``xreduce.tensorflow._input``) and a new ``tf.data`` iterator, and drops the last one. While that
went through TF's ``MultiDeviceIterator``, a TF process died there now and then (SIGSEGV in its background thread,
``GetNext`` on a freed iterator, while the main thread dropped the last fit's iterator): in 7 of 10 jobs with the
kernel's fast steps. Each replica now reads through a plain ``tf.data`` iterator; this counts such deaths (0 of 20
jobs since, ``bench/results/keras-refits.txt``).

Each job is two processes (one replica each, one daemon) of ``--fits`` fits of ``--steps`` steps (MLP of 82,689
parameters, global batch 64), ``--jobs`` jobs in turn. A job whose process died of a signal is printed with the
start of its standard error (the fault handler's threads).

    python bench/keras_refits.py --jobs 20 --fits 60 > bench/results/keras-refits.txt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from xreduce_bench.daemon import DaemonProcess


def child(process_id: int, fits: int, steps: int) -> None:
    """One process of a job: ``fits`` fits, then one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()])
    import keras
    import xreduce
    import xreduce.tensorflow
    from xreduce_bench import keras_job

    xreduce.distribution.initialize(num_processes=2, process_id=process_id)
    strategy = xreduce.tensorflow.MirroredStrategy()
    x, y = keras_job.data("mlp", 64 * steps)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras_job.build(keras, "mlp")
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    for _ in range(fits):
        history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    print(json.dumps({"event": "done", "fits": fits, "loss": history.history["loss"][-1]}), flush=True)


def job(env: dict[str, str], fits: int, steps: int, timeout: float) -> tuple[list[int], list[str]]:
    """Both processes' exit statuses and standard errors."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(p), "--fits", str(fits), "--steps", str(steps)],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in range(2)]
    ended = []
    for proc in procs:
        try:
            ended.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            ended.append(proc.communicate())
    return [p.returncode for p in procs], [err for _, err in ended]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--fits", type=int, default=60, help="fits of each process of a job")
    p.add_argument("--steps", type=int, default=8, help="steps of each fit")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a job may take")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.fits, args.steps)
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", XREDUCE_STALL_WARNING_SECONDS="0", PYTHONFAULTHANDLER="1")
    print(f"# bench/keras_refits.py: {args.jobs} two-process jobs of {args.fits} fits x {args.steps} steps", flush=True)
    died = 0
    with tempfile.TemporaryDirectory(prefix="xreduce-refits-") as tmp:
        daemon = DaemonProcess(["--listen", f"unix:{tmp}/xreduced.sock", "--log-level", "WARNING"])
        env["XREDUCE_ADDRESS"] = daemon.address
        try:
            for n in range(args.jobs):
                env["XREDUCE_GROUP"] = f"refits-{n}"
                start = time.monotonic()
                codes, errors = job(env, args.fits, args.steps, args.timeout)
                signals = [signal.Signals(-c).name for c in codes if c < 0]
                died += bool(signals)
                print(f"job {n}: exit statuses {codes} in {time.monotonic() - start:.1f} s"
                      + (f": died of {', '.join(signals)}" if signals else ""), flush=True)
                for c, err in zip(codes, errors):
                    if c < 0:
                        print("  " + "\n  ".join(err.splitlines()[:40]), flush=True)
        finally:
            daemon.terminate()
    dropped = 2 * args.jobs * args.fits
    print(f"# {died} of {args.jobs} jobs had a process die of a signal ({dropped} fits in all)")
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
