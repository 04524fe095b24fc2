"""TF's device names as the SDK's (``xreduce.tensorflow._devices``): every form TF gives, one device each."""

from __future__ import annotations

import pytest
from tf_env import logical_cpus

logical_cpus()
from xreduce._runtime import ProcessGroup  # noqa: E402
from xreduce.tensorflow._devices import local_name, sdk_name  # noqa: E402

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format
GROUP = ProcessGroup("train", 2, 1, (CPU(4), CPU(5)), tuple(CPU(i) for i in range(6)), shares=(4, 2))
"""Process 1 of 2, whose share of its daemon is CPU:4 and CPU:5."""


@pytest.mark.parametrize("name", ["/cpu:1", "cpu:1", "CPU:1", "/device:CPU:1", CPU(1), "/job:localhost/task:0/cpu:1"])
def test_outside_a_group_tfs_device_is_the_daemons_of_the_same_name(name):
    assert sdk_name(name, None) == CPU(1)


@pytest.mark.parametrize("name", ["/cpu:1", "/device:CPU:1", CPU(1), "/job:worker/replica:0/task:1/device:CPU:1",
                                  "/job:worker/task:1/cpu:1"])
def test_in_a_group_tfs_device_i_is_the_processs_ith_device(name):
    assert sdk_name(name, GROUP) == CPU(5)
    assert local_name(name) == "/device:CPU:1"


def test_another_processs_device_is_refused_naming_whose_it_is():
    with pytest.raises(ValueError, match=r"^device '/job:worker/replica:0/task:0/device:CPU:0' is process 0's; this "
                                         r"is process 1 of 2, whose devices are cpu:4, cpu:5 \(/job:worker/replica:0/"
                                         r"task:1/device:CPU:0, /job:worker/replica:0/task:1/device:CPU:1\)$"):
        sdk_name("/job:worker/replica:0/task:0/device:CPU:0", GROUP)


def test_a_device_past_the_processs_share_is_refused():
    with pytest.raises(ValueError, match=r"^device '/cpu:2': no device '/job:worker/replica:0/task:1/device:CPU:2': "
                                         r"process 1 has 2 CPU device\(s\) \(/job:worker/replica:0/task:1/device:"
                                         r"CPU:0, /job:worker/replica:0/task:1/device:CPU:1\)$"):
        sdk_name("/cpu:2", GROUP)
    with pytest.raises(ValueError, match=r"process 1 has 0 GPU device\(s\)"):
        sdk_name("/gpu:0", GROUP)


def test_a_name_without_a_device_is_refused():
    with pytest.raises(ValueError, match="names no device"):
        sdk_name("/job:worker/task:1", GROUP)
