"""What the SDK makes of a JoinGroup reply for a group across nodes: the group id and epoch of every
collective, the global keras names, global replica ids, and `xreduce status`'s groups section.

The replies are shaped as the daemon answers a group of three processes on two nodes (processes 0 and 2
on node 0, process 1 on node 1, two CPU devices each); tests/integration/test_distribution.py gets the
same from real daemons.
"""

from __future__ import annotations

import numpy as np
import pytest
from xreduce._cli import describe_status
from xreduce._keras_devices import keras_names
from xreduce._runtime import ProcessGroup, set_process_group
from xreduce._strategy import MirroredStrategy
from xreduce.v1 import xreduce_pb2 as pb


def _name(task: int, index: int, job: str = "worker") -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:{index}"


NODE_OF = {0: 0, 1: 1, 2: 0}
"""Process -> node: node 0 hosts process 0 (and 2), node 1 process 1."""
LOCAL = {pid: [_name(0, i, "localhost") for i in indices] for pid, indices in {0: (0, 1), 1: (0, 1), 2: (2, 3)}.items()}
"""Each process's devices as its own daemon names them (task 0)."""


def _global() -> list[str]:
    return [_name(NODE_OF[pid], int(d[-1])) for pid in range(3) for d in LOCAL[pid]]


def _reply(pid: int, epoch: int = 4) -> pb.JoinGroupResponse:
    nodes = [pb.ClusterNode(index=n, address=f"10.0.0.{n + 1}", backend="numpy",
                            processes=[pb.ProcessDevices(process_id=p, devices=LOCAL[p])
                                       for p in range(3) if NODE_OF[p] == n]) for n in (0, 1)]
    return pb.JoinGroupResponse(
        local_devices=LOCAL[pid], global_devices=_global(),
        processes=[pb.ProcessDevices(process_id=p, devices=[_name(NODE_OF[p], int(d[-1])) for d in LOCAL[p]])
                   for p in range(3)],
        epoch=epoch, group="train@10.0.0.1:1234", nodes=nodes, node_index=NODE_OF[pid], engine="gloo")


def test_keras_names_across_nodes_are_positions_in_the_global_list():
    assert keras_names(_global()) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4", "cpu:5"]


def test_keras_names_of_one_node_keep_the_daemon_index():
    one = [_name(0, 3, "localhost"), _name(0, 0, "localhost"), "/job:worker/replica:0/task:0/device:GPU:1"]
    assert keras_names(one) == ["cpu:3", "cpu:0", "gpu:1"]


def test_keras_names_number_each_device_type_apart():
    mixed = [_name(0, 0), "/job:worker/replica:0/task:0/device:GPU:0", _name(1, 0),
             "/job:worker/replica:0/task:1/device:GPU:0"]
    assert keras_names(mixed) == ["cpu:0", "gpu:0", "cpu:1", "gpu:1"]


@pytest.mark.parametrize("pid, offset", [(0, 0), (1, 2), (2, 4)])
def test_the_replica_offset_counts_the_devices_of_lower_processes(pid, offset):
    group = ProcessGroup.from_reply("train", 3, pid, _reply(pid))
    assert group.replica_offset == offset
    assert (group.node_index, group.num_nodes, group.engine) == (NODE_OF[pid], 2, "gloo")


def test_every_collective_names_the_replys_group_and_epoch():
    group = ProcessGroup.from_reply("train", 3, 2, _reply(2, epoch=7))
    specs = [group.next_spec() for _ in range(2)]
    assert [(s.group, s.epoch, s.process_id, s.num_processes, s.sequence) for s in specs] == [
        ("train@10.0.0.1:1234", 7, 2, 3, 0), ("train@10.0.0.1:1234", 7, 2, 3, 1)]


def test_a_reply_without_a_group_keeps_the_requested_name_and_epoch_zero():
    reply = pb.JoinGroupResponse(local_devices=["/cpu:1"], global_devices=["/cpu:0", "/cpu:1"],
                                 processes=[pb.ProcessDevices(process_id=0, devices=["/cpu:0"]),
                                            pb.ProcessDevices(process_id=1, devices=["/cpu:1"])])
    group = ProcessGroup.from_reply("train", 2, 1, reply)
    spec = group.next_spec()
    assert (spec.group, spec.epoch, group.num_nodes, group.engine, group.replica_offset) == ("train", 0, 1, "", 1)


@pytest.fixture
def installed():
    """Installs a JoinGroup reply's group for a daemon address nothing serves (the strategy never calls it
    for what is tested here); removes it after."""
    address = "127.0.0.1:9"

    def install(pid: int) -> str:
        set_process_group(address, ProcessGroup.from_reply("train", 3, pid, _reply(pid)))
        return address

    yield install
    set_process_group(address, None)


@pytest.mark.parametrize("pid, first", [(0, 0), (1, 2), (2, 4)])
def test_mirrored_strategy_replica_ids_are_global_across_nodes(installed, pid, first):
    strategy = MirroredStrategy(address=installed(pid))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]))
    assert [v.tolist() for v in values.values] == [[first, 6], [first + 1, 6]]
    # The job's names (process 2's devices are CPU:2 and CPU:3 of node 0, but cpu:4 and cpu:5 of the job).
    assert strategy.extended.worker_devices == (_name(0, first, "localhost"), _name(0, first + 1, "localhost"))


def _status(groups) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(version="0.1.0", backend="numpy", limits=pb.Limits(workers=4), groups=groups)


def test_status_without_groups_has_no_groups_section():
    assert "groups" not in describe_status(_status([]), "127.0.0.1:50551")


def test_status_shows_each_group_after_now():
    group = pb.GroupStatus(group="train@10.0.0.1:1234", epoch=4, state="active", num_processes=3, node_index=1,
                           nodes=_reply(1).nodes, engine="gloo", cross_node_collectives=5,
                           cross_node_bytes=2048, cross_node_seconds=0.5)
    text = describe_status(_status([group]), "10.0.0.2:50551")
    now, rest = text.split("\nnow\n")
    assert "groups across nodes" not in now
    assert rest.split("\n\n")[1].splitlines() == [
        "groups across nodes (1)",
        "  train@10.0.0.1:1234  epoch 4  active",
        "    processes    3 on 2 nodes, this daemon is node 1",
        "    engine       gloo",
        "    node 0       10.0.0.1  numpy  processes 0 [CPU:0, CPU:1], 2 [CPU:2, CPU:3]",
        "    node 1       10.0.0.2  numpy  process 1 [CPU:0, CPU:1]",
        "    cross-node   5 collectives, 2 KiB, 0.5s in the engine",
    ]
