"""DDP's options and ways of training, unchanged, over the "xreduce" backend against the same over Gloo.

One job of 2 ranks (``torch_worker.py options``) trains, for each option, the worker's ``Wide`` model on an xreduce
group and on a Gloo group of the same ranks, from the same weights on the same batches. The model's middle
gradient is 1 MiB, so DDP's buckets go through shared memory from the second step (``xreduce.torch._shared``);
it has a BatchNorm, whose buffers DDP broadcasts every step, and a second head that ``find_unused_parameters``
leaves out on even steps. Two ranks add in the only order there is: the weights and the buffers must be Gloo's
bit for bit (the same on both ranks), and so must each rank's buffers.
"""

from __future__ import annotations

import pytest
from torch_worker import OPTIONS

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def trained(daemon, tmp_path_factory):
    """{(option, backend): each rank's ``trained`` event}, from one job of 2 ranks."""
    from torch_ranks import WORKER, Ranks

    with Ranks(WORKER, ["options", "--fsdp"], 2, daemon.address, tmp_path_factory.mktemp("options")) as job:
        events = job.finish(JOB_TIMEOUT)
    found: dict[tuple[str, str], list[dict]] = {}
    for rank in events:
        assert rank[-1] == {"event": "done"}
        for e in rank:
            if e.get("event") == "trained":
                found.setdefault((e["option"], e["backend"]), []).append(e)
            elif e.get("event") == "sharded":
                found.setdefault(("fully_shard", e["backend"]), []).append(e)
    return found


@pytest.mark.parametrize("option", list(OPTIONS))
def test_ddp_with_the_option_trains_to_gloos_weights_and_buffers_bit_for_bit(trained, option):
    ours, gloos = trained[(option, "xreduce")], trained[(option, "gloo")]
    assert len(ours) == len(gloos) == 2
    assert len({e["digest"] for e in ours + gloos}) == 1, (ours, gloos)
    # Each rank's last forward pass updates its BatchNorm's running statistics from its own batch, after DDP
    # broadcast rank 0's (under Join, the buffers are synchronized once more at the end): each rank's must be
    # what it is under Gloo.
    assert [e["buffers"] for e in ours] == [e["buffers"] for e in gloos], (ours, gloos)
    if option == "gradient_as_bucket_view":  # the gradients are views of the buckets the daemon reduced in place
        assert all(e["grad_in_shared_memory"] for e in ours) and not any(e["grad_in_shared_memory"] for e in gloos)


def test_fsdp2_fully_shard_trains_each_rank_to_gloos_shards_bit_for_bit(trained):
    """FSDP2 on a DeviceMesh of the xreduce group (``DeviceMesh.from_group``, which reads the group's name: a group
    written in Python keeps it itself): its all-gathers and reduce-scatters on the daemon. Each rank holds its own
    shard of the weights, the same as under Gloo."""
    ours, gloos = trained[("fully_shard", "xreduce")], trained[("fully_shard", "gloo")]
    assert [e["digest"] for e in ours] == [e["digest"] for e in gloos], (ours, gloos)
    assert ours[0]["digest"] != ours[1]["digest"]  # two shards
    assert all(e["group_name"] for e in ours), ours
