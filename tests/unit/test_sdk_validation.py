"""The SDK's front without a daemon: constructing needs none, and bad arguments fail before any call.

What reaches a daemon is in tests/integration/test_sdk.py.
"""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest
import xreduce
from xreduce.distribute import (
    HierarchicalCopyAllReduce,
    MirroredStrategy,
    NcclAllReduce,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_constructing_needs_no_daemon():
    dead = f"127.0.0.1:{_free_port()}"
    HierarchicalCopyAllReduce(num_packs=3, address=dead)
    ReductionToOneDevice(reduce_to_device="gpu:0", address=dead)
    MirroredStrategy(devices=["gpu:0", "gpu:1"], address=dead)
    PerReplica([np.zeros(1), np.zeros(1)], devices=["CPU:0", "CPU:1"])
    xreduce.Client(dead)


def test_reduce_op_strings_any_case_and_bad_ones():
    assert ReduceOp.from_value("Sum") is ReduceOp.SUM
    assert ReduceOp.from_value(ReduceOp.MEAN) is ReduceOp.MEAN
    for bad in ("bogus", None, 1):
        with pytest.raises(ValueError, match=r"`reduce_op` must be Reduce.SUM or Reduce.MEAN; got"):
            ReduceOp.from_value(bad)


def test_per_replica_validation():
    with pytest.raises(ValueError, match="at least one value"):
        PerReplica([])
    with pytest.raises(ValueError, match="2 values but devices="):
        PerReplica([1.0, 2.0], devices=["CPU:0"])
    with pytest.raises(ValueError, match="Unknown attribute 'nope'"):
        PerReplica([1.0], devices=["nope"])
    with pytest.raises(ValueError, match=r"each device may hold one value; got devices=\['CPU:0', '/cpu:0'\]"):
        PerReplica([1.0, 2.0], devices=["CPU:0", "/cpu:0"])


def test_mirrored_strategy_validates_devices():
    with pytest.raises(ValueError, match="non-empty list"):
        MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="twice"):
        MirroredStrategy(devices=["gpu:0", "/device:GPU:0"])
    s = MirroredStrategy(devices=["gpu:0", "/gpu:1"], address="127.0.0.1:1")
    assert s.extended.worker_devices == (xreduce.canonical("GPU:0"), xreduce.canonical("GPU:1"))
    assert s.num_replicas_in_sync == 2


def test_cupy_arrays_carry_their_device():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the gpu extra); needs a GPU")
    from xreduce._arrays import to_host

    host = to_host(cupy.arange(3))
    assert host.device == "GPU:0"
    assert isinstance(host.restore(host.array), cupy.ndarray)


# --- bad input is refused at the call, naming the argument, the value and what is accepted ---------------------


_UNSUPPORTED = [
    (np.array([1, "a"], dtype=object), r"an array of Python objects \(dtype object\)",
     "np.asarray(x, dtype=np.float32)"),
    (np.array(["abc", "def"]), r"an array of strings \(dtype <U3\)", "only numbers"),
    (np.array([b"abc"]), r"an array of byte strings \(dtype \|S3\)", "only numbers"),
    (np.array([True, False]), r"a bool array \(dtype bool\)", "x.astype(np.int32)"),
    (np.array(["2024-01-01"], dtype="datetime64[D]"), r"dtype datetime64\[D\]", "supported dtypes"),
]


def _accepted(message: str) -> None:
    assert f"supported dtypes: {', '.join(xreduce.SUPPORTED_DTYPES)} (xreduce.SUPPORTED_DTYPES)" in message


@pytest.mark.parametrize(("array", "what", "hint"), _UNSUPPORTED)
def test_unsupported_dtypes_are_refused_before_anything_is_sent(array, what, hint):
    # A dead daemon: the refusal must come before any connection, staging or call.
    ops = HierarchicalCopyAllReduce(address=f"127.0.0.1:{_free_port()}")
    value = PerReplica([array.copy(), array.copy()], devices=["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=rf"^per_replica_value\.values\[0\]: {what} cannot be reduced") as e:
        ops.reduce("sum", value, "CPU:0")
    assert hint in str(e.value)
    _accepted(str(e.value))
    assert "; got array([" in str(e.value)
    with pytest.raises(ValueError, match=rf"^per_replica_value: {what}"):
        ops.reduce("sum", array, "CPU:1")  # a plain array is a value on one device, reduced elsewhere
    ok = PerReplica([np.ones(2), np.ones(2)], devices=["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=rf"^value_destination_pairs\[1\]\[0\]\.values\[0\]: {what}"):
        ops.batch_reduce("sum", [(ok, "CPU:0"), (value, "CPU:0")])
    with pytest.raises(ValueError, match=rf"^tensor: {what}"):
        ops.broadcast(array, ["CPU:0", "CPU:1"])


def test_a_python_list_of_strings_is_refused_naming_the_argument():
    ops = HierarchicalCopyAllReduce(address=f"127.0.0.1:{_free_port()}")
    value = PerReplica([["a", "b"], ["c", "d"]], devices=["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"^per_replica_value\.values\[0\]: an array of strings \(dtype <U1\)"):
        ops.reduce("sum", value, "CPU:0")


def test_every_supported_dtype_passes_the_check():
    from xreduce._arrays import check_dtype

    for name in xreduce.SUPPORTED_DTYPES:
        check_dtype(np.zeros(2, xreduce.wire.codec.numpy_dtype(xreduce.wire.codec.dtype_enum(name))), "x")
    check_dtype(2.5, "x")
    check_dtype([1, 2], "x")
    check_dtype(True, "x")  # a Python bool is to_host's to refuse, with TF's message


@pytest.mark.parametrize("bad", [2.5, "2", True, None, [2]])
def test_num_packs_must_be_an_integer(bad):
    message = f"num_packs must be an integer >= 0 (0: no packing); got {bad!r} of type {type(bad).__name__}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        HierarchicalCopyAllReduce(num_packs=bad)


@pytest.mark.parametrize("ops", [HierarchicalCopyAllReduce, NcclAllReduce])
def test_num_packs_beyond_the_wires_int32_is_refused_naming_it(ops):
    for bad in (2**70, 2**31):
        with pytest.raises(ValueError) as raised:
            ops(num_packs=bad)
        assert str(raised.value) == f"num_packs must be in [0, 2147483647] (0: no packing); got {bad}"
    assert ops(num_packs=2**31 - 1).num_packs == 2**31 - 1


@pytest.mark.parametrize(("values", "shown"), [
    (["a", "b"], "'a'"), ([np.ones(2), None], "None"), ([np.ones(2), object()], "<object object at"),
])
def test_per_replica_of_values_that_are_not_arrays_names_the_value(values, shown):
    bad = next(i for i, v in enumerate(values) if not isinstance(v, np.ndarray))
    with pytest.raises(ValueError) as raised:
        PerReplica(values)
    message = str(raised.value)
    assert message.startswith(f"PerReplica: values[{bad}] must be an array, a tensor or a number, one per device"), \
        message
    assert shown in message
    if isinstance(values[bad], str):
        assert "device names go in devices=" in message


def test_num_packs_keeps_tfs_message_and_takes_numpy_integers():
    with pytest.raises(ValueError, match=r"^HierarchicalCopy requires num_packs >= 0, but -1 is specified$"):
        HierarchicalCopyAllReduce(num_packs=-1)
    ops = HierarchicalCopyAllReduce(num_packs=np.int64(2))
    assert ops.num_packs == 2 and type(ops.num_packs) is int


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bytes_per_pack": "1"}, r"^Argument `bytes_per_pack` must be an integer >= 0; got '1' of type str$"),
    ({"bytes_per_pack": 2.5}, r"^Argument `bytes_per_pack` must be an integer >= 0; got 2.5 of type float$"),
    ({"timeout_seconds": "5"}, r"^Argument `timeout_seconds` must be a number > 0 or None; got '5' of type str$"),
])
def test_communication_options_name_the_argument_and_the_value(kwargs, message):
    from xreduce.distribute import CommunicationOptions

    with pytest.raises(ValueError, match=message):
        CommunicationOptions(**kwargs)
