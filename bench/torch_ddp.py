"""A PyTorch DDP training step on the daemon against DDP on Gloo, in the same run: ratios of step times.

Four ranks on this machine (fresh processes for every job, ``RANK``/``WORLD_SIZE``/``MASTER_*`` as torchrun sets
them), one daemon of 4 host devices; per model, in alternating rounds, three jobs:

* ``xreduce``: ``init_process_group("xreduce")`` (``import xreduce.torch``), DDP unchanged;
* ``gloo``: ``init_process_group("gloo")``, the peer;
* ``hook``: Gloo's default group, DDP's gradients through the daemon (``xreduce.torch.allreduce_hook``).

Models (``xreduce_bench.torch_models``): an MLP of 25.2 M parameters (batch 1 a rank: communication matters;
target: xreduce <= 0.6x Gloo's step) and ResNet-50 (torchvision's architecture, batch 4 of 64x64 images a rank;
reported). A job's step time is the mean over its ranks of each rank's median step (after warm-up steps).

    python bench/torch_ddp.py --rounds 3 > bench/results/torch-ddp.txt
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

from xreduce_bench.daemon import DaemonProcess

RANKS = 4
BATCH = {"mlp": 1, "resnet50": 4}
STEPS = {"mlp": (3, 10), "resnet50": (2, 5)}
"""Warm-up and timed steps per model."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(backend: str, model: str, address: str, args: argparse.Namespace) -> dict:
    """One DDP job of ``args.ranks`` ranks; its ranks' JSON lines, and their mean median step."""
    port = str(free_port())
    warmup, steps = STEPS[model] if args.steps is None else (1, args.steps)
    procs = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "XREDUCE_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "xreduce_bench.torch_job", "--backend", backend, "--model", model,
             "--batch", str(BATCH[model]), "--warmup", str(warmup), "--steps", str(steps)],
            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    ranks = []
    for proc in procs:
        out, err = proc.communicate(timeout=args.timeout)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"{backend} {model}: a rank failed (exit {proc.returncode}):\n{err[-3000:]}")
        ranks.append(lines[-1])
    if len({r["weights"] for r in ranks}) != 1:
        raise SystemExit(f"{backend} {model}: the ranks' weights differ: {[r['weights'] for r in ranks]}")
    return {"backend": backend, "model": model, "step_s": statistics.mean(r["median_s"] for r in ranks),
            "weights": ranks[0]["weights"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--steps", type=int, help="timed steps (after one warm-up); default per model")
    parser.add_argument("--json", help="also write every job's figures here")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    daemon = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", str(args.ranks),
                            "--log-level", "WARNING"])
    jobs = []
    try:
        for model in models:
            for _ in range(args.rounds):
                for backend in ("xreduce", "gloo", "hook"):
                    jobs.append(job(backend, model, daemon.address, args))
                    print(f"# {model} {backend}: {jobs[-1]['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    finally:
        daemon.terminate()
    print(f"DDP training step, {args.ranks} ranks on one machine ({os.cpu_count()} cores), one daemon of {args.ranks} "
          f"host devices; {args.rounds} rounds, each job fresh processes; a job's step: the mean over ranks of "
          "each rank's median step")
    print(f"{'model':<10} {'batch':>5} {'xreduce ms':>11} {'gloo ms':>8} {'hook ms':>8} {'xreduce/gloo':>13} "
          f"{'hook/gloo':>10}")
    for model in models:
        step = {b: statistics.median(j["step_s"] for j in jobs if j["model"] == model and j["backend"] == b)
                for b in ("xreduce", "gloo", "hook")}
        ratio, hook = step["xreduce"] / step["gloo"], step["hook"] / step["gloo"]
        print(f"{model:<10} {BATCH[model]:>5} {step['xreduce'] * 1e3:>11.1f} {step['gloo'] * 1e3:>8.1f} "
              f"{step['hook'] * 1e3:>8.1f} {ratio:>12.2f}x {hook:>9.2f}x")
    print("(medians over the rounds; every job's ranks ended with the same weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jobs, f, indent=1)


if __name__ == "__main__":
    main()
