"""NCCL all-reduce among distinct GPUs, through CuPy's ``cupy.cuda.nccl`` bindings.

What TF's ``NcclAllReduce`` runs: one NCCL rank per GPU, a clique made once per
set of GPUs (``ncclCommInitAll``) and kept, every rank's sum launched in one
NCCL group on the rank's own stream. NCCL needs one rank per GPU: logical
devices that share a GPU cannot take part. The order of additions is NCCL's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_CODES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
          "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
          "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16",
          # A complex sum is the sum of its real and imaginary parts: pairs of floats.
          "complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}


def nccl_type(nccl: Any, dtype: np.dtype) -> tuple[int, int]:
    """NCCL's data type for ``dtype`` and how many of its elements make one value.

    Raises:
        ValueError: a dtype NCCL does not add (int16, uint16; bfloat16 with a CuPy whose NCCL lacks it).

    Example:
        >>> class Nccl: NCCL_FLOAT32 = 7
        >>> nccl_type(Nccl, np.dtype(np.complex64))
        (7, 2)
    """
    name = np.dtype(dtype).name
    code = getattr(nccl, _CODES.get(name, ""), None)
    if code is None:
        raise ValueError(f"algorithm: NCCL cannot add {name} values; it adds {', '.join(sorted(_CODES))}")
    return code, 2 if name.startswith("complex") else 1


def missing_types(nccl: Any) -> list[str]:
    """The dtypes whose NCCL type the bindings ``nccl`` lack (e.g. bfloat16 in an old CuPy).

    Example:
        >>> class Nccl: NCCL_FLOAT32 = 7
        >>> "bfloat16" in missing_types(Nccl), "float32" in missing_types(Nccl)
        (True, False)
    """
    return sorted(name for name, code in _CODES.items() if not hasattr(nccl, code))


def check_distinct(gpus: Sequence[int]) -> None:
    """NCCL's rule: one rank per GPU.

    Raises:
        ValueError: two devices on one GPU, naming them.

    Example:
        >>> check_distinct([0, 0])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: devices: NCCL needs one rank per GPU, but devices 0 and 1 are both on GPU 0 ...
    """
    seen: dict[int, int] = {}
    for i, g in enumerate(gpus):
        if g in seen:
            raise ValueError(f"devices: NCCL needs one rank per GPU, but devices {seen[g]} and {i} are both on GPU {g} "
                             "(logical devices that share a GPU)")
        seen[g] = i


class Cliques:
    """NCCL communicators per set of GPUs, made on first use and kept.

    Example (needs GPUs):
        >>> import cupy  # doctest: +SKIP
        >>> a = cupy.ones(4, cupy.float32)  # doctest: +SKIP
        >>> Cliques().all_reduce([a], [0], [cupy.cuda.Stream()]); a  # doctest: +SKIP
        array([1., 1., 1., 1.], dtype=float32)
    """

    def __init__(self) -> None:
        from cupy.cuda import nccl

        self._nccl = nccl
        self._comms: dict[tuple[int, ...], list[Any]] = {}
        self._lock = threading.Lock()

    def _clique(self, gpus: tuple[int, ...]) -> list[Any]:
        with self._lock:
            if gpus not in self._comms:
                self._comms[gpus] = self._nccl.NcclCommunicator.initAll(list(gpus))
            return self._comms[gpus]

    def all_reduce(self, arrays: Sequence[Any], gpus: Sequence[int], streams: Sequence[Any]) -> None:
        """Sums ``arrays`` (CuPy arrays of one dtype and size, ``arrays[i]`` on GPU ``gpus[i]``) in
        place, each rank on ``streams[i]``; done when the streams are.

        Raises:
            ValueError: two arrays on one GPU, or a dtype NCCL does not add.
        """
        check_distinct(gpus)
        code, per_value = nccl_type(self._nccl, arrays[0].dtype)
        comms = self._clique(tuple(gpus))
        import cupy

        self._nccl.groupStart()
        try:
            for comm, array, gpu, stream in zip(comms, arrays, gpus, streams):
                with cupy.cuda.Device(gpu):
                    comm.allReduce(array.data.ptr, array.data.ptr, array.size * per_value, code, self._nccl.NCCL_SUM,
                                   stream.ptr)
        finally:
            self._nccl.groupEnd()
