"""One name per device: every name the SDK gives out works wherever it takes a device, in every process.

A job of four processes, two on each of two nodes (network-namespace nodes where they can be made, else
two daemons on loopback), and a job of two processes on one daemon. Each process reduces its replicas
with its devices named in every form the SDK gives out (``process_info().local_devices``,
``list_devices()``, their canonical form, ``worker_devices``, ``distribute_batch``'s, TF's task-qualified
``/job:worker/replica:0/task:P/device:CPU:i``), to destinations in another form, onto
``reduce_to_device``, in a broadcast; and names another process's device, which is refused, naming its
process and this process's names (:meth:`xreduce_bench.faults.Worker.names`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from multinode import FAST_PEERS, NODE_FLAGS, Job, run_named
from netns import Nodes, namespaces_unavailable
from xreduce.wire.devices import canonical
from xreduce_bench.faults import Cluster, NamespaceCluster

FORMS = ("local_devices", "list_devices", "canonical", "worker_devices", "distribute_batch", "task")
"""The checks whose value and destinations are this process's devices named in one form."""


def script(pid: int) -> list[dict]:
    return [{"op": "init", "name": "init"}, {"op": "names", "name": "names"}]


@contextlib.contextmanager
def two_nodes(loopback: Cluster) -> Iterator[Cluster | NamespaceCluster]:
    """Two node daemons of 4 devices: in network namespaces where they can be made, else ``loopback``'s."""
    if namespaces_unavailable() is not None:
        loopback.new_job()
        yield loopback
        return
    with Nodes(2) as nodes:
        yield NamespaceCluster(nodes, [*NODE_FLAGS, *FAST_PEERS])


def check(job: Job) -> None:
    """Every process's every form reduced to the job's sum under the names it gave; another process's
    device refused, naming whose it is and this process's devices."""
    inits = job.inits
    total = float(sum(r + 1 for r in range(job.replicas)))
    for pid, (info, outcome) in enumerate(zip(inits, job.results("names"))):
        mine = [f"/job:worker/replica:0/task:{pid}/device:CPU:{i}" for i in range(len(info["local_devices"]))]
        for form in (*FORMS, "to_task", "reduce_to_device", "broadcast"):
            got = outcome[form]
            assert got["ok"], f"process {pid} (node {info['node_index']}), {form}: {got['error']}: {got['message']}"
            want = [7.0] if form == "broadcast" else [total]
            assert got["values"] == [want] * len(info["local_devices"]), (pid, form, got)
        assert outcome["task"]["devices"] == outcome["to_task"]["devices"] == mine, pid
        assert outcome["local_devices"]["devices"] == [canonical(d) for d in info["local_devices"]], pid
        other = (pid + 1) % len(inits)
        theirs = inits[other]["local_devices"][0]
        where = f" (on node {inits[other]['node_index']})" if info["num_nodes"] > 1 else ""
        yours = (f"; this is process {pid} of {len(inits)}, whose devices are {', '.join(info['local_devices'])} "
                 f"({', '.join(mine)})")
        for check, field, name in (("other", "per_replica_value.devices[0]", mine[0].replace(f"task:{pid}",
                                                                                              f"task:{other}")),
                                   ("other_keras", "destinations[0]", canonical(theirs))):
            refused = outcome[check]
            assert not refused["ok"] and refused["error"] == "InvalidArgumentError", (pid, check, refused)
            assert refused["message"] == f"{field}: device {name!r} is process {other}'s{where}{yours}", (pid, check)


@pytest.mark.slow
def test_two_processes_on_each_of_two_nodes_take_every_name_form(three_nodes):
    with two_nodes(three_nodes) as cluster:
        job = run_named(cluster, [0, 0, 1, 1], script)
    assert [i["local_devices"] for i in job.inits] == [[f"cpu:{2 * p}", f"cpu:{2 * p + 1}"] for p in range(4)]
    check(job)


def test_two_processes_on_one_daemon_take_every_name_form(three_nodes):
    group = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "", "XREDUCE_GROUP": "names-one-daemon"}
    job = run_named(three_nodes, [0, 0], script, env=group)
    assert [i["num_nodes"] for i in job.inits] == [1, 1]
    check(job)
