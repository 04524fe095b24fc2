"""PyTorch DistributedDataParallel on the xreduce daemon: the one-line change from Gloo.

Trains a small MLP on random regression data with DDP; each rank draws its own batches. The only
xreduce-specific lines are ``import xreduce.torch`` and the backend's name. Rank 0 prints the mean loss
every few steps and, at the end, whether every rank ended with the same weights (sha256 of their bytes).

    xreduced &  torchrun --nproc-per-node 2 examples/torch_ddp.py       # 2 ranks on the daemon
    python examples/torch_ddp.py                                        # 1 rank (no torchrun needed)
    torchrun --nproc-per-node 2 examples/torch_ddp.py --backend gloo    # the same on Gloo
    torchrun --nproc-per-node 2 examples/torch_ddp.py --hook            # Gloo's group, xreduce's hook
    torchrun --nproc-per-node 2 examples/torch_ddp.py --keras           # the MLP built with Keras 3

Options: --steps N, --backend xreduce|gloo, --hook (default group Gloo, gradients through the daemon
with ``xreduce.torch.allreduce_hook``), --keras (the same MLP built with Keras 3 on its torch backend: a
Keras model is a ``torch.nn.Module``, and DDP trains it on the default group), --out FILE (rank 0 saves
the weights).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import socket

import _project_env  # noqa: F401 -- before torch and xreduce: without xreduce, reruns this under the project's .venv
import torch
import torch.distributed as dist
import xreduce.torch  # registers the "xreduce" backend
from torch.nn.parallel import DistributedDataParallel


def single_process_env() -> None:
    """What torchrun would set, for a run without it: one rank, a free port for torch's store."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def mlp(keras_layers: bool) -> torch.nn.Module:
    """The MLP, the same initial weights in every rank (DDP also broadcasts rank 0's); ``keras_layers``: built
    with Keras 3 on its torch backend."""
    torch.manual_seed(0)
    if not keras_layers:
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    os.environ["KERAS_BACKEND"] = "torch"  # read when keras is first imported
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="xreduce", choices=["xreduce", "gloo"])
    parser.add_argument("--hook", action="store_true", help="Gloo as the default group, gradients via xreduce")
    parser.add_argument("--keras", action="store_true", help="the MLP built with Keras 3 (its torch backend)")
    parser.add_argument("--out", help="rank 0 saves the final weights here (torch.save)")
    args = parser.parse_args()
    single_process_env()

    dist.init_process_group("gloo" if args.hook else args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    model = mlp(args.keras)
    ddp = DistributedDataParallel(model)
    if args.hook:
        ddp.register_comm_hook(dist.new_group(backend="xreduce"), xreduce.torch.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    truth = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
    if rank == 0:
        name = "gloo + xreduce hook" if args.hook else dist.get_backend()
        print(f"backend {name}, {size} rank(s)" + (", a Keras model" if args.keras else ""), flush=True)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ truth)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dist.all_reduce(summed := loss.detach().clone())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {summed.item() / size:.4f}", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = [None] * size
    dist.all_gather_object(digests, digest[:16])
    if rank == 0:
        same = "the same weights" if len(set(digests)) == 1 else f"DIFFERENT weights: {digests}"
        print(f"{'OK' if len(set(digests)) == 1 else 'FAILED'}: {size} rank(s) end with {same}, sha256 "
              f"{digest[:16]}", flush=True)
        if len(set(digests)) != 1:
            raise SystemExit(1)
    if args.out and rank == 0:
        torch.save([p.detach() for p in model.parameters()], args.out)
    # DDP holds its process group, and a Keras model's reference cycles would keep DDP until the interpreter's end:
    # a Gloo group that lives that long aborts the process at exit about half the time ("terminate called without
    # an active exception"). Let them go first.
    del ddp, optimizer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
