"""How ReduceStream's data travels: chunk messages and the header's streamed tensors.

A ``ReduceStream`` request is a header whose tensors say ``streamed: true``
and carry no data (:func:`streamed_tensor`), then ``TensorChunk`` messages;
the reply is a header, then chunks. Chunks are encoded by hand
(:func:`chunk_message`): protobuf would copy each chunk's bytes three times
(into a ``bytes``, into the message, into its serialization); here a slice of
the caller's array is copied once, into the message that goes on the wire.
:func:`chunk_message_size` is the size of such a message without building it,
which shows the overhead bound below for any chunk.

Chunks of either side stay within 1 MiB (data plus at most
:data:`CHUNK_OVERHEAD_BYTES`), so any ``--max-message-bytes`` of 1 MiB or more
carries them.

Example:
    >>> DEFAULT_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES <= 1 << 20, REPLY_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES
    (True, 1048576)
    >>> top = (1 << 64) - 1  # the largest indices and offset, a 1 TiB chunk: still within the overhead
    >>> chunk_message_size(top, top, top, 1 << 40) - (1 << 40) < CHUNK_OVERHEAD_BYTES
    True
"""

from __future__ import annotations

import numpy as np

from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec

CHUNK_OVERHEAD_BYTES = 64
"""More than a chunk message's bytes besides its data (tags, lengths, indices, offset)."""

DEFAULT_CHUNK_BYTES = 512 << 10
"""Bytes of tensor data per request chunk the SDK sends: 512 KiB. Streaming 64 MiB (8 replicas) with
chunks of 256 KiB to 4 MiB, 512 KiB was fastest over a unix socket and loopback TCP
(256 KiB within 5%, 1 MiB 15-20% slower, 2 and 4 MiB about 2x slower): large enough that
per-message costs vanish, small enough that receiving, reducing and replying overlap and
that the daemon buffers little. It fits any ``--max-message-bytes`` of 1 MiB or more."""

REPLY_CHUNK_BYTES = (1 << 20) - CHUNK_OVERHEAD_BYTES
"""Most data bytes in one reply chunk the daemon sends (less with a smaller ``--max-message-bytes``): a chunk
message stays within 1 MiB; the result of a larger range leaves in several."""


def _varint(n: int) -> bytes:
    """``n`` as a protobuf varint (negative numbers as 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_size(n: int) -> int:
    n &= (1 << 64) - 1
    return max(1, (n.bit_length() + 6) // 7)


def _chunk_fields(pair: int, component: int, offset: int, nbytes: int) -> bytes:
    """The ``TensorChunk`` fields before ``data``'s bytes, zeros left out as protobuf does."""
    head = bytearray()
    for tag, v in ((0x08, pair), (0x10, component), (0x18, offset)):
        if v:
            head += bytes((tag,)) + _varint(v)
    if nbytes:
        head += b"\x22" + _varint(nbytes)
    return bytes(head)


def chunk_message(pair: int, component: int, offset: int, data) -> bytes:
    """A serialized ``ReduceStreamRequest`` holding one chunk, with ``data`` copied once.

    Args:
        pair: the pair's index in the header.
        component: the component's index in the pair's value.
        offset: where ``data`` starts in the tensor's raw bytes.
        data: the bytes, e.g. a ``memoryview`` slice of the array.

    Returns:
        The same bytes protobuf would serialize.

    Example:
        >>> m = chunk_message(1, 2, 8, memoryview(b"abcd")[2:])
        >>> m == pb.ReduceStreamRequest(
        ...     chunk=pb.TensorChunk(pair=1, component=2, offset=8, data=b"cd")).SerializeToString()
        True
    """
    n = len(data)
    head = _chunk_fields(pair, component, offset, n)
    return b"".join((b"\x12", _varint(len(head) + n), head, data))


def chunk_message_size(pair: int, component: int, offset: int, nbytes: int) -> int:
    """Bytes of the serialized ``ReduceStreamRequest`` (or ``ReduceStreamResponse``) holding one chunk.

    Example:
        >>> chunk_message_size(1, 2, 8, 2) == len(chunk_message(1, 2, 8, b"cd"))
        True
    """
    inner = len(_chunk_fields(pair, component, offset, nbytes)) + nbytes
    return 1 + _varint_size(inner) + inner


def streamed_tensor(array: np.ndarray) -> pb.Tensor:
    """The header's ``Tensor`` for ``array``: dtype, shape, ``streamed: true``, no data.

    Example:
        >>> t = streamed_tensor(np.zeros((2, 3), np.float32))
        >>> list(t.shape), t.streamed, t.raw_data
        ([2, 3], True, b'')
    """
    array = np.asarray(array)
    return pb.Tensor(dtype=codec.dtype_enum(array.dtype), shape=array.shape, streamed=True)
