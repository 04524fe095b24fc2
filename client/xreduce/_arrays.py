"""Array interop: numpy, Python scalars, CuPy, torch and JAX in; the caller's type out.

Values travel as host numpy arrays. Arrays that live on a GPU carry their
device (``GPU:i``); host arrays carry none, and the caller's device list
decides where they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from xreduce.wire.codec import SUPPORTED_DTYPES

_INT32 = np.iinfo(np.int32)
_REPR_CHARS = 60


@dataclasses.dataclass(frozen=True)
class HostArray:
    """An input as a host array, its device if it has one, and the way back."""

    array: np.ndarray
    device: str | None
    restore: Callable[[np.ndarray], Any]


def _writable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


def _python(value) -> np.ndarray:
    """TF's conversion of Python values: float -> float32, int -> int32 (int64 if
    it does not fit), complex -> complex128."""
    arr = np.asarray(value)
    if arr.dtype == np.bool_:
        raise ValueError(f"bool values are not supported; got {value!r}")
    if arr.dtype.kind == "f":
        return arr.astype(np.float32)
    if arr.dtype.kind == "i" and (arr.size == 0 or (arr.min() >= _INT32.min and arr.max() <= _INT32.max)):
        return arr.astype(np.int32)
    if arr.dtype.kind in "iuc":
        return arr
    raise ValueError(f"cannot convert {value!r} to an array of numbers")


def to_host(value: Any) -> HostArray:
    """Converts one tensor-like input.

    Raises:
        ValueError: ``None``, a bool, or something that is not an array of numbers.

    Example:
        >>> h = to_host(2.5)
        >>> h.array.dtype.name, h.device
        ('float32', None)
    """
    if value is None or isinstance(value, bool):
        raise ValueError(
            f"Attempt to convert a value ({value!r}) with an unsupported type ({type(value)}) to an array."
        )
    module = type(value).__module__.split(".")[0]
    if isinstance(value, np.ndarray):
        return HostArray(value, None, _writable)
    if isinstance(value, np.generic):
        return HostArray(np.asarray(value), None, _writable)
    if isinstance(value, (int, float, complex, list, tuple)):
        return HostArray(_python(value), None, _writable)
    if module == "cupy":
        return _from_cupy(value)
    if module == "torch":
        return _from_torch(value)
    if module in ("jax", "jaxlib"):
        return _from_jax(value)
    if hasattr(value, "__array__"):
        return HostArray(np.asarray(value), None, _writable)
    raise ValueError(
        f"Attempt to convert a value ({value!r}) with an unsupported type ({type(value)}) to an array."
    )


def _dtype_of(value: Any) -> tuple[str, str] | None:
    """The dtype of a value as (its name, how to show it), read without copying
    anything off a GPU; None for Python scalars and what has no dtype (``to_host`` judges those)."""
    if isinstance(value, (list, tuple)):
        try:
            dtype = np.asarray(value).dtype
        except ValueError:  # ragged nesting: numpy would need an object array
            dtype = np.dtype(object)
        return dtype.name, str(dtype)
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    if type(value).__module__.split(".")[0] == "torch":
        return str(dtype).removeprefix("torch."), str(dtype)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    return _names(dtype)


@functools.lru_cache(maxsize=256)
def _names(dtype: np.dtype) -> tuple[str, str]:
    """A dtype's name and how it shows (numpy computes both in Python, and a batch asks per tensor)."""
    return dtype.name, str(dtype)


def _what(name: str, shown: str) -> tuple[str, str]:
    """The kind of array a dtype makes, and what to do about it, in words."""
    if name == "object":
        return f"an array of Python objects (dtype {shown})", "make it an array of numbers, e.g. " \
            "np.asarray(x, dtype=np.float32)"
    if name.startswith("str"):
        return f"an array of strings (dtype {shown})", "only numbers can"
    if name.startswith("bytes"):
        return f"an array of byte strings (dtype {shown})", "only numbers can"
    if name == "bool":
        return f"a bool array (dtype {shown})", "cast it first, e.g. x.astype(np.int32)"
    return f"dtype {shown}", "it is not one the daemon reduces"


def _short_repr(value: Any) -> str:
    with np.printoptions(threshold=4, edgeitems=2):
        text = " ".join(repr(value).split())
    return text if len(text) <= _REPR_CHARS else text[:_REPR_CHARS - 3] + "..."


def check_dtype(value: Any, argument: str) -> None:
    """Refuses a value whose dtype the daemon does not reduce, before anything is staged or sent.

    Args:
        value: an array (numpy, CuPy, torch, JAX) or a Python list; Python
            scalars and values without a dtype are left to :func:`to_host`.
        argument: the argument path the caller gave it as, for the message.

    Raises:
        ValueError: the dtype is not in ``xreduce.SUPPORTED_DTYPES``; the
            message names ``argument``, the kind of array, what to do, the
            supported dtypes and the value.

    Example:
        >>> check_dtype(np.array(["a"]), "tensor")
        Traceback (most recent call last):
        ...
        ValueError: tensor: an array of strings (dtype <U1) cannot be reduced: only numbers can; supported ...
    """
    found = _dtype_of(value)
    if found is None or found[0] in SUPPORTED_DTYPES:
        return
    what, todo = _what(*found)
    raise ValueError(f"{argument}: {what} cannot be reduced: {todo}; supported dtypes: "
                     f"{', '.join(SUPPORTED_DTYPES)} (xreduce.SUPPORTED_DTYPES); got {_short_repr(value)}")


_TENSOR_MODULES = ("cupy", "torch", "jax", "jaxlib")


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is an array (numpy, CuPy, torch, JAX), as TF accepts a tensor.

    Example:
        >>> is_tensor(np.zeros(2)), is_tensor(0), is_tensor("GPU:0")
        (True, False, False)
    """
    return isinstance(value, (np.ndarray, np.generic)) or type(value).__module__.split(".")[0] in _TENSOR_MODULES


def device_of(value: Any) -> str | None:
    """The GPU an array lives on (``GPU:i``), or None for host arrays; nothing is copied.

    Example:
        >>> device_of(np.zeros(2)) is None
        True
    """
    module = type(value).__module__.split(".")[0]
    if module == "cupy":
        return f"GPU:{value.device.id}"
    if module == "torch" and value.device.type == "cuda":
        return f"GPU:{value.device.index or 0}"
    if module in ("jax", "jaxlib") and hasattr(value, "devices"):
        devices = list(value.devices())
        if len(devices) == 1 and devices[0].platform == "gpu":
            return f"GPU:{devices[0].id}"
    return None


def _from_cupy(x) -> HostArray:
    import cupy

    device_id = x.device.id

    def restore(a: np.ndarray):
        with cupy.cuda.Device(device_id):
            return cupy.asarray(a)

    return HostArray(x.get(), f"GPU:{device_id}", restore)


def _from_torch(x) -> HostArray:
    import torch

    t = x.detach()
    device = f"GPU:{t.device.index or 0}" if t.device.type == "cuda" else None
    if t.dtype == torch.bfloat16:
        host = t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = t.cpu().numpy()

    def restore(a: np.ndarray):
        a = np.ascontiguousarray(a)
        if a.dtype == ml_dtypes.bfloat16:
            out = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(_writable(a))
        return out.to(t.device)

    return HostArray(host, device, restore)


def _from_jax(x) -> HostArray:
    import jax

    devices = list(x.devices()) if hasattr(x, "devices") else []
    dev = devices[0] if len(devices) == 1 else None
    device = f"GPU:{dev.id}" if dev is not None and dev.platform == "gpu" else None

    def restore(a: np.ndarray):
        return jax.device_put(a, dev) if dev is not None else jax.numpy.asarray(a)

    return HostArray(np.asarray(x), device, restore)
