"""``xreduce.distribute``: the ``tf.distribute`` cross-device API over the daemon.

Replace ``tf.distribute`` with ``xreduce.distribute``:

    >>> import numpy as np
    >>> import xreduce
    >>> from xreduce import distribute
    >>> with xreduce.serve_embedded(virtual_devices=2):
    ...     v = distribute.PerReplica([np.array([1.0]), np.array([2.0])], devices=["CPU:0", "CPU:1"])
    ...     distribute.HierarchicalCopyAllReduce().reduce(distribute.ReduceOp.SUM, v, "CPU:1")
    array([3.])
"""

from xreduce._contexts import (
    ReplicaContext,
    ValueContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from xreduce._input import InputContext, InputOptions, InputReplicationMode
from xreduce._nccl import NcclAllReduce
from xreduce._ops import (
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    ReduceOp,
    ReductionToOneDevice,
)
from xreduce._sparse import IndexedSlices
from xreduce._strategy import MirroredStrategy
from xreduce._values import DistributedValues, Mirrored, PerReplica
from xreduce.distribute import experimental

__all__ = [
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "ValueContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "NcclAllReduce",
    "experimental",
    "in_cross_replica_context",
]
