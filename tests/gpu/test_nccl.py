"""The cupy backend's NCCL all-reduce (needs a GPU, and two for a clique of two).

Skipped, with the reason, where CuPy, a GPU or NCCL is missing; run with
``pytest -m gpu tests/gpu/test_nccl.py`` on a GPU machine.
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


def test_nccl_refuses_dtypes_it_cannot_add():
    _nccl_or_skip()
    backend = cupy_backend.CupyBackend(1)
    with pytest.raises(ValueError, match="NCCL cannot add int16 values"):
        backend.nccl_all_reduce([backend.upload(0, np.ones(2, np.int16))])
