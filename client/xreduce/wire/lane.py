"""The local lane's frames: small calls of a process on the daemon's host, beside gRPC.

A process that shares the daemon's host (its session says so) may send its
small ``Reduce``, ``BatchReduce`` and ``Broadcast`` requests over a unix
socket instead of a gRPC call. The messages are the same protobuf messages; the
daemon serves them through the same call pipeline (token gate, limits,
matching, reduction, metrics, call log). What crosses the socket:

* the client opens a connection and sends a *hello*: :data:`MAGIC`, then JSON
  with its session id and its call metadata (the bearer token); the daemon
  answers a *reply* frame (code 0, or the refusal);
* then, one call at a time: a *request* frame (the method, the call's timeout
  in seconds, the serialized request) and a *reply* frame (the status code, whether the
  daemon answered the error itself, then the serialized response or the error
  message).

Every frame is a 4-byte little-endian length, then that many bytes.

Addresses are ``unix:PATH`` (a socket file beside the daemon's own unix socket)
or ``unix-abstract:NAME`` (Linux's abstract namespace, for a daemon on TCP).

Example:
    >>> frame = request("BatchReduce", 2.5, b"...")
    >>> read_request(frame[4:])
    ('BatchReduce', 2.5, b'...')
"""

from __future__ import annotations

import json
import socket
import struct

MAGIC = b"XRL1"
"""The first bytes of a hello: the lane and its version."""

METHODS: tuple[str, ...] = ("Reduce", "BatchReduce", "Broadcast")
"""The RPCs a lane carries: the collectives whose requests can be small."""

MAX_FRAME_BYTES = (1 << 31) - 1
"""The largest frame either side reads (gRPC's own message limit)."""

ABSTRACT_PREFIX = "unix-abstract:"
"""How an address in Linux's abstract socket namespace is written (gRPC's spelling)."""

_LENGTH = struct.Struct("<I")
_REQUEST = struct.Struct("<Bd")  # method index, timeout seconds (0: none)
_REPLY = struct.Struct("<BB")  # status code (gRPC's number), answered by the daemon


class FrameError(ValueError):
    """A frame that is not one of the lane's; the message says what was wrong.

    Example:
        >>> read_request(b"")
        Traceback (most recent call last):
        ...
        xreduce.wire.lane.FrameError: lane request: 0 bytes, shorter than its 9-byte header
    """


def frame(body: bytes) -> bytes:
    """``body`` with its length in front.

    Example:
        >>> frame(b"ab")
        b'\\x02\\x00\\x00\\x00ab'
    """
    return _LENGTH.pack(len(body)) + body


def hello(session_id: str, metadata: tuple[tuple[str, str], ...]) -> bytes:
    """The first frame of a connection: the session it belongs to and the call metadata of every call.

    Example:
        >>> read_hello(hello("s1", (("authorization", "Bearer t"),))[4:])
        ('s1', (('authorization', 'Bearer t'),))
    """
    return frame(MAGIC + json.dumps({"session": session_id, "metadata": [list(m) for m in metadata]}).encode())


def read_hello(body: bytes) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The session id and metadata of a hello.

    Raises:
        FrameError: not a hello of this version, or malformed.

    Example:
        >>> read_hello(b"GET / HTTP/1.1")
        Traceback (most recent call last):
        ...
        xreduce.wire.lane.FrameError: lane hello: must start with b'XRL1'; got b'GET '
    """
    if not body.startswith(MAGIC):
        raise FrameError(f"lane hello: must start with {MAGIC!r}; got {body[:4]!r}")
    try:
        fields = json.loads(body[len(MAGIC):])
        session = fields["session"]
        metadata = tuple((str(k), str(v)) for k, v in fields.get("metadata", ()))
    except (ValueError, KeyError, TypeError) as e:
        raise FrameError(f"lane hello: malformed ({type(e).__name__}: {e})") from None
    if not isinstance(session, str) or not session:
        raise FrameError(f"lane hello: session must be a non-empty string; got {session!r}")
    return session, metadata


def request(method: str, timeout: float | None, body: bytes) -> bytes:
    """A call's frame: ``method`` (one of :data:`METHODS`), its timeout, its serialized request.

    Example:
        >>> len(request("Reduce", None, b"")) == 4 + _REQUEST.size
        True
    """
    return frame(_REQUEST.pack(METHODS.index(method), timeout or 0.0) + body)


def read_request(body: bytes) -> tuple[str, float | None, bytes]:
    """(method, timeout or None, serialized request) of a request frame's body.

    Raises:
        FrameError: too short, or an unknown method.
    """
    if len(body) < _REQUEST.size:
        raise FrameError(f"lane request: {len(body)} bytes, shorter than its {_REQUEST.size}-byte header")
    index, timeout = _REQUEST.unpack_from(body)
    if index >= len(METHODS):
        raise FrameError(f"lane request: method {index} is not one of 0..{len(METHODS) - 1} ({', '.join(METHODS)})")
    if not timeout >= 0.0:  # also nan
        raise FrameError(f"lane request: timeout must be >= 0 seconds; got {timeout}")
    return METHODS[index], (timeout or None), body[_REQUEST.size:]


def reply(code: int, answered: bool, body: bytes) -> bytes:
    """A reply frame: status ``code`` (0: OK, then ``body`` is the response; else the error's message).

    Example:
        >>> read_reply(reply(5, True, b"no device 'CPU:9'")[4:])
        (5, True, b"no device 'CPU:9'")
    """
    return frame(_REPLY.pack(code, answered) + body)


def read_reply(body: bytes) -> tuple[int, bool, bytes]:
    """(status code, answered, body) of a reply frame's body.

    Raises:
        FrameError: too short.
    """
    if len(body) < _REPLY.size:
        raise FrameError(f"lane reply: {len(body)} bytes, shorter than its {_REPLY.size}-byte header")
    code, answered = _REPLY.unpack_from(body)
    return code, bool(answered), body[_REPLY.size:]


class FrameBuffer:
    """Frames out of bytes as they arrive, in pieces (a reader that never blocks: the daemon's lane loop).

    Example:
        >>> buffer = FrameBuffer()
        >>> data = frame(b"hi") + frame(b"there")
        >>> buffer.push(data[:5]); buffer.pop() is None
        True
        >>> buffer.push(data[5:]); buffer.pop(), buffer.pop(), buffer.pop(), len(buffer)
        (b'hi', b'there', None, 0)
    """

    def __init__(self, data: bytes = b""):
        self._data = bytearray(data)
        self._start = 0

    def __len__(self) -> int:
        """Bytes held that no :meth:`pop` has returned yet."""
        return len(self._data) - self._start

    def push(self, data: bytes) -> None:
        """Adds bytes received."""
        if self._start and self._start == len(self._data):
            self._data.clear()
            self._start = 0
        self._data += data

    def pop(self) -> bytes | None:
        """The next whole frame's body, or None until it has all arrived.

        Raises:
            FrameError: a length over :data:`MAX_FRAME_BYTES`.
        """
        have = len(self._data) - self._start
        if have < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._data, self._start)
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"lane frame: {length} bytes, over the {MAX_FRAME_BYTES}-byte limit")
        if have < _LENGTH.size + length:
            return None
        begin = self._start + _LENGTH.size
        body = bytes(self._data[begin:begin + length])
        self._start = begin + length
        if self._start == len(self._data):
            self._data.clear()
            self._start = 0
        return body


class FrameReader:
    """Reads one frame after another from a stream socket, keeping bytes that came with the last frame.

    One ``recv`` usually brings a whole small frame; a large one is received straight into its own buffer.

    Args:
        sock: the connection (its timeout applies to every ``recv``).
        chunk: bytes asked of one ``recv`` for a frame's start.

    Example:
        >>> a, b = socket.socketpair()
        >>> a.sendall(frame(b"hi") + frame(b"there")); a.close()
        >>> reader = FrameReader(b)
        >>> reader.read(), reader.read(), reader.read()
        (b'hi', b'there', None)
    """

    def __init__(self, sock: socket.socket, chunk: int = 65536):
        self._sock = sock
        self._chunk = chunk
        self._buffer = b""

    @property
    def leftover(self) -> bytes:
        """Bytes received after the last frame read (the start of the next one)."""
        return self._buffer

    def read(self) -> bytes | None:
        """The next frame's body; None when the peer closed the connection between frames.

        Raises:
            FrameError: a length over :data:`MAX_FRAME_BYTES`.
            ConnectionError: the connection ended inside a frame.
            OSError: the socket's own errors (its timeout included).
        """
        data = self._buffer
        while len(data) < _LENGTH.size:
            more = self._sock.recv(self._chunk)
            if not more:
                self._buffer = b""
                if data:
                    raise ConnectionError("the lane closed inside a frame's length")
                return None
            data += more
        (length,) = _LENGTH.unpack_from(data)
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"lane frame: {length} bytes, over the {MAX_FRAME_BYTES}-byte limit")
        end = _LENGTH.size + length
        if len(data) >= end:
            self._buffer = data[end:]
            return data[_LENGTH.size:end]
        self._buffer = b""
        body = bytearray(length)
        view = memoryview(body)
        have = len(data) - _LENGTH.size
        view[:have] = data[_LENGTH.size:]
        while have < length:
            n = self._sock.recv_into(view[have:])
            if not n:
                raise ConnectionError(f"the lane closed inside a frame ({have} of {length} bytes)")
            have += n
        return bytes(body)


def socket_address(address: str) -> str | bytes:
    """What ``socket.bind``/``connect`` take for a lane address.

    Raises:
        ValueError: neither ``unix:PATH`` nor ``unix-abstract:NAME``.

    Example:
        >>> socket_address("unix-abstract:xreduce-lane-1f"), socket_address("unix:/run/xreduce.sock.lane")
        (b'\\x00xreduce-lane-1f', '/run/xreduce.sock.lane')
    """
    if address.startswith(ABSTRACT_PREFIX):
        return b"\0" + address[len(ABSTRACT_PREFIX):].encode()
    if address.startswith("unix:") and len(address) > len("unix:"):
        return address[len("unix:"):].removeprefix("//")
    raise ValueError(f"lane address: must be unix:PATH or {ABSTRACT_PREFIX}NAME; got {address!r}")
