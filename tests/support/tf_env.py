"""What the TensorFlow tests share: TF with eight logical CPU devices in this process, and a child's
environment for the tests that start TensorFlow processes of their own."""

from __future__ import annotations

import os

LOGICAL_CPUS = 8
"""Logical CPU devices every TF test process of this suite has (TF can set them once per process)."""

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
"""TF's C++ log lines off (its start-up notices would fill every test's output)."""


def logical_cpus(count: int = LOGICAL_CPUS):
    """TensorFlow, with ``count`` logical CPUs (``/cpu:0`` ... ``/cpu:{count-1}``) in this process.

    Raises:
        RuntimeError: TF started in this process with fewer before (another test module set them).
    """
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:  # TF's devices are made already: they must be enough
        pass
    have = len(tf.config.list_logical_devices("CPU"))
    if have < count:
        raise RuntimeError(f"TF started in this process with {have} logical CPUs; these tests need {count}")
    return tf
