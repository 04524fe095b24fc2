"""Which local-lane calls the lane's own thread serves (``xreduced.lane._inline``): tensors in the message, or in
host shared-memory regions of at most ``INLINE_REGION_BYTES``; GPU regions, large ones, broadcasts and calls of a
group across nodes go to a worker. The calls themselves run against real daemons in
tests/integration/test_local_lane.py and the SDK's shared-memory tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduced.lane import INLINE_MAX_BYTES, INLINE_REGION_BYTES, _inline


def region(name: str, nbytes: int) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[nbytes // 4],
                     region=pb.RegionSlice(name=name, byte_size=nbytes))


def incoming(tensors, output: pb.RegionSlice | None = None, epoch: int = 0) -> SimpleNamespace:
    value = pb.DistributedValue(components=[pb.Component(device=f"CPU:{i}", tensor=t) for i, t in enumerate(tensors)])
    request = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value)], output=output,
                                    collective=pb.CollectiveSpec(group="g", num_processes=2, epoch=epoch))
    return SimpleNamespace(size=request.ByteSize(), message=request)


def host(kinds: dict[str, str]):
    """``host_bytes`` over a session whose regions have these kinds: the slices' bytes, None past a GPU or
    unknown region."""
    def host_bytes(slices) -> int | None:
        if any(kinds.get(s.name) != "shm" for s in slices):
            return None
        return sum(s.byte_size for s in slices)
    return host_bytes


SHM = host({"in": "shm", "out": "shm"})


def test_tensors_in_the_message_are_served_by_the_lane_s_thread():
    assert _inline("BatchReduce", incoming([codec.encode(np.float32([1, 2]))] * 2), SHM)


@pytest.mark.parametrize("nbytes", [4, 330_756, INLINE_REGION_BYTES // 4])
def test_host_regions_up_to_the_bound_are_served_by_the_lane_s_thread(nbytes):
    call = incoming([region("in", nbytes), region("in", nbytes)],
                    output=pb.RegionSlice(name="out", byte_size=2 * nbytes))
    assert _inline("BatchReduce", call, SHM)


def test_host_regions_past_the_bound_go_to_a_worker():
    nbytes = INLINE_REGION_BYTES // 4 + 4
    call = incoming([region("in", nbytes), region("in", nbytes)],
                    output=pb.RegionSlice(name="out", byte_size=2 * nbytes))
    assert not _inline("BatchReduce", call, SHM)


@pytest.mark.parametrize("kinds", [{"in": "cuda_ipc", "out": "shm"}, {"in": "shm", "out": "cuda_ipc"}, {}],
                         ids=["gpu-input", "gpu-output", "unknown-region"])
def test_gpu_or_unknown_regions_go_to_a_worker(kinds):
    call = incoming([region("in", 8), region("in", 8)], output=pb.RegionSlice(name="out", byte_size=16))
    assert not _inline("BatchReduce", call, host(kinds))


def test_broadcasts_groups_across_nodes_and_large_messages_go_to_a_worker():
    assert not _inline("Broadcast", SimpleNamespace(size=10, message=pb.BroadcastRequest()), SHM)
    assert not _inline("BatchReduce", incoming([region("in", 8)] * 2, epoch=3), SHM)
    large = incoming([codec.encode(np.zeros(INLINE_MAX_BYTES // 8, np.float32))] * 2)
    large.size = INLINE_MAX_BYTES + 1
    assert not _inline("BatchReduce", large, SHM)
