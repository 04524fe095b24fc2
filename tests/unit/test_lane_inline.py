"""Which local-lane calls the lane's own thread serves (``xreduced.lane._inline``): tensors in the message, or in
host shared-memory regions of at most ``INLINE_REGION_BYTES``; GPU regions, large ones, broadcasts and calls of a
group across nodes go to a worker. And ``classify``'s table: which of them the express lane may take. The calls
themselves run against real daemons in tests/integration/test_local_lane.py and the SDK's shared-memory tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduced.lane import INLINE_MAX_BYTES, INLINE_REGION_BYTES, _inline, classify
from xreduced.repeated import collective_key


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


def call_of(method="BatchReduce", *, tensors=None, output=None, n=2, sequence=1, epoch=0, collective=True):
    tensors = tensors or [codec.encode(np.float32([1, 2]))] * 2
    value = pb.DistributedValue(components=[pb.Component(device=f"CPU:{i}", tensor=t) for i, t in enumerate(tensors)])
    spec = pb.CollectiveSpec(group="g", num_processes=n, sequence=sequence, epoch=epoch) if collective else None
    if method == "Reduce":
        request = pb.ReduceRequest(value=value, output=output, collective=spec)
    else:
        request = pb.BatchReduceRequest(pairs=[pb.ReducePair(value=value)], output=output, collective=spec)
    return SimpleNamespace(size=request.ByteSize(), message=request)


OUT = pb.RegionSlice(name="out", byte_size=16)


@pytest.mark.parametrize("method, kw, inline, express, shaped, keyed", [
    ("BatchReduce", {}, True, True, True, False),  # a group's call of tensors in the message: a shape
    ("Reduce", {}, True, True, True, False),
    ("BatchReduce", dict(collective=False), True, False, False, False),  # one process
    ("BatchReduce", dict(n=1), True, False, False, False),  # a group of one: nothing to match
    ("BatchReduce", dict(sequence=-1), True, False, False, False),  # the full path names the bad field
    ("BatchReduce", dict(epoch=3), False, False, False, False),  # a group across nodes: a worker's
    ("BatchReduce", dict(tensors=[region("in", 8)] * 2, output=OUT), True, True, False, True),  # a group's repeat
    ("BatchReduce", dict(tensors=[region("in", 8)] * 2, output=OUT, n=1), True, False, False, True),
    ("BatchReduce", dict(tensors=[region("in", 8)] * 2, output=OUT, collective=False), True, False, False, False),
    ("BatchReduce", dict(tensors=[region("gpu", 8)] * 2, output=OUT), False, True, False, True),
    ("BatchReduce", dict(tensors=[region("in", 8)] * 2), True, True, False, False),  # regions: no shape
])
def test_classify_says_the_thread_and_whether_the_express_lane_may_take_a_call(method, kw, inline, express, shaped,
                                                                                 keyed):
    call = call_of(method, **kw)
    path = classify(method, call, SHM)
    assert (path.inline, path.express, path.shape is not None, path.repeat_key is not None) == (
        inline, express, shaped, keyed)
    if keyed:
        assert path.repeat_key == collective_key(call.message)


def test_a_broadcast_is_a_worker_s_and_never_express():
    message = pb.BroadcastRequest(collective=pb.CollectiveSpec(group="g", num_processes=2), output=OUT)
    path = classify("Broadcast", SimpleNamespace(size=message.ByteSize(), message=message), SHM)
    assert path == classify("Broadcast", SimpleNamespace(size=1, message=message), SHM)
    assert (path.inline, path.express, path.shape, path.repeat_key) == (False, False, None, None)
