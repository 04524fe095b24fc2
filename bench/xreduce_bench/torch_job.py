"""One rank of ``bench/torch_ddp.py``: DDP training steps of a model on random data, timed.

    python -m xreduce_bench.torch_job --backend xreduce|gloo|hook --model mlp|resnet50 [--steps N] [--batch B]

The rank reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun sets them). ``hook`` is Gloo's
default group with DDP's gradients through the daemon (``xreduce.torch.allreduce_hook``). After ``--warmup``
steps it times ``--steps`` steps (forward, backward with DDP's bucket all-reduces overlapping it, SGD) and prints
one JSON line: the median and mean step time, and a checksum of the weights.

With ``--until-error`` (``bench/torch_faults.py``) it prints ``{"event": "training", ...}`` after the warm-up steps
and trains on (at most ``--steps`` steps) until a step fails: then it prints ``{"event": "error", "at": <wall
clock seconds>, "type": ..., "message": ...}`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from xreduce_bench.torch_models import MODELS

INPUTS = {"mlp": lambda b, g: torch.randn(b, 1024, generator=g),
          "resnet50": lambda b, g: torch.randn(b, 3, 64, 64, generator=g)}
"""A batch of inputs per model (ResNet-50 on 64x64 images: small, so that communication matters)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["xreduce", "gloo", "hook"], required=True)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--until-error", action="store_true", help="train until a step fails (a rank killed)")
    args = parser.parse_args()
    if args.backend != "gloo":
        import xreduce.torch  # registers the backend

    dist.init_process_group("gloo" if args.backend == "hook" else args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MODELS[args.model]()
    ddp = DistributedDataParallel(model)
    if args.backend == "hook":
        ddp.register_comm_hook(dist.new_group(backend="xreduce"), xreduce.torch.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    data = torch.Generator().manual_seed(1 + rank)
    if args.until_error:
        until_error(ddp, optimizer, lambda: INPUTS[args.model](args.batch, data), args)
        return
    times = []
    for step in range(args.warmup + args.steps):
        x = INPUTS[args.model](args.batch, data)
        dist.barrier() if step == args.warmup else None  # the timed steps start together
        start = time.perf_counter()
        train_step(ddp, optimizer, x)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"event": "steps", "rank": rank, "backend": args.backend, "model": args.model,
                      "median_s": statistics.median(times), "mean_s": statistics.mean(times),
                      "weights": digest[:16]}), flush=True)
    dist.destroy_process_group()


def train_step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One step: forward, backward (DDP's bucket all-reduces overlapping it), SGD."""
    optimizer.zero_grad()
    ddp(x).float().square().mean().backward()
    optimizer.step()


def until_error(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, batch, args: argparse.Namespace):
    """Trains until a step fails (``--until-error``); prints when it trains, then what failed and when."""
    times = []
    try:
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            train_step(ddp, optimizer, batch())
            times.append(time.perf_counter() - start)
            if step + 1 == args.warmup:
                print(json.dumps({"event": "training", "rank": dist.get_rank(), "step_s": statistics.median(times)}),
                      flush=True)
    except Exception as e:  # noqa: BLE001 - what the rank saw is the bench's result
        print(json.dumps({"event": "error", "at": time.time(), "step": len(times), "type": type(e).__name__,
                          "message": str(e)[:2000]}), flush=True)
        sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
