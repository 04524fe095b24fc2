"""What the local lane costs while nobody calls: the daemon's CPU with lane connections open and idle.

Starts ``xreduced`` on a unix socket, lets it settle, measures its CPU time
(user + system, from ``/proc/PID/stat``) over ``--seconds`` with no client;
then starts ``--processes`` SDK processes that each make one small all-reduce
(so each holds a lane connection) and then sleep, and measures again. Busy
polling would show as a second figure near ``--seconds`` of CPU per core.

    $ python bench/lane_idle.py --processes 4 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CLIENT = r"""
import sys, time, numpy as np
from xreduce import distribute
ops = distribute.HierarchicalCopyAllReduce(address=sys.argv[1])
value = distribute.PerReplica([np.float32([1]), np.float32([2])], devices=["CPU:0", "CPU:1"])
assert ops.reduce("SUM", value, "CPU:0").tolist() == [3.0]
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lane_counts(address: str) -> tuple[int, int]:
    import xreduce

    with xreduce.Client(address) as client:
        status = client.get_status()
    return status.local_lane_connections, status.local_lane_calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=4, help="SDK processes holding a lane connection")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each idle measurement")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds left to the daemon after its start, and to the clients after their call")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xreduce-lane-idle-") as tmp:
        address = f"unix:{tmp}/d.sock"
        daemon = subprocess.Popen([sys.executable, "-m", "xreduced", "--listen", address, "--backend", "numpy",
                                   "--virtual-devices", "2", "--log-level", "WARNING"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        clients = []
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(f"{tmp}/d.sock.lane"):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    print("the daemon did not start", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            time.sleep(args.settle)  # its start-up (imports) is over
            before = cpu_seconds(daemon.pid)
            time.sleep(args.seconds)
            alone = cpu_seconds(daemon.pid) - before
            for _ in range(args.processes):
                clients.append(subprocess.Popen(
                    [sys.executable, "-c", CLIENT, address, str(args.seconds + 30)],
                    stdout=subprocess.PIPE, text=True))
            for c in clients:
                assert c.stdout.readline().strip() == "ready"
            connections, calls = lane_counts(address)
            time.sleep(args.settle)
            before = cpu_seconds(daemon.pid)
            time.sleep(args.seconds)
            held = cpu_seconds(daemon.pid) - before
            print(f"daemon CPU while idle, {args.seconds:g} s each: no client {alone * 1e3:.1f} ms; "
                  f"{args.processes} processes holding {connections} lane connection(s) after {calls} lane call(s) "
                  f"{held * 1e3:.1f} ms ({held / args.seconds * 100:.2f}% of one core)")
        finally:
            for c in clients:
                c.kill()
                c.wait()
            daemon.terminate()
            daemon.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
