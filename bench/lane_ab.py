"""Two versions of a 4-byte all-reduce over the local lane (or one against the gRPC echo), in turns.

A 2-core VM's speed drifts by 20% within minutes, so two systems timed one
after the other compare the machine's moods as much as the systems. This
script keeps both alive and times them in alternating blocks: each side is a
daemon started from a source tree (a checkout with ``server/`` and
``client/``), or ``echo``, the raw grpcio echo server ``xreduce bench --echo``
compares with; each side has its own 2 processes, which all-reduce one float32
through the SDK (transport ``auto``: the lane) after a barrier, as ``xreduce
bench`` does. Per block, the slower process's time per iteration; it prints
each side's median and the median of the per-block ratios A/B, with their
quartiles. ``--both-orders`` runs again with B started first and prints the
geometric mean of the two ratios (the side started first is a few percent
slower on this machine).

    $ python bench/lane_ab.py . echo --blocks 30
    $ python bench/lane_ab.py . ../before --both-orders
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

ECHO = "echo"
_BENCH = os.path.dirname(os.path.abspath(__file__))


def _xreduce_side(root: str, address: str, rank: int, barrier, go, out) -> None:
    sys.path[:0] = [os.path.join(root, "server"), os.path.join(root, "client")]
    os.environ.update(XREDUCE_ADDRESS=address, XREDUCE_TRANSPORT="auto", XREDUCE_GROUP="lane-ab")
    import numpy as np
    from xreduce import distribute, distribution

    distribution.initialize(num_processes=2, process_id=rank)
    ops = distribute.HierarchicalCopyAllReduce(num_packs=1)
    value = distribute.PerReplica([np.full(1, rank + 1, np.float32)], devices=[distribution.list_devices()[rank]])

    def run():
        (result,) = ops.batch_reduce("SUM", [(value, value)])
        return float(np.asarray(result).reshape(-1)[0]) == 3.0

    _serve_blocks(run, barrier, go, out, rank)


def _echo_side(address: str, rank: int, barrier, go, out) -> None:
    import grpc

    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=60)
    echo = channel.unary_unary("/xreduce.bench.Echo/Echo")
    payload = bytes(4)
    _serve_blocks(lambda: echo(payload, timeout=60) == payload, barrier, go, out, rank)


def _serve_blocks(run, barrier, go, out, rank: int) -> None:
    for _ in range(50):
        barrier.wait()
        run()
    out.put(("ready", rank, None))
    while (iters := go.get()) > 0:
        times, right = [], True
        for _ in range(iters):
            barrier.wait()
            start = time.perf_counter()
            right = run() and right
            times.append(time.perf_counter() - start)
        out.put(("times" if right else "wrong", rank, times))


class _Side:
    """One side: its server (a daemon or the echo) and its 2 processes."""

    def __init__(self, spec: str, index: int, tmp: str, ctx):
        self.name = spec
        sock = os.path.join(tmp, f"side{index}.sock")
        if spec == ECHO:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([_BENCH, *sys.path]))
            self.server = subprocess.Popen([sys.executable, "-m", "xreduce_bench.peers", "echo-server",
                                            f"unix:{sock}", "4"], env=env, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
            self.server.stdout.readline()  # "serving ..."
            target, args = _echo_side, (f"unix:{sock}",)
        else:
            root = os.path.abspath(spec)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "server"),
                                                               os.path.join(root, "client")]))
            self.server = subprocess.Popen([sys.executable, "-m", "xreduced", "--listen", f"unix:{sock}",
                                            "--virtual-devices", "2"], env=env, stdin=subprocess.DEVNULL,
                                           stderr=open(os.path.join(tmp, f"side{index}.log"), "w"))
            deadline = time.monotonic() + 60
            while not os.path.exists(sock):
                if time.monotonic() > deadline or self.server.poll() is not None:
                    raise SystemExit(f"lane_ab: the daemon from {spec} did not start")
                time.sleep(0.05)
            target, args = _xreduce_side, (root, f"unix:{sock}")
        barrier, self.out = ctx.Barrier(2), ctx.Queue()
        self.go = [ctx.Queue() for _ in range(2)]
        self.procs = [ctx.Process(target=target, args=(*args, rank, barrier, self.go[rank], self.out))
                      for rank in range(2)]
        for proc in self.procs:
            proc.start()
        for _ in range(2):
            self.out.get(timeout=180)

    def block(self, iters: int) -> list[float]:
        for go in self.go:
            go.put(iters)
        got = sorted(self.out.get(timeout=600) for _ in range(2))
        if any(kind != "times" for kind, _, _ in got):
            raise SystemExit(f"lane_ab: {self.name} returned a wrong result")
        return [max(a, b) for a, b in zip(got[0][2], got[1][2])]

    def close(self) -> None:
        for go in self.go:
            go.put(0)
        for proc in self.procs:
            proc.join(30)
        if self.server.stdin is not None:
            self.server.stdin.close()
        self.server.terminate()
        self.server.wait(30)


def compare(first: str, second: str, blocks: int, iters: int) -> tuple[float, float, list[float]]:
    """(first's median, second's median, per-block ratios first/second), in seconds."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="xreduce-lane-ab-") as tmp:
        sides = []
        try:
            for index, spec in enumerate((first, second)):
                sides.append(_Side(spec, index, tmp, ctx))
            times: list[list[float]] = [[], []]
            ratios = []
            for b in range(blocks):
                medians = [0.0, 0.0]
                for i in ((0, 1) if b % 2 == 0 else (1, 0)):
                    block = sides[i].block(iters)
                    times[i] += block
                    medians[i] = statistics.median(block)
                ratios.append(medians[0] / medians[1])
        finally:
            for side in sides:
                side.close()
    return statistics.median(times[0]), statistics.median(times[1]), ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="a source tree (with server/ and client/), or 'echo'")
    p.add_argument("b", help="the same, for the other side")
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--iters", type=int, default=200, help="iterations per block")
    p.add_argument("--both-orders", action="store_true", help="run again with b started first")
    args = p.parse_args(argv)
    runs = [(args.a, args.b)] + ([(args.b, args.a)] if args.both_orders else [])
    ratios = []
    for first, second in runs:
        m1, m2, per_block = compare(first, second, args.blocks, args.iters)
        q = statistics.quantiles(per_block, n=4)
        ratio = statistics.median(per_block)
        print(f"{first}: {m1 * 1e6:.1f} us   {second}: {m2 * 1e6:.1f} us   median block ratio {ratio:.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {args.blocks} blocks x {args.iters})", flush=True)
        ratios.append(ratio if first == args.a else 1 / ratio)
    if len(ratios) == 2:
        print(f"{args.a} / {args.b}: {math.sqrt(ratios[0] * ratios[1]):.3f} (geometric mean of both orders)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
