"""One name per device (``xreduce._job_devices``): every name form the SDK gives out, mapped to the process that
drives the device and its daemon's name; another process's device refused, saying whose it is.

The groups are shaped as the daemon's JoinGroup replies: four processes of two CPU devices on two nodes
(processes 0 and 1 on node 0, 2 and 3 on node 1, four devices a node), and two processes on one daemon.
"""

from __future__ import annotations

import pytest
from xreduce._errors import InvalidArgumentError, NotFoundError
from xreduce._job_devices import DaemonName, JobDevices, reduce_to, sdk_name, to_daemon
from xreduce._runtime import ProcessGroup
from xreduce.v1 import xreduce_pb2 as pb

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format
TASK = "/job:worker/replica:0/task:{}/device:CPU:{}".format


def across_nodes(pid: int) -> ProcessGroup:
    """Process ``pid`` of 4, two per node: node 1's daemon calls processes 2 and 3's devices CPU:0 to CPU:3."""
    node = pid // 2
    names = {p: [f"/job:localhost/replica:0/task:{p // 2}/device:CPU:{2 * (p % 2) + i}" for i in range(2)]
             for p in range(4)}
    reply = pb.JoinGroupResponse(
        local_devices=[CPU(2 * (pid % 2) + i) for i in range(2)],
        global_devices=[n for p in range(4) for n in names[p]],
        processes=[pb.ProcessDevices(process_id=p, devices=names[p]) for p in range(4)], epoch=1,
        group="default@10.0.0.1:1234", nodes=[pb.ClusterNode(index=0), pb.ClusterNode(index=1)], node_index=node,
        engine="gloo")
    return ProcessGroup.from_reply("default", 4, pid, reply)


def one_daemon(pid: int) -> ProcessGroup:
    """Process ``pid`` of 2 on one daemon of 8 devices, four each."""
    shares = {p: [CPU(4 * p + i) for i in range(4)] for p in range(2)}
    reply = pb.JoinGroupResponse(local_devices=shares[pid], global_devices=shares[0] + shares[1],
                                 processes=[pb.ProcessDevices(process_id=p, devices=shares[p]) for p in range(2)])
    return ProcessGroup.from_reply("train", 2, pid, reply)


@pytest.mark.parametrize("name", ["cpu:5", "CPU:5", "/cpu:5", "/device:CPU:5", CPU(5), TASK(2, 1),
                                  "/job:worker/task:2/cpu:1", "/job:chief/replica:0/task:2/device:CPU:1"])
def test_every_form_of_a_node_1_device_is_the_same_device(name):
    group = across_nodes(2)
    assert to_daemon(name, group, "devices[0]") == CPU(1)  # process 2's second device, node 1's CPU:1
    assert sdk_name(name, group, "devices[0]") == CPU(5)  # the job's name: cpu:5, in every process
    device = JobDevices(group).find(name, "devices[0]")
    assert (device.process_id, device.node, device.replica, device.task_name) == (2, 1, 5, TASK(2, 1))


def test_the_job_names_are_the_same_in_every_process():
    tables = [JobDevices(across_nodes(pid)) for pid in range(4)]
    assert len({t.devices for t in tables}) == 1
    assert [t.mine for t in tables] == [(CPU(2 * p), CPU(2 * p + 1)) for p in range(4)]
    assert [d.daemon_name for d in tables[0].devices] == [CPU(i) for i in (0, 1, 2, 3, 0, 1, 2, 3)]


@pytest.mark.parametrize("name", ["cpu:5", TASK(1, 1)])
def test_on_one_daemon_the_job_names_are_the_daemons(name):
    assert to_daemon(name, one_daemon(1), "devices[0]") == CPU(5)


def test_another_processs_device_is_refused_saying_whose_it_is_and_naming_mine():
    with pytest.raises(InvalidArgumentError, match=r"^destinations\[1\]: device 'cpu:0' is process 0's \(on node 0\); "
                       r"this is process 2 of 4, whose devices are cpu:4, cpu:5 \(/job:worker/replica:0/task:2/device:"
                       r"CPU:0, /job:worker/replica:0/task:2/device:CPU:1\)$"):
        to_daemon("cpu:0", across_nodes(2), "destinations[1]")
    with pytest.raises(InvalidArgumentError, match=r"^devices\[0\]: device '/job:worker/replica:0/task:0/device:CPU:3' "
                       r"is process 0's; this is process 1 of 2, whose devices are cpu:4, cpu:5, cpu:6, cpu:7 \("):
        to_daemon(TASK(0, 3), one_daemon(1), "devices[0]")


@pytest.mark.parametrize(("name", "message"), [
    ("cpu:8", r"^devices\[0\]: no device 'cpu:8' in group 'default@10.0.0.1:1234'; its devices are cpu:0, cpu:1, "
              r"cpu:2, cpu:3, cpu:4, cpu:5, cpu:6, cpu:7 \(list_devices\(\)\)$"),
    ("gpu:0", r"no device 'gpu:0' in group"),
    (TASK(4, 0), r"^devices\[0\]: device '/job:worker/replica:0/task:4/device:CPU:0' names task 4, but group "
                 r"'default@10.0.0.1:1234' has processes 0 to 3$"),
    (TASK(3, 2), r"^devices\[0\]: no device '/job:worker/replica:0/task:3/device:CPU:2': process 3 has 2 CPU "
                 r"device\(s\) \(/job:worker/replica:0/task:3/device:CPU:0, /job:worker/replica:0/task:3/device:"
                 r"CPU:1\)$"),
])
def test_a_device_the_job_does_not_have_is_not_found(name, message):
    with pytest.raises(NotFoundError, match=message):
        to_daemon(name, across_nodes(2), "devices[0]")


def test_a_localhost_name_of_another_task_is_refused_in_a_job():
    with pytest.raises(InvalidArgumentError, match=r"/job:localhost names the job's devices \(task 0 only\); "
                                                   r"name process P's i-th device /job:worker/replica:0/task:P/"
                                                   r"device:CPU:i"):
        to_daemon("/job:localhost/replica:0/task:1/device:CPU:0", across_nodes(2), "devices[0]")


def test_outside_a_job_names_are_the_daemons_and_this_process_is_task_0():
    assert to_daemon("cpu:5", None, "devices[0]") == CPU(5)
    assert to_daemon(TASK(0, 5), None, "devices[0]") == sdk_name(TASK(0, 5), None, "devices[0]") == CPU(5)
    with pytest.raises(InvalidArgumentError, match=r"^devices\[0\]: device '/job:worker/replica:0/task:1/device:"
                                                   r"CPU:0' is process 1's, but this process is in no multi-process"):
        to_daemon(TASK(1, 0), None, "devices[0]")


def test_an_arrays_own_device_is_the_gpu_of_this_node_it_is_on():
    group = across_nodes(3)  # node 1, devices CPU:2 and CPU:3 there
    assert sdk_name(DaemonName(CPU(3)), group, "devices[0]") == CPU(7)
    assert to_daemon(DaemonName(CPU(3)), group, "devices[0]") == CPU(3)
    with pytest.raises(InvalidArgumentError, match=r"is process 2's \(on node 1\); this is process 3 of 4"):
        to_daemon(DaemonName(CPU(0)), group, "devices[0]")
    with pytest.raises(NotFoundError, match="an array on /job:localhost/replica:0/task:0/device:CPU:4, which this "
                                            "process's daemon does not serve"):
        to_daemon(DaemonName(CPU(4)), group, "devices[0]")


def test_reduce_to_device_names_any_process_device_of_this_node_else_the_first_destination():
    assert reduce_to("cpu:6", across_nodes(2)) == CPU(2)  # process 3's, on this node
    assert reduce_to("cpu:0", across_nodes(2)) == ""  # node 0's: node 1 sums on its first destination
    assert reduce_to("cpu:0", across_nodes(1)) == CPU(0)
    assert reduce_to("cpu:0", one_daemon(1)) == CPU(0)


def test_a_group_made_by_hand_has_equal_shares_unless_it_says_otherwise():
    group = ProcessGroup("g", 2, 1, (CPU(2), CPU(3)), tuple(CPU(i) for i in range(4)))
    assert JobDevices(group).mine == (CPU(2), CPU(3))
    with pytest.raises(ValueError, match="3 devices for 2 processes, and no shares to say whose is which"):
        JobDevices(ProcessGroup("g", 2, 1, (CPU(2),), tuple(CPU(i) for i in range(3))))
    with pytest.raises(ValueError, match=r"process 1's share of global_devices is not its local_devices"):
        JobDevices(ProcessGroup("g", 2, 1, (CPU(3),), tuple(CPU(i) for i in range(4))))
    assert JobDevices(ProcessGroup("g", 2, 1, (CPU(3),), tuple(CPU(i) for i in range(4)), shares=(3, 1))).mine == (
        CPU(3),)
