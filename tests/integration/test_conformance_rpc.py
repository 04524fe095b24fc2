"""Every conformance case through the real RPCs of a real daemon, bit-exact.

The vectors in tests/conformance were produced by TensorFlow 2.21 (with the
TF bugs we fix recomputed); see tests/conformance/README.md.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
DOC = json.loads((HERE / "cases.json").read_text())
ARRAYS = np.load(HERE / "arrays.npz")
ROUTES = {
    "identity": pb.ROUTE_IDENTITY,
    "hierarchical_copy": pb.ROUTE_HIERARCHICAL_COPY,
    "reduction_to_one_device": pb.ROUTE_REDUCTION_TO_ONE_DEVICE,
}
OPS = {"SUM": pb.REDUCE_OP_SUM, "MEAN": pb.REDUCE_OP_MEAN}


def _value(entry) -> pb.DistributedValue:
    return pb.DistributedValue(
        components=[
            pb.Component(device=f"CPU:{d}", tensor=codec.encode(ARRAYS[k]))
            for d, k in zip(entry["devices"], entry["keys"])
        ]
    )


def _dests(spec) -> list[str]:
    return [] if spec == "same" else [f"CPU:{d}" for d in spec]


def _op(case) -> int:
    op = case["reduce_op"] or (case.get("reduce_op_python") or "").strip("'\"")
    return OPS[op.upper()]


def _check(result: pb.DistributedValue, route: int, want: dict) -> None:
    devices = [c.device for c in result.components]
    assert devices == [f"/job:localhost/replica:0/task:0/device:CPU:{d}" for d in want["devices"]]
    assert route == ROUTES[want["algorithm"]]
    for comp, key in zip(result.components, want["keys"]):
        got, expected = codec.decode(comp.tensor), ARRAYS[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes(), f"{got!r} != {expected!r}"


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["id"] for c in DOC["cases"]])
def test_case(stub, case):
    if case["call"] == "broadcast":
        v = case["values"][0]
        reply = stub.Broadcast(pb.BroadcastRequest(
            tensor=codec.encode(ARRAYS[v["key"]]), source_device=f"CPU:{v['device']}",
            destinations=_dests(case["destinations"]),
        ))
        _check(reply.result, pb.ROUTE_IDENTITY, case["expected"][0])
    elif case["call"] == "reduce":
        reply = stub.Reduce(pb.ReduceRequest(
            reduce_op=_op(case), value=_value(case["values"][0]),
            destinations=_dests(case["destinations"]), num_packs=case["num_packs"],
        ))
        _check(reply.result, reply.route, case["expected"][0])
    else:
        reply = stub.BatchReduce(pb.BatchReduceRequest(
            reduce_op=_op(case), num_packs=case["num_packs"],
            pairs=[pb.ReducePair(value=_value(v), destinations=_dests(d))
                   for v, d in zip(case["values"], case["destinations"])],
        ))
        assert len(reply.results) == len(case["expected"])
        for r, want in zip(reply.results, case["expected"]):
            _check(r.result, r.route, want)
