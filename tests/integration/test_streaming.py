"""ReduceStream against real daemons: bit-exact results, payloads over the message limit,
bad streams refused by name, and the in-flight budget bounding what a stream buffers.
"""

from __future__ import annotations

import json
import pathlib
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
import xreduce
from daemons import wait_log
from google.protobuf.duration_pb2 import Duration
from xreduce._streaming import stream_batch_reduce
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire.framing import chunk_message, streamed_tensor

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
DOC = json.loads((HERE / "cases.json").read_text())
ARRAYS = np.load(HERE / "arrays.npz")
CASES = [c for c in DOC["cases"] if c["call"] in ("reduce", "batch_reduce")]
SHAPE_ERRORS = [e for e in DOC["errors"] if e["id"].startswith("replica_shape_mismatch")]
ROUTES = {"identity": pb.ROUTE_IDENTITY, "hierarchical_copy": pb.ROUTE_HIERARCHICAL_COPY,
          "reduction_to_one_device": pb.ROUTE_REDUCTION_TO_ONE_DEVICE}
OPS = {"SUM": pb.REDUCE_OP_SUM, "MEAN": pb.REDUCE_OP_MEAN}
CANON = "/job:localhost/replica:0/task:0/device:"
CHUNK_BYTES = (8, 20, 24, 40)
"""Chunk sizes that split the vectors' tensors (3 to 12 elements) unevenly, in whole elements."""
MIB = 1 << 20
SMALL_LIMITS = ["--max-message-bytes", str(MIB), "--max-inflight-bytes", str(MIB)]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def client(daemon):
    with xreduce.Client(daemon.address) as c:
        yield c


@pytest.fixture(scope="module")
def small(start_module_daemon):
    """A daemon with a 1 MiB message limit and a 1 MiB in-flight budget."""
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4", *SMALL_LIMITS)


@pytest.fixture(scope="module")
def small_stub(small):
    with grpc.insecure_channel(small.address) as channel:
        yield pb_grpc.CrossDeviceOpsStub(channel)


def _pair(devices, arrays, destinations=()) -> pb.ReducePair:
    return pb.ReducePair(destinations=list(destinations), value=pb.DistributedValue(components=[
        pb.Component(device=d, tensor=streamed_tensor(a)) for d, a in zip(devices, arrays)]))


def _case_request(case) -> tuple[pb.BatchReduceRequest, list[list[np.ndarray]]]:
    op = case["reduce_op"] or (case.get("reduce_op_python") or "").strip("'\"")
    specs = [case["destinations"]] if case["call"] == "reduce" else case["destinations"]
    header = pb.BatchReduceRequest(reduce_op=OPS[op.upper()], num_packs=case["num_packs"])
    arrays = []
    for value, spec in zip(case["values"], specs):
        xs = [ARRAYS[k] for k in value["keys"]]
        dests = [] if spec == "same" else [f"CPU:{d}" for d in spec]
        header.pairs.append(_pair([f"CPU:{d}" for d in value["devices"]], xs, dests))
        arrays.append(xs)
    return header, arrays


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["id"] for c in CASES])
def test_conformance_case_streamed(client, index):
    case = CASES[index]
    header, arrays = _case_request(case)
    results = stream_batch_reduce(client, header, arrays, timeout=60, chunk_bytes=CHUNK_BYTES[index % 4])
    assert len(results) == len(case["expected"])
    for (route, components), want in zip(results, case["expected"]):
        assert route == ROUTES[want["algorithm"]]
        assert [d for d, _ in components] == [f"{CANON}CPU:{d}" for d in want["devices"]]
        for (_, got), key in zip(components, want["keys"]):
            expected = ARRAYS[key]
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert got.tobytes() == expected.tobytes(), f"{got!r} != {expected!r}"


def _random(dtype: np.dtype, shape, rng) -> np.ndarray:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _raw(header: pb.BatchReduceRequest, arrays) -> pb.BatchReduceRequest:
    """The same request with its data inline, for BatchReduce."""
    request = pb.BatchReduceRequest()
    request.CopyFrom(header)
    for pair, xs in zip(request.pairs, arrays):
        for comp, x in zip(pair.value.components, xs):
            comp.tensor.CopyFrom(codec.encode(x))
    return request


def _same_as_batch_reduce(client, stub, header, arrays, chunk_bytes) -> None:
    want = stub.BatchReduce(_raw(header, arrays), timeout=60)
    got = stream_batch_reduce(client, header, arrays, timeout=60, chunk_bytes=chunk_bytes)
    assert len(got) == len(want.results)
    for (route, components), expected in zip(got, want.results):
        assert route == expected.route
        assert [d for d, _ in components] == [c.device for c in expected.result.components]
        for (_, array), comp in zip(components, expected.result.components):
            reference = codec.decode(comp.tensor)
            assert array.dtype == reference.dtype and array.shape == reference.shape
            assert array.tobytes() == reference.tobytes()


ALGORITHMS = {
    "all_reduce": {},
    "hierarchical_copy_to_others": {"destinations": ["CPU:7", "CPU:2"]},
    "reduction_to_one_device": {"algorithm": pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE, "reduce_to_device": "CPU:5",
                                "destinations": ["CPU:6", "CPU:5", "CPU:1"]},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", codec.SUPPORTED_DTYPES)
def test_every_dtype_matches_batch_reduce(client, stub, dtype, op, algorithm):
    rng = np.random.default_rng(len(dtype) * 31 + len(op) * 7 + len(algorithm))
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    devices = ["CPU:3", "CPU:1", "CPU:4", "CPU:0", "CPU:6"]  # five, out of order: an uneven split
    xs = [_random(np_dtype, (4, 7), rng) for _ in devices]
    options = dict(ALGORITHMS[algorithm])
    header = pb.BatchReduceRequest(reduce_op=OPS[op], algorithm=options.get("algorithm", 0),
                                   reduce_to_device=options.get("reduce_to_device", ""),
                                   pairs=[_pair(devices, xs, options.get("destinations", ()))])
    _same_as_batch_reduce(client, stub, header, [xs], chunk_bytes=48)


def test_batch_folds_in_the_first_values_device_order(client, stub):
    rng = np.random.default_rng(5)
    orders = [[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 0, 4, 1, 5, 3]]
    arrays = [[rng.standard_normal(37).astype(np.float32) for _ in order] for order in orders]
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, num_packs=3, pairs=[
        _pair([f"CPU:{d}" for d in order], xs) for order, xs in zip(orders, arrays)])
    _same_as_batch_reduce(client, stub, header, arrays, chunk_bytes=28)


def test_mixed_routes_and_empty_tensors(client, stub):
    rng = np.random.default_rng(6)
    f64 = [rng.standard_normal((3, 5)) for _ in range(3)]
    i16 = [rng.integers(-50, 50, 11).astype(np.int16) for _ in range(2)]
    empty = [np.zeros((2, 0), np.float32)] * 2
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, num_packs=0, pairs=[
        _pair(["CPU:0", "CPU:1", "CPU:2"], f64),
        _pair(["CPU:4", "CPU:5"], i16, ["CPU:3"]),
        _pair(["CPU:6"], [f64[0]]),
        _pair(["CPU:1", "CPU:7"], empty),
    ])
    _same_as_batch_reduce(client, stub, header, [f64, i16, [f64[0]], empty], chunk_bytes=16)


def test_mirrored_components_are_separate_copies(client):
    xs = [np.arange(6, dtype=np.float32), np.ones(6, np.float32)]
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair(["CPU:0", "CPU:1"], xs)])
    [(_, [(_, a), (_, b)])] = stream_batch_reduce(client, header, [xs])
    assert not np.shares_memory(a, b)
    a[0] = 100
    assert b.tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("index", range(len(SHAPE_ERRORS)), ids=[e["id"] for e in SHAPE_ERRORS])
def test_conformance_errors_refused(client, index):
    case = dict(SHAPE_ERRORS[index], destinations=["same"])
    header, arrays = _case_request(case)
    with pytest.raises(xreduce.InvalidArgumentError, match=r"pairs\[0\]\.value\.components\[1\]\.tensor: replicas"):
        stream_batch_reduce(client, header, arrays)


def test_arrays_must_match_the_header(client):
    header = pb.BatchReduceRequest(pairs=[_pair(["CPU:0", "CPU:1"], [np.zeros(2)] * 2)])
    with pytest.raises(ValueError, match=r"arrays\[0\]: one array per component of pairs\[0\]; got 1 for 2"):
        stream_batch_reduce(client, header, [[np.zeros(2)]])
    with pytest.raises(ValueError, match=r"arrays\[0\]\[1\]: the header says float64\[2\]; got float32\[2\]"):
        stream_batch_reduce(client, header, [[np.zeros(2), np.zeros(2, np.float32)]])
    with pytest.raises(ValueError, match="chunk_bytes: must be >= 1; got 0"):
        stream_batch_reduce(client, header, [[np.zeros(2)] * 2], chunk_bytes=0)


# Bad streams, sent as raw messages.

F32 = np.arange(4, dtype=np.float32)


def _header(**fields) -> pb.ReduceStreamRequest:
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair(["CPU:0", "CPU:1"], [F32, F32])])
    for name, value in fields.items():
        getattr(header, name).CopyFrom(value)
    return pb.ReduceStreamRequest(header=header)


def _with_tensor(component: int, **tensor) -> pb.ReduceStreamRequest:
    message = _header()
    fields = {"dtype": pb.DATA_TYPE_FLOAT32, "shape": [4], **tensor}
    message.header.pairs[0].value.components[component].tensor.CopyFrom(pb.Tensor(**fields))
    return message


def _chunk(pair=0, component=0, offset=0, nbytes=16) -> pb.ReduceStreamRequest:
    return pb.ReduceStreamRequest.FromString(chunk_message(pair, component, offset, F32.tobytes()[:nbytes]))


def _header_with(mutate) -> pb.ReduceStreamRequest:
    message = _header()
    mutate(message.header)
    return message


BAD_STREAMS = {
    "missing_header": ([_chunk()], "header: the first message must be a header (a BatchReduceRequest); got chunk"),
    "empty_stream": ([], "header: the stream ended before its header"),
    "second_header": ([_header(), _header()], "chunk 0: got a second header"),
    "out_of_order": ([_header(), _chunk(offset=8, nbytes=8)],
                     "chunk 0 (pairs[0].value.components[0]): offset 8 but 0 bytes were received"),
    "overlap": ([_header(), _chunk(nbytes=8), _chunk(offset=4, nbytes=8)],
                "chunk 1 (pairs[0].value.components[0]): offset 4 but 8 bytes were received"),
    "misaligned": ([_header(), _chunk(nbytes=6)],
                   "chunk 0 (pairs[0].value.components[0]): data of 6 bytes is not a whole number of float32 "
                   "elements (4 bytes each)"),
    "past_the_end": ([_header(), _chunk(), _chunk(offset=16, nbytes=4)],
                     "chunk 1 (pairs[0].value.components[0]): bytes [16, 20) run past the tensor's end at 16 bytes"),
    "incomplete": ([_header(), _chunk(), _chunk(component=1, nbytes=8)],
                   "pairs[0].value.components[1]: the stream ended after 8 of its 16 bytes (float32)"),
    "bad_pair": ([_header(), _chunk(pair=1)], "chunk 0: pair must be in [0, 1) (the header's pairs); got 1"),
    "bad_component": ([_header(), _chunk(), _chunk(component=2)],
                      "chunk 1 (pairs[0]): component must be in [0, 2) (the pair's components); got 2"),
    "typed_data": ([_with_tensor(1, streamed=True, float_values=[1, 2, 3, 4])],
                   "pairs[0].value.components[1].tensor: a ReduceStream tensor carries no data (its bytes follow in "
                   "chunks); got float_values"),
    "raw_data": ([_with_tensor(0, streamed=True, raw_data=F32.tobytes())],
                 "pairs[0].value.components[0].tensor: a ReduceStream tensor carries no data"),
    "not_streamed": ([_with_tensor(1)], "pairs[0].value.components[1].tensor.streamed: must be true"),
    "multi_process": ([_header(collective=pb.CollectiveSpec(group="g", num_processes=2, process_id=0))],
                      "collective: ReduceStream serves one process; got a collective of 2 processes (multi-process "
                      "callers use BatchReduce or shared memory)"),
    "bad_shape": ([_with_tensor(0, streamed=True, shape=[-1])], "pairs[0].value.components[0].tensor.shape"),
    "bad_op": ([_header_with(lambda h: setattr(h, "reduce_op", 0))], "reduce_op: must be REDUCE_OP_SUM"),
    "mixed_dtypes_packed": (
        [_header_with(lambda h: h.pairs.add().CopyFrom(_pair(["CPU:0", "CPU:1"], [np.zeros(2, np.int8)] * 2)))],
        "share one dtype"),
}


def _expect_refused(stub, messages, code, text) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ReduceStream(iter(messages), timeout=60))
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()
    return info.value


def _serves_a_normal_reduce(stub) -> None:
    two = pb.DistributedValue(components=[pb.Component(device=f"CPU:{i}", tensor=codec.encode(F32)) for i in (0, 1)])
    reply = stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=two), timeout=60)
    assert codec.decode(reply.result.components[1].tensor).tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
def test_bad_stream_is_refused_by_name(stub, name):
    messages, text = BAD_STREAMS[name]
    _expect_refused(stub, messages, INVALID, text)
    _serves_a_normal_reduce(stub)


def test_unknown_device_is_not_found(stub):
    message = _header()
    message.header.pairs[0].value.components[1].device = "CPU:42"
    _expect_refused(stub, [message], grpc.StatusCode.NOT_FOUND, "pairs[0].value.components[1].device: no device")


def test_header_timeout_bounds_a_stalled_stream(stub):
    release = threading.Event()

    def stalled():
        yield _header(timeout=Duration(seconds=1))
        yield _chunk()
        release.wait(60)

    try:
        _expect_refused(stub, stalled(), grpc.StatusCode.DEADLINE_EXCEEDED,
                        "timed out after 1 s while waiting for chunk 1")
    finally:
        release.set()
    _serves_a_normal_reduce(stub)


# Limits: a payload over the message limit, and the in-flight budget.

def _large(n=4, nbytes=2 * MIB) -> list[np.ndarray]:
    rng = np.random.default_rng(8)
    return [rng.standard_normal(nbytes // 4).astype(np.float32) for _ in range(n)]


def test_payload_over_the_message_limit_streams(small, small_stub):
    xs = _large()  # 8 MiB in all, 2 MiB per component, against a 1 MiB message limit and in-flight budget
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair([f"CPU:{i}" for i in range(4)], xs)])
    with pytest.raises(grpc.RpcError) as info:
        small_stub.BatchReduce(_raw(header, [xs]), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with xreduce.Client(small.address) as c:
        # 4 x 256 KiB: a range fills the budget, so each waits until the one before is reduced
        [(route, components)] = stream_batch_reduce(c, header, [xs], timeout=60, chunk_bytes=256 << 10)
    assert route == pb.ROUTE_HIERARCHICAL_COPY
    want = (xs[0] + xs[1]) + (xs[2] + xs[3])  # fold(x[0:2]) + fold(x[2:4])
    for _, got in components:
        assert got.tobytes() == want.tobytes()
    status = small_stub.GetStatus(pb.GetStatusRequest(), timeout=60)
    assert status.inflight_bytes == 0
    stats = {m.method: m for m in status.methods}["/xreduce.v1.CrossDeviceOps/ReduceStream"]
    assert stats.calls_by_code["OK"] >= 1 and stats.bytes_in > 8 * MIB and stats.bytes_out > 2 * MIB
    wait_log(small, "method=/xreduce.v1.CrossDeviceOps/ReduceStream")  # the log is read by a thread of the test


def test_component_sent_whole_first_is_over_the_inflight_budget(small, small_stub):
    xs = _large()
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair([f"CPU:{i}" for i in range(4)], xs)])
    step = 128 << 10

    def one_component_first():
        yield pb.ReduceStreamRequest(header=header)
        for c, x in enumerate(xs):
            data = memoryview(x.view(np.uint8))
            for offset in range(0, len(data), step):
                yield pb.ReduceStreamRequest.FromString(chunk_message(0, c, offset, data[offset:offset + step]))

    error = _expect_refused(small_stub, one_component_first(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "over --max-inflight-bytes 1048576 (1048576 in flight now, 1048576 of them this "
                            "stream's, waiting for the other components of their ranges)")
    assert error.details().startswith("chunk 8 (pairs[0].value.components[0]): its 131072 bytes")
    assert "send the components' chunks interleaved" in error.details()
    assert small_stub.GetStatus(pb.GetStatusRequest(), timeout=60).inflight_bytes == 0
    wait_log(small, "status=RESOURCE_EXHAUSTED")
    _serves_a_normal_reduce(small_stub)


def _inflight_becomes(stub, done) -> int:
    """Polls GetStatus (bounded) until ``done(inflight_bytes)``; returns the last value."""
    for _ in range(600):
        value = stub.GetStatus(pb.GetStatusRequest(), timeout=60).inflight_bytes
        if done(value):
            return value
        threading.Event().wait(0.05)
    return value


def test_cancelled_stream_releases_what_it_buffered(small, small_stub):
    xs = _large(nbytes=MIB)
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair([f"CPU:{i}" for i in range(4)], xs)])
    release = threading.Event()

    def half_of_one_component():
        yield pb.ReduceStreamRequest(header=header)
        yield pb.ReduceStreamRequest.FromString(chunk_message(0, 0, 0, xs[0].tobytes()[:MIB // 2]))
        release.wait(60)

    responses = small_stub.ReduceStream(half_of_one_component(), timeout=60)
    try:
        assert next(responses).WhichOneof("kind") == "header"
        assert _inflight_becomes(small_stub, lambda v: v > 0) == MIB // 2
        responses.cancel()
        assert _inflight_becomes(small_stub, lambda v: v == 0) == 0
    finally:
        release.set()
    _serves_a_normal_reduce(small_stub)


def test_empty_batch(client):
    assert stream_batch_reduce(client, pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM), []) == []


def test_token_applies_to_streams(tmp_path, start_daemon):
    token = "stream-s3cret"
    (tmp_path / "token").write_text(token)
    (tmp_path / "token").chmod(0o600)
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2",
                     "--auth-token-file", str(tmp_path / "token"))
    try:
        xs = [np.arange(3, dtype=np.float32)] * 2
        header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[_pair(["CPU:0", "CPU:1"], xs)])
        with xreduce.Client(d.address) as c, pytest.raises(xreduce.UnauthenticatedError, match="bearer token"):
            stream_batch_reduce(c, header, [xs])
        with xreduce.Client(d.address, token=token) as c:
            [(_, [(_, total), _])] = stream_batch_reduce(c, header, [xs])
        assert total.tolist() == [0, 2, 4]
    finally:
        d.terminate()


@pytest.mark.parametrize("dtype,op", [("float32", "mean"), ("int32", "sum"), ("float16", "sum")])
def test_the_sdk_streams_large_values_over_the_wire(daemon, dtype, op):
    """Over the wire, a value above STREAM_THRESHOLD_BYTES goes through ReduceStream; the numbers are
    those of the shared-memory path, bit for bit."""
    import xreduce
    from xreduce import _streaming
    from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica

    rng = np.random.default_rng(3)
    n = _streaming.STREAM_THRESHOLD_BYTES // 2 + 7
    arrays = [(rng.standard_normal(n) * 100).astype(dtype) for _ in range(4)]
    value = PerReplica(arrays, devices=[f"CPU:{i}" for i in range(4)])
    got = {}
    for transport in ("wire", "shm"):
        ops = HierarchicalCopyAllReduce(address=daemon.address, transport=transport)
        got[transport] = [ops.reduce(op, value, value), ops.reduce(op, value, ["CPU:5", "CPU:6"])]
    for wire, shm in zip(got["wire"], got["shm"]):
        assert [a.tobytes() for a in wire.values] == [a.tobytes() for a in shm.values]
        assert wire.devices == shm.devices
    assert xreduce.canonical("CPU:6") == got["wire"][1].devices[1]
