"""``ProcessGroupXReduce``: a ``torch.distributed`` process group whose collectives the daemon performs.

Each rank is one replica of an xreduce group (:mod:`xreduce.torch._rendezvous`) and every collective is
one call of the SDK's :class:`xreduce.distribute.HierarchicalCopyAllReduce` across the group, run on the
group's worker thread (:mod:`xreduce.torch._work`):

* ``allreduce`` (and ``allreduce_coalesced``): one ``batch_reduce`` of the tensors, written back into
  them (``out=``: a CPU tensor's own memory). SUM and AVG on the daemon (AVG: the sum divided by the
  group's size); MIN, MAX and PRODUCT over the gathered tensors, folded in rank order in each rank.
* ``allgather``/``all_gather_single``: each rank's tensor in its slot of a buffer that holds 0 elsewhere,
  summed as integers of the elements' width (:func:`xreduce.torch._tensors.as_bits`): ``x + 0`` is ``x`` for
  every bit pattern, so the gather is exact, NaN payloads and signalling NaNs included.
* ``broadcast``: the same sum, every rank but the root contributing 0.
* ``reduce_scatter``/``reduce_scatter_single``: the all-reduce of the whole input, each rank keeping its part.
* ``barrier``: an all-reduce of one element.
"""

from __future__ import annotations

import atexit
import datetime
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup

from xreduce._job_devices import job_devices
from xreduce._ops import CommunicationOptions, HierarchicalCopyAllReduce
from xreduce._values import PerReplica
from xreduce.torch import _rendezvous
from xreduce.torch._shared import SharedStorages
from xreduce.torch._tensors import GATHERED, as_bits, check_tensor, checked_op, from_sdk, to_sdk
from xreduce.torch._work import Runner, Work

BACKEND = "xreduce"
"""The name ``torch.distributed`` knows the backend by."""

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class _GroupOps(HierarchicalCopyAllReduce):
    """The SDK's all-reduce across one torch group's xreduce group (not the process's default one)."""

    def __init__(self, group, address: str | None):
        super().__init__(address=address)
        self._torch_group = group
        self.in_place_shared = False
        """Set for a call whose tensors all lie in shared memory, reduced in place: nothing is staged or copied,
        so it goes whole, not in chunks (which bound the staging memory) and their agreement collective."""

    def _group(self):
        return self._torch_group

    def _cut(self, given) -> bool:
        return not self.in_place_shared and super()._cut(given)


def _not_provided(name: str, note: str = "") -> Callable[..., Work]:
    """A collective the backend does not provide: it raises ``NotImplementedError`` naming ``name``.

    Example:
        >>> _not_provided("scatter")(None)
        Traceback (most recent call last):
        ...
        NotImplementedError: the xreduce backend has no scatter: it reduces; use the gloo or nccl backend for ...
    """

    def refuse(self: Any, *args: Any) -> Work:
        raise NotImplementedError(f"the xreduce backend has no {name}: it reduces; use the gloo or nccl backend "
                                  f"for {name} (e.g. a second group, dist.new_group(backend='gloo'))")

    refuse.__doc__ = f"Not provided{f' ({note})' if note else ''}: raises ``NotImplementedError``."
    return refuse


class ProcessGroupXReduce(ProcessGroup):
    """A ``torch.distributed`` process group over the xreduce daemon (the ``xreduce`` backend).

    ``import xreduce.torch`` registers it; ``torch.distributed.init_process_group("xreduce")`` (or
    ``new_group(backend="xreduce")``) makes one. Each rank drives one device of its node's daemon.

    Args:
        store: the group's ``torch.distributed`` store (through which the ranks plan the xreduce group).
        rank: this rank in the group.
        size: the group's size.
        timeout: how long a collective, and the forming of the group, may take.
        address: the daemon; default ``XREDUCE_ADDRESS``, else the default address.

    Example:
        >>> import torch, torch.distributed as dist, xreduce
        >>> with xreduce.serve_embedded(virtual_devices=1):
        ...     pg = ProcessGroupXReduce(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
        ...     t = torch.tensor([1.0, 2.0])
        ...     pg.allreduce([t]).wait()
        ...     pg.shutdown()
        True
        >>> t, pg.getBackendName()
        (tensor([1., 2.]), 'xreduce')
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 address: str | None = None):
        super().__init__(rank, size)
        self._state, device = _rendezvous.join(store, rank, size, timeout, address)
        group = self._state.group
        self._device = job_devices(group).mine[0] if group is not None else device
        self._ops = _GroupOps(group, address)
        self._options = CommunicationOptions(timeout_seconds=timeout.total_seconds())
        self._runner = Runner(group.group if group is not None else "one")
        self._shared = SharedStorages()
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"xreduce"``."""
        return BACKEND

    @property
    def device(self) -> str:
        """This rank's device in the xreduce group (the job's name, e.g. ``cpu:1``)."""
        return self._device

    # --- collectives ------------------------------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        """Reduces each tensor across the group, in place (``opts.reduceOp``, default SUM)."""
        op = checked_op(opts.reduceOp if opts is not None else "SUM")
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
        return self._submit(lambda: self._reduce(op, tensors) or tensors)

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        """As :meth:`allreduce`: the tensors go in one call."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        """Copies the root rank's tensors (``opts.rootRank``) into every rank's."""
        root = opts.rootRank if opts is not None else 0
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")

        def run() -> list[torch.Tensor]:
            bits = [as_bits(t) for t in tensors]
            if self.rank() != root:
                for b in bits:
                    b.zero_()
            self._sum(bits)
            return tensors

        return self._submit(run)

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]], input_tensors: Sequence[torch.Tensor],
                  opts: Any = None) -> Work:
        """Each rank's tensor into ``output_tensors[0][rank]`` of every rank."""
        outs, t = self._one(output_tensors, input_tensors, "input_tensors")
        if len(outs) != self.size() or any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
            raise ValueError(f"output_tensors[0] must hold {self.size()} tensors of {t.numel()} elements of "
                             f"{t.dtype}; got {[(o.numel(), o.dtype) for o in outs]}")

        def run() -> list[list[torch.Tensor]]:
            gathered = self._gathered(t)
            for o, part in zip(outs, gathered):
                o.copy_(part.view_as(o))
            return [outs]

        return self._submit(run)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """Each rank's tensor into its slot of ``output`` (``size`` times the input's elements)."""
        check_tensor(input, "input_tensor")
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise ValueError(f"output_tensor must have {self.size()} x {input.numel()} elements of {input.dtype}; "
                             f"got {output.numel()} of {output.dtype}")
        return self._submit(lambda: [output.copy_(self._gathered(input).view_as(output))])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: Sequence[torch.Tensor],
                       input_tensors: Sequence[Sequence[torch.Tensor]], opts: Any = None) -> Work:
        """The reduction of ``input_tensors[0][r]`` over the group into rank r's ``output_tensors[0]``."""
        op = checked_op(opts.reduceOp if opts is not None else "SUM")
        ins, out = self._one(input_tensors, output_tensors, "output_tensors")
        if len(ins) != self.size():
            raise ValueError(f"input_tensors[0] must hold {self.size()} tensors; got {len(ins)}")

        def run() -> list[torch.Tensor]:
            whole = torch.cat([i.reshape(-1) for i in ins])
            self._reduce(op, [whole])
            out.copy_(whole[self.rank() * out.numel():(self.rank() + 1) * out.numel()].view_as(out))
            return [out]

        return self._submit(run)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """The reduction of ``input`` over the group; rank r keeps part r in ``output``."""
        op = checked_op(opts.reduceOp if opts is not None else "SUM")
        check_tensor(input, "input")
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"input must have {self.size()} x {output.numel()} elements; got {input.numel()}")

        def run() -> list[torch.Tensor]:
            whole = input.reshape(-1).clone()
            self._reduce(op, [whole])
            n = output.numel()
            output.copy_(whole[self.rank() * n:(self.rank() + 1) * n].view_as(output))
            return [output]

        return self._submit(run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Work:
        """The reduction into the root rank's tensors (``opts.rootRank``); here every rank's gets it."""
        return self.allreduce(tensors, opts)

    send = _not_provided("send", "point to point")
    recv = recv_anysource = _not_provided("recv", "point to point")
    gather = _not_provided("gather", "all_gather is")
    scatter = _not_provided("scatter")
    alltoall = alltoall_base = _not_provided("all_to_all")

    def barrier(self, opts: Any = None) -> Work:
        """Done once every rank has called it."""
        flag = torch.zeros(1)
        return self._submit(lambda: self._sum([flag]) or [flag])

    # --- the end ----------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the xreduce group (``destroy_process_group`` calls it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._runner.close()
        self._shared.clear()
        self._ops.close()
        self._state.shutdown()

    abort = shutdown

    # --- the work ---------------------------------------------------------------------------------------------

    def _submit(self, call: Callable[[], Any]) -> Work:
        if self._closed:
            raise ValueError("this xreduce process group was shut down (destroy_process_group)")
        return self._runner.submit(call)

    def _one(self, lists: Sequence[Sequence[torch.Tensor]], tensors: Sequence[torch.Tensor],
             field: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        if len(lists) != 1 or len(tensors) != 1:
            raise ValueError(f"the xreduce backend takes one tensor per rank; got {len(tensors)} in {field}")
        return list(lists[0]), tensors[0]

    def _reduce(self, op: str, tensors: list[torch.Tensor]) -> None:
        """``op`` over the group of each tensor, written into it."""
        if op in GATHERED:
            for t in tensors:
                gathered = self._gathered(t)
                result = gathered[0].clone()
                for part in gathered[1:]:
                    if op == "MIN":
                        torch.minimum(result, part, out=result)
                    elif op == "MAX":
                        torch.maximum(result, part, out=result)
                    else:
                        result.mul_(part)
                t.copy_(result.view_as(t))
            return
        self._sum(tensors)
        if op == "AVG":
            for t in tensors:
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    t.div_(self.size())
                else:
                    t.copy_(torch.div(t, self.size(), rounding_mode="trunc"))

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t``, flattened, one row per rank."""
        bits = as_bits(t)
        buffer = torch.zeros((self.size(), bits.numel()), dtype=bits.dtype, device=t.device)
        buffer[self.rank()].copy_(bits.reshape(-1))
        self._sum([buffer])
        return buffer.view(t.dtype)

    def _sum(self, tensors: list[torch.Tensor]) -> None:
        """The sum over the group of each tensor, written into it: one call for all of them."""
        work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        shared = [w is t and t.device.type == "cpu" and self._shared.share(t)  # DDP's buckets: into shm, once
                  for t, w in zip(tensors, work)]
        arrays = [to_sdk(t) for t in work]
        pairs = [(PerReplica([a], devices=[self._device]), self._device) for a in arrays]
        host = all(type(a).__module__ == "numpy" for a in arrays)
        self._ops.in_place_shared = all(shared)
        results = self._ops.batch_reduce("sum", pairs, self._options, out=list(arrays) if host else None)
        for t, w, result in zip(tensors, work, results):
            if not host:
                w.copy_(from_sdk(result, w).view_as(w))
            if w is not t:
                t.copy_(w)


def _close_at_exit(ref: weakref.ref) -> None:
    pg = ref()
    if pg is not None:
        pg.shutdown()
