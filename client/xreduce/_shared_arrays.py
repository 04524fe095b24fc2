"""Arrays in POSIX shared memory, which the SDK sends to a daemon on the same host without a copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xreduce import _runtime


def shared_array(shape: int | Sequence[int], dtype=np.float32) -> np.ndarray:
    """A zero-filled numpy array in POSIX shared memory: the SDK sends it to a
    daemon on the same host without copying a byte.

    The memory is freed when the array and every view of it are gone. Where
    this process already has a shared-memory session with a daemon, the
    daemon maps the array here, not at the first call that sends it.

    Args:
        shape: as for ``numpy.zeros``.
        dtype: any dtype the daemon reduces (see ``xreduce.SUPPORTED_DTYPES``).

    Raises:
        ValueError: a negative or fractional dimension, or a dtype the daemon does not reduce
            (``bool``, strings, objects); nothing is made.
        OSError: no shared memory on this host (``/dev/shm``), or not enough room in it (ENOSPC).

    Example:
        >>> import xreduce
        >>> x = xreduce.shared_array((2, 3), "float32")
        >>> x[:] = 1.5
        >>> x.sum(), x.dtype
        (np.float32(9.0), dtype('float32'))
    """
    runtime = _runtime.default()
    array = runtime.shared_arrays.allocate(shape, dtype)
    runtime.adopt(array)
    return array


def find(array: np.ndarray) -> tuple[str, int, int] | None:
    """The (segment name, byte offset, segment size) of a C-contiguous array
    inside a :func:`shared_array` segment, else None.

    Example:
        >>> x = shared_array(8, "int32")
        >>> find(x[2:])[1:]
        (8, 32)
        >>> find(np.zeros(8)) is None
        True
    """
    return _runtime.default().shared_arrays.find(array)
