"""``xreduce.distribution``: the ``keras.distribution`` utilities over the daemon.

Replace ``keras.distribution`` with ``xreduce.distribution``: devices come from
the xreduce daemon, gradients are all-reduced by it.

    >>> import numpy as np
    >>> import xreduce
    >>> from xreduce import distribution
    >>> with xreduce.serve_embedded(virtual_devices=2):
    ...     dp = distribution.DataParallel(devices=distribution.list_devices())
    ...     x = dp.distribute_batch(np.arange(8.0).reshape(4, 2))  # rows 0-1 on cpu:0, rows 2-3 on cpu:1
    ...     dp.all_reduce_gradients(x, "sum").values[0]
    array([[ 4.,  6.],
           [ 8., 10.]])
"""

from xreduce._keras_devices import (
    DistributionState,
    ProcessInfo,
    get_device_count,
    initialize,
    is_initialized,
    list_devices,
    num_processes,
    process_id,
    process_info,
    shutdown,
)
from xreduce._keras_layouts import (
    DEFAULT_BATCH_DIM_NAME,
    DataParallel,
    DeviceMesh,
    Distribution,
    TensorLayout,
    distribution,
    set_distribution,
)

__all__ = [
    "DEFAULT_BATCH_DIM_NAME",
    "DataParallel",
    "DeviceMesh",
    "Distribution",
    "DistributionState",
    "ProcessInfo",
    "TensorLayout",
    "distribution",
    "get_device_count",
    "initialize",
    "is_initialized",
    "list_devices",
    "num_processes",
    "process_id",
    "process_info",
    "set_distribution",
    "shutdown",
]
