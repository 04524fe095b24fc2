"""One rank of a ``torch.distributed`` job that trains a small model with DDP: the multi-node torch tests' job.

Usage (``torch.distributed``'s ``env://`` variables set, as torchrun sets them)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m torch_job --steps 1000

Each rank trains ``--steps`` steps of ``DistributedDataParallel`` over ``--backend`` (default ``xreduce``)
and prints one JSON line per event on stdout: ``{"event": "training"}`` after step :data:`TRAINING`,
``{"event": "done"}`` after the last, or ``{"event": "error", "type": T, "message": M, "at": S}`` when a step
fails (and exits 0): ``T`` the exception's type, ``S`` the ``time.monotonic()`` at which the step raised (one
clock for every process of the machine).
"""

from __future__ import annotations

import argparse
import json
import time

TRAINING = 2
"""The step after which a rank says it is training: DDP has rebuilt its buckets (in the second step's forward),
so from then on its collectives are the gradients' all-reduces in the backward pass."""


def emit(event: str, **fields: object) -> None:
    """One event as a JSON line on stdout, flushed at once.

    Example:
        >>> emit("error", type="builtins.RuntimeError", message="lost", at=1.5)
        {"event": "error", "type": "builtins.RuntimeError", "message": "lost", "at": 1.5}
    """
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Trains (see the module), reporting a failed step as an event instead of raising."""
    parser = argparse.ArgumentParser(prog="python -m torch_job", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="xreduce", choices=["xreduce", "gloo"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    import xreduce.torch  # noqa: F401 - registers the backend
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        try:
            loss = ddp(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        except Exception as e:  # noqa: BLE001 - the test reads what a failed step raised
            emit("error", type=f"{type(e).__module__}.{type(e).__qualname__}", message=str(e), at=time.monotonic())
            return
        if step == TRAINING:
            emit("training")
    emit("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
