"""Where a small all-reduce's time goes: the daemon's CPU per call, its threads free or sharing one core.

Starts ``xreduced`` on a unix socket twice per round: once free to run on
every core, once with all its threads confined to one core (CPU affinity set
before it starts, so every thread it makes inherits it). Each time,
``--processes`` SDK processes (free to run anywhere) all-reduce one float32
``--iters`` times over the local lane (``XREDUCE_TRANSPORT=auto``); the script
prints each run's time per all-reduce (median of the processes' means) and
the daemon's CPU per all-reduce (user + system from ``/proc/PID/stat``), then
the medians over ``--rounds`` and their ratio.

This is a diagnosis, not a setting: the daemon does not pin itself. It shows
how much of a small collective's cost is the daemon's Python moving between
cores. With a thread per lane connection (each woken where its caller ran),
confining the daemon saved 30% of its CPU; the lane now serves every
connection from one thread, and confining it changes nothing.

    $ python bench/lane_cores.py --rounds 3 --iters 4000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from lane_idle import cpu_seconds

WORKER = r"""
import os, sys, time, numpy as np
rank, n, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
from xreduce import distribute, distribution
distribution.initialize(num_processes=n, process_id=rank)
ops = distribute.HierarchicalCopyAllReduce(num_packs=1)
v = distribute.PerReplica([np.full(1, rank + 1, np.float32)], devices=[distribution.list_devices()[rank]])
for _ in range(50):
    ops.batch_reduce("SUM", [(v, v)])
start = time.perf_counter()
for _ in range(iters):
    (r,) = ops.batch_reduce("SUM", [(v, v)])
took = (time.perf_counter() - start) / iters
want = n * (n + 1) / 2
print(took, float(np.asarray(r).reshape(-1)[0]) == want, flush=True)
"""


def one_run(processes: int, iters: int, cores: set[int] | None) -> tuple[float, float]:
    """(seconds per all-reduce, the daemon's CPU seconds per all-reduce) for one daemon."""
    with tempfile.TemporaryDirectory(prefix="xreduce-lane-cores-") as tmp:
        address = f"unix:{tmp}/d.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "xreduced", "--listen", address, "--backend", "numpy",
             "--virtual-devices", str(processes), "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(f"{tmp}/d.sock.lane"):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError("the daemon did not start")
                time.sleep(0.1)
            env = {**os.environ, "XREDUCE_ADDRESS": address, "XREDUCE_TRANSPORT": "auto"}
            before = cpu_seconds(daemon.pid)
            workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(k), str(processes), str(iters)],
                                        env=env, stdout=subprocess.PIPE, text=True) for k in range(processes)]
            outputs = [w.communicate(timeout=600)[0].split() for w in workers]
            spent = cpu_seconds(daemon.pid) - before
            if any(w.returncode != 0 for w in workers) or not all(o and o[1] == "True" for o in outputs):
                raise RuntimeError(f"a worker failed or got a wrong sum: {outputs}")
            return statistics.median(float(o[0]) for o in outputs), spent / (iters + 50)
        finally:
            daemon.terminate()
            daemon.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="SDK processes, one device each")
    p.add_argument("--iters", type=int, default=4000, help="all-reduces per process and run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternating")
    p.add_argument("--core", type=int, default=None,
                   help="the core the confined daemon runs on (default: the lowest this script may use)")
    args = p.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[0] if args.core is None else args.core
    if len(allowed) < 2:
        print("needs at least 2 cores to compare", file=sys.stderr)
        return 2
    print(f"# {args.processes} processes x 1 device, 4-byte float32 all-reduce over the local lane, "
          f"{args.iters} iterations a run; cores {allowed}")
    print(f"# {'daemon':<28} {'time/all-reduce(us)':>20} {'daemon CPU/all-reduce(us)':>26}")
    runs: dict[str, list[tuple[float, float]]] = {"free": [], "one core": []}
    for _ in range(args.rounds):
        for kind, cores in (("free", None), ("one core", {core})):
            took, cpu = one_run(args.processes, args.iters, cores)
            runs[kind].append((took, cpu))
            label = "free (every core)" if cores is None else f"confined to core {core}"
            print(f"  {label:<28} {took * 1e6:>20.1f} {cpu * 1e6:>26.1f}", flush=True)
    free_t, free_c = (statistics.median(r[i] for r in runs["free"]) for i in (0, 1))
    one_t, one_c = (statistics.median(r[i] for r in runs["one core"]) for i in (0, 1))
    print(f"# medians: free {free_t * 1e6:.1f} us ({free_c * 1e6:.1f} us daemon CPU); one core "
          f"{one_t * 1e6:.1f} us ({one_c * 1e6:.1f} us daemon CPU); one core / free: time {one_t / free_t:.2f}, "
          f"daemon CPU {one_c / free_c:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
