"""A traced step that only all-reduces one gradient over 2 logical CPUs: xreduce's TF kernel, the
``tf.numpy_function`` bridge and TF's own ``HierarchicalCopyAllReduce``, in one process, timed in turn.

What a Keras step pays for its all-reduce, without the model: each way is a ``tf.function`` that runs
``strategy.run`` of ``ReplicaContext.all_reduce("sum", [gradient])`` and adds the result to a variable. The kernel
and the bridge are both ``xreduce.tensorflow.HierarchicalCopyAllReduce`` (``XREDUCE_TF_KERNEL`` off while the
bridge's step is traced). ``--rounds`` rounds of ``--steps`` steps each way, in turn; the medians of the rounds'
milliseconds per step, and their ratios to TF's; then the kernel's call in its parts (copying in, the exchange with
the daemon, copying out: ``xreduce.tensorflow._kernel.times``). A daemon is started for the run unless
``XREDUCE_ADDRESS`` is set.

    python bench/tf_allreduce_step.py --rounds 10 --steps 100 --elements 82689
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--elements", type=int, default=82689, help="float32 elements of the gradient")
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import xreduce.tensorflow
    from xreduce.tensorflow import _kernel
    from xreduce_bench.daemon import DaemonProcess

    with contextlib.ExitStack() as stack:
        if not os.environ.get("XREDUCE_ADDRESS"):
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="xreduce-tf-step-"))
            daemon = DaemonProcess(["--listen", f"unix:{tmp}/xreduced.sock", "--log-level", "WARNING"])
            stack.callback(daemon.terminate)
            os.environ["XREDUCE_ADDRESS"] = daemon.address

        def step_of(ops, kernel: bool):
            strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
            with strategy.scope():
                total = tf.Variable(tf.zeros([args.elements]))

            @tf.function
            def step():
                def fn():
                    ctx = tf.distribute.get_replica_context()
                    scale = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.5
                    total.assign_add(ctx.all_reduce("sum", [tf.ones([args.elements]) * scale])[0])

                strategy.run(fn)

            os.environ["XREDUCE_TF_KERNEL"] = "1" if kernel else "0"
            step.get_concrete_function()  # traced now, with the kernel on or off
            os.environ.pop("XREDUCE_TF_KERNEL")
            step()
            return step

        steps = {"kernel": step_of(xreduce.tensorflow.HierarchicalCopyAllReduce(), True),
                 "bridge": step_of(xreduce.tensorflow.HierarchicalCopyAllReduce(), False),
                 "tf": step_of(tf.distribute.HierarchicalCopyAllReduce(), True)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        parts = [0.0, 0.0, 0.0]  # the kernel's steps: copying in, the exchange, copying out (seconds, summed)
        for _ in range(args.rounds):
            for name, step in steps.items():
                before = _kernel.times()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
                if name == "kernel":
                    parts = [p + b - a for p, a, b in zip(parts, before, _kernel.times())]
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"# bench/tf_allreduce_step.py: {args.elements} float32 over 2 logical CPUs, {args.rounds} rounds of "
          f"{args.steps} steps each way; milliseconds per step, median of the rounds (min-max)")
    for name, v in times.items():
        print(f"{name:7s} {median[name]:7.3f} ms ({min(v):.3f}-{max(v):.3f}), {median[name] / median['tf']:.2f}x TF's")
    calls = args.rounds * args.steps
    print("kernel's call (mean): copy in {:.3f} ms, exchange with the daemon {:.3f} ms, copy out {:.3f} ms".format(
        *(p / calls * 1e3 for p in parts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
