"""torch tensors as the SDK takes them, ``torch.distributed``'s reduce ops, and its exception types.

A CPU tensor is handed over as a numpy view of its own memory (no copy: the daemon's result is written
back into it, through the SDK's ``out=``); a ``bfloat16`` one as an ``ml_dtypes.bfloat16`` view. A CUDA
tensor is handed over as a CuPy view (DLPack, no copy), which the SDK sends by CUDA IPC to a daemon that
owns the GPU; its result is copied back into the tensor.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from xreduce import _errors
from xreduce.wire.codec import SUPPORTED_DTYPES

ON_THE_DAEMON = ("SUM", "AVG")
"""Reduce ops the daemon computes (AVG as the sum divided by the group's size, as NCCL does)."""
GATHERED = ("MIN", "MAX", "PRODUCT")
"""Reduce ops computed in each rank over the gathered tensors, in rank order (one all-gather on the daemon)."""


def op_name(op: object) -> str:
    """The name of a ``torch.distributed.ReduceOp`` (or of its ``RedOpType``).

    Example:
        >>> op_name(dist.ReduceOp.MAX), op_name(dist.ReduceOp.SUM)
        ('MAX', 'SUM')
    """
    kind = getattr(op, "op", op)
    return getattr(kind, "name", str(kind)).upper()


def checked_op(op: object) -> str:
    """``op``'s name when the backend reduces with it.

    Raises:
        ValueError: BAND, BOR, BXOR or PREMUL_SUM; the message names the op and those it takes.

    Example:
        >>> checked_op(dist.ReduceOp.BXOR)
        Traceback (most recent call last):
        ...
        ValueError: the xreduce backend cannot reduce with ReduceOp.BXOR; it takes SUM, AVG (on the daemon), ...
    """
    name = op_name(op)
    if name not in ON_THE_DAEMON + GATHERED:
        raise ValueError(f"the xreduce backend cannot reduce with ReduceOp.{name}; it takes "
                         f"{', '.join(ON_THE_DAEMON)} (on the daemon), {', '.join(GATHERED)} (over the gathered "
                         "tensors)")
    return name


def check_tensor(t: torch.Tensor, field: str) -> None:
    """Refuses a tensor the daemon cannot take, naming ``field``, its dtype and device.

    Example:
        >>> check_tensor(torch.zeros(2, dtype=torch.bool), "tensors[0]")
        Traceback (most recent call last):
        ...
        ValueError: tensors[0]: the xreduce backend cannot reduce a tensor of dtype torch.bool (device cpu); ...
    """
    name = str(t.dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{field}: the xreduce backend cannot reduce a tensor of dtype {t.dtype} (device "
                         f"{t.device}); it takes {', '.join(SUPPORTED_DTYPES)} tensors on cpu or cuda")


def to_sdk(t: torch.Tensor):
    """The tensor as the SDK takes it, sharing its memory: a numpy array for a CPU tensor, a CuPy array
    for a CUDA one. ``t`` must be contiguous.

    Example:
        >>> t = torch.arange(3.0)
        >>> a = to_sdk(t); a[0] = 7.0; t
        tensor([7., 1., 2.])
    """
    t = t.detach()
    if t.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_sdk(a, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``a`` (an SDK result) on ``like``'s device and of its dtype.

    Example:
        >>> from_sdk(np.array([1.0, 2.0], np.float32), torch.zeros(2)).dtype
        torch.float32
    """
    if type(a).__module__.split(".")[0] == "cupy":
        return torch.from_dlpack(a)
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a).to(like.dtype)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integers of its element's width (a complex one's as its parts'), for copies through a
    sum: ``x + 0`` is ``x`` for every bit pattern, where a float sum would quiet a signalling NaN or, in
    ``bfloat16`` (summed in float32), drop a NaN's payload. An integer tensor as it is.

    Example:
        >>> t = torch.tensor([-0.0, float("nan")], dtype=torch.bfloat16)
        >>> as_bits(t).dtype, as_bits(t).data_ptr() == t.data_ptr()
        (torch.int16, True)
        >>> as_bits(torch.zeros(3, dtype=torch.complex64)).shape
        torch.Size([3, 2])
    """
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t if not t.dtype.is_floating_point else t.view(_BITS[t.element_size()])


def torch_error(error: BaseException) -> BaseException:
    """``torch.distributed``'s exception for an SDK error, with the daemon's message: the daemon unreachable
    is a ``DistNetworkError``, bad input stays a ``ValueError``, anything else the daemon reports (a rank
    lost, a timeout, an abort) a ``DistBackendError``; other exceptions as they are.

    Example:
        >>> import grpc
        >>> e = torch_error(_errors.AbortedError("process 1 of group g ended", grpc.StatusCode.ABORTED))
        >>> type(e).__name__, str(e)
        ('DistBackendError', 'process 1 of group g ended')
        >>> str(torch_error(_errors.AbortedError("lost; every process must shutdown() and initialize() again")))
        'lost; every rank must destroy_process_group() and init_process_group() again'
    """
    if not isinstance(error, _errors.XReduceError) or isinstance(error, ValueError):
        return error
    if isinstance(error, _errors.UnavailableError):
        return dist.DistNetworkError(str(error))
    message = str(error)
    for advice in _KERAS_ADVICE:  # the daemon speaks to xreduce.distribution's users; say it in torch's terms
        message = message.replace(advice, TORCH_ADVICE)
    return dist.DistBackendError(message)


_KERAS_ADVICE = ("call xreduce.distribution.shutdown() and initialize() again on every process for a new epoch",
                 "every process must shutdown() and initialize() again")
TORCH_ADVICE = "every rank must destroy_process_group() and init_process_group() again"
"""What the message of a failed group tells a torch user to do."""
