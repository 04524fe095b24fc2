"""Bad input through the real RPCs of a real daemon.

Every bad request gets INVALID_ARGUMENT (NOT_FOUND for an unknown device)
whose details name the field and the values received, and the daemon goes on
serving: after each rejection a normal request is answered correctly.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
SUM = pb.REDUCE_OP_SUM
TO_ONE = pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE
CANON = "/job:localhost/replica:0/task:0/device:"
LISTING = "its devices are CPU:0, CPU:1, CPU:2, CPU:3, CPU:4, CPU:5, CPU:6, CPU:7"
"""How NOT_FOUND lists the session daemon's 8 host devices."""


def f32(values) -> pb.Tensor:
    return codec.encode(np.asarray(values, np.float32))


def f64(values) -> pb.Tensor:
    return codec.encode(np.asarray(values, np.float64))


def value(*components: tuple[str, pb.Tensor]) -> pb.DistributedValue:
    return pb.DistributedValue(components=[pb.Component(device=d, tensor=t) for d, t in components])


def one_bad(bad: pb.Tensor, at: int = 0) -> pb.DistributedValue:
    """A two-replica float32[2] value whose component ``at`` is ``bad``."""
    tensors = [f32([1, 2]), f32([10, 20])]
    tensors[at] = bad
    return value(("CPU:0", tensors[0]), ("CPU:1", tensors[1]))


GOOD = value(("CPU:0", f32([1, 2])), ("CPU:1", f32([10, 20])))
GOOD64 = value(("CPU:0", f64([1, 2])), ("CPU:1", f64([10, 20])))


def reduce(v: pb.DistributedValue = GOOD, **kw) -> tuple[str, pb.ReduceRequest]:
    kw.setdefault("reduce_op", SUM)
    return "Reduce", pb.ReduceRequest(value=v, **kw)


def batch(*pairs, **kw) -> tuple[str, pb.BatchReduceRequest]:
    """``pairs``: values, or (value, destinations) tuples."""
    kw.setdefault("reduce_op", SUM)
    out = []
    for p in pairs:
        v, dests = p if isinstance(p, tuple) else (p, [])
        out.append(pb.ReducePair(value=v, destinations=dests))
    return "BatchReduce", pb.BatchReduceRequest(pairs=out, **kw)


def broadcast(**kw) -> tuple[str, pb.BroadcastRequest]:
    return "Broadcast", pb.BroadcastRequest(**kw)


def case(case_id: str, call, code: grpc.StatusCode, *needles: str):
    return pytest.param(call, code, needles, id=case_id)


def assert_serves(stub) -> None:
    """A normal request right after a rejected one is answered correctly."""
    reply = stub.Reduce(pb.ReduceRequest(reduce_op=SUM, value=GOOD), timeout=30)
    assert reply.route == pb.ROUTE_HIERARCHICAL_COPY
    assert [c.device for c in reply.result.components] == [CANON + "CPU:0", CANON + "CPU:1"]
    for comp in reply.result.components:
        np.testing.assert_array_equal(codec.decode(comp.tensor), np.array([11, 22], np.float32))


def rejected(stub, call, code: grpc.StatusCode) -> str:
    """Sends ``call``; asserts it fails with ``code``; returns the details."""
    method, request = call
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request, timeout=30)
    err = info.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    return err.details()


TENSOR_CASES = [
    case("dtype-unspecified",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_UNSPECIFIED, shape=[2], raw_data=bytes(8)))), INVALID,
         "value.components[0].tensor.dtype: unsupported dtype DATA_TYPE_UNSPECIFIED; supported: ",
         "DATA_TYPE_FLOAT32"),
    case("dtype-out-of-range-99",
         reduce(one_bad(pb.Tensor(dtype=99, shape=[2], raw_data=bytes(8)), at=1)), INVALID,
         "value.components[1].tensor.dtype: unsupported dtype 99; supported: ", "DATA_TYPE_COMPLEX128"),
    case("raw-data-too-short",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=bytes(4)))), INVALID,
         "value.components[0].tensor.raw_data: 4 bytes for float32[2], expected 8"),
    case("raw-data-too-long",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=bytes(12)), at=1)), INVALID,
         "value.components[1].tensor.raw_data: 12 bytes for float32[2], expected 8"),
    case("raw-data-missing",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2]))), INVALID,
         "value.components[0].tensor.raw_data: 0 bytes for float32[2], expected 8"),
    case("typed-count-too-few",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], float_values=[1.0]), at=1)), INVALID,
         "value.components[1].tensor.float_values: 1 values for float32[2], expected 2"),
    case("typed-count-too-many",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], float_values=[1, 2, 3]))), INVALID,
         "value.components[0].tensor.float_values: 3 values for float32[2], expected 2"),
    case("typed-complex-needs-pairs",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_COMPLEX64, shape=[1], float_values=[1.0])))),
         INVALID, "value.components[0].tensor.float_values: 1 values for complex64[1], expected 2"),
    case("typed-int-values-for-float32",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], int_values=[1, 2]))), INVALID,
         "value.components[0].tensor.int_values: float32 values travel in float_values, not int_values"),
    case("typed-uint-values-for-int32",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_INT32, shape=[1], uint_values=[1])))), INVALID,
         "value.components[0].tensor.uint_values: int32 values travel in int_values, not uint_values"),
    case("typed-float-values-for-uint8",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=[1], float_values=[1.0])))), INVALID,
         "value.components[0].tensor.float_values: uint8 values travel in uint_values, not float_values"),
    case("int8-above-range",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_INT8, shape=[3], int_values=[1, 128, 300])))),
         INVALID, "value.components[0].tensor.int_values: value 128 is out of range for int8 [-128, 127]"),
    case("int8-below-range",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_INT8, shape=[1], int_values=[-129])))),
         INVALID, "value.components[0].tensor.int_values: value -129 is out of range for int8 [-128, 127]"),
    case("uint8-above-range",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=[1], uint_values=[256])))),
         INVALID, "value.components[0].tensor.uint_values: value 256 is out of range for uint8 [0, 255]"),
    case("float16-typed-value-overflows",
         reduce(value(("CPU:0", pb.Tensor(dtype=pb.DATA_TYPE_FLOAT16, shape=[2], float_values=[1.0, 1e6])))),
         INVALID, "value.components[0].tensor.float_values: value 1000000.0 is out of range for float16 "
         "(largest finite 65504.0)"),
    case("raw-and-typed-both-set",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=bytes(8),
                                  float_values=[1, 2]))), INVALID,
         "value.components[0].tensor: set exactly one of raw_data or typed values; got raw_data, float_values"),
    case("negative-shape-dim",
         reduce(one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2, -1], raw_data=bytes(8)))), INVALID,
         "value.components[0].tensor.shape: dimensions must be >= 0; got [2, -1]"),
    case("batch-pair-field-path",
         batch(GOOD, one_bad(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=bytes(3)), at=1)),
         INVALID, "pairs[1].value.components[1].tensor.raw_data: 3 bytes for float32[2], expected 8"),
    case("broadcast-tensor-field-path",
         broadcast(tensor=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=bytes(5)),
                   destinations=["CPU:1"]), INVALID,
         "tensor.raw_data: 5 bytes for float32[2], expected 8"),
]

VALUE_CASES = [
    case("replicas-disagree-in-dtype",
         reduce(value(("CPU:0", f32([1, 2])), ("CPU:1", f64([1, 2])))), INVALID,
         "value.components[1].tensor: replicas must agree in dtype and shape; got float64[2] but "
         "components[0] is float32[2]"),
    case("replicas-disagree-in-shape",
         reduce(value(("CPU:0", f32([1, 2])), ("CPU:1", f32([1, 2])), ("CPU:2", f32([1, 2, 3])))), INVALID,
         "value.components[2].tensor: replicas must agree in dtype and shape; got float32[3] but "
         "components[0] is float32[2]"),
    case("replicas-disagree-in-shape-same-count-1x2-vs-2x1",
         reduce(value(("CPU:0", f32([[1, 2]])), ("CPU:1", f32([[1], [2]]))), num_packs=1), INVALID,
         "value.components[1].tensor: replicas must agree in dtype and shape; got float32[2, 1] but "
         "components[0] is float32[1, 2]"),
    case("batch-replicas-disagree",
         batch(GOOD, value(("CPU:0", f32([1])), ("CPU:1", f32([1, 2])))), INVALID,
         "pairs[1].value.components[1].tensor: replicas must agree in dtype and shape; got float32[2] but "
         "components[0] is float32[1]"),
    case("duplicate-device-in-value",
         reduce(value(("CPU:3", f32([1])), ("CPU:4", f32([1])), ("/device:CPU:3", f32([1])))), INVALID,
         "value.components[2].device: CPU:3 already holds components[0]; each device may hold one component"),
    case("empty-value",
         reduce(value()), INVALID, "value.components: a value needs at least one component; got none"),
    case("value-not-set",
         ("Reduce", pb.ReduceRequest(reduce_op=SUM)), INVALID,
         "value.components: a value needs at least one component; got none"),
    case("batch-empty-value",
         batch(GOOD, value()), INVALID, "pairs[1].value.components: a value needs at least one component; got none"),
]

OPTION_CASES = [
    case("reduce-op-unspecified-0",
         reduce(reduce_op=pb.REDUCE_OP_UNSPECIFIED), INVALID,
         "reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got REDUCE_OP_UNSPECIFIED (0)"),
    case("reduce-op-unknown-7",
         reduce(reduce_op=7), INVALID, "reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got 7"),
    case("batch-reduce-op-unknown-7",
         batch(GOOD, reduce_op=7), INVALID, "reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got 7"),
    case("algorithm-unknown-9",
         reduce(algorithm=9), INVALID,
         "algorithm: must be ALGORITHM_HIERARCHICAL_COPY, ALGORITHM_REDUCTION_TO_ONE_DEVICE or ALGORITHM_NCCL; got 9"),
    case("num-packs-negative",
         reduce(num_packs=-1), INVALID, "num_packs: must be in [0, 65536]; got num_packs=-1"),
    case("batch-num-packs-negative",
         batch(GOOD, num_packs=-5), INVALID, "num_packs: must be in [0, 65536]; got num_packs=-5"),
    case("batch-mixed-dtypes-num-packs-unset",
         batch(GOOD, GOOD64), INVALID,
         "num_packs=1 packs the batch into one buffer, so every value must share one dtype; got pairs[0].value "
         "float32 and pairs[1].value float64 (num_packs=0 reduces mixed dtypes)"),
    case("batch-mixed-dtypes-num-packs-3",
         batch(GOOD, GOOD, GOOD64, num_packs=3), INVALID,
         "num_packs=3 packs the batch into one buffer, so every value must share one dtype; got pairs[0].value "
         "float32 and pairs[2].value float64"),
    case("timeout-zero",
         reduce(timeout=Duration()), INVALID, "timeout: must be positive; got 0s"),
    case("timeout-negative",
         reduce(timeout=Duration(seconds=-1)), INVALID, "timeout: must be positive; got -1s"),
    case("batch-timeout-negative",
         batch(GOOD, timeout=Duration(seconds=-2, nanos=-500_000_000)), INVALID,
         "timeout: must be positive; got -2.5s"),
    case("broadcast-timeout-zero",
         broadcast(tensor=f32([1]), destinations=["CPU:1"], timeout=Duration()), INVALID,
         "timeout: must be positive; got 0s"),
    case("reduce-to-device-with-hierarchical-copy",
         reduce(reduce_to_device="CPU:1", algorithm=pb.ALGORITHM_HIERARCHICAL_COPY), INVALID,
         "reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got 'CPU:1' with "
         "ALGORITHM_HIERARCHICAL_COPY (1)"),
    # A fused value's parts (the SDK's tensor fusion) must hold its components' elements.
    case("fused-parts-hold-more-than-the-tensor",
         reduce(pb.DistributedValue(components=GOOD.components, fused_parts=[
             pb.FusedPart(shape=[1], index=0), pb.FusedPart(shape=[2], index=1)])), INVALID,
         "value.fused_parts: the parts hold 3 elements but components[0] is float32[2]"),
    case("fused-parts-negative-dimension",
         reduce(pb.DistributedValue(components=GOOD.components, fused_parts=[pb.FusedPart(shape=[-2], index=0)])),
         INVALID, "value.fused_parts[0]: dimensions and index must be >= 0; got shape=[-2], index=0"),
    # The SDK's NcclAllReduce refuses host devices before sending; the daemon refuses a raw request itself.
    case("algorithm-nccl-on-host-devices",
         reduce(algorithm=pb.ALGORITHM_NCCL), INVALID,
         "algorithm: ALGORITHM_NCCL cannot run on this daemon: NCCL runs on GPUs, but the numpy backend's devices "
         "are host memory; ALGORITHM_HIERARCHICAL_COPY reduces on any devices"),
    case("batch-algorithm-nccl-on-host-devices-to-one-destination",
         batch((GOOD, ["CPU:0"]), GOOD, algorithm=pb.ALGORITHM_NCCL), INVALID,
         "algorithm: ALGORITHM_NCCL cannot run on this daemon (pairs[0].value): NCCL runs on GPUs"),
    case("reduce-to-device-with-nccl",
         reduce(reduce_to_device="CPU:1", algorithm=pb.ALGORITHM_NCCL), INVALID,
         "reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got 'CPU:1' with ALGORITHM_NCCL (3)"),
    case("reduce-to-device-with-unspecified-algorithm",
         reduce(reduce_to_device="CPU:1"), INVALID,
         "reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got 'CPU:1' with "
         "ALGORITHM_UNSPECIFIED (0)"),
    case("batch-reduce-to-device-with-hierarchical-copy",
         batch(GOOD, reduce_to_device="CPU:2", algorithm=pb.ALGORITHM_HIERARCHICAL_COPY), INVALID,
         "reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got 'CPU:2' with "
         "ALGORITHM_HIERARCHICAL_COPY (1)"),
]

DEVICE_CASES = [
    case("unparsable-component-device",
         reduce(value(("CPU:0", f32([1])), ("garbage", f32([1])))), INVALID,
         "value.components[1].device: Unknown attribute 'garbage' is encountered while parsing the device "
         "spec: 'garbage'."),
    case("unparsable-destination",
         reduce(destinations=["CPU:0", "garbage"]), INVALID,
         "destinations[1]: Unknown attribute 'garbage' is encountered while parsing the device spec: 'garbage'."),
    case("unknown-device-type-destination",
         reduce(destinations=["/device:TPU:0"]), INVALID,
         "destinations[0]: device name '/device:TPU:0': unknown device type 'TPU'; expected one of CPU, GPU"),
    case("empty-component-device",
         reduce(value(("", f32([1])))), INVALID,
         "value.components[0].device: a device name can not be empty; got ''"),
    case("unknown-component-device-cpu9",
         reduce(value(("CPU:0", f32([1])), ("CPU:9", f32([1])))), NOT_FOUND,
         "value.components[1].device: no device 'CPU:9' on this daemon; " + LISTING),
    case("unknown-destination-gpu0",
         reduce(destinations=["GPU:0"]), NOT_FOUND,
         "destinations[0]: no device 'GPU:0' on this daemon; " + LISTING),
    case("unknown-destination-other-job",
         reduce(destinations=["/job:worker/replica:0/task:0/device:CPU:0"]), NOT_FOUND,
         "destinations[0]: no device '/job:worker/replica:0/task:0/device:CPU:0' on this daemon; " + LISTING),
    case("batch-unknown-destination",
         batch(GOOD, (GOOD, ["CPU:0", "CPU:9"])), NOT_FOUND,
         "pairs[1].destinations[1]: no device 'CPU:9' on this daemon; " + LISTING),
    case("unknown-reduce-to-device",
         reduce(algorithm=TO_ONE, reduce_to_device="GPU:0"), NOT_FOUND,
         "reduce_to_device: no device 'GPU:0' on this daemon; " + LISTING),
    case("broadcast-unknown-source",
         broadcast(tensor=f32([1]), source_device="CPU:9", destinations=["CPU:1"]), NOT_FOUND,
         "source_device: no device 'CPU:9' on this daemon; " + LISTING),
    case("broadcast-unknown-destination",
         broadcast(tensor=f32([1]), destinations=["CPU:1", "GPU:0"]), NOT_FOUND,
         "destinations[1]: no device 'GPU:0' on this daemon; " + LISTING),
    case("duplicated-destination",
         reduce(destinations=["CPU:2", "/cpu:2"]), INVALID, "destinations[1]: CPU:2 is listed twice in destinations"),
    case("batch-duplicated-destination",
         batch((GOOD, ["CPU:1", "CPU:1"])), INVALID,
         "pairs[0].destinations[1]: CPU:1 is listed twice in pairs[0].destinations"),
    case("broadcast-duplicated-destination",
         broadcast(tensor=f32([1]), destinations=["CPU:1", "CPU:3", "CPU:1"]), INVALID,
         "destinations[2]: CPU:1 is listed twice in destinations"),
    case("broadcast-without-tensor",
         broadcast(destinations=["CPU:1"]), INVALID, "tensor: broadcast needs a tensor; got none"),
    case("broadcast-without-destinations",
         broadcast(tensor=f32([1, 2])), INVALID,
         "destinations: broadcast needs at least one destination; got none"),
]


@pytest.mark.parametrize("call, code, needles", TENSOR_CASES + VALUE_CASES + OPTION_CASES + DEVICE_CASES)
def test_bad_input_is_rejected_and_the_daemon_keeps_serving(stub, call, code, needles):
    details = rejected(stub, call, code)
    for needle in needles:
        assert needle in details, f"{needle!r} not in {details!r}"
    assert_serves(stub)


def test_mixed_dtypes_reduce_without_packing(stub):
    """num_packs=0 reduces each value alone, so dtypes may differ."""
    method, request = batch(GOOD, GOOD64, num_packs=0)
    reply = stub.BatchReduce(request, timeout=30)
    assert [r.route for r in reply.results] == [pb.ROUTE_HIERARCHICAL_COPY] * 2
    for r, dtype in zip(reply.results, (np.float32, np.float64)):
        for comp in r.result.components:
            np.testing.assert_array_equal(codec.decode(comp.tensor), np.array([11, 22], dtype))


@pytest.mark.parametrize("method", ["Reduce", "BatchReduce"])
def test_reduction_to_one_device_with_reduce_to_device(stub, method):
    """The sum happens on reduce_to_device (not a destination); the result lands on the destinations."""
    dests = ["CPU:3", "/cpu:0"]
    kw = {"algorithm": TO_ONE, "reduce_to_device": "CPU:5"}
    if method == "Reduce":
        result = stub.Reduce(pb.ReduceRequest(reduce_op=SUM, value=GOOD, destinations=dests, **kw), timeout=30)
    else:
        reply = stub.BatchReduce(batch((GOOD, dests), **kw)[1], timeout=30)
        assert len(reply.results) == 1
        result = reply.results[0]
    assert result.route == pb.ROUTE_REDUCTION_TO_ONE_DEVICE
    assert [c.device for c in result.result.components] == [CANON + "CPU:3", CANON + "CPU:0"]
    for comp in result.result.components:
        np.testing.assert_array_equal(codec.decode(comp.tensor), np.array([11, 22], np.float32))


def test_tiny_timeout_on_a_large_reduce_is_deadline_exceeded(stub):
    """A 1 us timeout: the deadline starts before the 8 inputs (256 KiB each) are
    copied onto their devices and is checked before the first pack, so it has
    always passed by then. (1 us is the smallest the daemon honours; see the
    sub-microsecond xfail below.)"""
    n = 1 << 16
    big = value(*((f"CPU:{d}", codec.encode(np.full(n, d, np.float32))) for d in range(8)))
    details = rejected(
        stub, reduce(big, num_packs=64, timeout=Duration(nanos=1000)), grpc.StatusCode.DEADLINE_EXCEEDED
    )
    assert details.startswith("timed out after 1e-06 s while "), details
    assert_serves(stub)


def test_sub_microsecond_timeout_is_positive(stub):
    details = rejected(stub, reduce(timeout=Duration(nanos=1)), grpc.StatusCode.DEADLINE_EXCEEDED)
    assert details.startswith("timed out after 1e-09 s while "), details


def test_out_of_range_timeout_is_not_an_internal_error(stub):
    try:
        reply = stub.Reduce(reduce(timeout=Duration(seconds=2**62))[1], timeout=30)
    except grpc.RpcError as e:
        assert e.code() == INVALID and e.details().startswith("timeout: "), f"{e.code()}: {e.details()}"
    else:  # treating it as unbounded would be fine too
        assert reply.route == pb.ROUTE_HIERARCHICAL_COPY
    assert_serves(stub)


def test_huge_num_packs_on_a_tiny_value_answers_promptly(start_daemon):
    # A private daemon: the stuck call would otherwise burn the session daemon's CPU.
    proc = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = pb_grpc.CrossDeviceOpsStub(ch)
            request = pb.ReduceRequest(reduce_op=SUM, value=GOOD, num_packs=2**31 - 1, timeout=Duration(seconds=1))
            try:
                reply = stub.Reduce(request, timeout=4)
            except grpc.RpcError as e:
                # Acceptable: a rejection naming num_packs, or the daemon's own timeout.
                ok = (e.code() == INVALID and "num_packs" in e.details()) or (
                    e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "timed out after" in e.details()
                )
                assert ok, f"{e.code()}: {e.details()}"
            else:
                for comp in reply.result.components:
                    np.testing.assert_array_equal(codec.decode(comp.tensor), np.array([11, 22], np.float32))
    finally:
        proc.kill()
