"""keras.distribution over the daemon, part one: devices and process identity."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from xreduce import _stall
from xreduce._client import Client
from xreduce._errors import DeadlineExceededError, UnavailableError, XReduceError
from xreduce._job_devices import job_devices, keras_names
from xreduce._runtime import ProcessGroup, process_group, set_process_group
from xreduce._session import Session
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire.devices import DeviceName

ENV_JOB_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
ENV_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ENV_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"
ENV_GROUP = "XREDUCE_GROUP"
"""The multi-process group's name (default ``default``): jobs sharing a daemon need different names."""
ENV_LOCAL_DEVICES = "XREDUCE_LOCAL_DEVICES"
"""This process's devices, comma-separated; unset lets the daemon assign a contiguous block."""

LEAVE_TIMEOUT = 5.0
"""Seconds :meth:`DistributionState.shutdown` gives the daemon to hear that this process left its group."""

LIST_TIMEOUT = 30.0
"""Seconds a ListDevices call may take: it answers from memory, so longer means unreachable."""


# --- devices -------------------------------------------------------------------------------------------------


def _devices_by_type(client: Client) -> dict[str, list[str]]:
    by_type: dict[str, list[str]] = {}
    for device in client.list_devices().devices:
        kind = device.device_type.lower()
        by_type.setdefault(kind, []).append(f"{kind}:{device.index}")
    return by_type


def _select(by_type: dict[str, list[str]], device_type: Any, address: str) -> list[str]:
    if device_type is None:
        for kind in ("gpu", "cpu"):
            if kind in by_type:
                return list(by_type[kind])
        raise ValueError(f"the xreduce daemon at {address} reports no devices")
    if not isinstance(device_type, str):
        raise ValueError(
            f"device_type must be a string such as 'gpu' or 'cpu'; got {device_type!r} "
            f"of type {type(device_type).__name__}"
        )
    kind = device_type.strip().lower()
    if kind not in by_type:
        present = ", ".join(f"{k!r} ({len(v)} devices)" for k, v in by_type.items()) or "none"
        raise ValueError(
            f"device_type {device_type!r} is not served by the xreduce daemon at {address}; "
            f"device types present: {present}"
        )
    return list(by_type[kind])


def list_devices(device_type: str | None = None) -> list[str]:
    """The daemon's devices in the keras form, ``["gpu:0", "gpu:1", ...]``.

    Args:
        device_type: ``"gpu"`` or ``"cpu"``, in any case. Default: the GPUs
            when the daemon has any, else its CPU devices.

    Returns:
        The devices of that type, in the daemon's order. After a multi-process
        :func:`initialize`, the global list: every process's devices, process
        0's first, the same in every process; across nodes, numbered by their
        place in that list (:func:`keras_names`): with 4 CPU devices per node,
        node 1's are ``cpu:4`` to ``cpu:7``.

    Raises:
        ValueError: the daemon has no device of ``device_type`` (the message
            names the types it has), or ``device_type`` is not a string.
        xreduce.UnavailableError: the daemon cannot be reached.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     list_devices(), list_devices("CPU")
        (['cpu:0', 'cpu:1'], ['cpu:0', 'cpu:1'])
    """
    with Client(timeout=LIST_TIMEOUT) as client:
        group = process_group(client.address)
        if group is not None:
            by_type: dict[str, list[str]] = {}
            for keras in keras_names(group.global_devices):
                by_type.setdefault(keras.split(":")[0], []).append(keras)
            return _select(by_type, device_type, client.address)
        return _select(_devices_by_type(client), device_type, client.address)


def get_device_count(device_type: str | None = None) -> int:
    """How many devices :func:`list_devices` returns for ``device_type``.

    Raises:
        ValueError: as :func:`list_devices`.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=3):
        ...     get_device_count("cpu")
        3
    """
    return len(list_devices(device_type))


# --- process identity ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Who this process is in a (possibly multi-process) job, as :func:`initialize` recorded it.

    Attributes:
        process_id: this process, in ``[0, num_processes)``.
        num_processes: processes in the job.
        job_addresses: every process's address, or just the coordinator's, or none.
        daemon_address: the xreduce daemon this process checked at initialization.
        devices: the job's devices, keras form: the daemon's, or with several
            processes every process's devices, process 0's first.
        local_devices: this process's devices, keras form (their names in ``devices``):
            the job's names, which every device argument of the SDK takes and which mean
            the same device in every process (see docs/sdk.md, "Device names").
        group: the group id every collective names, or None for one process:
            ``XREDUCE_GROUP`` (default ``default``), and with job addresses the
            coordinator's too, e.g. ``default@10.0.0.1:1234``.
        node_index: this process's node (its daemon) in the group; node 0
            hosts process 0, the others follow in the order of their lowest
            process id. 0 without job addresses.
        num_nodes: the node daemons the group spans; 1 without job addresses.
        epoch: the group's membership epoch, 0 without job addresses. A new
            :func:`initialize` after a lost node forms a new epoch.
        engine: what carries bytes between nodes, ``"gloo"``; empty within a node.

    Example:
        >>> info = ProcessInfo(process_id=1, num_processes=2, job_addresses=("10.0.0.1:1234", "10.0.0.2:2345"))
        >>> info.coordinator_address, info.is_multi_process, info.is_multi_node
        ('10.0.0.1:1234', True, False)
        >>> two = ProcessInfo(1, 2, ("10.0.0.1:1234", "10.0.0.2:2345"), "127.0.0.1:50551",
        ...                   ("cpu:0", "cpu:1", "cpu:2", "cpu:3"), ("cpu:2", "cpu:3"), "default@10.0.0.1:1234",
        ...                   node_index=1, num_nodes=2, epoch=1, engine="gloo")
        >>> two.is_multi_node, two.local_devices, two.engine
        (True, ('cpu:2', 'cpu:3'), 'gloo')
    """

    process_id: int = 0
    num_processes: int = 1
    job_addresses: tuple[str, ...] = ()
    daemon_address: str | None = None
    devices: tuple[str, ...] = ()
    local_devices: tuple[str, ...] = ()
    group: str | None = None
    node_index: int = 0
    num_nodes: int = 1
    epoch: int = 0
    engine: str = ""

    @property
    def coordinator_address(self) -> str | None:
        """The first job address (process 0's), or None when none was given."""
        return self.job_addresses[0] if self.job_addresses else None

    @property
    def is_multi_process(self) -> bool:
        """Whether the job has more than one process."""
        return self.num_processes > 1

    @property
    def is_multi_node(self) -> bool:
        """Whether the job's processes use more than one node daemon."""
        return self.num_nodes > 1


def _env(name: str) -> str | None:
    return os.environ.get(name) or None  # an empty variable counts as unset


def _int(name: str, value: Any, source: str) -> int:
    if isinstance(value, str) and source:
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{source} must be an integer; got {value!r}") from None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r} of type bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer; got {value!r} of type {type(value).__name__}") from None


def _addresses(value: Any, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        parts = [p.strip() for p in value]
    else:
        raise ValueError(
            f"job_addresses must be a comma-separated string or a list of strings; got {value!r} "
            f"of type {type(value).__name__}"
        )
    if any(not p for p in parts):
        raise ValueError(f"{source or 'job_addresses'} has an empty address; got {value!r}")
    return tuple(parts)


def _resolve(job_addresses: Any, num_processes: Any, process_id: Any) -> tuple[tuple[str, ...], int, int]:
    """Argument, else environment variable (only when the argument is None), else detection."""
    sources = {}
    if job_addresses is None and _env(ENV_JOB_ADDRESSES):
        job_addresses, sources["job_addresses"] = _env(ENV_JOB_ADDRESSES), ENV_JOB_ADDRESSES
    if num_processes is None and _env(ENV_NUM_PROCESSES):
        num_processes, sources["num_processes"] = _env(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES
    if process_id is None and _env(ENV_PROCESS_ID):
        process_id, sources["process_id"] = _env(ENV_PROCESS_ID), ENV_PROCESS_ID

    def origin(*names: str) -> str:
        named = [f"{n} from {sources[n]}" for n in names if n in sources]
        return f" ({', '.join(named)})" if named else ""

    addresses = _addresses(job_addresses, sources.get("job_addresses", ""))
    if num_processes is None:
        count = len(addresses) if len(addresses) > 1 else 1
    else:
        count = _int("num_processes", num_processes, sources.get("num_processes", ""))
    if count < 1:
        raise ValueError(f"num_processes must be >= 1; got num_processes={count}{origin('num_processes')}")
    # Keras' check; one address alone is the coordinator's, as with the JAX backend.
    if len(addresses) > 1 and len(addresses) != count:
        raise ValueError(
            f"The provided job_addresses {list(addresses)} has {len(addresses)} jobs, but num_processes "
            f"is {count}{origin('job_addresses', 'num_processes')}"
        )
    if process_id is None:
        if count > 1:
            raise ValueError(
                f"process_id is required when num_processes={count}; pass process_id= or set {ENV_PROCESS_ID}"
            )
        process_id = 0
    pid = _int("process_id", process_id, sources.get("process_id", ""))
    if not 0 <= pid < count:
        raise ValueError(
            f"process_id must be in [0, num_processes); got process_id={pid}, num_processes={count}"
            f"{origin('process_id', 'num_processes')}"
        )
    return addresses, count, pid


@dataclasses.dataclass
class _Membership:
    """The session that ties this process to its group: the daemon fails the group (on one daemon, or its epoch
    across nodes) if the session ends before the process leaves (the process died); see the daemon's
    ``xreduced.membership`` and ``Peers.session_ended``."""

    client: Client
    session: Session

    @classmethod
    def open(cls, address: str | None, token: str | None, timeout: float) -> _Membership | None:
        """A new session on the process's daemon, or None when the daemon opens none (the group then
        ends only by ``shutdown()``, its process's exit, a timeout or a lost node)."""
        client = Client(address, token=token, transport="wire")
        try:
            return cls(client, client.open_session(pb.OpenSessionRequest(), timeout=timeout))
        except XReduceError:
            client.close()
            return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.session.close()
        self.client.close()


class DistributionState:
    """The process identity behind :func:`initialize`; tests make fresh instances.

    One default instance sits behind the module functions. Several instances
    can live in one process, e.g. threads standing in for processes.

    Args:
        address: the daemon :meth:`initialize` checks; default
            :func:`xreduce.resolve_address` at that time.
        timeout: seconds the daemon may take to answer that check.
        token: the daemon's bearer token; default ``XREDUCE_TOKEN``, else none.

    Example:
        >>> import threading, xreduce
        >>> states = [DistributionState(), DistributionState()]  # two "processes" as threads
        >>> with xreduce.serve_embedded(virtual_devices=4):
        ...     threads = [threading.Thread(target=s.initialize, kwargs={"num_processes": 2, "process_id": i})
        ...                for i, s in enumerate(states)]
        ...     for t in threads: t.start()
        ...     for t in threads: t.join()
        >>> states[1].info.local_devices, states[1].info.devices
        (('cpu:2', 'cpu:3'), ('cpu:0', 'cpu:1', 'cpu:2', 'cpu:3'))
        >>> states[1].process_id(), states[1].num_processes()
        (1, 2)
        >>> states[1].shutdown()
        >>> states[1].is_initialized
        False
    """

    def __init__(self, address: str | None = None, timeout: float = LIST_TIMEOUT, token: str | None = None):
        self._address = address
        self._token = token
        self._timeout = timeout
        self._info: ProcessInfo | None = None
        self._group: ProcessGroup | None = None
        self._membership: _Membership | None = None
        self._lock = threading.Lock()

    def initialize(self, job_addresses: str | Sequence[str] | None = None, num_processes: int | None = None,
                   process_id: int | None = None, *, group: str | None = None,
                   devices: Sequence[str] | None = None) -> ProcessInfo:
        """Validates and records this process's identity, after checking the daemon answers.

        Each argument that is None falls back to its ``KERAS_DISTRIBUTION_*``
        variable (see :func:`initialize`); nothing is recorded on failure.
        ``group`` and ``devices`` (this process's devices, daemon names) stand
        for ``XREDUCE_GROUP`` and ``XREDUCE_LOCAL_DEVICES`` when given (as
        ``xreduce.torch`` gives them, one group per ``torch.distributed`` group).

        Returns:
            The recorded :class:`ProcessInfo`.

        Raises:
            RuntimeError: already initialized (call :meth:`shutdown` first).
            ValueError: an invalid or inconsistent setting; the message names
                the values received and where they came from.
            xreduce.UnavailableError: the daemon cannot be reached; the message
                names its address.
            xreduce.XReduceError: the daemon refused the join, e.g. its
                coordinator could not be reached or it cannot drive groups
                across nodes; the message is the daemon's.
        """
        with self._lock:
            if self._info is not None:
                info = self._info
                raise RuntimeError(
                    "xreduce.distribution.initialize() should only be called once; this process is already "
                    f"process_id={info.process_id} of num_processes={info.num_processes} (shutdown() first "
                    "to initialize again)"
                )
            addresses, count, pid = _resolve(job_addresses, num_processes, process_id)
            daemon, names = self._check_daemon()
            if count == 1:
                self._info = ProcessInfo(pid, count, addresses, daemon, names, names)
                return self._info
            group = self._group = self._join(count, pid, addresses[0] if addresses else "", group, devices)
            self._open_shared_memory()
            job = job_devices(group)
            keras = tuple(d.keras for d in job.devices)
            local = tuple(DeviceName.parse(n).keras for n in job.mine)
            self._info = ProcessInfo(pid, count, addresses, daemon, keras, local, group.group,
                                     group.node_index, group.num_nodes, group.epoch, group.engine)
            return self._info

    def _open_shared_memory(self) -> None:
        """Opens this process's shared-memory session with its daemon now (when the daemon shares this host),
        as its first collective would: an ``xreduce.shared_array`` made from here on is mapped by the daemon
        when it is made, not during the first call that sends it."""
        with contextlib.suppress(Exception), Client(self._address, token=self._token, timeout=self._timeout) as c:
            c.shared_memory()

    def _join(self, count: int, pid: int, coordinator: str, name: str | None = None,
              devices: Sequence[str] | None = None) -> ProcessGroup:
        """Meets the other processes through this process's daemon, which registers them with the
        ``coordinator`` when there is one (bounded by the daemon's --collective-timeout)."""
        name = name or _env(ENV_GROUP) or "default"
        requested = list(devices) if devices is not None else [
            d.strip() for d in (_env(ENV_LOCAL_DEVICES) or "").split(",") if d.strip()]
        spec = pb.CollectiveSpec(group=name, num_processes=count, process_id=pid, name="join")
        # A session ties this process to its group: if the process dies without leaving, the daemon fails the
        # group's collectives at once (on every node) instead of letting the others wait for it.
        membership = _Membership.open(self._address, self._token, self._timeout)
        try:
            with Client(self._address, token=self._token) as client, _stall.watch(client, spec, coordinator):
                reply = client.join_group(pb.JoinGroupRequest(
                    group=name, num_processes=count, process_id=pid, devices=requested, coordinator=coordinator),
                    session=membership.session.id if membership is not None else None)
        except BaseException:
            if membership is not None:
                membership.close()
            raise
        self._membership = membership
        return ProcessGroup.from_reply(name, count, pid, reply)

    def _check_daemon(self) -> tuple[str, tuple[str, ...]]:
        with Client(self._address, timeout=self._timeout, token=self._token) as client:
            try:
                by_type = _devices_by_type(client)
            except DeadlineExceededError as e:
                raise UnavailableError(
                    f"xreduce daemon at {client.address} is unavailable: ListDevices got no answer within "
                    f"{self._timeout}s ({e})", grpc.StatusCode.UNAVAILABLE,
                ) from None
            return client.address, tuple(d for kind in by_type.values() for d in kind)

    def shutdown(self) -> None:
        """Forgets the recorded identity; :meth:`initialize` may run again. Idempotent.

        A process of a multi-process group also tells its daemon it has left (``LeaveGroup``, best effort,
        bounded): a group whose processes have all left is over; across nodes, once all of a node's processes
        have, the daemon leaves the group.
        """
        with self._lock:
            group, self._info, self._group = self._group, None, None
            membership, self._membership = self._membership, None
        if group is not None:
            with contextlib.suppress(XReduceError), Client(self._address, timeout=LEAVE_TIMEOUT,
                                                           token=self._token) as client:
                client.leave_group(pb.LeaveGroupRequest(group=group.group, epoch=group.epoch,
                                                        process_id=group.process_id))
        if membership is not None:  # after leaving: a session that ends first would end the group's epoch
            membership.close()

    @property
    def group(self) -> ProcessGroup | None:
        """The multi-process group joined at :meth:`initialize`, or None."""
        return self._group

    @property
    def info(self) -> ProcessInfo | None:
        """The recorded identity, or None before :meth:`initialize`."""
        return self._info

    @property
    def is_initialized(self) -> bool:
        """Whether :meth:`initialize` has succeeded (and no :meth:`shutdown` since)."""
        return self._info is not None

    def process_id(self) -> int:
        """This process's id; 0 before :meth:`initialize` (a single process)."""
        return self._info.process_id if self._info else 0

    def num_processes(self) -> int:
        """The job's process count; 1 before :meth:`initialize`."""
        return self._info.num_processes if self._info else 1


_global_state = DistributionState()
atexit.register(_global_state.shutdown)  # a process that ends without shutdown() still leaves its group


def initialize(job_addresses: str | Sequence[str] | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> ProcessInfo:
    """Records this process's place in a multi-process job (Keras' ``initialize``).

    Each argument that is None is read from its environment variable,
    ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (comma-separated),
    ``KERAS_DISTRIBUTION_NUM_PROCESSES`` and ``KERAS_DISTRIBUTION_PROCESS_ID``;
    an argument given always wins. Still unset: ``num_processes`` is the number
    of addresses (1 with none or one), ``process_id`` is 0 in a one-process job.
    The daemon (:func:`xreduce.resolve_address`) must answer ``ListDevices``.

    With several processes, every process's ``initialize`` meets the others
    through its daemon (``JoinGroup``, bounded by the daemon's
    ``--collective-timeout``): each gets its local devices (``XREDUCE_LOCAL_DEVICES``,
    else a contiguous block of its daemon's devices, process 0's first), and from
    then on :func:`list_devices` is the global list and every collective of
    ``xreduce.distribute`` reduces across all the processes of the group
    (``XREDUCE_GROUP``, default ``default``).

    Job addresses make a group across nodes: the first address is the
    coordinator's, which process 0's daemon serves; every process's daemon
    (each node has one, ``XREDUCE_ADDRESS``) registers its processes there and
    the group's collectives cross nodes. Without job addresses every process
    uses the same daemon. A group across nodes has an epoch: when a node is
    lost, every collective fails naming it; :func:`shutdown` then
    ``initialize`` again forms a new epoch with the nodes that remain.

    Args:
        job_addresses: every process's ``host:port``, comma-separated or a list;
            or just the coordinator's (process 0's). Only the first is used:
            the coordinator's address, where process 0's daemon listens.
        num_processes: processes in the job.
        process_id: this process, in ``[0, num_processes)``.

    Returns:
        The recorded :class:`ProcessInfo` (also :func:`process_info`).

    Raises:
        RuntimeError: called a second time without :func:`shutdown`.
        ValueError: several addresses but not ``num_processes`` of them (Keras'
            message), ``process_id`` out of range, a non-integer.
        xreduce.UnavailableError: the daemon cannot be reached.
        xreduce.XReduceError: the daemon refused the join (its coordinator
            cannot be reached, torch is missing for groups across nodes, ...);
            the message is the daemon's.

    Example:
        >>> import xreduce
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     info = initialize("10.0.0.1:1234", num_processes=1, process_id=0)  # one process: no coordinator
        >>> process_id(), num_processes(), info.coordinator_address
        (0, 1, '10.0.0.1:1234')
        >>> initialize(num_processes=2, process_id=5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: xreduce.distribution.initialize() should only be called once; ...
        >>> shutdown()
        >>> initialize(num_processes=2, process_id=5)
        Traceback (most recent call last):
        ...
        ValueError: process_id must be in [0, num_processes); got process_id=5, num_processes=2
    """
    info = _global_state.initialize(job_addresses, num_processes, process_id)
    set_process_group(info.daemon_address, _global_state.group)  # the collectives of ops on that daemon join it
    return info


def shutdown() -> None:
    """Forgets what :func:`initialize` recorded, so it may be called again.

    Example:
        >>> shutdown()
        >>> is_initialized()
        False
    """
    info = _global_state.info
    _global_state.shutdown()
    if info is not None:
        set_process_group(info.daemon_address, None)


def is_initialized() -> bool:
    """Whether :func:`initialize` has run (and no :func:`shutdown` since).

    Example:
        >>> is_initialized()
        False
    """
    return _global_state.is_initialized


def current_group() -> ProcessGroup | None:
    """The group :func:`initialize` joined, or None (one process, or not initialized).

    Example:
        >>> current_group() is None
        True
    """
    return _global_state.group


def process_info() -> ProcessInfo | None:
    """What :func:`initialize` recorded, or None before it.

    Example:
        >>> process_info() is None
        True
    """
    return _global_state.info


def process_id() -> int:
    """This process's id in the job; 0 before :func:`initialize`.

    Example:
        >>> process_id()
        0
    """
    return _global_state.process_id()


def num_processes() -> int:
    """The number of processes in the job; 1 before :func:`initialize`.

    Example:
        >>> num_processes()
        1
    """
    return _global_state.num_processes()
