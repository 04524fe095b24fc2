"""The Python work of a small all-reduce, counted: bytecode instructions per all-reduce, not seconds.

On a shared 2-core VM a 4-byte all-reduce's time moves by 20% from one run to
the next; the work behind it does not. This script runs the daemon in this
process (its lane thread traced) and ``--processes`` SDK processes (each
tracing itself) that all-reduce one float32 ``--iters`` times over the local
lane, after a warm-up, and prints the Python instructions executed per
all-reduce in the daemon's lane thread and per call in process 0, with the
functions that execute the most. Work done in C (protobuf, numpy, system
calls) is not counted: compare counts of one tree against another, not
counts against seconds.

    $ python bench/lane_work.py --iters 300
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import collections, sys, numpy as np
rank, n, iters, top = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from xreduce import distribute, distribution
distribution.initialize(num_processes=n, process_id=rank)
ops = distribute.HierarchicalCopyAllReduce(num_packs=1)
v = distribute.PerReplica([np.full(1, rank + 1, np.float32)], devices=[distribution.list_devices()[rank]])
for _ in range(50):
    ops.batch_reduce("SUM", [(v, v)])
print("ready", flush=True)
sys.stdin.readline()  # the parent counts from now
counts = collections.Counter()
def trace(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        counts[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
    return trace
sys.settrace(trace)
for _ in range(iters):
    (r,) = ops.batch_reduce("SUM", [(v, v)])
sys.settrace(None)
assert float(np.asarray(r).reshape(-1)[0]) == n * (n + 1) / 2
if rank == 0:
    print(f"SDK process 0: {sum(counts.values()) / iters:.0f} instructions per call")
    for name, c in counts.most_common(top):
        print(f"  {c / iters:7.0f}  {name}")
"""


class _Tracer:
    """Counts instructions by function in the threads it is set in, while ``on``."""

    def __init__(self):
        self.on = False
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if self.on and event == "opcode":
            self.counts[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
        return self


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--top", type=int, default=12, help="functions shown per side")
    args = p.parse_args(argv)

    from xreduced import cli, lane
    from xreduced.config import Config
    from xreduced.server import Daemon

    tracer = _Tracer()
    loop = lane.LocalLane._loop

    def traced_loop(self):
        sys.settrace(tracer)
        loop(self)

    lane.LocalLane._loop = traced_loop  # the lane's thread starts traced; nothing else in the daemon is
    with tempfile.TemporaryDirectory(prefix="xreduce-lane-work-") as tmp:
        with open(os.path.join(tmp, "xreduced.log"), "w") as log:
            configure = getattr(cli, "configure_logging", None)  # a tree from before it existed: plain logging
            if configure is not None:
                configure("INFO", log)  # as the daemon's own process does: every call is logged
            else:
                logging.basicConfig(level="INFO", stream=log, format="%(asctime)s %(levelname)s %(name)s %(message)s")
            daemon = Daemon(Config(listen=f"unix:{tmp}/d.sock", virtual_devices=args.processes)).start()
            try:
                env = dict(os.environ, XREDUCE_ADDRESS=f"unix:{tmp}/d.sock", XREDUCE_TRANSPORT="auto")
                procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(args.processes),
                                           str(args.iters), str(args.top)], env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True) for rank in range(args.processes)]
                for proc in procs:  # warmed up, untraced
                    if proc.stdout.readline().strip() != "ready":
                        raise SystemExit("lane_work: a worker failed to start")
                tracer.on = True
                for proc in procs:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                outputs = [proc.communicate(timeout=600)[0] for proc in procs]
                tracer.on = False
            finally:
                daemon.stop(1)
    per = args.iters
    print(f"daemon lane thread: {sum(tracer.counts.values()) / per:.0f} instructions per all-reduce "
          f"({args.processes} processes x 1 float32)")
    for name, c in tracer.counts.most_common(args.top):
        print(f"  {c / per:7.0f}  {name}")
    print(outputs[0], end="")
    return 0 if all(proc.returncode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
