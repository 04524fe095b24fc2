"""A session with a daemon: the ``OpenSession`` stream that regions are registered under."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc

from xreduce._errors import Security, from_rpc_error
from xreduce.v1 import xreduce_pb2 as pb


class Session:
    """One ``OpenSession`` stream: its id, what the daemon can share with this process, whether it lives.

    Made by :meth:`xreduce.Client.open_session`. The stream is watched by a
    thread: when it ends (the daemon stopped or restarted) the session is dead
    (``alive`` is cleared) and the daemon has released its regions.

    Args:
        responses: the call's stream of ``OpenSessionResponse`` (gRPC's, with ``cancel()``).
        address: the daemon's address, for error messages.
        timeout: seconds to wait for the daemon's first message.
        security: what the client offered (TLS, a certificate), for the hint of a TLS mismatch.

    Raises:
        xreduce.XReduceError: the daemon refused the session or did not answer in time.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=1):
        ...     session = xreduce.Client().open_session(pb.OpenSessionRequest())
        ...     session.alive.is_set(), session.shared_memory
        ...     session.close()
        (True, False)
    """

    def __init__(self, responses: Iterator[pb.OpenSessionResponse], address: str, timeout: float,
                 security: Security | None = None):
        self._call = responses
        timer = threading.Timer(timeout, responses.cancel)  # no unbounded wait for the first message
        timer.start()
        try:
            first = next(responses)
        except grpc.RpcError as e:
            raise from_rpc_error(e, address, security) from None
        finally:
            timer.cancel()
        self.id: str = first.session_id
        self.shared_memory: bool = first.shared_memory
        """Whether the daemon read the probe segment: it shares this host's memory."""
        self.error: str = first.shared_memory_error
        """Why it does not, when it does not."""
        self.cuda_ipc: bool = first.cuda_ipc
        """Whether the daemon opens CUDA IPC handles."""
        self.local_lane: str = first.local_lane
        """The daemon's local lane for this session (:mod:`xreduce._lane`), or empty."""
        self.alive = threading.Event()
        self.alive.set()
        threading.Thread(target=self._watch, name="xreduce-session", daemon=True).start()

    def _watch(self) -> None:
        with contextlib.suppress(Exception):
            for _ in self._call:
                pass
        self.alive.clear()

    def close(self) -> None:
        """Ends the stream: the daemon releases every region of the session.

        Example:
            >>> import xreduce
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     session = xreduce.Client().open_session(pb.OpenSessionRequest())
            ...     session.close(); session.alive.is_set()
            False
        """
        self.alive.clear()
        self._call.cancel()
