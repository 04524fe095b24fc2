"""Big host all-reduces in chunks: memory near the tensors, whatever their size.

A dense reduce of host arrays whose bytes per replica are over
:func:`chunk_bytes` (64 MiB unless ``XREDUCE_CHUNK_BYTES`` says otherwise) is
sent as a series of calls, each over at most that many bytes of every replica:
flat slices of the tensors, in order (:func:`plan`). Every call stages its
slices, the daemon reduces them, and the results are copied into the result
arrays, allocated once, or into the caller's ``out=`` arrays. So a process
needs its input, its result and one chunk's staging and output segments
(pooled: the same ones every chunk and every call), never a second copy of
the whole tensor; the daemon maps one chunk at a time.

The daemon reduces every element in the same order whatever the packing of a
call (a hierarchical copy sums the lower half of the devices first, then the
upper, members in order; a reduction to one device sums in device order), so
the chunked result is bit-identical to the one call's.

In a job of several processes, every process must cut its call into the same
chunks. Before the first chunk the processes agree (:func:`agreement`): a
tiny all-reduce of a signature of the call's shapes, dtypes and chunk size
(:func:`signature`); a process whose call differs makes every process raise
the same ``ValueError``, instead of calls that would never match.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from xreduce._call import Pair
from xreduce.wire.layout import OUTPUT_ALIGNMENT

DEFAULT_CHUNK_BYTES = 64 << 20
"""Bytes of each replica one call of a chunked reduce carries, at most (``XREDUCE_CHUNK_BYTES`` overrides)."""

MIN_CHUNK_BYTES = 4096

IN_FLIGHT = 2
"""Chunks sent and not yet copied out, at most: while the daemon reduces one, the next is staged and the
last one's results are copied out."""

PROCESS_OVERHEAD_BYTES = 320 << 20
"""The documented constant of a process in the bound on a job's memory (docs/operations.md, "Memory"):
:data:`IN_FLIGHT` chunks' staging and output segments (4 x 64 MiB) and the SDK's working memory (64 MiB)."""

DAEMON_OVERHEAD_BYTES = 64 << 20
"""The daemon's share of that constant: its scratch buffers and a call's bookkeeping."""

_SIGNATURE_BITS = 20


def chunk_bytes() -> int:
    """The chunk size: ``XREDUCE_CHUNK_BYTES`` (bytes, at least 4096) if set, else 64 MiB.

    Raises:
        ValueError: ``XREDUCE_CHUNK_BYTES`` that is not a whole number of at least 4096.

    Example:
        >>> chunk_bytes() == DEFAULT_CHUNK_BYTES or "XREDUCE_CHUNK_BYTES" in os.environ
        True
    """
    text = os.environ.get("XREDUCE_CHUNK_BYTES", "").strip()
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < MIN_CHUNK_BYTES:
        raise ValueError(f"XREDUCE_CHUNK_BYTES must be a number of bytes of at least {MIN_CHUNK_BYTES}; got {text!r}")
    return value


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of pair ``pair``'s flattened values."""

    pair: int
    start: int
    stop: int


def replica_bytes(pairs: Sequence[Pair]) -> int:
    """Bytes of one replica of every pair: what each device sends (the same in every process of a job whose
    calls match).

    Example:
        >>> from xreduce._values import PerReplica
        >>> replica_bytes([Pair(PerReplica([np.ones(4, np.float32)] * 2), ("CPU:0", "CPU:1"), ("CPU:0",))])
        16
    """
    return sum(p.value.hosts()[0].array.nbytes for p in pairs)


def plan(sizes: Sequence[tuple[int, int]], most: int) -> list[list[Piece]]:
    """Cuts pairs of ``(elements, itemsize)`` into chunks of at most ``most`` bytes, in order.

    A pair that fits in what is left of a chunk goes in whole; a bigger one
    is sliced, its slices ending on whole elements. Each piece counts as its
    bytes rounded up to :data:`~xreduce.wire.layout.OUTPUT_ALIGNMENT`, as it is staged.

    Example:
        >>> [[tuple(piece) for piece in chunk] for chunk in plan([(40, 4), (3, 4), (5, 4)], 64)]
        [[(0, 0, 16)], [(0, 16, 32)], [(0, 32, 40)], [(1, 0, 3)], [(2, 0, 5)]]
        >>> [[tuple(piece) for piece in chunk] for chunk in plan([(3, 4), (5, 4)], 128)]
        [[(0, 0, 3), (1, 0, 5)]]
    """
    chunks: list[list[Piece]] = [[]]
    room = most
    for k, (elements, itemsize) in enumerate(sizes):
        start = 0
        while start < elements or (elements == 0 and start == 0):
            take = min(elements - start, max(room, 0) // itemsize)
            if take == 0 and elements:
                chunks.append([])
                room = most
                continue
            chunks[-1].append(Piece(k, start, start + take))
            room -= _aligned(take * itemsize)  # each piece is staged at a multiple of OUTPUT_ALIGNMENT
            start += take
            if elements == 0:
                break
    return [c for c in chunks if c]


def pipelined(chunks: Sequence[list[Piece]], send: Callable[[int, list[Piece], Callable[[], None]], list[Any]],
              copy_out: Callable[[list[Piece], list[Any]], None]) -> None:
    """Runs ``send(n, chunk, numbered)`` for every chunk on :data:`IN_FLIGHT` threads and ``copy_out(chunk,
    results)`` here, in order.

    ``send`` calls ``numbered()`` once its collective has its sequence number;
    the next chunk is sent only then, so that every process numbers its chunks
    alike. An error stops the sending; the chunks in flight are waited for
    (each bounded by its timeout) and the first error is raised.

    Example:
        >>> got = []
        >>> def send(n, chunk, numbered):
        ...     numbered()
        ...     return [n]
        >>> pipelined([[Piece(0, 0, 1)], [Piece(0, 1, 2)]], send, lambda chunk, r: got.append((chunk[0].start, r)))
        >>> got
        [(0, [0]), (1, [1])]
    """
    pending: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="xreduce-chunks") as pool:
        try:
            for n, chunk in enumerate(chunks):
                if len(pending) == IN_FLIGHT:
                    _collect(pending, copy_out)
                numbered = threading.Event()
                future = pool.submit(send, n, chunk, numbered.set)
                pending.append((chunk, future))
                while not numbered.wait(0.05) and not future.done():
                    pass
                if future.done() and future.exception() is not None:
                    future.result()
            while pending:
                _collect(pending, copy_out)
        except BaseException:
            for _, future in pending:
                concurrent.futures.wait([future])
            raise


def _aligned(nbytes: int) -> int:
    return nbytes + -nbytes % OUTPUT_ALIGNMENT


def per_replica(most: int, replicas: int) -> int:
    """Bytes of each replica in one chunk when a process has ``replicas`` of them: ``most`` shared out, a
    multiple of :data:`~xreduce.wire.layout.OUTPUT_ALIGNMENT`, so that a process stages at most ``most``
    bytes a chunk (and its segments stay of one power-of-two size).

    Example:
        >>> per_replica(64 << 20, 1) == 64 << 20, per_replica(64 << 20, 3)
        (True, 22369600)
    """
    return max(OUTPUT_ALIGNMENT, most // max(1, replicas) // OUTPUT_ALIGNMENT * OUTPUT_ALIGNMENT)


def _collect(pending: collections.deque, copy_out: Callable[[list[Piece], list[Any]], None]) -> None:
    """Copies out the oldest chunk in flight, then lets its results go: an output segment goes back to its
    pool only once no view of it is left."""
    done, future = pending.popleft()
    results = future.result()
    copy_out(done, results)


def signature(op: str, pairs: Sequence[Pair], most: int) -> int:
    """A number in ``[1, 2**20]`` that every process of a job computes alike when their calls match: it
    covers the op, each pair's replica shape and dtype, and the chunk size.

    Example:
        >>> from xreduce._values import PerReplica
        >>> p = Pair(PerReplica([np.ones((2, 3), np.float32)]), ("CPU:0",), ("CPU:0",))
        >>> signature("SUM", [p], 64) == signature("SUM", [p], 64) != signature("MEAN", [p], 64)
        True
    """
    text = repr((op, most, [(tuple(h.shape), h.dtype.str) for h in (p.value.hosts()[0].array for p in pairs)]))
    return zlib.crc32(text.encode()) % (1 << _SIGNATURE_BITS) + 1


def agreement(signature: int, replicas: int) -> np.ndarray:
    """What each of this process's ``replicas`` sends in the agreement: ``[s, s*s, 1]`` (int64).

    Summed over every replica of the job these give ``(Σs, Σs², n)``; see :func:`agreed`.

    Example:
        >>> agreement(3, 2).tolist()
        [[3, 9, 1], [3, 9, 1]]
    """
    return np.tile(np.array([signature, signature * signature, 1], np.int64), (replicas, 1))


def agreed(total: np.ndarray) -> int | None:
    """The number of replicas of the job if every one sent the same signature, else None: ``n·Σs² = (Σs)²``
    holds only then (Cauchy–Schwarz).

    Example:
        >>> agreed(np.array([6, 18, 2])), agreed(np.array([5, 13, 2]))
        (2, None)
    """
    total_s, total_squares, n = (int(x) for x in total.reshape(-1)[:3])
    return n if n * total_squares == total_s * total_s else None


def flat(array: np.ndarray) -> np.ndarray:
    """``array`` as one dimension (a view when it is contiguous).

    Example:
        >>> flat(np.zeros((2, 3))).shape
        (6,)
    """
    return array.reshape(-1) if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)
