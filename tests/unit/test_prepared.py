"""Request shapes remembered (xreduced.prepared): what counts as the same shape, what is never remembered,
and that a remembered shape decodes a request as the full path does, its errors included."""

from __future__ import annotations

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduced.admission import Admission, working_set
from xreduced.backends import DeviceInfo
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.decode import value as decode_value
from xreduced.devices import DeviceTable
from xreduced.engine import Engine
from xreduced.prepared import PREPARED_MAX_BYTES, PreparedCalls, shape_of

TABLE = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(4)])


def batch(*arrays, sequence=7, destinations=(), devices=None, **fields) -> pb.BatchReduceRequest:
    devices = devices or [f"CPU:{i}" for i in range(len(arrays))]
    value = pb.DistributedValue(components=[pb.Component(device=d, tensor=codec.encode(a))
                                            for d, a in zip(devices, arrays)])
    return pb.BatchReduceRequest(
        reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value, destinations=list(destinations))],
        collective=pb.CollectiveSpec(group="g", num_processes=2, process_id=0, sequence=sequence), **fields)


def shape(request) -> bytes | None:
    return shape_of(request, request.ByteSize())


def test_the_shape_ignores_the_tensors_bytes_and_the_sequence_only():
    a = shape(batch(np.float32([1, 2]), np.float32([3, 4]), sequence=1))
    assert a is not None
    assert a == shape(batch(np.float32([5, 6]), np.float32([7, 8]), sequence=2))
    different = [
        batch(np.float64([1, 2]), np.float64([3, 4])),  # dtype
        batch(np.float32([1, 2, 3]), np.float32([3, 4, 5])),  # shape
        batch(np.float32([1, 2]), np.float32([3, 4]), devices=["CPU:0", "CPU:2"]),  # device
        batch(np.float32([1, 2]), np.float32([3, 4]), destinations=["CPU:0"]),  # destinations
        batch(np.float32([1, 2]), np.float32([3, 4]), num_packs=2),  # options
    ]
    assert all(shape(r) not in (None, a) for r in different)
    changed = batch(np.float32([1, 2]), np.float32([3, 4]))
    changed.collective.process_id = 1
    assert shape(changed) != a


@pytest.mark.parametrize("make", [
    lambda: batch(np.float32([1]), output=pb.RegionSlice(name="out")),
    lambda: pb.BatchReduceRequest(pairs=[pb.ReducePair(value=pb.DistributedValue(
        components=[pb.Component(device="CPU:0", tensor=codec.encode(np.float32([1]), codec.TYPED))]))]),
    lambda: pb.ReduceRequest(value=pb.DistributedValue(components=[pb.Component(
        device="CPU:0", tensor=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[1], region=pb.RegionSlice(name="r")))])),
    lambda: pb.ReduceRequest(value=pb.DistributedValue(components=[pb.Component(
        device="CPU:0", indexed_slices=pb.IndexedSlices())])),
], ids=["output", "typed values", "region", "sparse"])
def test_requests_that_are_never_remembered_have_no_shape(make):
    assert shape(make()) is None


def test_a_large_request_has_no_shape():
    request = batch(np.zeros(PREPARED_MAX_BYTES // 4 + 1, np.float32))
    assert shape_of(request, request.ByteSize()) is None


def remembered(request):
    calls = PreparedCalls()
    values = [decode_value(p.value, f"pairs[{i}].value", TABLE, None) for i, p in enumerate(request.pairs)]
    dests = [tuple(TABLE.resolve(d, "destinations") for d in p.destinations) for p in request.pairs]
    pairs = list(zip(values, dests))
    resolved = Engine(NumpyBackend(4)).validate("SUM", pairs, 1)
    calls.remember(shape(request), "SUM", 1, "hierarchical_copy", None, pairs, resolved,
                   [f"pairs[{i}].destinations" for i in range(len(pairs))])
    return calls


def test_a_remembered_shape_decodes_as_the_full_path_does():
    calls = remembered(batch(np.arange(3, dtype=np.int16), np.arange(3, dtype=np.int16)))
    request = batch(np.int16([7, 8, 9]), np.int16([1, 2, 3]), sequence=99)
    prepared = calls.get(shape(request))
    assert prepared is not None and prepared.op == "SUM"
    pairs, resolved = prepared.decode(request)
    full = decode_value(request.pairs[0].value, "pairs[0].value", TABLE, None)
    (value, dests), = pairs
    assert value.devices == full.devices == (0, 1) and value.field == full.field and dests == ()
    assert [a.tolist() for a in value.arrays] == [a.tolist() for a in full.arrays] == [[7, 8, 9], [1, 2, 3]]
    assert all(a.dtype == np.int16 for a in value.arrays)
    assert resolved[0][1] == (0, 1)


def test_a_remembered_shape_refuses_bytes_that_do_not_match_as_the_codec_does():
    request = batch(np.float32([1, 2]), np.float32([3, 4]))
    calls = remembered(request)
    request.pairs[0].value.components[1].tensor.raw_data = b"\0" * 12
    prepared = calls.get(shape(request))
    with pytest.raises(codec.CodecError) as e:
        prepared.decode(request)
    assert str(e.value) == "pairs[0].value.components[1].tensor.raw_data: 12 bytes for float32[2], expected 8"


def test_the_least_recently_used_shape_is_forgotten_first():
    calls = PreparedCalls(kept=2)
    requests = [batch(np.zeros(n, np.float32)) for n in (1, 2, 3)]
    for request in requests[:2]:
        calls.remember(shape(request), "SUM", 1, "hierarchical_copy", None, [], [], [])
    assert calls.get(shape(requests[0])) is not None  # now the most recently used
    calls.remember(shape(requests[2]), "SUM", 1, "hierarchical_copy", None, [], [], [])
    assert len(calls) == 2
    assert calls.get(shape(requests[1])) is None and calls.get(shape(requests[0])) is not None


def test_admission_reuses_a_shapes_working_set_and_releases_it_the_same():
    admission = Admission()
    request = batch(np.ones(64, np.float32), np.ones(64, np.float32), destinations=["CPU:0", "CPU:1"])
    size = request.ByteSize()
    want = working_set(request, size)
    first = admission.admit(request, size, shape(request))
    again = admission.admit(request, size, shape(request))
    assert first == again == want and admission.inflight.value == 2 * want
    admission.release(first)
    admission.release(again)
    assert admission.inflight.value == 0
