"""Tensor codec: numpy arrays <-> ``xreduce.v1.Tensor`` in both encodings.

The raw encoding carries little-endian C-order bytes (what the SDK sends); the
typed encoding carries ``float_values``/``int_values``/``uint_values`` that a
person can type in grpcurl JSON. Decoding checks everything and names the
field in its error.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from xreduce.v1 import xreduce_pb2 as pb

_BY_ENUM: dict[int, np.dtype] = {
    pb.DATA_TYPE_FLOAT16: np.dtype(np.float16),
    pb.DATA_TYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.DATA_TYPE_FLOAT32: np.dtype(np.float32),
    pb.DATA_TYPE_FLOAT64: np.dtype(np.float64),
    pb.DATA_TYPE_INT8: np.dtype(np.int8),
    pb.DATA_TYPE_INT16: np.dtype(np.int16),
    pb.DATA_TYPE_INT32: np.dtype(np.int32),
    pb.DATA_TYPE_INT64: np.dtype(np.int64),
    pb.DATA_TYPE_UINT8: np.dtype(np.uint8),
    pb.DATA_TYPE_UINT16: np.dtype(np.uint16),
    pb.DATA_TYPE_UINT32: np.dtype(np.uint32),
    pb.DATA_TYPE_UINT64: np.dtype(np.uint64),
    pb.DATA_TYPE_COMPLEX64: np.dtype(np.complex64),
    pb.DATA_TYPE_COMPLEX128: np.dtype(np.complex128),
}
_BY_NAME: dict[str, int] = {dt.name: enum for enum, dt in _BY_ENUM.items()}
_BY_DTYPE: dict[np.dtype, int] = {dt: enum for enum, dt in _BY_ENUM.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(dt.name for dt in _BY_ENUM.values())
"""Names of the dtypes the wire carries, e.g. ``'float32'``, ``'bfloat16'``."""

RAW = "raw"
TYPED = "typed"
MAX_DIMS = 32
"""The most dimensions a tensor may have (numpy allows 64)."""


class CodecError(ValueError):
    """A tensor that cannot be encoded or decoded; the message names the field.

    Example:
        >>> try:
        ...     decode(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2], raw_data=b"x"))
        ... except CodecError as e:
        ...     print(e)
        tensor.raw_data: 1 bytes for float32[2], expected 8
    """


def dtype_enum(dtype: object, field: str = "dtype") -> int:
    """Returns the ``DataType`` enum value for a numpy dtype (or its name).

    Example:
        >>> dtype_enum(np.float32) == pb.DATA_TYPE_FLOAT32
        True
    """
    if isinstance(dtype, np.dtype) and dtype in _BY_DTYPE:  # numpy's dtype.name is slow, and asked per tensor
        return _BY_DTYPE[dtype]
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError:
        name = str(dtype)
    if name not in _BY_NAME:
        raise CodecError(
            f"{field}: unsupported dtype {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    return _BY_NAME[name]


def numpy_dtype(enum: int, field: str = "tensor.dtype") -> np.dtype:
    """Returns the numpy dtype of a ``DataType`` enum value.

    Example:
        >>> numpy_dtype(pb.DATA_TYPE_BFLOAT16).name
        'bfloat16'
    """
    if enum not in _BY_ENUM:
        label = pb.DataType.Name(enum) if enum in pb.DataType.values() else str(enum)
        raise CodecError(
            f"{field}: unsupported dtype {label}; supported: "
            + ", ".join(pb.DataType.Name(e) for e in _BY_ENUM)
        )
    return _BY_ENUM[enum]


def encoding_of(tensor: pb.Tensor) -> str:
    """Returns ``'typed'`` when the tensor carries typed values, else ``'raw'``.

    Example:
        >>> encoding_of(pb.Tensor(float_values=[1.0]))
        'typed'
    """
    if tensor.float_values or tensor.int_values or tensor.uint_values:
        return TYPED
    return RAW


def raw_bytes(array: np.ndarray) -> bytes:
    """An array's elements as a ``Tensor``'s ``raw_data`` holds them: C order, little-endian.

    Example:
        >>> raw_bytes(np.array([1, 2], ">i2"))
        b'\\x01\\x00\\x02\\x00'
    """
    return np.ascontiguousarray(array).astype(little_endian(array.dtype), copy=False).tobytes()


def encode(array: np.ndarray, encoding: str = RAW) -> pb.Tensor:
    """Encodes an array as a ``Tensor`` in the given encoding.

    Example:
        >>> t = encode(np.array([1, 2], np.int16), TYPED)
        >>> list(t.int_values), list(t.shape)
        ([1, 2], [2])
    """
    array = np.asarray(array)
    if encoding == RAW:
        return pb.Tensor(dtype=dtype_enum(array.dtype), shape=array.shape, raw_data=raw_bytes(array))
    out = pb.Tensor(dtype=dtype_enum(array.dtype), shape=array.shape)
    kind = array.dtype.kind
    flat = array.reshape(-1)
    if kind == "c":
        pairs = np.empty((flat.size, 2), np.float64)
        pairs[:, 0], pairs[:, 1] = flat.real, flat.imag
        out.float_values.extend(pairs.reshape(-1).tolist())
    elif kind == "i":
        out.int_values.extend(flat.tolist())
    elif kind == "u":
        out.uint_values.extend(flat.tolist())
    else:
        out.float_values.extend(flat.astype(np.float64).tolist())
    return out


def spec(tensor: pb.Tensor, field: str = "tensor") -> tuple[np.dtype, tuple[int, ...]]:
    """A ``Tensor``'s dtype and shape, checked (its data is not looked at).

    Raises:
        CodecError: unsupported dtype, a bad shape.

    Example:
        >>> spec(pb.Tensor(dtype=pb.DATA_TYPE_INT8, shape=[2, 3]))
        (dtype('int8'), (2, 3))
    """
    dtype = numpy_dtype(tensor.dtype, f"{field}.dtype")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"{field}.shape: dimensions must be >= 0; got {list(shape)}")
    if len(shape) > MAX_DIMS:
        raise CodecError(f"{field}.shape: at most {MAX_DIMS} dimensions; got {len(shape)}")
    if any(d >= 1 << 62 for d in shape) or math.prod(shape) >= 1 << 62:
        raise CodecError(f"{field}.shape: too large; got {list(shape)}")
    return dtype, shape


def decode(tensor: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """Decodes a ``Tensor`` into a numpy array, checking it completely.

    Args:
        tensor: the message.
        field: the field path used in error messages.

    Raises:
        CodecError: unsupported dtype, a bad shape, data that does not match the
            shape, typed values of the wrong kind or out of range.

    Example:
        >>> decode(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[3], float_values=[1, 2, 3]))
        array([1., 2., 3.], dtype=float32)
    """
    dtype, shape = spec(tensor, field)
    count = math.prod(shape)
    raw = tensor.raw_data
    if not (tensor.float_values or tensor.int_values or tensor.uint_values):  # raw bytes (or none): the usual case
        want = count * dtype.itemsize
        if len(raw) != want:
            raise CodecError(f"{field}.raw_data: {len(raw)} bytes for {dtype.name}{list(shape)}, expected {want}")
        return _reshape(np.frombuffer(raw, little_endian(dtype)).astype(dtype, copy=False), shape, field)
    label = f"{dtype.name}{list(shape)}"
    present = [
        name
        for name in ("raw_data", "float_values", "int_values", "uint_values")
        if len(getattr(tensor, name))
    ]
    if len(present) > 1:
        raise CodecError(f"{field}: set exactly one of raw_data or typed values; got {', '.join(present)}")
    return _decode_typed(tensor, present[0], dtype, shape, field, label)


_LITTLE: dict[np.dtype, np.dtype] = {}


def little_endian(dtype: np.dtype) -> np.dtype:
    """``dtype`` in little-endian order (the wire's), remembered: ``newbyteorder`` is slow.

    Example:
        >>> little_endian(np.dtype(">i4")).str
        '<i4'
    """
    found = _LITTLE.get(dtype)
    if found is None:
        found = _LITTLE[dtype] = dtype.newbyteorder("<")
    return found


def _reshape(flat: np.ndarray, shape: tuple[int, ...], field: str) -> np.ndarray:
    try:
        return flat.reshape(shape)
    except ValueError as e:  # e.g. an empty shape whose other dimensions overflow numpy's size type
        raise CodecError(f"{field}.shape: numpy cannot make an array of shape {list(shape)} ({e})") from None


def _decode_typed(tensor, name, dtype, shape, field, label) -> np.ndarray:
    kind = dtype.kind
    expected = {"c": "float_values", "f": "float_values", "V": "float_values",
                "i": "int_values", "u": "uint_values"}.get(kind, "float_values")
    if name != expected:
        raise CodecError(f"{field}.{name}: {dtype.name} values travel in {expected}, not {name}")
    values = getattr(tensor, name)
    count = math.prod(shape)
    want = count * 2 if kind == "c" else count
    if len(values) != want:
        raise CodecError(f"{field}.{name}: {len(values)} values for {label}, expected {want}")
    if kind == "c":
        part = np.dtype(np.float32 if dtype == np.complex64 else np.float64)
        pairs = _narrow(values, part, field, name).reshape(-1, 2)
        out = np.empty(count, dtype)
        out.real, out.imag = pairs[:, 0], pairs[:, 1]
        return _reshape(out, shape, field)
    if kind in "iu":
        info = np.iinfo(dtype)
        src = np.asarray(values, np.int64 if kind == "i" else np.uint64)
        bad = src[(src < info.min) | (src > info.max)] if src.size else src
        if bad.size:
            raise CodecError(
                f"{field}.{name}: value {int(bad[0])} is out of range for {dtype.name} "
                f"[{info.min}, {info.max}]"
            )
        return _reshape(src.astype(dtype), shape, field)
    return _reshape(_narrow(values, dtype, field, name), shape, field)


def _narrow(values, dtype: np.dtype, field: str, name: str) -> np.ndarray:
    """float64 values as ``dtype``; a finite value that would become infinite is an error."""
    src = np.asarray(values, np.float64)
    with np.errstate(over="ignore"):
        out = src.astype(dtype)
    overflow = np.isfinite(src) & ~np.isfinite(out.astype(np.float64))
    if overflow.any():
        raise CodecError(
            f"{field}.{name}: value {float(src[overflow][0])!r} is out of range for {dtype.name} "
            f"(largest finite {float(ml_dtypes.finfo(dtype).max)!r})"
        )
    return out
