"""TF's device names as the daemon names them.

TF names a process's devices locally: ``/job:localhost/replica:0/task:0/device:CPU:1``
(or ``/cpu:1``), and under a multi-worker cluster ``/job:worker/replica:0/task:T/device:CPU:1``.
The daemon names its own devices. One rule maps one onto the other:

* a process outside any group: TF's ``CPU:i`` (``GPU:i``) is the daemon's ``CPU:i`` (``GPU:i``);
* a process of a multi-process group (``xreduce.distribution.initialize``): TF's ``CPU:i`` is
  the ``i``-th CPU device of the group's share of this process (``process_info().local_devices``),
  so ``/cpu:0`` of process 1 is process 1's first device on every node. A task-qualified name
  (``/job:worker/task:T/...``) names process ``T``'s device; another process's is refused.
"""

from __future__ import annotations

import tensorflow as tf

from xreduce._runtime import ProcessGroup
from xreduce.wire.devices import DeviceName, canonical


def daemon_name(tf_name: str, group: ProcessGroup | None) -> str:
    """The daemon's canonical name of the device TF calls ``tf_name``.

    Raises:
        ValueError: ``tf_name`` names no device, names another process's device, or a device beyond
            this process's share; the message says which devices are this process's.

    Example:
        >>> daemon_name("/job:localhost/replica:0/task:0/device:CPU:1", None)
        '/job:localhost/replica:0/task:0/device:CPU:1'
        >>> group = ProcessGroup("g", 2, 1, ("/cpu:2", "/cpu:3"), ("/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"))
        >>> daemon_name("/job:worker/replica:0/task:1/device:CPU:1", group)
        '/job:localhost/replica:0/task:0/device:CPU:3'
    """
    spec = tf.DeviceSpec.from_string(tf_name)
    if spec.device_type is None:
        raise ValueError(f"device {tf_name!r} names no device (expected e.g. /cpu:0 or /gpu:0)")
    kind, index = spec.device_type.upper(), spec.device_index or 0
    if group is None:
        return canonical(f"{kind}:{index}")
    if spec.job not in (None, "localhost") and spec.task is not None and spec.task != group.process_id:
        raise ValueError(f"device {tf_name!r} is process {spec.task}'s; this is process {group.process_id} of "
                         f"{group.num_processes}, whose devices are {_listing(group)}")
    mine = [d for d in group.local_devices if DeviceName.parse(d).device_type == kind]
    if index >= len(mine):
        raise ValueError(f"device {tf_name!r}: process {group.process_id} has {len(mine)} {kind} device(s) in "
                         f"group {group.group!r} ({_listing(group)}), so /{kind.lower()}:{index} is not one of them")
    return canonical(mine[index])


def local_name(tf_name: str) -> str:
    """Where TF places this process's copy of a result for device ``tf_name``: the name without its job, replica
    and task (a task-qualified name is this process's own once :func:`daemon_name` has accepted it).

    Example:
        >>> local_name("/job:worker/replica:0/task:1/device:CPU:1")
        '/device:CPU:1'
    """
    return tf.DeviceSpec.from_string(tf_name).replace(job=None, replica=None, task=None).to_string()


def _listing(group: ProcessGroup) -> str:
    names = [DeviceName.parse(d) for d in group.local_devices]
    counts: dict[str, int] = {}
    for n in names:
        counts[n.device_type] = counts.get(n.device_type, 0) + 1
    return ", ".join(f"/{kind.lower()}:{i}" for kind, count in counts.items() for i in range(count)) or "none"
