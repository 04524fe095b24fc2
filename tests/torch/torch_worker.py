"""One rank of the torch tests: ``python torch_worker.py --rank R --world-size N --store-port P MODE ...``.

It meets the other ranks at the test's ``TCPStore`` (``torch_ranks.Ranks`` serves it), forms its groups with
``init_process_group(store=...)`` and prints what it saw as JSON lines on stdout. Without ``--store-port`` (mode
``train`` only) it forms the group as torchrun's ranks do, from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (``env://``): the multi-node tests start it so in each node. Modes:

* ``ddp``: the same small MLP, data and seeds trained with DDP over xreduce, over Gloo, and over Gloo with
  ``xreduce.torch.allreduce_hook`` on an xreduce group (``--variants``); rank 0 saves each's weights (``--out``).
* ``train``: DDP over xreduce until a collective fails (a rank killed): a ``training`` event once it trains,
  then an ``error`` event with the exception's type and message, and the process exits.
* ``collectives``: every collective and reduce op through ``torch.distributed``'s API on the xreduce group,
  beside Gloo's result on a Gloo group of the same ranks and the exact result (``--suite all`` or ``four``).
* ``timeout``: ``init_process_group(timeout=--timeout)``; rank 0 alone enters a collective.
* ``options``: DDP's options and ways of training (``gradient_as_bucket_view``, ``find_unused_parameters``,
  ``static_graph``, ``no_sync``, ``Join`` with uneven inputs), each on xreduce and on Gloo; ``--fsdp``: then
  FSDP2 (``fully_shard``) on each.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import xreduce.torch
from torch.nn.parallel import DistributedDataParallel

STORE_WAIT = datetime.timedelta(seconds=120)
"""How long a rank waits at the store for the others (far above a test's own timeouts)."""

DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "float16", "bfloat16", "int64", "uint8")}
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")

# Bit patterns a copy must keep: -0.0, a quiet NaN with a payload, a negative one, +inf, the smallest
# subnormal, a signalling NaN with a payload.
SPECIAL_BITS = {
    "float32": [0x80000000, 0x7FC12345, 0xFFC00001, 0x7F800000, 0x00000001, 0x7F812345],
    "float64": [1 << 63, 0x7FF8000000012345, 0xFFF8000000000001, 0x7FF0000000000000, 1, 0x7FF0000000012345],
    "float16": [0x8000, 0x7E45, 0xFE01, 0x7C00, 0x0001, 0x7D01],
    "bfloat16": [0x8000, 0x7FC5, 0xFFC1, 0x7F80, 0x0001, 0x7F81],
}
_WORDS = {2: (np.uint16, np.int16), 4: (np.uint32, np.int32), 8: (np.uint64, np.int64)}


def emit(**event) -> None:
    """One JSON line on stdout."""
    print(json.dumps(event), flush=True)


def encode(t: torch.Tensor) -> dict:
    """A tensor as the tests compare it: its bytes (bit for bit) and its values (to read)."""
    t = t.detach().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "bits": t.view(-1).view(torch.uint8).numpy().tobytes().hex(), "values": t.tolist()}


def error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def digest(tensors) -> str:
    """A short digest of the tensors' bytes, in order (a model's parameters or buffers, a rank's shards)."""
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()[:16]


# --- ddp and train ----------------------------------------------------------------------------------------------

def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


class Batches:
    """This rank's regression batches: its own inputs, one target function for every rank."""

    def __init__(self, rank: int):
        self._inputs = torch.Generator().manual_seed(1000 + rank)
        self._truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    def step(self, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        x = torch.randn(16, 32, generator=self._inputs)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ self._truth)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()


def ddp(args: argparse.Namespace, store: dist.Store) -> None:
    dist.init_process_group(args.default, store=store, rank=args.rank, world_size=args.world_size)
    xreduce_group = dist.group.WORLD if args.default == "xreduce" else dist.new_group(backend="xreduce")
    gloo_group = dist.group.WORLD if args.default == "gloo" else dist.new_group(backend="gloo")
    weights = {}
    for variant in args.variants.split(","):
        model = mlp()
        net = DistributedDataParallel(model, process_group=xreduce_group if variant == "xreduce" else gloo_group)
        if variant == "hook":
            net.register_comm_hook(xreduce_group, xreduce.torch.allreduce_hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        batches = Batches(args.rank)
        started = time.monotonic()
        losses = [batches.step(net, optimizer) for _ in range(args.steps)]
        weights[variant] = [p.detach().clone() for p in model.parameters()]
        emit(event="trained", variant=variant, losses=losses, digest=digest(model.parameters()),
             seconds=round(time.monotonic() - started, 3))
    if args.rank == 0:
        torch.save(weights, args.out)
    dist.destroy_process_group()
    emit(event="done")


class Wide(torch.nn.Module):
    """An MLP whose middle layer's gradient is 1 MiB (DDP's buckets go through shared memory from the second
    step), a BatchNorm (buffers DDP broadcasts every step) and a second head, left out of the forward pass when
    ``use_spare`` is False (an unused parameter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(32, 512)
        self.norm = torch.nn.BatchNorm1d(512)
        self.middle = torch.nn.Linear(512, 512)
        self.head = torch.nn.Linear(512, 1)
        self.spare = torch.nn.Linear(512, 1)
        self.use_spare = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.middle(torch.relu(self.norm(self.inner(x)))))
        return self.head(h) + (self.spare(h) if self.use_spare else 0)


OPTIONS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "no_sync": {},
    "join": {},
}
"""DDP's options and ways of training that a job uses unchanged (``options`` mode)."""


def options(args: argparse.Namespace, store: dist.Store) -> None:
    """Each of :data:`OPTIONS` trained on an xreduce group and on a Gloo group of the same ranks, from the same
    weights on the same batches (:func:`train_with`)."""
    dist.init_process_group("xreduce", store=store, rank=args.rank, world_size=args.world_size)
    groups = {"xreduce": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    for name in args.options.split(","):
        for backend, group in groups.items():
            model = train_with(name, group, args.rank, args.steps)
            grad = model.middle.weight.grad  # with gradient_as_bucket_view, a view of DDP's bucket
            emit(event="trained", option=name, backend=backend, digest=digest(model.parameters()),
                 buffers=digest(model.buffers()),
                 grad_in_shared_memory=grad is not None and grad.is_shared())
    if args.fsdp:
        for backend, group in groups.items():
            emit(event="sharded", backend=backend, **train_sharded(group, args.rank, args.steps))
    dist.destroy_process_group()
    emit(event="done")


def train_with(name: str, group: dist.ProcessGroup, rank: int, steps: int) -> Wide:
    """A :class:`Wide` trained with DDP's option ``name`` over ``group``: ``find_unused_parameters`` leaves the
    second head out on even steps; ``no_sync`` accumulates two batches a step; ``join`` gives rank 0 two batches
    fewer and trains under ``torch.distributed.algorithms.Join``. (``SyncBatchNorm`` takes GPU tensors only.)"""
    from torch.distributed.algorithms.join import Join

    model = Wide()
    net = DistributedDataParallel(model, process_group=group, **OPTIONS[name])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    inputs = torch.Generator().manual_seed(1000 + rank)
    truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    def loss() -> torch.Tensor:
        x = torch.randn(16, 32, generator=inputs)
        return torch.nn.functional.mse_loss(net(x), x @ truth)

    with Join([net]) if name == "join" else contextlib.nullcontext():
        for k in range(steps - (2 if name == "join" and rank == 0 else 0)):
            model.use_spare = k % 2 == 1 or name != "find_unused_parameters"
            optimizer.zero_grad()
            if name == "no_sync":
                with net.no_sync():
                    loss().backward()
            loss().backward()
            optimizer.step()
    return model


def train_sharded(group: dist.ProcessGroup, rank: int, steps: int) -> dict:
    """An MLP trained with FSDP2 (``fully_shard`` of each layer, then of the model, on a mesh of ``group``):
    a digest of this rank's shards of the weights, and the group's name as DeviceMesh read it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = Batches(rank)
    for _ in range(steps):
        batches.step(model, optimizer)
    shards = [p.to_local().detach() for p in model.parameters()]
    return {"digest": digest(shards),
            "group_name": mesh.get_group().group_name}


def train(args: argparse.Namespace, store: dist.Store | None) -> None:
    if store is None:  # env://, as torchrun's ranks
        dist.init_process_group("xreduce")
    else:
        dist.init_process_group("xreduce", store=store, rank=args.rank, world_size=args.world_size)
    model = mlp()
    net = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = Batches(dist.get_rank())
    step = 0
    try:
        while step < args.steps:
            batches.step(net, optimizer)
            step += 1
            if step == 3:
                emit(event="training")
    except Exception as e:  # noqa: BLE001 - what the rank saw is the test's result
        emit(event="error", step=step, at=time.time(), **error(e))
        sys.exit(1)
    dist.destroy_process_group()
    emit(event="done", step=step)


# --- collectives ------------------------------------------------------------------------------------------------

class Ctx:
    """What a case needs: this rank, the group's size, a Gloo group of the same ranks, the store."""

    def __init__(self, rank: int, size: int, gloo: dist.ProcessGroup, store: dist.Store):
        self.rank, self.size, self.gloo, self.store = rank, size, gloo, store


def ints(rank: int, dtype: torch.dtype, seed: int, low: int = -8, high: int = 9, n: int = 7) -> torch.Tensor:
    """Small whole numbers: every sum, product and mean of a few of them is exact in every dtype here, in
    any order of additions."""
    generator = torch.Generator().manual_seed(seed * 64 + rank)
    return torch.randint(0 if dtype == torch.uint8 else low, high, (n,), generator=generator).to(dtype)


def randoms(rank: int, dtype: torch.dtype, seed: int, n: int = 9) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 64 + rank), dtype=torch.float64).to(dtype)


def payload(rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A rank's tensor for copies: the special bit patterns (rotated by rank) and random values."""
    name = str(dtype).removeprefix("torch.")
    if name not in SPECIAL_BITS:
        return ints(rank, dtype, seed)
    unsigned, signed = _WORDS[torch.tensor([], dtype=dtype).element_size()]
    special = torch.from_numpy(np.array(SPECIAL_BITS[name], dtype=np.uint64).astype(unsigned).view(signed)).view(dtype)
    return torch.cat([special.roll(rank), randoms(rank, dtype, seed, 5)])


def fold(op: str, parts: list[torch.Tensor], size: int) -> torch.Tensor:
    """``op`` over the ranks' tensors in rank order, in their dtype: the exact result for :func:`ints`."""
    if op in ("SUM", "AVG"):
        total = functools.reduce(torch.add, parts)
        if op == "SUM":
            return total
        return total / size if total.dtype.is_floating_point else torch.div(total, size, rounding_mode="trunc")
    return functools.reduce({"MIN": torch.minimum, "MAX": torch.maximum, "PRODUCT": torch.mul}[op], parts)


def side_by_side(ctx: Ctx, run: Callable[[dist.ProcessGroup | None], torch.Tensor], expected: torch.Tensor) -> dict:
    """``run(group)`` on the xreduce group (None: the default one) and on the Gloo group (or why Gloo refused),
    beside the exact result."""
    try:
        gloo = encode(run(ctx.gloo))
    except (RuntimeError, ValueError) as e:
        gloo = {"unsupported": f"{type(e).__name__}: {e}"}
    return {"xreduce": encode(run(None)), "gloo": gloo, "expected": encode(expected)}


def reduce_op(op: str) -> dist.ReduceOp:
    return getattr(dist.ReduceOp, op)


def all_reduce(ctx: Ctx, op: str, data: Callable[[int], torch.Tensor]) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        t = data(ctx.rank)
        if group is ctx.gloo and op == "AVG" and not t.dtype.is_floating_point:  # Gloo averages floats only
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return torch.div(t, ctx.size, rounding_mode="trunc")
        dist.all_reduce(t, op=reduce_op(op), group=group)
        return t

    return side_by_side(ctx, run, fold(op, [data(r) for r in range(ctx.size)], ctx.size))


def refused(ctx: Ctx, op: str | None) -> dict:
    """``op`` (a bitwise one) or a bool tensor: refused before anything is sent."""
    t = torch.ones(3, dtype=torch.int64 if op else torch.bool)
    try:
        dist.all_reduce(t, op=reduce_op(op or "SUM"))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": error(e)}
    return {"error": None}


def broadcast(ctx: Ctx, src: int, dtype: torch.dtype) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        t = payload(ctx.rank, dtype, 1)
        dist.broadcast(t, src, group=group)
        return t

    return side_by_side(ctx, run, payload(src, dtype, 1))


def all_gather(ctx: Ctx, dtype: torch.dtype) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        mine = payload(ctx.rank, dtype, 2)
        out = [torch.empty_like(mine) for _ in range(ctx.size)]
        dist.all_gather(out, mine, group=group)
        return torch.stack(out)

    return side_by_side(ctx, run, torch.stack([payload(r, dtype, 2) for r in range(ctx.size)]))


def all_gather_into_tensor(ctx: Ctx, dtype: torch.dtype) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        mine = payload(ctx.rank, dtype, 3)
        out = torch.empty(ctx.size * mine.numel(), dtype=dtype)
        dist.all_gather_into_tensor(out, mine, group=group)
        return out

    return side_by_side(ctx, run, torch.cat([payload(r, dtype, 3) for r in range(ctx.size)]))


def all_gather_object(ctx: Ctx) -> dict:
    ours: list = [None] * ctx.size
    dist.all_gather_object(ours, objects(ctx.rank))
    theirs: list = [None] * ctx.size
    dist.all_gather_object(theirs, objects(ctx.rank), group=ctx.gloo)
    return {"xreduce": ours, "gloo": theirs, "expected": [objects(r) for r in range(ctx.size)]}


def gather(ctx: Ctx, dst: int, dtype: torch.dtype) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        mine = payload(ctx.rank, dtype, 6)
        out = [torch.empty_like(mine) for _ in range(ctx.size)] if ctx.rank == dst else None
        dist.gather(mine, out, dst=dst, group=group)
        return torch.stack(out) if out is not None else mine

    expected = torch.stack([payload(r, dtype, 6) for r in range(ctx.size)]) if ctx.rank == dst else \
        payload(ctx.rank, dtype, 6)
    return side_by_side(ctx, run, expected)


def scatter(ctx: Ctx, src: int, dtype: torch.dtype) -> dict:
    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        out = torch.zeros_like(payload(0, dtype, 7))
        dist.scatter(out, [payload(r, dtype, 7) for r in range(ctx.size)] if ctx.rank == src else None, src=src,
                     group=group)
        return out

    return side_by_side(ctx, run, payload(ctx.rank, dtype, 7))


def to_all(ctx: Ctx, dtype: torch.dtype, how: str) -> dict:
    """``all_to_all_single`` (``how``: ``even``, each part 2 rows; ``uneven``, rank r sends (r + j) % 3 + 1 rows
    to rank j; ``bits``, each part a :func:`payload`) or ``all_to_all`` (``list``: uneven parts, one tensor each)."""
    def part(r: int, j: int) -> torch.Tensor:
        if how == "bits":
            return payload(r, dtype, 8 + j)
        rows = 2 if how == "even" else (r + j) % 3 + 1
        return (torch.arange(2 * rows).reshape(rows, 2) + 100 * r + 10 * j).to(dtype)

    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        sends = [part(ctx.rank, j) for j in range(ctx.size)]
        gets = [torch.empty_like(part(r, ctx.rank)) for r in range(ctx.size)]
        if how == "list":
            dist.all_to_all(gets, sends, group=group)
            return torch.cat(gets)
        out = torch.cat(gets)
        splits = how == "uneven"
        dist.all_to_all_single(out, torch.cat(sends), [len(g) for g in gets] if splits else None,
                               [len(p) for p in sends] if splits else None, group=group)
        return out

    return side_by_side(ctx, run, torch.cat([part(r, ctx.rank) for r in range(ctx.size)]))


def refused_all_to_all(ctx: Ctx) -> dict:
    """Rank 1 expects 2 elements from rank 0, which sends it 1: every rank refuses the call alike."""
    gets = [2 if ctx.rank == 1 and r == 0 else 1 for r in range(ctx.size)]
    try:
        dist.all_to_all_single(torch.zeros(sum(gets)), torch.zeros(ctx.size), gets, [1] * ctx.size)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": error(e)}
    return {"error": None}


def refused_send(ctx: Ctx) -> dict:
    """Point to point: refused on the spot, naming it (no rank waits for the other)."""
    try:
        dist.send(torch.zeros(1), (ctx.rank + 1) % ctx.size)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": error(e)}
    return {"error": None}


def objects(rank: int) -> dict:
    return {"rank": rank, "text": "é" * (rank + 1), "nested": [rank, None, 1.5] * (rank + 1)}


def gather_object(ctx: Ctx) -> dict:
    def run(group: dist.ProcessGroup | None) -> list:
        out: list | None = [None] * ctx.size if ctx.rank == 1 else None
        dist.gather_object(objects(ctx.rank), out, dst=1, group=group)
        return out or []

    return {"xreduce": run(None), "gloo": run(ctx.gloo),
            "expected": [objects(r) for r in range(ctx.size)] if ctx.rank == 1 else []}


def scatter_object_list(ctx: Ctx) -> dict:
    def run(group: dist.ProcessGroup | None) -> list:
        out: list = [None]
        dist.scatter_object_list(out, [objects(r) for r in range(ctx.size)] if ctx.rank == 0 else None, src=0,
                                 group=group)
        return out

    return {"xreduce": run(None), "gloo": run(ctx.gloo), "expected": [objects(ctx.rank)]}


def reduce_scatter(ctx: Ctx, op: str, dtype: torch.dtype) -> dict:
    def parts(rank: int) -> list[torch.Tensor]:
        return [ints(rank, dtype, 10 + i, -3, 4, 5) for i in range(ctx.size)]

    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        out = torch.empty(5, dtype=dtype)
        dist.reduce_scatter(out, parts(ctx.rank), op=reduce_op(op), group=group)
        return out

    return side_by_side(ctx, run, fold(op, [parts(r)[ctx.rank] for r in range(ctx.size)], ctx.size))


def reduce_scatter_tensor(ctx: Ctx, op: str, dtype: torch.dtype) -> dict:
    def whole(rank: int) -> torch.Tensor:
        return ints(rank, dtype, 20, -3, 4, 3 * ctx.size)

    def run(group: dist.ProcessGroup | None) -> torch.Tensor:
        out = torch.empty(3, dtype=dtype)
        dist.reduce_scatter_tensor(out, whole(ctx.rank), op=reduce_op(op), group=group)
        return out

    total = fold(op, [whole(r) for r in range(ctx.size)], ctx.size)
    return side_by_side(ctx, run, total[3 * ctx.rank:3 * ctx.rank + 3])


def barrier(ctx: Ctx) -> dict:
    """Rank 0 enters first; the last rank enters only once rank 0 is about to: rank 0's barrier returns
    after the last rank's entry (an order, seen in the store)."""
    last = ctx.size - 1
    if ctx.rank == last:
        ctx.store.wait(["barrier/0"], STORE_WAIT)
        ctx.store.set(f"barrier/{last}", "entered")
        # A TCPStore's set is sent without an answer: read it back on this connection, so that the store has it
        # before this rank enters (rank 0's check comes on a connection of its own, and could overtake the set).
        ctx.store.get(f"barrier/{last}")
    elif ctx.rank == 0:
        ctx.store.set("barrier/0", "entering")
    dist.barrier()
    return {"checks": {"the last rank had entered": ctx.store.check([f"barrier/{last}"])}}


def noncontiguous(ctx: Ctx, how: str) -> dict:
    """Views that are not contiguous: results land in the view, the rest of its base untouched."""
    def base(rank: int) -> torch.Tensor:
        return ints(rank, torch.float32, 30, n=24).reshape(4, 6)

    ours, expected = base(ctx.rank), base(ctx.rank)
    bases = [base(r) for r in range(ctx.size)]
    if how == "transposed_sum":
        dist.all_reduce(ours.t())
        expected = fold("SUM", bases, ctx.size)
    elif how == "strided_max":
        dist.all_reduce(ours[:, ::2], op=dist.ReduceOp.MAX)
        expected[:, ::2] = fold("MAX", [b[:, ::2] for b in bases], ctx.size)
    elif how == "broadcast_rows":
        dist.broadcast(ours[1::2], 1)
        expected[1::2] = bases[1][1::2]
    else:  # a column gathered
        gathered = torch.empty(ctx.size * 4)
        dist.all_gather_into_tensor(gathered, ours[:, 1])
        return {"xreduce": encode(gathered), "expected": encode(torch.cat([b[:, 1] for b in bases]))}
    return {"xreduce": encode(ours), "expected": encode(expected)}


def async_op(ctx: Ctx) -> dict:
    """Rank 0's ``all_reduce(async_op=True)`` returns while the others have not entered it: they enter only
    once rank 0 has looked at its work (an order, through the store, not a delay)."""
    t = torch.full((5,), float(ctx.rank + 1))
    expected = sum(range(1, ctx.size + 1))
    if ctx.rank != 0:
        ctx.store.wait(["async/looked"], STORE_WAIT)
        work = dist.all_reduce(t, async_op=True)
        return {"checks": {"wait() is True": work.wait() is True, "the sum": bool((t == expected).all())}}
    work = dist.all_reduce(t, async_op=True)
    completed_before = work.is_completed()
    ctx.store.set("async/looked", "1")
    waited = work.wait()
    value = work.get_future().value()
    return {"checks": {
        "not completed before the others entered": completed_before is False,
        "wait() is True": waited is True,
        "completed after wait()": work.is_completed(),
        "is_success()": work.is_success(),
        "the future's value is the tensor, reduced": value[0].data_ptr() == t.data_ptr(),
        "the sum": bool((t == expected).all()),
    }}


def async_many(ctx: Ctx) -> dict:
    """Several collectives in flight at once, waited for in reverse order: each has its own result."""
    tensors = [torch.full((3,), float(ctx.rank + i)) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    gathered = [torch.empty(2) for _ in range(ctx.size)]
    works.append(dist.all_gather(gathered, torch.full((2,), float(ctx.rank)), async_op=True))
    done = [w.wait() for w in reversed(works)]
    sums = [sum(r + i for r in range(ctx.size)) for i in range(6)]
    return {"checks": {
        "every wait() is True": all(d is True for d in done),
        "each sum": [t[0].item() for t in tensors] == sums,
        "the gather": [g[0].item() for g in gathered] == list(range(ctx.size)),
    }}


def cases(suite: str, size: int) -> dict[str, Callable[[Ctx], dict]]:
    """The cases of ``suite``, by name, in the order every rank runs them."""
    found: dict[str, Callable[[Ctx], dict]] = {}
    full = suite == "all"
    dtypes = list(DTYPES) if full else ["float32", "bfloat16", "int64"]
    for op in OPS:
        for name in dtypes:
            low, high = (-3, 4) if op == "PRODUCT" else (-8, 9)
            found[f"all_reduce/{op}/{name}"] = functools.partial(
                all_reduce, op=op, data=functools.partial(ints, dtype=DTYPES[name], seed=OPS.index(op),
                                                          low=low, high=high))
    if full:
        for name in ("float32", "float64", "float16", "bfloat16"):
            found[f"all_reduce/SUM/{name}/random"] = functools.partial(
                all_reduce, op="SUM", data=functools.partial(randoms, dtype=DTYPES[name], seed=5))
        for op in ("BAND", "BOR", "BXOR"):
            found[f"refused/{op}"] = functools.partial(refused, op=op)
        found["refused/bool"] = functools.partial(refused, op=None)
    for src in ((0, 1) if full else (1, size - 1)):
        for name in (dtypes if full else ["float32", "bfloat16"]):
            found[f"broadcast/src{src}/{name}"] = functools.partial(broadcast, src=src, dtype=DTYPES[name])
    for name in (dtypes if full else ["float16"]):
        found[f"all_gather/{name}"] = functools.partial(all_gather, dtype=DTYPES[name])
        found[f"all_gather_into_tensor/{name}"] = functools.partial(all_gather_into_tensor, dtype=DTYPES[name])
    found["all_gather_object"] = all_gather_object
    for dst in ((0, 1) if full else (size - 1,)):
        for name in (dtypes if full else ["float32"]):
            found[f"gather/dst{dst}/{name}"] = functools.partial(gather, dst=dst, dtype=DTYPES[name])
            found[f"scatter/src{dst}/{name}"] = functools.partial(scatter, src=dst, dtype=DTYPES[name])
    found["gather_object"] = gather_object
    found["scatter_object_list"] = scatter_object_list
    for how in ("even", "uneven", "bits") if full else ("uneven",):
        for name in (("float32", "int64") if how != "bits" else ("float32", "bfloat16", "float64")) if full \
                else ("float32",):
            found[f"all_to_all_single/{how}/{name}"] = functools.partial(to_all, dtype=DTYPES[name], how=how)
    found["all_to_all/list/int64"] = functools.partial(to_all, dtype=torch.int64, how="list")
    if full:
        found["refused/all_to_all"] = refused_all_to_all
        found["refused/send"] = refused_send
    for op in (("SUM", "AVG", "MAX") if full else ("SUM",)):
        for name in (("float32", "int64") if full else ("float32",)):
            found[f"reduce_scatter/{op}/{name}"] = functools.partial(reduce_scatter, op=op, dtype=DTYPES[name])
            found[f"reduce_scatter_tensor/{op}/{name}"] = functools.partial(
                reduce_scatter_tensor, op=op, dtype=DTYPES[name])
    found["barrier"] = barrier
    if full:
        for how in ("transposed_sum", "strided_max", "broadcast_rows", "gathered_column"):
            found[f"noncontiguous/{how}"] = functools.partial(noncontiguous, how=how)
        found["async_many"] = async_many
    found["async_op"] = async_op
    return found


def collectives(args: argparse.Namespace, store: dist.Store) -> None:
    dist.init_process_group("xreduce", store=store, rank=args.rank, world_size=args.world_size)
    ctx = Ctx(args.rank, args.world_size, dist.new_group(backend="gloo"), store)
    suite = cases(args.suite, args.world_size)
    emit(event="cases", names=list(suite))
    for name, case in suite.items():
        emit(event="case", case=name, **case(ctx))
    dist.destroy_process_group()
    emit(event="done")


def timeout(args: argparse.Namespace, store: dist.Store) -> None:
    dist.init_process_group("xreduce", store=store, rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    dist.all_reduce(torch.ones(1))  # the group works
    if args.rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2))
            emit(event="no error")
        except Exception as e:  # noqa: BLE001 - the error is the result
            emit(event="error", seconds=time.monotonic() - started, **error(e))
        store.set("timeout/done", "1")
    else:
        store.wait(["timeout/done"], STORE_WAIT)
    emit(event="done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--store-port", type=int, help="the test's store; without it, env:// (mode train only)")
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("ddp")
    p.add_argument("--default", choices=["xreduce", "gloo"], default="xreduce")
    p.add_argument("--variants", default="xreduce,gloo,hook")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    modes.add_parser("train").add_argument("--steps", type=int, default=100_000)
    modes.add_parser("collectives").add_argument("--suite", choices=["all", "four"], default="all")
    modes.add_parser("timeout").add_argument("--timeout", type=float, default=3.0)
    p = modes.add_parser("options")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fsdp", action="store_true", help="then FSDP2's fully_shard on each group")
    args = parser.parse_args()
    if args.store_port is None:
        if args.mode != "train":
            parser.error(f"mode {args.mode} meets the other ranks at the test's store: give --store-port")
        train(args, None)
        return
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=STORE_WAIT)
    # Every rank has started (imported torch) before any forms a group: the groups' timeouts count from here.
    store.set(f"started/{args.rank}", "1")
    store.wait([f"started/{r}" for r in range(args.world_size)], STORE_WAIT)
    {"ddp": ddp, "train": train, "collectives": collectives, "timeout": timeout, "options": options}[args.mode](
        args, store)


if __name__ == "__main__":
    main()
