"""What the node daemons report about a group across nodes: GetStatus's groups and the Prometheus metrics.
(After a fault, the failed epoch and its lost peers: tests/multinode/test_nodes_faults.py.)"""

from __future__ import annotations

import pytest
from multinode import group_metrics, group_status

pytestmark = pytest.mark.slow

ELEMENTS = 1024
SCRIPT = [{"op": "init"}, {"op": "reduce", "tensors": [{"dtype": "float32", "shape": [ELEMENTS]}]},
          {"op": "strategy", "reduce_op": "SUM"}, {"op": "barrier"}]


def test_status_and_metrics_of_a_group_after_reduces(nodes):
    processes = nodes.launch([0, 1], SCRIPT)
    try:
        inits = [p.step(0, 120) for p in processes]
        assert all(p.step(2, 120)["ok"] for p in processes)
        info = inits[0]["result"]
        gid, epoch = info["group"], info["epoch"]
        groups = [group_status(nodes.address(n), gid) for n in (0, 1)]
        samples = [group_metrics(nodes.daemons[n], gid) for n in (0, 1)]
        for p in processes:
            p.go()
    finally:
        for p in processes:
            p.close()
    for index, (group, sample) in enumerate(zip(groups, samples)):
        where = f"node {index}: {group}"
        assert (group.epoch, group.state, group.num_processes) == (epoch, "active", 2), where
        assert (group.node_index, group.coordinator, group.engine) == (index, index == 0, "gloo"), where
        assert [[p.process_id for p in n.processes] for n in group.nodes] == [[0], [1]], where
        assert [list(n.processes[0].devices) for n in group.nodes] == [[f"CPU:{d}" for d in range(4)]] * 2, where
        assert not group.lost and not group.reason, where
        assert group.cross_node_collectives >= 2, where
        assert group.cross_node_bytes >= 4 * ELEMENTS, where  # the node sum of the first reduce crossed
        assert sample["xreduce_group_epoch"] == epoch and sample["xreduce_group_nodes"] == 2, sample
        assert (sample["xreduce_group_failed"], sample["xreduce_group_lost_peers"]) == (0, 0), sample
        assert sample["xreduce_cross_node_bytes_total"] == group.cross_node_bytes, (sample, where)
        assert sample["xreduce_cross_node_collectives_total"] == group.cross_node_collectives, (sample, where)
