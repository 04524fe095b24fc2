"""``NcclAllReduce``: TF's NCCL all-reduce, which needs a daemon whose devices are distinct GPUs.

Before anything is sent, the daemon's device table (``ListDevices``) says
whether NCCL can run: every device of the call must be a GPU of the cupy
backend and no two may share a GPU (NCCL runs one rank per GPU). Elsewhere the
call fails with an error that says why, as TF's does without GPUs. On distinct
GPUs the request names ``ALGORITHM_NCCL`` and the daemon routes it as TF's
``AllReduceCrossDeviceOps`` does: values whose destinations are their own
devices are all-reduced by NCCL (packed into ``num_packs`` packs), others go
to TF's fallback, ReductionToOneDevice (:mod:`xreduced.backends.nccl` sums).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import grpc

from xreduce._call import Algorithm
from xreduce._errors import InvalidArgumentError, XReduceError
from xreduce._job_devices import to_daemon
from xreduce._ops import CommunicationOptions, CrossDeviceOps, ReduceOp, checked_num_packs
from xreduce._options import ConnectionOptions
from xreduce._values import DistributedValues
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.devices import DeviceName


def nccl_refusal(table: pb.ListDevicesResponse, names: Sequence[str]) -> str | None:
    """Why NCCL cannot all-reduce over the devices ``names`` of a daemon whose device table is
    ``table``, or None when it can (each a GPU of its own).

    Example:
        >>> cpu0 = "/job:localhost/replica:0/task:0/device:CPU:0"
        >>> table = pb.ListDevicesResponse(backend="numpy", devices=[
        ...     pb.Device(name=cpu0, device_type="CPU", physical_device="host")])
        >>> print(nccl_refusal(table, [cpu0]))  # doctest: +ELLIPSIS
        NcclAllReduce needs GPUs: CPU:0 is a host device (the daemon's backend is numpy); NCCL runs on GPUs only, ...
    """
    by_name = {d.name: d for d in table.devices}
    hosts = [n for n in names if n in by_name and by_name[n].device_type != "GPU"]
    if hosts or table.backend != "cupy":
        listing = ", ".join(DeviceName.parse(n).short for n in (hosts or names))
        kind = "a host device" if len(hosts or names) == 1 else "host devices"
        return (f"NcclAllReduce needs GPUs: {listing} {'is' if kind[0] == 'a' else 'are'} {kind} (the daemon's "
                f"backend is {table.backend or 'unknown'}); NCCL runs on GPUs only, use HierarchicalCopyAllReduce or "
                "ReductionToOneDevice")
    seen: dict[str, str] = {}
    for n in names:
        physical = by_name[n].physical_device if n in by_name else ""
        if physical and physical in seen and seen[physical] != n:
            return (f"NcclAllReduce needs one GPU per device: {DeviceName.parse(seen[physical]).short} and "
                    f"{DeviceName.parse(n).short} are logical devices on one GPU ({physical}); NCCL runs one rank per "
                    "GPU, use HierarchicalCopyAllReduce for logical devices")
        seen.setdefault(physical, n)
    return None


class NcclAllReduce(CrossDeviceOps):
    """TF's ``tf.distribute.NcclAllReduce``: all-reduce with NCCL among the daemon's GPUs.

    Args:
        num_packs: the batch is packed into this many packs (0: no packing), as TF's.
        address: the daemon; see :func:`xreduce.resolve_address`.
        token: the daemon's bearer token; default ``XREDUCE_TOKEN``, else none.
        transport: ``"auto"``, ``"shm"`` or ``"wire"``; see :class:`xreduce.Client`.
        options: the connection settings as one :class:`xreduce.ConnectionOptions`.

    Raises:
        ValueError: ``num_packs`` < 0, with TF's message, or not an integer.
        xreduce.InvalidArgumentError: at a reduce, the daemon's devices are host devices or
            logical devices sharing a GPU (the message says which); NCCL needs distinct GPUs.

    Example:
        >>> import numpy as np, xreduce
        >>> NcclAllReduce(num_packs=-1)
        Traceback (most recent call last):
        ...
        ValueError: NCCL all-reduce requires num_packs >= 0, but -1 is specified
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     v = xreduce.distribute.PerReplica([np.ones(1), np.ones(1)], devices=["CPU:0", "CPU:1"])
        ...     NcclAllReduce().reduce("sum", v, v)
        Traceback (most recent call last):
        ...
        xreduce._errors.InvalidArgumentError: NcclAllReduce needs GPUs: CPU:0, CPU:1 are host devices (the daemon's ...
    """

    def __init__(self, num_packs: int = 1, address: str | None = None, token: str | None = None,
                 transport: str | None = None, *, options: ConnectionOptions | None = None):
        self.num_packs = checked_num_packs(num_packs, "NCCL all-reduce")
        super().__init__(address, token, transport, options=options)

    def _batch(self, op: ReduceOp, pairs: list[tuple[DistributedValues, Any]],
               options: CommunicationOptions | None, single: bool, outs: list[Any] | None = None) -> list[Any]:
        group = self._group()
        names = self._local_names(group)
        used = []
        for value, destinations in pairs:
            for name in list(value._resolve_devices(names)) + self._destination_names(destinations, names):
                with contextlib.suppress(ValueError, XReduceError):  # the collective refuses it, for every process
                    used.append(to_daemon(name, group, "devices"))
        refusal = nccl_refusal(self.client.list_devices(), list(dict.fromkeys(used)))
        if refusal is not None:
            raise InvalidArgumentError(refusal, grpc.StatusCode.INVALID_ARGUMENT)
        return super()._batch(op, pairs, options, single, outs)

    def _algorithm(self) -> Algorithm:
        return Algorithm("nccl", num_packs=self.num_packs)
