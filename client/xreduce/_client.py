"""The connection to a daemon: address resolution, a lazy channel, typed calls."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading

import grpc

from xreduce._errors import from_rpc_error
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50551"
"""The daemon's default listen address, and where the SDK looks last."""

DEFAULT_TIMEOUT = 600.0
"""Seconds a call may take when the caller gives no timeout: no wait is unbounded."""

MAX_MESSAGE_BYTES = (1 << 31) - 1

_embedded_address: list[str] = []  # set by serve_embedded(), innermost last
_lock = threading.Lock()


@dataclasses.dataclass
class ProcessGroup:
    """This process's place in a multi-process job, as the daemon's JoinGroup gave it.

    Every collective call of the SDK in this process takes the next sequence
    number, so the k-th collective of every process meets the others' k-th.

    Example:
        >>> pg = ProcessGroup("train", 2, 1, ("/cpu:1",), ("/cpu:0", "/cpu:1"))
        >>> [pg.next_spec().sequence for _ in range(2)]
        [0, 1]
    """

    group: str
    num_processes: int
    process_id: int
    local_devices: tuple[str, ...]
    global_devices: tuple[str, ...]
    _counter: itertools.count = dataclasses.field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def next_spec(self) -> pb.CollectiveSpec:
        """The ``CollectiveSpec`` of this process's next collective."""
        with self._lock:
            sequence = next(self._counter)
        return pb.CollectiveSpec(group=self.group, num_processes=self.num_processes,
                                 process_id=self.process_id, sequence=sequence)


_process_group: list[ProcessGroup] = []


def process_group() -> ProcessGroup | None:
    """The multi-process job this process joined (``xreduce.distribution.initialize``), or None."""
    return _process_group[0] if _process_group else None


def set_process_group(group: ProcessGroup | None) -> None:
    """Installs (or, with None, removes) this process's multi-process job."""
    _process_group[:] = [group] if group is not None else []


def resolve_address(address: str | None = None) -> str:
    """Where the SDK finds its daemon.

    An explicit ``address`` wins, then a running :func:`xreduce.serve_embedded`,
    then ``XREDUCE_ADDRESS``, then :data:`DEFAULT_ADDRESS`. ``unix:PATH`` works.

    Example:
        >>> resolve_address("unix:/tmp/x.sock")
        'unix:/tmp/x.sock'
    """
    if address:
        return address
    if _embedded_address:
        return _embedded_address[-1]
    return os.environ.get("XREDUCE_ADDRESS") or DEFAULT_ADDRESS


class Client:
    """A connection to one daemon; the channel opens on first use.

    Args:
        address: ``host:port`` or ``unix:PATH``; see :func:`resolve_address`.
        timeout: default seconds per call (``None``: :data:`DEFAULT_TIMEOUT`).

    Example:
        >>> with Client("127.0.0.1:1") as c:  # constructing needs no daemon
        ...     c.address
        '127.0.0.1:1'
    """

    def __init__(self, address: str | None = None, timeout: float | None = None):
        self._explicit = address
        self._address: str | None = None
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CrossDeviceOpsStub | None = None
        self._devices: pb.ListDevicesResponse | None = None

    @property
    def address(self) -> str:
        """The daemon's address, resolved on first use and then fixed."""
        if self._address is None:
            self._address = resolve_address(self._explicit)
        return self._address

    def _get_stub(self) -> pb_grpc.CrossDeviceOpsStub:
        with _lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(
                    self.address,
                    options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ],
                )
                self._stub = pb_grpc.CrossDeviceOpsStub(self._channel)
            return self._stub

    def call(self, method: str, request, timeout: float | None = None):
        """Calls RPC ``method``; failures raise :class:`xreduce.XReduceError`."""
        rpc = getattr(self._get_stub(), method)
        try:
            return rpc(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    def list_devices(self, refresh: bool = False) -> pb.ListDevicesResponse:
        """The daemon's ``ListDevicesResponse`` (cached after the first call)."""
        if self._devices is None or refresh:
            self._devices = self.call("ListDevices", pb.ListDevicesRequest())
        return self._devices

    def device_names(self) -> list[str]:
        """Canonical names of the daemon's devices, in order."""
        return [d.name for d in self.list_devices().devices]

    def close(self) -> None:
        """Closes the channel; the client reopens it if used again."""
        with _lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
