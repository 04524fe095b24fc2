"""NCCL all-reduce: the cupy backend's, and ``NcclAllReduce`` from the SDK through a real daemon
(needs a GPU; the daemon tests need two distinct GPUs).

Skipped, with the reason, where CuPy, a GPU, NCCL or a second GPU is missing; run with
``pytest -m gpu tests/gpu/test_nccl.py`` on a GPU machine. Values are small integers
in float32, so every order of NCCL's additions gives the numpy sum exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from xreduced.backends import cupy_backend

_REASON = cupy_backend.unavailable_reason()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"GPU backend unavailable: {_REASON}")]


def _gpus() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _nccl_or_skip():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        pytest.skip(f"CuPy has no NCCL here: {e}")
    if not nccl.available:
        pytest.skip("CuPy was built without NCCL")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.complex64, np.float16])
def test_nccl_sums_one_buffer_per_gpu_as_numpy_does(dtype):
    _nccl_or_skip()
    n = _gpus()
    backend = cupy_backend.CupyBackend(n)  # one logical device per GPU
    rng = np.random.default_rng(13)
    arrays = [(rng.integers(-8, 8, size=(3, 5)) + (1j if np.dtype(dtype).kind == "c" else 0)).astype(dtype)
              for _ in range(n)]
    bufs = [backend.upload(i, a) for i, a in enumerate(arrays)]
    out = backend.nccl_all_reduce(bufs)
    want = sum(arrays[1:], arrays[0])  # small integers: every order of additions gives these exactly
    for i, buf in enumerate(out):
        assert buf.device == i
        np.testing.assert_array_equal(backend.download(buf), want)
    np.testing.assert_array_equal(backend.download(bufs[0]), arrays[0])  # the inputs are left as they were


def test_nccl_refuses_logical_devices_that_share_a_gpu():
    _nccl_or_skip()
    backend = cupy_backend.CupyBackend(_gpus() + 1)  # the last device shares GPU 0
    bufs = [backend.upload(i, np.ones(2, np.float32)) for i in (0, _gpus())]
    with pytest.raises(ValueError, match="NCCL needs one rank per GPU, but devices 0 and 1 are both on GPU 0"):
        backend.nccl_all_reduce(bufs)
    assert backend.nccl_refusal([0, _gpus()]) == (
        f"NCCL needs one GPU per device, but GPU:0 and GPU:{_gpus()} are logical devices on one GPU (cuda:0)")


def test_nccl_refuses_dtypes_it_cannot_add():
    _nccl_or_skip()
    backend = cupy_backend.CupyBackend(1)
    with pytest.raises(ValueError, match="NCCL cannot add int16 values"):
        backend.nccl_all_reduce([backend.upload(0, np.ones(2, np.int16))])


# --- the SDK through a daemon -------------------------------------------------


def _two_gpus_or_skip() -> int:
    _nccl_or_skip()
    n = _gpus()
    if n < 2:
        pytest.skip(f"NCCL among distinct GPUs needs two; this machine has {n}")
    return n


@pytest.fixture(scope="module")
def gpu_daemon(start_module_daemon):
    """A cupy daemon with one logical device per GPU."""
    n = _two_gpus_or_skip()
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", str(n),
                               timeout=120)


def _per_replica(n: int, seed: int, shape=(3, 5)):
    import xreduce

    rng = np.random.default_rng(seed)
    arrays = [rng.integers(-8, 8, size=shape).astype(np.float32) for _ in range(n)]
    return arrays, xreduce.distribute.PerReplica(arrays, devices=[f"GPU:{i}" for i in range(n)])


@pytest.mark.timeout(300)
def test_nccl_all_reduce_from_the_sdk_sums_and_means_on_every_gpu(gpu_daemon):
    import xreduce

    n = _gpus()
    arrays, value = _per_replica(n, 1)
    ops = xreduce.distribute.NcclAllReduce(address=gpu_daemon.address)
    want = sum(arrays[1:], arrays[0])
    for op, expect in (("sum", want), ("mean", want / np.float32(n))):
        result = ops.reduce(op, value, value)
        assert result.devices == tuple(xreduce.canonical(f"GPU:{i}") for i in range(n))
        for got in result.values:
            np.testing.assert_array_equal(np.asarray(got), expect)
    # A batch whose destinations are the sources: one NCCL all-reduce, as TF's _batch_all_reduce.
    others, second = _per_replica(n, 4, shape=(7,))
    reduced = ops.batch_reduce("sum", [(value, value), (second, second)])
    for result, inputs in zip(reduced, (arrays, others)):
        for got in result.values:
            np.testing.assert_array_equal(np.asarray(got), sum(inputs[1:], inputs[0]))


@pytest.mark.timeout(300)
def test_nccl_batch_and_fallbacks_follow_tfs_all_reduce_cross_device_ops(gpu_daemon):
    import grpc
    from xreduce.v1 import xreduce_pb2 as pb
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduce.wire import codec

    n = _gpus()
    a, _ = _per_replica(n, 2)
    b, _ = _per_replica(n, 3, shape=(4,))

    def value(arrays):
        return pb.DistributedValue(components=[pb.Component(device=f"GPU:{i}", tensor=codec.encode(x))
                                              for i, x in enumerate(arrays)])

    with grpc.insecure_channel(gpu_daemon.address) as ch:
        stub = pb_grpc.CrossDeviceOpsStub(ch)
        # Destinations are the sources for every pair: one packed NCCL all-reduce (TF's _batch_all_reduce).
        reply = stub.BatchReduce(pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM, algorithm=pb.ALGORITHM_NCCL, num_packs=2,
            pairs=[pb.ReducePair(value=value(a)), pb.ReducePair(value=value(b))]), timeout=120)
        for result, arrays in zip(reply.results, (a, b)):
            assert result.route == pb.ROUTE_NCCL
            assert len(result.result.components) == n
            for c in result.result.components:
                np.testing.assert_array_equal(codec.decode(c.tensor), sum(arrays[1:], arrays[0]))
        # One destination that is not all the sources: TF falls back to ReductionToOneDevice.
        reply = stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, algorithm=pb.ALGORITHM_NCCL,
                                             value=value(a), destinations=["GPU:1"]), timeout=120)
        assert reply.route == pb.ROUTE_REDUCTION_TO_ONE_DEVICE
        (c,) = reply.result.components
        np.testing.assert_array_equal(codec.decode(c.tensor), sum(a[1:], a[0]) / np.float32(n))
        # A dtype NCCL does not add is refused before anything runs, naming it.
        with pytest.raises(grpc.RpcError) as e:
            stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, algorithm=pb.ALGORITHM_NCCL,
                                         value=value([x.astype(np.int16) for x in a])), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ALGORITHM_NCCL cannot run on this daemon: NCCL cannot add int16 values" in e.value.details()


@pytest.mark.timeout(300)
def test_daemon_refuses_nccl_on_logical_devices_that_share_a_gpu(start_daemon):
    import grpc
    from xreduce.v1 import xreduce_pb2 as pb
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduce.wire import codec

    _nccl_or_skip()
    n = _gpus()
    proc = start_daemon("--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", str(n + 1),
                        timeout=120)
    x = codec.encode(np.ones(2, np.float32))
    with grpc.insecure_channel(proc.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CrossDeviceOpsStub(ch).Reduce(pb.ReduceRequest(
                reduce_op=pb.REDUCE_OP_SUM, algorithm=pb.ALGORITHM_NCCL, value=pb.DistributedValue(components=[
                    pb.Component(device="GPU:0", tensor=x), pb.Component(device=f"GPU:{n}", tensor=x)])), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        f"algorithm: ALGORITHM_NCCL cannot run on this daemon: NCCL needs one GPU per device, but GPU:0 and GPU:{n} "
        "are logical devices on one GPU (cuda:0); ALGORITHM_HIERARCHICAL_COPY reduces on any devices")
