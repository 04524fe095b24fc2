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
* ``gather``/``scatter``: an all-gather of which the root keeps the rows; the root's parts, the same sum as a
  broadcast, each rank keeping its own.
* ``alltoall_base`` (``all_to_all_single``)/``alltoall``: every rank's split sizes gathered first (all ranks
  refuse a plan that does not add up, alike), then every rank's elements, each rank keeping its parts.
* ``send``/``recv``: not provided (``NotImplementedError``): the daemon runs collectives only.
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
        >>> _not_provided("send")(None)
        Traceback (most recent call last):
        ...
        NotImplementedError: the xreduce backend has no send: it reduces; use the gloo or nccl backend for send ...
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
        self._names: dict[str, str] = {}
        atexit.register(_close_at_exit, weakref.ref(self))

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"xreduce"``."""
        return BACKEND

    # torch names a group once it is made (``_set_group_name``, ``_set_group_desc``) and reads the names back
    # (``group.group_name``: DeviceMesh, and FSDP through it). A ProcessGroup keeps them on its backends, of which
    # a group written in Python has none: it keeps them itself.

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Records the name torch gave the group."""
        self._names["name"] = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch gave the group (``group.group_name``)."""
        return self._names.get("name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Records the description torch gave the group."""
        self._names["desc"] = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """The description torch gave the group (``group.group_desc``)."""
        return self._names.get("desc", "")

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

    def gather(self, output_tensors: Sequence[Sequence[torch.Tensor]], input_tensors: Sequence[torch.Tensor],
               opts: Any = None) -> Work:
        """Each rank's tensor into ``output_tensors[0][rank]`` of the root rank (``opts.rootRank``); the other
        ranks pass no outputs. An all-gather of which the root keeps the rows."""
        root = opts.rootRank if opts is not None else 0
        t = self._single(input_tensors, "input_tensors")
        outs = self._at_root(output_tensors, root, t, "output_tensors")

        def run() -> list[list[torch.Tensor]]:
            for o, part in zip(outs, self._gathered(t)):
                o.copy_(part.view_as(o))
            return [outs] if outs else []

        return self._submit(run)

    def scatter(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[Sequence[torch.Tensor]],
                opts: Any = None) -> Work:
        """The root rank's ``input_tensors[0][r]`` (``opts.rootRank``) into rank r's ``output_tensors[0]``; the
        other ranks pass no inputs. Every rank receives all the parts and keeps its own."""
        root = opts.rootRank if opts is not None else 0
        out = self._single(output_tensors, "output_tensors")
        ins = self._at_root(input_tensors, root, out, "input_tensors")

        def run() -> list[torch.Tensor]:
            rows = self._rows(dict(enumerate(ins)), out.dtype, out.numel())
            out.copy_(rows[self.rank()].view_as(out))
            return [out]

        return self._submit(run)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - torch's name
                      output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], opts: Any = None) -> Work:
        """``all_to_all_single``: rank r's ``input`` split along its first dimension (``input_split_sizes``, else
        in ``size`` equal parts), part j to rank j; rank j's ``output`` holds the parts it gets, in rank order
        (``output_split_sizes``)."""
        check_tensor(input, "input")
        check_tensor(output, "output")
        sends = _split(input, input_split_sizes, self.size(), "input")
        gets = _split(output, output_split_sizes, self.size(), "output")
        self._same_dtype([input, output], "output")

        def run() -> list[torch.Tensor]:
            output.copy_(torch.cat(self._exchange(input, sends, gets)).view(output.shape))
            return [output]

        return self._submit(run)

    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                 opts: Any = None) -> Work:
        """``all_to_all``: rank r's ``input_tensors[j]`` into rank j's ``output_tensors[r]``."""
        ins, outs = list(input_tensors), list(output_tensors)
        for field, tensors in (("input_tensors", ins), ("output_tensors", outs)):
            if len(tensors) != self.size():
                raise ValueError(f"{field} must hold {self.size()} tensors, one per rank; got {len(tensors)}")
            for i, t in enumerate(tensors):
                check_tensor(t, f"{field}[{i}]")
        self._same_dtype(ins + outs, "output_tensors")

        def run() -> list[torch.Tensor]:
            flat = torch.cat([t.reshape(-1) for t in ins])
            for o, part in zip(outs, self._exchange(flat, [t.numel() for t in ins], [t.numel() for t in outs])):
                o.copy_(part.view_as(o))
            return outs

        return self._submit(run)

    send = _not_provided("send", "point to point")
    recv = recv_anysource = _not_provided("recv", "point to point")

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

    def _single(self, tensors: Sequence[torch.Tensor], field: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"the xreduce backend takes one tensor per rank; got {len(tensors)} in {field}")
        check_tensor(tensors[0], f"{field}[0]")
        return tensors[0]

    def _at_root(self, lists: Sequence[Sequence[torch.Tensor]], root: int, like: torch.Tensor,
                 field: str) -> list[torch.Tensor]:
        """The root's list of ``size`` tensors like ``like`` (``lists[0]``); none on the other ranks."""
        if not 0 <= root < self.size():
            raise ValueError(f"the root rank must be in [0, {self.size()}); got {root}")
        if self.rank() != root:
            if any(len(x) for x in lists):
                raise ValueError(f"{field}: only the root rank {root} passes tensors; rank {self.rank()} passed "
                                 f"{sum(len(x) for x in lists)}")
            return []
        tensors = list(lists[0]) if len(lists) == 1 else []
        if len(tensors) != self.size() or any(t.numel() != like.numel() or t.dtype != like.dtype for t in tensors):
            raise ValueError(f"{field}[0] of the root rank must hold {self.size()} tensors of {like.numel()} "
                             f"elements of {like.dtype}; got {[(t.numel(), t.dtype) for t in tensors]}")
        return tensors

    @staticmethod
    def _same_dtype(tensors: Sequence[torch.Tensor], field: str) -> None:
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise ValueError(f"{field}: the tensors of an all_to_all must have one dtype; got {', '.join(dtypes)}")

    def _one(self, lists: Sequence[Sequence[torch.Tensor]], tensors: Sequence[torch.Tensor],
             field: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        if len(lists) != 1:
            raise ValueError(f"the xreduce backend takes one list of tensors per rank; got {len(lists)}")
        return list(lists[0]), self._single(tensors, field)

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
        return self._rows({self.rank(): t}, t.dtype, t.numel(), t.device)

    def _rows(self, rows: dict[int, torch.Tensor], dtype: torch.dtype, width: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
        """A (size, ``width``) tensor of ``dtype`` whose row r is what some rank gave as ``rows[r]`` (its first
        elements; the rest 0), on every rank: the rows' bits summed as integers, every other rank adding 0
        (:func:`~xreduce.torch._tensors.as_bits`), so every bit pattern arrives as it was."""
        probe = as_bits(torch.zeros(1, dtype=dtype))  # a complex element is two words
        buffer = torch.zeros((self.size(), width * probe.numel()), dtype=probe.dtype, device=device)
        for r, t in rows.items():
            bits = as_bits(t).reshape(-1)
            buffer[r, :bits.numel()].copy_(bits)
        self._sum([buffer])
        return buffer.view(dtype)

    def _exchange(self, flat: torch.Tensor, sends: Sequence[int], gets: Sequence[int]) -> list[torch.Tensor]:
        """The all-to-all of ``flat`` (this rank's elements, ``sends[j]`` of them for rank j, in rank order):
        the part each rank sends this one (``gets[r]`` elements from rank r), in rank order. Every rank first
        learns every rank's counts (one gather), and all refuse a plan that does not add up, alike; then every
        rank's elements are gathered, padded to the longest, and each rank keeps its parts."""
        n = self.size()
        counts = self._gathered(torch.tensor([*sends, *gets], dtype=torch.int64)).tolist()
        wrong = [(r, j) for r in range(n) for j in range(n) if counts[r][j] != counts[j][n + r]]
        if wrong:
            r, j = wrong[0]
            raise ValueError(f"all_to_all: rank {r} sends {counts[r][j]} element(s) to rank {j}, which expects "
                             f"{counts[j][n + r]} from it (its output split sizes)")
        rows = self._rows({self.rank(): flat}, flat.dtype, max(sum(c[:n]) for c in counts), flat.device)
        me = self.rank()
        return [rows[r, sum(counts[r][:me]):sum(counts[r][:me + 1])] for r in range(n)]

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


def _split(t: torch.Tensor, split_sizes: Sequence[int], size: int, field: str) -> list[int]:
    """Elements of ``t`` for each rank, in rank order: ``split_sizes`` rows of its first dimension each, or (none
    given) ``size`` equal parts.

    Example:
        >>> _split(torch.zeros(3, 2), [1, 2], 2, "input"), _split(torch.zeros(4), [], 2, "input")
        ([2, 4], [2, 2])
        >>> _split(torch.zeros(3), [], 2, "output")
        Traceback (most recent call last):
        ...
        ValueError: output: 3 rows cannot be split in 2 equal parts; pass output_split_sizes
    """
    rows = t.shape[0] if t.dim() else 1
    if not split_sizes:
        if rows % size:
            raise ValueError(f"{field}: {rows} rows cannot be split in {size} equal parts; pass {field}_split_sizes")
        split_sizes = [rows // size] * size
    split_sizes = list(split_sizes)
    if len(split_sizes) != size or any(s < 0 for s in split_sizes) or sum(split_sizes) != rows:
        raise ValueError(f"{field}_split_sizes must be {size} counts of rows that add up to {field}'s {rows}; got "
                         f"{split_sizes}")
    per_row = t.numel() // rows if rows else 0
    return [s * per_row for s in split_sizes]


def _close_at_exit(ref: weakref.ref) -> None:
    pg = ref()
    if pg is not None:
        pg.shutdown()
