"""What the SDK keeps for this process, in one object, with one default instance (JAX's ``State`` pattern).

:class:`Runtime` holds the embedded daemons, the multi-process group joined
with each daemon, the shared-memory sessions with each daemon, the
:func:`xreduce.shared_array` segments, the queue of segment releases and the
CUDA IPC regions. The SDK uses :func:`default`; tests make fresh instances.

Teardown order, at exit (:meth:`Runtime.shutdown`): pause the background
releases (one in progress finishes first), so that no ``UnregisterRegion``
reaches the daemon after its session closed; close the sessions (the daemon
releases their regions) and unlink their free segments; run the queued
releases (unlinking only, now); then unlink every segment still in use (its
mappings stay valid until the process ends) and end the reaper, which has
nothing left to clean. In a forked child (:meth:`Runtime.after_fork_in_child`)
the sessions and threads of the parent are gone; its segments stay the
parent's to free.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from xreduce._cuda_regions import CudaRegions
from xreduce._segments import Releases, SharedArrays, reaper
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.addresses import check_address
from xreduce.wire.contract import DEFAULT_ADDRESS

ENV_ADDRESS = "XREDUCE_ADDRESS"
"""The daemon's address, when none is given and no embedded daemon runs."""


@dataclasses.dataclass
class ProcessGroup:
    """This process's place in a multi-process job, as the daemon's JoinGroup gave it.

    Every collective call of the SDK in this process takes the next sequence
    number, so the k-th collective of every process meets the others' k-th.
    A group across nodes also has a membership epoch, sent in every
    collective: a collective of an older epoch is refused.

    Attributes:
        group: the group id collectives name (with a coordinator, the
            daemon's, e.g. ``default@10.0.0.1:1234``).
        local_devices: this process's devices, canonical names of its own daemon
            (what requests carry; the SDK gives out the job's names, :mod:`xreduce._job_devices`).
        global_devices: every process's devices, process 0's first; across
            nodes, task ``T`` names node ``T``'s devices.
        epoch: the membership epoch (0 for a group of one daemon).
        nodes: the node daemons of a group across nodes, node 0 first (else empty).
        node_index: this process's node in ``nodes``.
        engine: what carries bytes between nodes (``"gloo"``), or empty.
        replica_offset: this process's first device's position in ``global_devices``.
        shares: every process's device count, by process id (how ``global_devices`` splits).

    Example:
        >>> pg = ProcessGroup("train", 2, 1, ("/cpu:1",), ("/cpu:0", "/cpu:1"))
        >>> [pg.next_spec().sequence for _ in range(2)]
        [0, 1]
        >>> pg = ProcessGroup("default@10.0.0.1:1234", 2, 1, ("/cpu:0",), ("/cpu:0", "/task:1/cpu:0"), epoch=3)
        >>> spec = pg.next_spec()
        >>> spec.group, spec.epoch
        ('default@10.0.0.1:1234', 3)
    """

    group: str
    num_processes: int
    process_id: int
    local_devices: tuple[str, ...]
    global_devices: tuple[str, ...]
    epoch: int = 0
    nodes: tuple[pb.ClusterNode, ...] = ()
    node_index: int = 0
    engine: str = ""
    replica_offset: int = 0
    shares: tuple[int, ...] = ()
    _counter: itertools.count = dataclasses.field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_reply(cls, name: str, num_processes: int, process_id: int,
                   reply: pb.JoinGroupResponse) -> ProcessGroup:
        """The group a ``JoinGroupResponse`` describes; ``name`` is the group the request named.

        Example:
            >>> reply = pb.JoinGroupResponse(
            ...     local_devices=["/cpu:0"], global_devices=["/task:0/cpu:0", "/task:0/cpu:1", "/task:1/cpu:0"],
            ...     processes=[pb.ProcessDevices(process_id=0, devices=["/cpu:0", "/cpu:1"]),
            ...                pb.ProcessDevices(process_id=1, devices=["/cpu:0"])],
            ...     epoch=1, group="default@10.0.0.1:1234", node_index=1, engine="gloo",
            ...     nodes=[pb.ClusterNode(index=0), pb.ClusterNode(index=1)])
            >>> pg = ProcessGroup.from_reply("default", 2, 1, reply)
            >>> pg.group, pg.epoch, pg.node_index, len(pg.nodes), pg.engine, pg.replica_offset, pg.shares
            ('default@10.0.0.1:1234', 1, 1, 2, 'gloo', 2, (2, 1))
        """
        # The global list is every process's devices in process order: this process's come after
        # those of every lower process id. (Names cannot locate them: across nodes the local names
        # are this daemon's, task 0, and repeat another node's.)
        offset = sum(len(p.devices) for p in reply.processes if p.process_id < process_id)
        shares = tuple(len(p.devices) for p in sorted(reply.processes, key=lambda p: p.process_id))
        return cls(reply.group or name, num_processes, process_id, tuple(reply.local_devices),
                   tuple(reply.global_devices), epoch=reply.epoch, nodes=tuple(reply.nodes),
                   node_index=reply.node_index, engine=reply.engine, replica_offset=offset, shares=shares)

    @property
    def num_nodes(self) -> int:
        """The node daemons the group spans (1 for a group of one daemon)."""
        return max(len(self.nodes), 1)

    def next_spec(self) -> pb.CollectiveSpec:
        """The ``CollectiveSpec`` of this process's next collective."""
        with self._lock:
            sequence = next(self._counter)
        return pb.CollectiveSpec(group=self.group, num_processes=self.num_processes,
                                 process_id=self.process_id, sequence=sequence, epoch=self.epoch)


class Closeable(Protocol):
    """A per-daemon object the runtime ends at exit."""

    def close(self) -> None:
        """Releases what the object holds in the daemon and on this host."""


T = TypeVar("T", bound=Closeable)


class Runtime:
    """The SDK's state for one process.

    Example:
        >>> rt = Runtime()
        >>> with rt.embedding("unix:/tmp/a.sock"):
        ...     rt.resolve_address(), rt.resolve_address("127.0.0.1:1")
        ('unix:/tmp/a.sock', '127.0.0.1:1')
        >>> rt.set_process_group("unix:/tmp/a.sock", ProcessGroup("g", 2, 0, ("/cpu:0",), ("/cpu:0", "/cpu:1")))
        >>> rt.process_group("unix:/tmp/a.sock").group, rt.process_group("unix:/tmp/b.sock")
        ('g', None)
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._embedded: list[str] = []  # innermost last
        self._groups: dict[str, ProcessGroup] = {}
        self._sessions: dict[tuple, Closeable] = {}
        self.releases = Releases()
        """Work that finalizers of segments hand over."""
        self.shared_arrays = SharedArrays(self.releases)
        """The segments of :func:`xreduce.shared_array`."""
        self.cuda_regions = CudaRegions()
        """The CUDA IPC regions registered with the daemons, and the free output buffers."""

    # --- where the daemon is ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def embedding(self, address: str) -> Iterator[str]:
        """Inside the block, ``address`` is a daemon embedded in this process (innermost wins). On leaving it,
        this process's sessions with that daemon end, before the daemon stops: a session stream still open when
        a server shuts down is cancelled with a GOAWAY that gRPC logs on stderr."""
        with self._lock:
            self._embedded.append(address)
        try:
            yield address
        finally:
            with self._lock:
                self._embedded.remove(address)
                ending = [self._sessions.pop(key) for key in [k for k in self._sessions if k[0] == address]]
            for session in ending:
                with contextlib.suppress(Exception):
                    session.close()

    def is_embedded(self, address: str) -> bool:
        """Whether the daemon at ``address`` runs in this process (:func:`xreduce.serve_embedded`)."""
        return address in self._embedded

    def resolve_address(self, address: str | None = None) -> str:
        """``address``, else the innermost embedded daemon, else ``XREDUCE_ADDRESS``, else the default;
        a malformed ``address`` or variable is refused, naming it."""
        if address:
            return check_address(address, "address")
        with self._lock:
            if self._embedded:
                return self._embedded[-1]
        from_env = os.environ.get(ENV_ADDRESS)
        return check_address(from_env, ENV_ADDRESS) if from_env else DEFAULT_ADDRESS

    # --- multi-process groups, one per daemon ------------------------------------------------------------------

    def process_group(self, address: str) -> ProcessGroup | None:
        """The group this process joined with the daemon at ``address``, or None."""
        with self._lock:
            return self._groups.get(address)

    def set_process_group(self, address: str, group: ProcessGroup | None) -> None:
        """Installs (or, with None, removes) this process's group with the daemon at ``address``."""
        with self._lock:
            if group is None:
                self._groups.pop(address, None)
            else:
                self._groups[address] = group

    # --- shared-memory sessions, one per daemon and credentials -----------------------------------------------

    def shared_memory(self, key: tuple, make: Callable[[], T]) -> T:
        """The object kept for ``key`` (a daemon and its credentials), made by ``make()`` on first use."""
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                found = self._sessions[key] = make()
            return found

    def adopt(self, array: object) -> None:
        """Has every open shared-memory session register ``array``'s segment now (see
        :meth:`xreduce._shared_memory.SharedMemory.adopt`)."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.adopt(array)

    def shutdown(self) -> None:
        """Ends every session of this process and unlinks every segment it made (run at exit)."""
        with self.releases.paused():
            with self._lock:
                sessions = list(self._sessions.values())
                self._sessions.clear()
            for session in sessions:
                with contextlib.suppress(Exception):
                    session.close()
            self.releases.run_queued()
        reaper().close()

    def after_fork_in_child(self) -> None:
        """A forked child has none of its parent's sessions or threads; locks start free.

        Embedded addresses and groups stay: the child's calls still name the same daemons.
        """
        self._lock = threading.Lock()
        self._sessions.clear()
        self.releases.after_fork_in_child()
        self.shared_arrays.after_fork_in_child()
        reaper().after_fork_in_child()


_default = Runtime()


def default() -> Runtime:
    """The runtime the SDK uses.

    Example:
        >>> default() is default()
        True
    """
    return _default


def resolve_address(address: str | None = None) -> str:
    """Where the SDK finds its daemon.

    An explicit ``address`` wins, then a running :func:`xreduce.serve_embedded`,
    then ``XREDUCE_ADDRESS``, then :data:`xreduce.DEFAULT_ADDRESS`. ``unix:PATH`` works.

    Raises:
        ValueError: ``address`` or ``XREDUCE_ADDRESS`` is not ``host:port`` (port
            1..65535) or ``unix:PATH``; the message names it and the value.

    Example:
        >>> resolve_address("unix:/tmp/x.sock")
        'unix:/tmp/x.sock'
        >>> resolve_address("localhost")
        Traceback (most recent call last):
        ...
        ValueError: address must be host:port or unix:PATH; got 'localhost' (no port)
    """
    return _default.resolve_address(address)


def process_group(address: str | None = None) -> ProcessGroup | None:
    """The multi-process job this process joined (``xreduce.distribution.initialize``) with the
    daemon at ``address`` (see :func:`resolve_address`), or None.

    Example:
        >>> process_group("127.0.0.1:1") is None
        True
    """
    return _default.process_group(resolve_address(address))


def set_process_group(address: str, group: ProcessGroup | None) -> None:
    """Installs (or, with None, removes) this process's multi-process job with the daemon at ``address``."""
    _default.set_process_group(address, group)


atexit.register(lambda: _default.shutdown())
os.register_at_fork(after_in_child=lambda: _default.after_fork_in_child())
