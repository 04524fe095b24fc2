"""Requests of a shape the daemon has validated before (xreduced.prepared), against the real daemon: the
same results as the first of their shape, and the same errors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec


def request(op, *arrays, destinations=()) -> pb.BatchReduceRequest:
    value = pb.DistributedValue(components=[pb.Component(device=f"CPU:{i}", tensor=codec.encode(a))
                                            for i, a in enumerate(arrays)])
    return pb.BatchReduceRequest(reduce_op=op, pairs=[pb.ReducePair(value=value, destinations=list(destinations))])


def results(reply) -> list[list]:
    return [codec.decode(c.tensor).tolist() for c in reply.results[0].result.components]


@pytest.mark.parametrize("op, dtype, want_dtype", [
    (pb.REDUCE_OP_SUM, np.float32, np.float32),
    (pb.REDUCE_OP_MEAN, np.int32, np.float64),
    (pb.REDUCE_OP_SUM, np.dtype(">i8"), np.int64),
])
def test_every_call_of_one_shape_is_exact(stub, op, dtype, want_dtype):
    for step in range(4):
        a, b = np.array([step, 2 * step + 1], dtype), np.array([10, step], dtype)
        reply = stub.BatchReduce(request(op, a, b), timeout=30)
        total = a.astype(np.float64) + b.astype(np.float64)
        want = total / 2 if op == pb.REDUCE_OP_MEAN else total
        assert results(reply) == [want.tolist()] * 2
        assert all(codec.decode(c.tensor).dtype == want_dtype for c in reply.results[0].result.components)


def test_a_shape_seen_before_refuses_bad_bytes_as_the_first_call_would(stub):
    good = request(pb.REDUCE_OP_SUM, np.float32([1, 2]), np.float32([3, 4]), destinations=["CPU:1"])
    assert results(stub.BatchReduce(good, timeout=30)) == [[4.0, 6.0]]
    bad = request(pb.REDUCE_OP_SUM, np.float32([1, 2]), np.float32([3, 4]), destinations=["CPU:1"])
    bad.pairs[0].value.components[1].tensor.raw_data = b"\0" * 4
    with pytest.raises(grpc.RpcError) as e:
        stub.BatchReduce(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "pairs[0].value.components[1].tensor.raw_data: 4 bytes for float32[2], expected 8"
    again = request(pb.REDUCE_OP_SUM, np.float32([5, 6]), np.float32([7, 8]), destinations=["CPU:1"])
    assert results(stub.BatchReduce(again, timeout=30)) == [[12.0, 14.0]]
