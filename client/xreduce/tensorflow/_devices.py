"""TF's device names as the SDK's.

TF names a process's own devices locally: ``/job:localhost/replica:0/task:0/device:CPU:1`` (or
``/cpu:1``); under a multi-worker cluster it qualifies them, ``/job:worker/replica:0/task:T/device:CPU:1``.
The SDK takes TF's task-qualified names as they are (process ``T``'s ``CPU:1``, see
:mod:`xreduce._job_devices`), so one rule is left here: a local name is this process's, task ``P``
(process ``P`` of a multi-process group, else 0). ``/cpu:0`` of process 1 is process 1's first
device, on every node; another process's device is refused, saying whose it is.
"""

from __future__ import annotations

import tensorflow as tf

from xreduce._errors import NotFoundError
from xreduce._job_devices import sdk_name as job_name
from xreduce._job_devices import task_name
from xreduce._runtime import ProcessGroup


def sdk_name(tf_name: str, group: ProcessGroup | None) -> str:
    """The SDK's canonical name of this process's device that TF calls ``tf_name``.

    Raises:
        ValueError: ``tf_name`` names no device, names another process's device, or a device beyond
            this process's share; the message says which devices are this process's.

    Example:
        >>> sdk_name("/job:localhost/replica:0/task:0/device:CPU:1", None)
        '/job:localhost/replica:0/task:0/device:CPU:1'
        >>> group = ProcessGroup("g", 2, 1, ("/cpu:2", "/cpu:3"), ("/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"))
        >>> sdk_name("/cpu:1", group), sdk_name("/job:worker/replica:0/task:1/device:CPU:1", group)
        ('/job:localhost/replica:0/task:0/device:CPU:3', '/job:localhost/replica:0/task:0/device:CPU:3')
    """
    spec = tf.DeviceSpec.from_string(tf_name)
    if spec.device_type is None:
        raise ValueError(f"device {tf_name!r} names no device (expected e.g. /cpu:0 or /gpu:0)")
    if spec.job in (None, "localhost"):
        task = group.process_id if group is not None else 0
        name, field = task_name(task, spec.device_type.upper(), spec.device_index or 0), f"device {tf_name!r}"
    else:
        name, field = tf_name, ""
    try:
        return job_name(name, group, field)
    except NotFoundError as e:  # TF's strategies take a bad device as a ValueError
        raise ValueError(str(e)) from None


def local_name(tf_name: str) -> str:
    """Where TF places this process's copy of a result for device ``tf_name``: the name without its job, replica
    and task (a task-qualified name is this process's own once :func:`sdk_name` has accepted it).

    Example:
        >>> local_name("/job:worker/replica:0/task:1/device:CPU:1")
        '/device:CPU:1'
    """
    return tf.DeviceSpec.from_string(tf_name).replace(job=None, replica=None, task=None).to_string()
