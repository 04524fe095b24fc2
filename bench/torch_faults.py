"""A rank SIGKILLed at a random moment of DDP training, on the daemon and on Gloo: when the others fail, whether
they name it, whether anything hangs, and whether the daemon goes on serving.

Each trial is a fresh job of ``--ranks`` ranks (torchrun's variables, rank 0 serving torch's store) training the
25 M MLP of ``bench/torch_ddp.py`` with DDP (``python -m xreduce_bench.torch_job --until-error``), on one daemon
for the whole run. Once every rank has trained its warm-up steps, the bench waits a random part of a step, then
SIGKILLs a random rank (rank 0 among them). Per survivor it records when its step failed (the rank's own clock
at the error, less the kill's), the error's type, whether the message names the killed rank (xreduce: ``process
N``), and whether it exited within ``--bound`` seconds (a rank still running then is a hang, and is killed).
Backends alternate trial by trial: ``xreduce`` (``init_process_group("xreduce")``) and ``gloo``, the peer. The
daemon's threads, descriptors and resident memory (``/proc``) are read after the first trial and at the end.
The issue's bound: the others' next step fails within 3 s.

    python bench/torch_faults.py --trials 20 --ranks 2,4 --json bench/results/torch-faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from xreduce_bench.daemon import DaemonProcess
from xreduce_bench.faults import footprint, free_address

BACKENDS = ("xreduce", "gloo")
LIMIT_S = 3.0
"""The issue's bound: from the kill to the others' failed step."""


def trial(backend: str, ranks: int, address: str, rng: random.Random, args: argparse.Namespace,
          logs: pathlib.Path) -> dict:
    """One job: trains, loses a rank, and what the others saw."""
    port = free_address().rsplit(":", 1)[1]
    procs, outs = [], []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "XREDUCE_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        out = logs / f"{backend}-{ranks}-{rank}.out"
        outs.append(out)
        with open(out, "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "xreduce_bench.torch_job", "--backend", backend, "--model", "mlp",
                 "--batch", "1", "--warmup", str(args.warmup), "--steps", "100000", "--until-error"],
                env=env, stdout=stdout, stderr=stderr))
    try:
        training = _wait_training(procs, outs, args.start_timeout)
        step_s = statistics.median(e["step_s"] for e in training)
        victim = rng.randrange(ranks)
        delay = rng.uniform(0.0, step_s)
        time.sleep(delay)
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.time()
        deadline = time.monotonic() + args.bound
        survivors = []
        for rank, proc in enumerate(procs):
            if rank == victim:
                proc.wait()
                continue
            try:
                status = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = None
            error = next((e for e in _events(outs[rank]) if e.get("event") == "error"), None)
            survivors.append({
                "rank": rank, "exit": status, "hung": status is None,
                "failed_after_s": None if error is None else round(error["at"] - killed_at, 3),
                "type": None if error is None else error["type"],
                "names_victim": error is not None and f"process {victim} " in error["message"],
                "message": None if error is None else error["message"][:300]})
        return {"backend": backend, "ranks": ranks, "victim": victim, "delay_s": round(delay, 3),
                "step_s": round(step_s, 4), "survivors": survivors}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _events(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


def _wait_training(procs: list[subprocess.Popen], outs: list[pathlib.Path], timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [next((e for e in _events(out) if e.get("event") == "training"), None) for out in outs]
        if all(found):
            return found
        ended = [r for r, p in enumerate(procs) if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            err = outs[ended[0] if ended else 0].with_suffix(".err").read_text()[-3000:]
            raise SystemExit(f"the job did not start training (rank(s) {ended} ended):\n{err}")
        time.sleep(0.05)


def summary(trials: list[dict]) -> list[str]:
    """A line per backend and size: the survivors' failure times, how many within the bound, named, hung."""
    lines = [f"{'backend':<8} {'ranks':>5} {'trials':>6} {'survivors':>9} {'min s':>6} {'median s':>8} "
             f"{'p90 s':>6} {'max s':>6} {f'<= {LIMIT_S:g} s':>7} {'named':>6} {'hung':>5}"]
    for backend in BACKENDS:
        for ranks in sorted({t["ranks"] for t in trials}):
            mine = [t for t in trials if t["backend"] == backend and t["ranks"] == ranks]
            if not mine:
                continue
            survivors = [s for t in mine for s in t["survivors"]]
            times = sorted(s["failed_after_s"] for s in survivors if s["failed_after_s"] is not None)
            p90 = times[min(len(times) - 1, int(0.9 * len(times)))] if times else float("nan")
            lines.append(
                f"{backend:<8} {ranks:>5} {len(mine):>6} {len(survivors):>9} "
                f"{(times[0] if times else float('nan')):>6.2f} "
                f"{(statistics.median(times) if times else float('nan')):>8.2f} {p90:>6.2f} "
                f"{(times[-1] if times else float('nan')):>6.2f} "
                f"{sum(t <= LIMIT_S for t in times):>7} {sum(s['names_victim'] for s in survivors):>6} "
                f"{sum(s['hung'] for s in survivors):>5}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per backend and size")
    parser.add_argument("--ranks", default="2,4", help="job sizes, comma-separated")
    parser.add_argument("--warmup", type=int, default=3, help="steps every rank trains before the kill")
    parser.add_argument("--bound", type=float, default=30.0, help="seconds after the kill a survivor may run")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write every trial here")
    args = parser.parse_args()
    sizes = [int(n) for n in args.ranks.split(",") if n]
    rng = random.Random(args.seed)
    daemon = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", str(max(sizes)),
                            "--log-level", "WARNING"])
    trials, footprints = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.trials):
                for ranks in sizes:
                    for backend in BACKENDS:
                        trials.append(trial(backend, ranks, daemon.address, rng, args, pathlib.Path(tmp)))
                        t = trials[-1]
                        print(f"# trial {k} {backend} {ranks} ranks: rank {t['victim']} killed "
                              f"{t['delay_s']:.2f} s into a step of {t['step_s']:.2f} s; the others failed after "
                              f"{[s['failed_after_s'] for s in t['survivors']]} s", file=sys.stderr, flush=True)
                if k == 0:
                    footprints.append(footprint(daemon.proc.pid))
            footprints.append(footprint(daemon.proc.pid))
    finally:
        daemon.terminate()
    print(f"A rank SIGKILLed at a random moment of DDP training (the 25 M MLP), {args.trials} trial(s) per backend "
          f"and size, on one machine ({os.cpu_count()} cores): when the other ranks' steps failed, after the kill")
    print("\n".join(summary(trials)))
    first, last = footprints
    print(f"the daemon after the first trials and at the end: threads {first['threads']} -> {last['threads']}, "
          f"descriptors {first['fds']} -> {last['fds']}, resident {first['rss_mib']:.0f} -> {last['rss_mib']:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": trials, "daemon": footprints}, f, indent=1)


if __name__ == "__main__":
    main()
