"""How the daemon's memory stays within its limits: glibc's malloc tuned and
trimmed, and the bound the daemon's RSS stays within.

The memory bound (:func:`memory_bound`): the daemon's peak RSS stays within

    idle RSS + ``--max-inflight-bytes``
    + TRANSFER_FACTOR x the bytes of the messages in transfer at once
    + OVERHEAD_FACTOR x the largest message (request or reply)

The in-flight budget (:mod:`xreduced.admission`) counts a call from the
moment its request is parsed; the bytes of a request that gRPC is still
receiving (or that is being refused), and of a reply it is still sending,
cannot be counted, and each costs about :data:`TRANSFER_FACTOR` times its size
meanwhile (gRPC's buffer and its Python copy), one message per connected
caller at most. What remains is the allocator's slack, :data:`OVERHEAD_FACTOR`
largest messages, provided :func:`tune_malloc` has run (the ``xreduced``
command runs it): glibc then keeps at most :data:`MALLOC_ARENAS` arenas and
maps every block of :data:`MALLOC_MMAP_THRESHOLD` bytes or more on its own, so
freed arrays go back to the system instead of staying in one arena per
thread. Measured with ``bench/load.py`` (32 clients x 500 mixed calls,
replicas of 4 B to 4 MiB, ``--max-inflight-bytes`` 256 MiB): see docs/benchmarks.md,
"Load".
"""

from __future__ import annotations

import ctypes
import functools

TRANSFER_FACTOR = 2
"""Uncounted bytes per byte of a message gRPC is receiving or sending: its own buffer and the Python copy."""

OVERHEAD_FACTOR = 4
"""The allocator's slack above what is counted, in largest messages (request or reply)."""

MALLOC_ARENAS = 2
"""glibc malloc arenas the daemon keeps at most (glibc's default is 8 per core, one per busy thread)."""

MALLOC_MMAP_THRESHOLD = 1 << 20
"""Blocks from this size up are mapped on their own and unmapped when freed (glibc's default threshold
rises to 32 MiB as large blocks are freed, after which freed arrays stay in the arenas)."""


def memory_bound(idle: int, inflight_limit: int, largest_message: int, transfers: int = 1) -> int:
    """The stated bound on the daemon's RSS, in bytes (see the module docstring):
    ``idle + inflight_limit + (TRANSFER_FACTOR * transfers + OVERHEAD_FACTOR) * largest_message``.

    Args:
        idle: the daemon's RSS before the load.
        inflight_limit: its ``--max-inflight-bytes``.
        largest_message: the largest request or reply of the load.
        transfers: how many messages of that size may be in transfer at once:
            1 for a mix of sizes; the number of callers when every one of them
            sends the largest at once.

    Example:
        >>> memory_bound(60 << 20, 256 << 20, 32 << 20) >> 20
        508
    """
    return idle + inflight_limit + (TRANSFER_FACTOR * transfers + OVERHEAD_FACTOR) * largest_message


def tune_malloc(arenas: int = MALLOC_ARENAS, mmap_threshold: int = MALLOC_MMAP_THRESHOLD) -> bool:
    """Makes glibc's malloc give freed memory back: at most ``arenas`` arenas,
    and blocks of ``mmap_threshold`` bytes and more mapped on their own. Call it
    once at process start, before the serving threads exist.

    Returns:
        True when glibc took the settings; False elsewhere (another C library).

    Example:
        >>> tune_malloc() in (True, False)
        True
    """
    libc = _glibc()
    if libc is None:
        return False
    m_mmap_threshold, m_arena_max = -3, -8  # glibc's malloc.h
    return bool(libc.mallopt(m_arena_max, arenas)) and bool(libc.mallopt(m_mmap_threshold, mmap_threshold))


TRIM_BYTES = 4 << 20
"""After a call whose request and reply add up to this many bytes, malloc's heaps are trimmed (the parts of
them below the mmap threshold that such a call freed: on a 16 x 100 call run of bench/load.py, peak RSS
-10 to -20%, no throughput change measurable)."""


def trim_malloc() -> None:
    """Returns the free memory at the top of glibc's heaps to the system (no-op
    elsewhere); cheap after :func:`tune_malloc`, which keeps large blocks out of
    the heaps.

    Example:
        >>> trim_malloc()
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    """The C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
        libc.gnu_get_libc_version  # noqa: B018 (glibc alone has it)
    except (OSError, AttributeError):
        return None
    return libc
