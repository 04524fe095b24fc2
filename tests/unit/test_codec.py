"""The tensor codec: every dtype round-trips bit-exactly in both encodings, raw
bytes are little-endian C order, and every decode error names its field."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.codec import (
    RAW,
    SUPPORTED_DTYPES,
    TYPED,
    CodecError,
    decode,
    dtype_enum,
    encode,
    encoding_of,
    numpy_dtype,
)

ENCODINGS = [RAW, TYPED]
ALL_DTYPES = [
    "float16", "bfloat16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "complex64", "complex128",
]
FIELD = "request.value.components[3].tensor"


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def extremes(name: str) -> list:
    """Edge values of a dtype: limits, zeros, inf/nan, subnormals where representable."""
    dt = np_dtype(name)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return [info.min, info.max, 0, 1, info.max - 1] + ([-1, info.min + 1] if dt.kind == "i" else [])
    if dt.kind == "c":
        part = np.finfo(dt)
        f = part.dtype.type
        return [
            complex(np.inf, -np.inf), complex(np.nan, 0.0), complex(-0.0, np.nan),
            complex(part.max, -part.max), complex(part.smallest_subnormal, -f(part.smallest_subnormal)),
            complex(part.tiny, part.eps), complex(1.5, -2.25),
        ]
    info = ml_dtypes.finfo(dt) if name == "bfloat16" else np.finfo(dt)
    return [
        info.max, -info.max, info.tiny, -info.tiny, info.smallest_subnormal, -info.smallest_subnormal,
        info.eps, np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -2.5,
    ]


def assert_bit_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{got!r} != {want!r}"


def test_supported_dtypes_are_the_wire_set():
    assert SUPPORTED_DTYPES == tuple(ALL_DTYPES)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_dtype_enum_round_trip(name):
    enum = dtype_enum(np_dtype(name))
    assert pb.DataType.Name(enum) == f"DATA_TYPE_{name.upper()}"
    assert numpy_dtype(enum) == np_dtype(name)
    assert dtype_enum(name) == enum


@pytest.mark.parametrize("bad", [np.bool_, "bool", "float128", object], ids=["np.bool_", "bool", "float128", "object"])
def test_dtype_enum_rejects_unsupported(bad):
    with pytest.raises(CodecError, match=r"^values\[0\]\.dtype: unsupported dtype '.*'; supported: float16, "):
        dtype_enum(bad, "values[0].dtype")


SHAPES = [(), (1,), (7,), (2, 3), (0,), (2, 0, 3), (3, 1, 2)]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "shape[" + ",".join(map(str, s)) + "]")
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_round_trip_shapes(name, shape, encoding):
    dt = np_dtype(name)
    rng = np.random.default_rng([len(shape), dt.itemsize])
    size = int(np.prod(shape))
    if dt.kind in "iu":
        info = np.iinfo(dt)
        arr = rng.integers(info.min, info.max, size, dtype=dt, endpoint=True)
    elif dt.kind == "c":
        arr = (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(dt)
    else:
        arr = rng.standard_normal(size).astype(dt)
    arr = arr.reshape(shape)
    t = encode(arr, encoding)
    assert list(t.shape) == list(shape)
    assert t.dtype == dtype_enum(dt)
    assert_bit_equal(decode(t), arr)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_round_trip_extreme_values(name, encoding):
    arr = np.array(extremes(name), np_dtype(name))
    t = encode(arr, encoding)
    assert encoding_of(t) == encoding
    assert_bit_equal(decode(t), arr)
    # Also through the wire bytes of the message.
    assert_bit_equal(decode(pb.Tensor.FromString(t.SerializeToString())), arr)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_round_trip_scalar(name, encoding):
    arr = np.array(extremes(name)[1], np_dtype(name))
    assert arr.shape == ()
    t = encode(arr, encoding)
    assert list(t.shape) == []
    assert_bit_equal(decode(t), arr)
    # numpy scalars (not 0-d arrays) encode the same way.
    assert encode(arr[()], encoding) == t


def test_extremes_cover_the_edges():
    f16 = np.array(extremes("float16"), np.float16)
    assert 65504.0 in f16.tolist()
    assert np.float16(2.0**-24) in f16  # the smallest float16 subnormal
    assert np.array([np.iinfo(np.uint64).max], np.uint64)[0] in np.array(extremes("uint64"), np.uint64)
    i64 = np.array(extremes("int64"), np.int64).tolist()
    assert -(2**63) in i64 and 2**63 - 1 in i64
    f32 = np.array(extremes("float32"), np.float32)
    assert np.float32(1.4e-45) in f32 and np.isnan(f32).any() and np.isneginf(f32).any()


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "bfloat16"])
def test_typed_signed_zero_and_nan(name):
    arr = np.array([-0.0, np.nan, -np.inf], np_dtype(name))
    t = encode(arr, TYPED)
    assert np.signbit(t.float_values[0]) and np.isnan(t.float_values[1]) and t.float_values[2] == -np.inf
    assert_bit_equal(decode(t), arr)


def test_typed_fields_per_kind():
    assert list(encode(np.array([-(2**63), 2**63 - 1], np.int64), TYPED).int_values) == [-(2**63), 2**63 - 1]
    assert list(encode(np.array([2**64 - 1], np.uint64), TYPED).uint_values) == [2**64 - 1]
    assert list(encode(np.array([1 + 2j, -3.5j], np.complex64), TYPED).float_values) == [1.0, 2.0, -0.0, -3.5]
    assert list(encode(np.array([65504], np.float16), TYPED).float_values) == [65504.0]
    assert list(encode(np.array([3.0], ml_dtypes.bfloat16), TYPED).float_values) == [3.0]


# --------------------------------------------------------------------------
# Raw bytes: little-endian, C order.


@pytest.mark.parametrize("name", ["int16", "uint32", "float32", "float64", "int64", "complex128", "bfloat16"])
def test_raw_is_little_endian_c_order(name):
    dt = np_dtype(name)
    arr = (np.arange(24) * 37 - 300).astype(dt).reshape(2, 3, 4)
    raw = encode(arr).raw_data
    assert raw == arr.astype(dt.newbyteorder("<")).tobytes(order="C")
    assert raw == b"".join(x.astype(dt.newbyteorder("<")).tobytes() for x in arr.reshape(-1))


def test_raw_known_bytes():
    assert encode(np.array([1, 0x0203], np.uint16)).raw_data == b"\x01\x00\x03\x02"
    assert encode(np.array([[1, 2], [3, 4]], "<i4")).raw_data == (
        b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00"
    )
    assert encode(np.array([1.0], np.float64)).raw_data == b"\x00\x00\x00\x00\x00\x00\xf0\x3f"


@pytest.mark.parametrize(
    "view",
    [lambda a: a.T, lambda a: a[:, ::2], lambda a: a[::-1], lambda a: np.asfortranarray(a)],
    ids=["transposed", "strided", "reversed", "fortran"],
)
@pytest.mark.parametrize("name", ["int32", "float64", "complex64", "float16"])
def test_raw_non_contiguous_input(name, view):
    base = (np.arange(48) * 3 - 20).astype(np_dtype(name)).reshape(6, 8)
    arr = view(base)
    t = encode(arr)
    assert list(t.shape) == list(arr.shape)
    assert t.raw_data == np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
    for encoding in ENCODINGS:
        assert_bit_equal(decode(encode(arr, encoding)), np.ascontiguousarray(arr))


@pytest.mark.parametrize("name", ["int16", "uint64", "float32", "float64", "complex128"])
def test_big_endian_input_is_sent_little_endian(name):
    native = (np.arange(6) * 1001 + 7).astype(name).reshape(2, 3)
    big = native.astype(np.dtype(name).newbyteorder(">"))
    t = encode(big)
    assert t.dtype == dtype_enum(name)
    assert t.raw_data == native.astype(np.dtype(name).newbyteorder("<")).tobytes()
    out = decode(t)
    assert out.dtype == np.dtype(name)
    np.testing.assert_array_equal(out, native)
    assert_bit_equal(decode(encode(big, TYPED)), native)


# --------------------------------------------------------------------------
# Decode errors: CodecError naming the field and the values.


def tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=(2,), **data) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(shape), **data)


ERRORS = [
    pytest.param(
        tensor(pb.DATA_TYPE_UNSPECIFIED, raw_data=b"\0" * 8),
        f"{FIELD}.dtype: unsupported dtype DATA_TYPE_UNSPECIFIED; supported: DATA_TYPE_FLOAT16, ",
        id="dtype-unspecified",
    ),
    pytest.param(
        tensor(99, raw_data=b"\0" * 8),
        f"{FIELD}.dtype: unsupported dtype 99; supported: DATA_TYPE_FLOAT16, ",
        id="dtype-unknown-enum",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (2, 3), raw_data=b"\0" * 5),
        f"{FIELD}.raw_data: 5 bytes for float32[2, 3], expected 24",
        id="raw-short",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT64, (), raw_data=b"\0" * 16),
        f"{FIELD}.raw_data: 16 bytes for int64[], expected 8",
        id="raw-long-scalar",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_COMPLEX128, (3,)),
        f"{FIELD}.raw_data: 0 bytes for complex128[3], expected 48",
        id="no-data",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT8, (0,), raw_data=b"\1"),
        f"{FIELD}.raw_data: 1 bytes for uint8[0], expected 0",
        id="raw-for-empty",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT32, (3,), int_values=[1, 2]),
        f"{FIELD}.int_values: 2 values for int32[3], expected 3",
        id="typed-count-int",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT16, (2, 2), float_values=[1, 2, 3, 4, 5]),
        f"{FIELD}.float_values: 5 values for float16[2, 2], expected 4",
        id="typed-count-float",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_COMPLEX64, (2,), float_values=[1.0, 2.0]),
        f"{FIELD}.float_values: 2 values for complex64[2], expected 4",
        id="typed-count-complex",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT16, (0,), uint_values=[1]),
        f"{FIELD}.uint_values: 1 values for uint16[0], expected 0",
        id="typed-for-empty",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (1,), int_values=[1]),
        f"{FIELD}.int_values: float32 values travel in float_values, not int_values",
        id="kind-int-for-float",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT8, (1,), uint_values=[1]),
        f"{FIELD}.uint_values: int8 values travel in int_values, not uint_values",
        id="kind-uint-for-int",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT32, (1,), int_values=[1]),
        f"{FIELD}.int_values: uint32 values travel in uint_values, not int_values",
        id="kind-int-for-uint",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT64, (1,), float_values=[1.0]),
        f"{FIELD}.float_values: int64 values travel in int_values, not float_values",
        id="kind-float-for-int",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_COMPLEX128, (1,), int_values=[1, 2]),
        f"{FIELD}.int_values: complex128 values travel in float_values, not int_values",
        id="kind-int-for-complex",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_BFLOAT16, (1,), uint_values=[1]),
        f"{FIELD}.uint_values: bfloat16 values travel in float_values, not uint_values",
        id="kind-uint-for-bfloat16",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT8, (3,), int_values=[127, 128, -129]),
        f"{FIELD}.int_values: value 128 is out of range for int8 [-128, 127]",
        id="range-int8-high",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT8, (2,), int_values=[-128, -129]),
        f"{FIELD}.int_values: value -129 is out of range for int8 [-128, 127]",
        id="range-int8-low",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT16, (1,), int_values=[40000]),
        f"{FIELD}.int_values: value 40000 is out of range for int16 [-32768, 32767]",
        id="range-int16",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT32, (2,), int_values=[0, -(2**31) - 1]),
        f"{FIELD}.int_values: value -2147483649 is out of range for int32 [-2147483648, 2147483647]",
        id="range-int32",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT8, (2,), uint_values=[255, 256]),
        f"{FIELD}.uint_values: value 256 is out of range for uint8 [0, 255]",
        id="range-uint8",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT16, (1,), uint_values=[2**16]),
        f"{FIELD}.uint_values: value 65536 is out of range for uint16 [0, 65535]",
        id="range-uint16",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_UINT32, (1,), uint_values=[2**64 - 1]),
        f"{FIELD}.uint_values: value 18446744073709551615 is out of range for uint32 [0, 4294967295]",
        id="range-uint32",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (2,), raw_data=b"\0" * 8, float_values=[1.0, 2.0]),
        f"{FIELD}: set exactly one of raw_data or typed values; got raw_data, float_values",
        id="both-raw-and-float",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT32, (1,), raw_data=b"\0" * 4, int_values=[1]),
        f"{FIELD}: set exactly one of raw_data or typed values; got raw_data, int_values",
        id="both-raw-and-int",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_INT32, (1,), int_values=[1], uint_values=[1], float_values=[1.0]),
        f"{FIELD}: set exactly one of raw_data or typed values; got float_values, int_values, uint_values",
        id="three-typed",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (2, -1), raw_data=b""),
        f"{FIELD}.shape: dimensions must be >= 0; got [2, -1]",
        id="negative-dim",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (-2, -3), raw_data=b"\0" * 24),
        f"{FIELD}.shape: dimensions must be >= 0; got [-2, -3]",
        id="negative-dims-positive-product",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (1 << 62,), raw_data=b""),
        f"{FIELD}.shape: too large; got [{1 << 62}]",
        id="huge-dim",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (1 << 61, 0), raw_data=b""),
        f"{FIELD}.shape: numpy cannot make an array of shape [{1 << 61}, 0]",
        id="empty-but-unmakeable",
    ),
    pytest.param(
        tensor(pb.DATA_TYPE_FLOAT32, (1,) * 33, raw_data=b"abcd"),
        f"{FIELD}.shape: at most 32 dimensions; got 33",
        id="too-many-dims",
    ),
]


@pytest.mark.parametrize("message, expected", ERRORS)
def test_decode_errors_name_the_field(message, expected):
    with pytest.raises(CodecError) as info:
        decode(message, FIELD)
    assert str(info.value).startswith(expected), str(info.value)
    assert isinstance(info.value, ValueError)


def test_decode_error_default_field():
    with pytest.raises(CodecError, match=re.escape("tensor.raw_data: 1 bytes for float32[2], expected 8")):
        decode(tensor(raw_data=b"x"))


def test_dtype_error_lists_every_supported_enum():
    with pytest.raises(CodecError) as info:
        decode(tensor(pb.DATA_TYPE_UNSPECIFIED), FIELD)
    listed = str(info.value).split("supported: ", 1)[1].split(", ")
    assert listed == [f"DATA_TYPE_{n.upper()}" for n in ALL_DTYPES]


@pytest.mark.parametrize(
    "dtype, values",
    [
        (pb.DATA_TYPE_INT8, [-128, 127]),
        (pb.DATA_TYPE_INT64, [-(2**63), 2**63 - 1]),
        (pb.DATA_TYPE_UINT8, [0, 255]),
        (pb.DATA_TYPE_UINT64, [0, 2**64 - 1]),
    ],
    ids=["int8", "int64", "uint8", "uint64"],
)
def test_typed_range_limits_are_accepted(dtype, values):
    field = "int_values" if pb.DataType.Name(dtype).startswith("DATA_TYPE_INT") else "uint_values"
    out = decode(tensor(dtype, (2,), **{field: values}), FIELD)
    assert out.tolist() == values
