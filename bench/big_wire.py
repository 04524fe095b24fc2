"""One big tensor over the wire from one process: streamed in chunks, the daemon's memory bounded.

Starts ``xreduced`` (2 host devices, a unix socket), then in this process
all-reduces ``t`` on both devices (``PerReplica([t, t])``, the same array
twice: the tensor's memory once) to ``CPU:0`` with ``transport="wire"`` and
``out=t``; checks every element of the result (2 x the value); reports the
time and the daemon's peak resident memory (sampled every 20 ms), which stays
near one chunk's whatever the tensor's size:

    python bench/big_wire.py --size 8GiB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from xreduce_bench.daemon_memory import MemoryWatch

BLOCK = 1 << 22
"""Elements filled and checked at once."""


def main(argv: list[str] | None = None) -> int:
    from xreduced.config import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_bytes, default=parse_bytes("8GiB"), help="bytes of the tensor (8GiB)")
    args = p.parse_args(argv)
    from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica

    with tempfile.TemporaryDirectory(prefix="xreduce-big-wire-") as tmp:
        address = f"unix:{tmp}/xreduced.sock"
        daemon = subprocess.Popen([sys.executable, "-m", "xreduced", "--listen", address, "--virtual-devices", "2"],
                                  stderr=subprocess.DEVNULL)
        try:
            ops = HierarchicalCopyAllReduce(address=address, transport="wire")
            deadline = time.monotonic() + 30
            while not os.path.exists(f"{tmp}/xreduced.sock") and time.monotonic() < deadline:
                time.sleep(0.05)
            ops.client.list_devices()
            t = np.empty(args.size // 4, np.float32)
            pattern = np.arange(BLOCK, dtype=np.float32) % 1024
            for at in range(0, t.size, BLOCK):
                part = t[at:at + BLOCK]
                part[:] = pattern[:part.size]
            with MemoryWatch(daemon.pid, period=0.02) as watch:
                start = time.perf_counter()
                result = ops.reduce("sum", PerReplica([t, t], devices=["CPU:0", "CPU:1"]), "CPU:0", out=t)
                took = time.perf_counter() - start
            wrong = sum(int(np.count_nonzero(t[at:at + BLOCK] != 2 * pattern[:min(BLOCK, t.size - at)]))
                        for at in range(0, t.size, BLOCK))
            print(f"{args.size / (1 << 30):g} GiB over the wire from one process: {took:.1f} s "
                  f"({args.size / (1 << 30) / took:.2f} GiB/s of tensor), result is out: {result is t}, "
                  f"#wrong {wrong}; the daemon's RSS {watch.idle['VmRSS'] / 1024:.0f} MiB idle, "
                  f"{watch.peak['VmRSS'] / 1024:.0f} MiB at its peak")
            ops.close()
            return 0 if wrong == 0 else 1
        finally:
            daemon.terminate()
            daemon.wait(30)


if __name__ == "__main__":
    sys.exit(main())
