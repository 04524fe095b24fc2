"""A process of a Keras job ended mid-``fit``: how soon the other's ``fit`` fails, and with what, trial after trial.

Each trial starts two ``xreduce_bench.keras_job`` processes (``xreduce.tensorflow.MirroredStrategy``, one replica
each, one daemon), waits until both train, lets them run a random 0.2-1.5 s more, ends process 1 with the signal,
and times process 0's ``fit`` until it raises. The daemon's ``--collective-timeout`` is 60 s, so an error that
names the process, well before that, is the session telling the daemon. After every trial the daemon must serve
the next job.

    python bench/keras_faults.py --trials 10 > bench/results/keras-faults.txt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from xreduce_bench.daemon import DaemonProcess


def trial(env: dict[str, str], sig: signal.Signals, rng: random.Random) -> tuple[float, dict]:
    procs = [subprocess.Popen([sys.executable, "-m", "xreduce_bench.keras_job", "--strategy", "xreduce",
                               "--replicas", "1", "--processes", "2", "--process-id", str(p), "--steps", "2000",
                               "--epochs", "1000"],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for p in range(2)]
    try:
        for proc in procs:
            while json.loads(proc.stdout.readline() or '{"event": "gone"}')["event"] not in ("training", "gone"):
                pass
        time.sleep(rng.uniform(0.2, 1.5))
        procs[1].send_signal(sig)
        start = time.monotonic()
        line = procs[0].stdout.readline()
        waited = time.monotonic() - start
        return waited, json.loads(line) if line.startswith("{") else {"event": "none"}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="xreduce-faults-") as tmp:
        daemon = DaemonProcess(["--listen", f"unix:{tmp}/xreduced.sock", "--collective-timeout", "60",
                                "--log-level", "WARNING"])
        try:
            print(f"# bench/keras_faults.py: {args.trials} trials per signal, 2 processes x 1 replica, one daemon")
            for sig in (signal.SIGKILL, signal.SIGTERM):
                waits, named = [], 0
                for k in range(args.trials):
                    env = dict(os.environ, XREDUCE_ADDRESS=daemon.address, XREDUCE_GROUP=f"faults-{sig.name}-{k}",
                               TF_CPP_MIN_LOG_LEVEL="2", XREDUCE_STALL_WARNING_SECONDS="0")
                    waited, event = trial(env, sig, rng)
                    ok = event.get("event") == "error" and "process 1 of group" in event.get("message", "")
                    named += ok
                    waits.append(waited)
                    print(f"{sig.name} trial {k}: process 0's fit failed after {waited:.3f} s "
                          f"({event.get('type', event.get('event'))}{', naming process 1' if ok else ''})",
                          flush=True)
                print(f"{sig.name}: median {statistics.median(waits):.3f} s, max {max(waits):.3f} s over "
                      f"{args.trials} trials; {named} of {args.trials} named process 1\n", flush=True)
        finally:
            daemon.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
