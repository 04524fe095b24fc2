"""The local lane from the SDK: small collectives over a unix socket beside gRPC.

When this process shares the daemon's host, the daemon's ``OpenSession``
reply names its *local lane* (:mod:`xreduced.lane`). A call whose tensors
total at most :data:`LANE_MAX_BYTES` then sends its ``Reduce``,
``BatchReduce`` or ``Broadcast`` request there, as the same protobuf message,
instead of making a gRPC call: one ``sendall`` and one ``recv`` per call, no
thread hops. The daemon serves it through its usual call pipeline, so it
matches and reduces exactly as a gRPC call, errors included.

Each connection carries one call at a time; a thread takes a free connection
or opens one. An idle connection costs nothing on either side (both sleep
in the kernel). ``XREDUCE_LOCAL_LANE=0`` turns the lane off in this process;
the transport ``wire`` never uses it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import grpc

from xreduce._errors import DeadlineExceededError, UnavailableError, answered
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import lane as frames

ENV_LOCAL_LANE = "XREDUCE_LOCAL_LANE"
"""``0``/``false``/``off``: this process never uses the local lane."""

LANE_MAX_BYTES = 64 << 10
"""Calls whose tensors total at most this many bytes take the lane; larger ones gain nothing from it."""

CONNECT_TIMEOUT_SECONDS = 5.0
"""How long opening a connection (and the daemon's answer to its hello) may take."""

_RESPONSES = {"Reduce": pb.ReduceResponse, "BatchReduce": pb.BatchReduceResponse,
              "Broadcast": pb.BroadcastResponse}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def enabled() -> bool:
    """Whether this process may use the lane (``XREDUCE_LOCAL_LANE`` is not off).

    Example:
        >>> import os
        >>> os.environ["XREDUCE_LOCAL_LANE"] = "off"; enabled()
        False
        >>> del os.environ["XREDUCE_LOCAL_LANE"]; enabled()
        True
    """
    return os.environ.get(ENV_LOCAL_LANE, "").strip().lower() not in ("0", "false", "no", "off")


class Refused(Exception):
    """The lane cannot be used (not reachable, or the daemon refused the connection): use gRPC."""


class Lane:
    """This process's connections to one daemon's local lane, for one session.

    Args:
        address: the lane's address from ``OpenSessionResponse.local_lane``.
        session_id: the session the connections belong to.
        metadata: the call metadata every call carries (the bearer token).
        daemon: the daemon's gRPC address, for error messages.
        alive: set while the session lives (:attr:`xreduce._session.Session.alive`).

    Example:
        >>> import numpy as np, xreduce
        >>> from xreduce.wire import codec
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     c = xreduce.Client()
        ...     lane = c.local_lane()
        ...     value = pb.DistributedValue(components=[
        ...         pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.float32([i + 1]))) for i in range(2)])
        ...     reply = lane.call("Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value,
        ...                                                  destinations=["CPU:0"]), 10.0)
        >>> codec.decode(reply.result.components[0].tensor)
        array([3.], dtype=float32)
    """

    def __init__(self, address: str, session_id: str, metadata: tuple[tuple[str, str], ...], daemon: str,
                 alive: threading.Event | None = None):
        self.address = address
        self._alive = alive
        self.session_id = session_id
        self._pid = os.getpid()  # a forked child must not talk on its parent's connections
        self._target = frames.socket_address(address)
        self.hello = frames.hello(session_id, metadata)
        """The hello frame every connection of this lane starts with."""
        self._daemon = daemon
        self._lock = threading.Lock()
        self._free: list[tuple[socket.socket, frames.FrameReader]] = []
        self._closed = False
        self.refused: str | None = None
        """Why a connection could not be had, once one could not: the session then uses gRPC."""

    def usable(self) -> bool:
        """Whether calls may still take this lane: its session lives, it is open, nothing refused it, and
        this is the process that opened it (not a forked child).

        Example:
            >>> Lane("unix-abstract:x", "s", (), "127.0.0.1:1", threading.Event()).usable()
            False
        """
        return (self.refused is None and not self._closed and self._pid == os.getpid()
                and (self._alive is None or self._alive.is_set()))

    def _connect(self) -> tuple[socket.socket, frames.FrameReader]:
        """A new connection, greeted; :class:`Refused` if the lane cannot be had."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader = frames.FrameReader(sock)
        try:
            sock.settimeout(CONNECT_TIMEOUT_SECONDS)
            sock.connect(self._target)
            sock.sendall(self.hello)
            body = reader.read()
            if body is None:
                raise Refused("the daemon closed the connection")
            code, _, message = frames.read_reply(body)
            if code != 0:
                raise Refused(message.decode(errors="replace"))
        except (OSError, frames.FrameError) as e:
            sock.close()
            self.refused = f"{self.address}: {e}"
            raise Refused(self.refused) from None
        except Refused as e:
            sock.close()
            self.refused = str(e)
            raise
        return sock, reader

    def _take(self) -> tuple[socket.socket, frames.FrameReader]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._connect()

    def _give(self, connection: tuple[socket.socket, frames.FrameReader]) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(connection)
                return
        connection[0].close()

    def call(self, method: str, request, timeout: float):
        """Sends ``request`` as ``method`` and returns the daemon's response message.

        Raises:
            Refused: no connection could be had; nothing was sent (the caller may use gRPC).
            xreduce.XReduceError: the daemon's error, with its code; or, when the
                connection broke or ``timeout`` passed before the answer,
                :class:`xreduce.UnavailableError` / :class:`xreduce.DeadlineExceededError`
                (``answered`` False).
        """
        return _RESPONSES[method].FromString(self.exchange(method, request.SerializeToString(), timeout))

    def exchange(self, method: str, body: bytes, timeout: float) -> bytes:
        """Sends a serialized request (``body``) as ``method`` and returns the daemon's serialized response:
        :meth:`call` without the messages, for a caller that sends the same bytes again
        (:mod:`xreduce._prepared`). Raises as :meth:`call` does."""
        connection = self._take()
        sock, reader = connection
        data = frames.request(method, timeout, body)
        try:
            sock.settimeout(timeout)
            sock.sendall(data)
            reply = reader.read()
            if reply is None:
                raise ConnectionError("the daemon closed the connection")
        except TimeoutError:
            sock.close()  # the daemon sees the hang-up: a collective this call waits in is abandoned
            raise DeadlineExceededError(f"{method} to the xreduce daemon at {self._daemon} (local lane) got no "
                                        f"answer within {timeout:.3g}s", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except (OSError, frames.FrameError) as e:
            sock.close()
            raise UnavailableError(f"xreduce daemon at {self._daemon} is unavailable: its local lane "
                                   f"{self.address} broke during {method} ({e})",
                                   grpc.StatusCode.UNAVAILABLE) from None
        self._give(connection)
        code, _, payload = frames.read_reply(reply)
        if code == 0:
            return payload
        # The daemon answered: it failed the collective for the others where it must.
        raise answered(_CODES.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))

    def close(self) -> None:
        """Closes every connection; calls in flight keep theirs until they end."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for sock, _ in free:
            with contextlib.suppress(OSError):
                sock.close()
