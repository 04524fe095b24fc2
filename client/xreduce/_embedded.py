"""An in-process daemon on a private unix socket, for notebooks and tests."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator

from xreduce import _runtime

SETTLE_SECONDS = 1.0
"""The most a block's end waits for the daemon to see this process's sessions end."""


@contextlib.contextmanager
def serve_embedded(virtual_devices: int = 8, backend: str = "numpy") -> Iterator[str]:
    """Starts a daemon in this process and points the SDK at it.

    Inside the block every SDK object without an explicit ``address=`` talks
    to this daemon; on exit the daemon stops and the socket is removed.

    Args:
        virtual_devices: logical devices (host devices with ``numpy``).
        backend: ``numpy``, ``cupy`` or ``auto``.

    Yields:
        The daemon's address, ``unix:/tmp/.../xreduced.sock``.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=4):
        ...     xreduce.distribution.list_devices()
        ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
    """
    from xreduced.config import Config  # the daemon ships in the same distribution
    from xreduced.server import Daemon

    with tempfile.TemporaryDirectory(prefix="xreduce-") as tmp:
        os.chmod(tmp, 0o700)
        config = Config(listen=f"unix:{tmp}/xreduced.sock", backend=backend,
                        virtual_devices=virtual_devices, grace_seconds=1.0)
        daemon = Daemon(config).start()
        try:
            with _runtime.default().embedding(daemon.address):
                yield daemon.address
        finally:
            _sessions_ended(daemon)
            daemon.stop()


def _sessions_ended(daemon, timeout: float = SETTLE_SECONDS) -> None:
    """Waits (at most ``timeout`` seconds) until ``daemon`` has no session open: the SDK's sessions were cancelled
    on leaving the block, but the daemon learns it a moment later, and a stream still open when it stops is cut
    with a GOAWAY that gRPC logs on stderr."""
    deadline = time.monotonic() + timeout
    while daemon.regions.counts()[0] and time.monotonic() < deadline:
        time.sleep(0.005)
