"""float32 addition and division on the GPU that keep subnormal numbers.

CuPy compiles its kernels with ``-ftz=true``: every float32 add and divide it
runs flushes subnormal operands and results to zero, where numpy (and
ml_dtypes' bfloat16, which adds through float32) keep them, so the GPU's sums
differed from the host's in the last bits of tiny values. These kernels are
PTX, which the CUDA driver compiles without CuPy's options: ``add.rn.f32`` and
``div.rn.f32`` without ``.ftz`` are IEEE 754 round-to-nearest-even with
subnormals.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

import numpy as np

_KERNEL = r"""
.visible .entry {name}(.param .u64 pa, {second}, .param .u64 pout, .param .u64 pn)
{{
    .reg .pred p;
    .reg .b32 r<4>;
    .reg .b64 rd<10>;
    .reg .f32 f<4>;
    ld.param.u64 rd1, [pa];
    ld.param.u64 rd3, [pout];
    ld.param.u64 rd4, [pn];
    mov.u32 r1, %ctaid.x;
    mov.u32 r2, %ntid.x;
    mov.u32 r3, %tid.x;
    mul.wide.u32 rd5, r1, r2;
    cvt.u64.u32 rd6, r3;
    add.u64 rd5, rd5, rd6;
    setp.ge.u64 p, rd5, rd4;
    @p bra DONE;
    shl.b64 rd6, rd5, 2;
    add.u64 rd7, rd1, rd6;
    ld.global.f32 f1, [rd7];
    {body}
    add.u64 rd9, rd3, rd6;
    st.global.f32 [rd9], f3;
DONE:
    ret;
}}
"""
"""One elementwise float32 kernel: thread i reads a[i] (and b[i]), computes f3, writes out[i]."""

_PTX = ".version 6.0\n.target sm_50\n.address_size 64\n" + _KERNEL.format(
    name="xr_add_f32", second=".param .u64 pb",
    body="ld.param.u64 rd2, [pb];\n    add.u64 rd8, rd2, rd6;\n"
         "    ld.global.f32 f2, [rd8];\n    add.rn.f32 f3, f1, f2;",
) + _KERNEL.format(
    name="xr_div_f32", second=".param .f32 pd",
    body="ld.param.f32 f2, [pd];\n    div.rn.f32 f3, f1, f2;",
)
"""``add.rn.f32`` and ``div.rn.f32`` without ``.ftz``: IEEE 754, subnormals kept."""

THREADS = 256
_lock = threading.Lock()
_modules: dict[int, Any] = {}
_path: list[str] = []


def _function(cp, name: str):
    """The kernel ``name`` in the current CUDA device's context (a module is loaded once per device)."""
    device = cp.cuda.Device().id
    with _lock:
        module = _modules.get(device)
        if module is None:
            if not _path:
                fd, path = tempfile.mkstemp(suffix=".ptx", prefix="xreduce-f32-")
                with os.fdopen(fd, "w") as f:
                    f.write(_PTX)
                _path.append(path)
            module = _modules[device] = cp.RawModule(path=_path[0])
    return module.get_function(name)


def _flat32(cp, x):
    """A contiguous float32 view of ``x`` (complex64 as its (real, imaginary) pairs)."""
    x = cp.ascontiguousarray(x).reshape(-1)
    return x.view(cp.float32) if x.dtype == cp.complex64 else x


def add(cp, a, b, out=None):
    """``a + b`` for float32 or complex64 CuPy arrays of one shape, subnormals kept.

    Example (on a GPU):
        >>> import cupy as cp  # doctest: +SKIP
        >>> add(cp, cp.full(1, 1e-45, cp.float32), cp.full(1, 1e-45, cp.float32))  # doctest: +SKIP
        array([3.e-45], dtype=float32)
    """
    result = cp.empty(a.shape, a.dtype) if out is None or not out.flags.c_contiguous else out
    fa, fb, fo = _flat32(cp, a), _flat32(cp, b), _flat32(cp, result)
    n = fa.size
    if n:
        _function(cp, "xr_add_f32")(((n + THREADS - 1) // THREADS,), (THREADS,), (fa, fb, fo, np.uint64(n)))
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


def divide(cp, a, n: int):
    """``a / n`` for a float32 or complex64 CuPy array (complex parts divided separately), subnormals kept."""
    result = cp.empty(a.shape, a.dtype)
    fa, fo = _flat32(cp, a), _flat32(cp, result)
    size = fa.size
    if size:
        _function(cp, "xr_div_f32")(((size + THREADS - 1) // THREADS,), (THREADS,),
                                    (fa, np.float32(n), fo, np.uint64(size)))
    return result
