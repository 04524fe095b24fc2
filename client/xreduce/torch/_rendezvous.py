"""How the ranks of a ``torch.distributed`` group become an xreduce group.

Every rank reads its daemon's ``node_id`` (``GetStatus``: a random id the daemon draws at start) and
writes it to the group's store. Rank 0 reads them all and writes the plan: a group name of its own
(``torch-<hex>``: jobs and ``new_group`` groups sharing a daemon never meet), and a coordinator
address when the ranks use more than one daemon (:func:`coordinator_address`). Every rank then joins
the xreduce group as ``xreduce.distribution.initialize`` joins it (``JoinGroup`` through its daemon,
bounded by the daemon's ``--collective-timeout``), asking for one device: its daemon's ``local_rank``-th
(``XREDUCE_LOCAL_DEVICES`` wins). On a GPU node that is the GPU torchrun's convention gives the rank
(``torch.cuda.set_device(local_rank)``) when the daemon drives the node's GPUs in their order.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from xreduce._client import Client
from xreduce._keras_devices import ENV_JOB_ADDRESSES, ENV_LOCAL_DEVICES, DistributionState

ENV_COORDINATOR = "XREDUCE_COORDINATOR"
"""``host:port`` where process 0's daemon serves the coordinator of a group across nodes."""

STATUS_TIMEOUT = 30.0
"""Seconds a daemon may take to answer ``GetStatus`` (it answers from memory)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What rank 0 decides for the group: its name and, across nodes, the coordinator's address.

    Example:
        >>> Plan.loads(Plan("torch-ab12", "10.0.0.1:29501").dumps())
        Plan(group='torch-ab12', coordinator='10.0.0.1:29501')
    """

    group: str
    coordinator: str = ""

    def dumps(self) -> bytes:
        """The plan as the store holds it."""
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def loads(cls, data: bytes) -> Plan:
        """The plan the store holds."""
        return cls(**json.loads(data))


def coordinator_address(env: Mapping[str, str] = os.environ) -> str:
    """Where process 0's daemon serves the coordinator when the ranks span nodes: the first of
    ``KERAS_DISTRIBUTION_JOB_ADDRESSES``, else ``XREDUCE_COORDINATOR``, else ``MASTER_ADDR`` at
    ``MASTER_PORT + 1`` (the port after torch's own store, as torchrun sets them).

    Raises:
        ValueError: none of them is set; the message names them.

    Example:
        >>> coordinator_address({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        '10.0.0.1:29501'
        >>> coordinator_address({"XREDUCE_COORDINATOR": "10.0.0.1:1234", "MASTER_ADDR": "10.0.0.1"})
        '10.0.0.1:1234'
    """
    if env.get(ENV_JOB_ADDRESSES):
        return env[ENV_JOB_ADDRESSES].split(",")[0].strip()
    if env.get(ENV_COORDINATOR):
        return env[ENV_COORDINATOR].strip()
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        try:
            port = int(env["MASTER_PORT"]) + 1
        except ValueError:
            raise ValueError(f"MASTER_PORT must be an integer; got {env['MASTER_PORT']!r}") from None
        return f"{env['MASTER_ADDR']}:{port}"
    raise ValueError(
        "the ranks use more than one xreduce daemon (several nodes), so process 0's daemon must serve a "
        f"coordinator: set {ENV_COORDINATOR}=host:port (or {ENV_JOB_ADDRESSES}, or MASTER_ADDR and MASTER_PORT "
        "as torchrun does; the coordinator then listens at MASTER_PORT + 1)")


def local_device(devices: Sequence[str], local_rank: int) -> str:
    """The daemon device this rank asks for: the ``local_rank``-th of the daemon's list.

    Raises:
        ValueError: more ranks on the node than the daemon has devices; the message says how to start it.

    Example:
        >>> local_device(["CPU:0", "CPU:1"], 1)
        'CPU:1'
    """
    if local_rank >= len(devices):
        raise ValueError(
            f"this node has at least {local_rank + 1} ranks of the group but its xreduce daemon has "
            f"{len(devices)} devices ({', '.join(devices)}): each rank drives one; start the daemon with "
            f"--virtual-devices {local_rank + 1} or more (XREDUCE_VIRTUAL_DEVICES), or name each rank's device "
            f"with {ENV_LOCAL_DEVICES}")
    return devices[local_rank]


def join(store: Any, rank: int, size: int, timeout: datetime.timedelta,
         address: str | None = None) -> tuple[DistributionState, str]:
    """This rank in its xreduce group, planned through ``store`` (the ``torch.distributed`` group's).

    Returns:
        The joined :class:`xreduce._keras_devices.DistributionState` (its ``group`` is the xreduce
        group, None for a group of one; ``shutdown()`` leaves it), and the daemon device this rank drives.

    Raises:
        ValueError: as :func:`coordinator_address` and :func:`local_device`.
        xreduce.XReduceError: the daemon refused the join; the message is the daemon's.
    """
    with Client(address, timeout=STATUS_TIMEOUT) as client:
        node = client.get_status().node_id or client.address
        devices = [f"{d.device_type}:{d.index}" for d in client.list_devices().devices]
    store.set(f"xreduce/node/{rank}", node)
    keys = [f"xreduce/node/{r}" for r in range(size)]
    store.wait(keys, timeout)
    nodes = [store.get(k).decode() for k in keys]
    if rank == 0:
        coordinator = coordinator_address() if len(set(nodes)) > 1 else ""
        store.set("xreduce/plan", Plan(f"torch-{secrets.token_hex(6)}", coordinator).dumps())
    store.wait(["xreduce/plan"], timeout)
    plan = Plan.loads(store.get("xreduce/plan"))
    local_rank = nodes[:rank].count(nodes[rank])
    named = [d.strip() for d in os.environ.get(ENV_LOCAL_DEVICES, "").split(",") if d.strip()]
    wanted = named or [local_device(devices, local_rank)]
    state = DistributionState(address)
    state.initialize((plan.coordinator,) if plan.coordinator else (), size, rank, group=plan.group,
                     devices=wanted)
    return state, wanted[0]
