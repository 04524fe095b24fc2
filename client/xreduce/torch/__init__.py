"""``xreduce.torch``: PyTorch's ``torch.distributed`` and ``DistributedDataParallel`` on the xreduce daemon.

Importing it registers the ``xreduce`` backend; then the one-line change from Gloo is the backend's name:

    import torch.distributed as dist
    import xreduce.torch  # registers "xreduce"

    dist.init_process_group("xreduce")  # env:// as torchrun sets it, or rank=, world_size=, store=
    model = torch.nn.parallel.DistributedDataParallel(model)

Each rank drives one device of its node's daemon (``XREDUCE_ADDRESS``); ranks on several nodes form one
group across nodes, as ``xreduce.distribution.initialize`` forms it (docs/pytorch.md). To keep Gloo or
NCCL as the default group and send only DDP's gradients through the daemon, use :func:`allreduce_hook`.

Example:
    >>> import torch.distributed as dist
    >>> BACKEND in dist.Backend.backend_list
    True
"""

import datetime
from typing import Any

import torch
import torch.distributed as dist

from xreduce.torch._group import BACKEND, ProcessGroupXReduce
from xreduce.torch._work import Work


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupXReduce:
    return ProcessGroupXReduce(store, rank, size, timeout)


def register() -> None:
    """Registers the ``xreduce`` backend with ``torch.distributed`` (``import xreduce.torch`` does). Idempotent.

    Example:
        >>> register(); register()
    """
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


# No `from __future__ import annotations` here: DDP's register_comm_hook checks these annotations' values.
def allreduce_hook(process_group: ProcessGroupXReduce | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each gradient bucket through the daemon.

    For a job that keeps Gloo or NCCL as its default group: make an xreduce group of the same ranks and
    give it to DDP's ``register_comm_hook`` with this hook (PyTorch's own ``allreduce_hook``, on the daemon):

        xr = dist.new_group(backend="xreduce")
        ddp.register_comm_hook(xr, xreduce.torch.allreduce_hook)

    Args:
        process_group: an xreduce group (``new_group(backend="xreduce")``); None: the default group,
            which must then be an xreduce one.
        bucket: DDP's bucket; its buffer is divided by the group's size, then summed in place.

    Returns:
        A future of the bucket's averaged buffer, as DDP expects of a hook.

    Example:
        >>> import torch.distributed as dist
        >>> allreduce_hook(None, None)
        Traceback (most recent call last):
        ...
        ValueError: allreduce_hook needs an xreduce process group (dist.new_group(backend="xreduce")); got the ...
    """
    group = process_group
    if group is None:
        if not dist.is_initialized():
            raise ValueError('allreduce_hook needs an xreduce process group (dist.new_group(backend="xreduce")); '
                             "got the default group, which is not initialized")
        group = dist.group.WORLD
    if not isinstance(group, ProcessGroupXReduce):
        name = group.getBackendName() if hasattr(group, "getBackendName") else "?"
        raise ValueError('allreduce_hook needs an xreduce process group (dist.new_group(backend="xreduce")); '
                         f"got {type(group).__name__} ({name})")
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return group.allreduce([tensor]).get_future().then(lambda fut: fut.value()[0])


register()

__all__ = ["BACKEND", "ProcessGroupXReduce", "Work", "allreduce_hook", "register"]
