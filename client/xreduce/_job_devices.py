"""One name per device: any name the SDK takes, as the process that drives the device and its daemon's name.

The SDK gives device names out in two forms and takes both, in every DeviceSpec spelling, wherever it
takes a device (``PerReplica`` devices, destinations, ``reduce_to_device``, a strategy's or a mesh's devices):

* the job's names, ``cpu:4``: :func:`xreduce.distribution.list_devices`, ``process_info().local_devices``,
  a mesh's devices; spelt any way, ``CPU:4``, ``/cpu:4``, ``/device:CPU:4`` or
  ``/job:localhost/replica:0/task:0/device:CPU:4``, the canonical spelling, which ``PerReplica.devices``,
  ``worker_devices``, ``distribute_batch``'s values and every result carry;
* TF's task-qualified names, ``/job:worker/replica:0/task:P/device:CPU:i`` (any job but ``localhost``):
  process ``P``'s ``i``-th CPU device, as in a TF cluster of one task per process.

Outside a multi-process job the job's names are the daemon's (``cpu:4`` is its ``CPU:4``) and this
process is task 0. In a job (``xreduce.distribution.initialize``) a name means the same device in every
process, on every node: on one daemon the daemon's own names; across nodes, positions in the job's list
(:func:`keras_names`), so node 1's ``CPU:0`` may be ``cpu:4``. A name of another process's device is
refused where a process's own device is needed, naming whose it is and this process's names. Requests
carry each device's name on its daemon (:attr:`JobDevice.daemon_name`), as the wire always has.

An array's own device (a CuPy, torch or JAX GPU array) is the GPU of this node it sits on: a
:class:`DaemonName`, translated here to the job's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from xreduce._errors import InvalidArgumentError, NotFoundError
from xreduce._runtime import ProcessGroup
from xreduce.wire.devices import DeviceName

TASK_JOB = "worker"
"""The job name of the task-qualified names the SDK writes (TF's multi-worker ``/job:worker``)."""


class DaemonName(str):
    """A device name as this process's daemon knows it: an array's own device, not a name of the job.

    Example:
        >>> DaemonName("/job:localhost/replica:0/task:0/device:GPU:1") == "/job:localhost/replica:0/task:0/device:GPU:1"
        True
    """

    __slots__ = ()


def keras_names(names: Sequence[str]) -> list[str]:
    """Canonical device names in the keras form, unique across the nodes of a group.

    Names of one task keep their index, ``gpu:3``; a list whose names span
    several tasks (a group across nodes, task ``T`` being node ``T``) numbers
    each device type by its position in the list, as JAX numbers its global
    devices, so that no two nodes' devices share a name.

    Example:
        >>> keras_names(["/job:localhost/replica:0/task:0/device:CPU:2", "/device:GPU:0"])
        ['cpu:2', 'gpu:0']
        >>> keras_names(["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:1",
        ...              "/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:1"])
        ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
    """
    parsed = [DeviceName.parse(n) for n in names]
    if len({d.task for d in parsed}) <= 1:
        return [d.keras for d in parsed]
    seen: dict[str, int] = {}
    out = []
    for d in parsed:
        kind = d.device_type.lower()
        out.append(f"{kind}:{seen.get(kind, 0)}")
        seen[kind] = seen.get(kind, 0) + 1
    return out


def task_name(process_id: int, device_type: str, index: int) -> str:
    """TF's task-qualified name of process ``process_id``'s ``index``-th device of ``device_type``.

    Example:
        >>> task_name(2, "CPU", 1)
        '/job:worker/replica:0/task:2/device:CPU:1'
    """
    return DeviceName(device_type, index, TASK_JOB, 0, process_id).canonical


@dataclasses.dataclass(frozen=True)
class JobDevice:
    """One device of a multi-process job.

    Attributes:
        name: the job's name, canonical: ``/job:localhost/replica:0/task:0/device:CPU:4`` (``cpu:4``).
        process_id: the process that drives it.
        node: the node (daemon) it is on, 0 for a job of one daemon.
        replica: its place in the job's list: the global replica id of the replica on it.
        daemon_name: its name on its node's daemon, what requests carry.
        task_name: TF's task-qualified name, ``/job:worker/replica:0/task:P/device:CPU:i``.
    """

    name: str
    process_id: int
    node: int
    replica: int
    daemon_name: str
    task_name: str

    @property
    def keras(self) -> str:
        """The keras form of :attr:`name`, ``cpu:4``."""
        return DeviceName.parse(self.name).keras


class JobDevices:
    """Every device of a multi-process job, found by any of its names (see the module's documentation).

    Args:
        group: the job, as ``JoinGroup`` gave it; every process's share is ``group.shares`` (devices by
            process id), or, for a group made by hand without it, equal shares.

    Example:
        >>> from xreduce.v1 import xreduce_pb2 as pb
        >>> group = ProcessGroup("g", 2, 1, ("/cpu:0", "/cpu:1"), ("/task:0/cpu:0", "/task:0/cpu:1", "/task:1/cpu:0",
        ...                      "/task:1/cpu:1"), nodes=(pb.ClusterNode(), pb.ClusterNode()), node_index=1)
        >>> job = JobDevices(group)
        >>> job.mine
        ('/job:localhost/replica:0/task:0/device:CPU:2', '/job:localhost/replica:0/task:0/device:CPU:3')
        >>> job.own("cpu:3", "devices[0]").daemon_name
        '/job:localhost/replica:0/task:0/device:CPU:1'
        >>> job.own("/job:worker/replica:0/task:1/device:CPU:0", "devices[0]").name
        '/job:localhost/replica:0/task:0/device:CPU:2'
        >>> job.own("/cpu:0", "destinations[0]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        xreduce._errors.InvalidArgumentError: destinations[0]: device '/cpu:0' is process 0's (on node 0); \
this is process 1 of 2, whose devices are cpu:2, cpu:3 (/job:worker/replica:0/task:1/device:CPU:0, ...)
    """

    def __init__(self, group: ProcessGroup):
        self.group = group
        shares = _shares(group)
        keras = keras_names(group.global_devices)
        self.devices: tuple[JobDevice, ...] = ()
        self._by_name: dict[str, JobDevice] = {}
        self._by_task: dict[tuple[int, str, int], JobDevice] = {}
        replica = 0
        devices = []
        for pid, count in enumerate(shares):
            kinds: dict[str, int] = {}
            for _ in range(count):
                on_node = DeviceName.parse(group.global_devices[replica])
                kind = on_node.device_type
                i = kinds[kind] = kinds.get(kind, -1) + 1
                device = JobDevice(DeviceName.parse(keras[replica]).canonical, pid,
                                   on_node.task if group.num_nodes > 1 else 0, replica,
                                   DeviceName(kind, on_node.index).canonical, task_name(pid, kind, i))
                devices.append(device)
                self._by_name[device.name] = device
                self._by_task[(pid, kind, i)] = device
                replica += 1
        self.devices = tuple(devices)
        me = group.process_id
        self._mine = tuple(d for d in self.devices if d.process_id == me)
        if [d.daemon_name for d in self._mine] != [DeviceName.parse(n).canonical for n in group.local_devices]:
            raise ValueError(f"group {group.group!r}: process {me}'s share of global_devices is not its local_devices "
                             f"{list(group.local_devices)}; give every process's share (shares=)")
        self._node = next((d.node for d in self._mine), group.node_index)
        self._by_daemon = {d.daemon_name: d for d in self.devices if d.node == self._node}

    @property
    def mine(self) -> tuple[str, ...]:
        """This process's devices, the job's canonical names, in the job's order."""
        return tuple(d.name for d in self._mine)

    def find(self, spec: str, field: str) -> JobDevice:
        """The device ``spec`` names, in any form, whoever drives it.

        Raises:
            ValueError: ``spec`` is not a device name.
            xreduce.NotFoundError: no device of the job has that name; the message lists the job's.
            xreduce.InvalidArgumentError: a ``/job:localhost`` name of a task other than 0.
        """
        if isinstance(spec, DaemonName):
            return self._daemon_device(spec, field)
        name = DeviceName.parse(spec)
        if name.job == "localhost":
            if name.task != 0:
                raise InvalidArgumentError(
                    f"{_at(field)}device {spec!r}: in a job, /job:localhost names the job's devices (task 0 only); "
                    f"name process P's i-th device /job:{TASK_JOB}/replica:0/task:P/device:{name.device_type}:i",
                    grpc.StatusCode.INVALID_ARGUMENT)
            found = self._by_name.get(DeviceName(name.device_type, name.index).canonical)
            if found is None:
                raise NotFoundError(f"{_at(field)}no device {spec!r} in group {self.group.group!r}; its devices are "
                                    f"{_listing(self.devices)} (list_devices())", grpc.StatusCode.NOT_FOUND)
            return found
        count = self.group.num_processes
        if name.task >= count:
            raise NotFoundError(f"{_at(field)}device {spec!r} names task {name.task}, but group {self.group.group!r} "
                                f"has processes 0 to {count - 1}", grpc.StatusCode.NOT_FOUND)
        found = self._by_task.get((name.task, name.device_type, name.index))
        if found is None:
            theirs = [d for d in self.devices if d.process_id == name.task]
            raise NotFoundError(f"{_at(field)}no device {spec!r}: process {name.task} has "
                                f"{_kind_count(theirs, name.device_type)} {name.device_type} device(s) "
                                f"({_tasks(theirs)})", grpc.StatusCode.NOT_FOUND)
        return found

    def own(self, spec: str, field: str) -> JobDevice:
        """:meth:`find`, for a device this process must drive (a value's, a destination).

        Raises:
            xreduce.InvalidArgumentError: another process's device; the message says whose and lists this
                process's devices.
        """
        found = self.find(spec, field)
        if found.process_id != self.group.process_id:
            where = f" (on node {found.node})" if self.group.num_nodes > 1 else ""
            raise InvalidArgumentError(
                f"{_at(field)}device {spec!r} is process {found.process_id}'s{where}; this is process "
                f"{self.group.process_id} of {self.group.num_processes}, whose devices are {_listing(self._mine)} "
                f"({_tasks(self._mine)})",
                grpc.StatusCode.INVALID_ARGUMENT)
        return found

    def on_node(self, spec: str, field: str) -> str:
        """The name on this process's daemon of the device ``spec`` names (any process's), or ``""`` when
        it is on another node: where a reduction to one device sums (each node sums its part on the named
        device when it holds it, else on its first destination; the numbers are the same)."""
        found = self.find(spec, field)
        return found.daemon_name if found.node == self._node else ""

    def _daemon_device(self, name: str, field: str) -> JobDevice:
        found = self._by_daemon.get(DeviceName.parse(name).canonical)
        if found is None:
            raise NotFoundError(f"{_at(field)}an array on {name}, which this process's daemon does not serve in "
                                f"group {self.group.group!r}", grpc.StatusCode.NOT_FOUND)
        return found


def _shares(group: ProcessGroup) -> tuple[int, ...]:
    if group.shares:
        return tuple(group.shares)
    count, every = group.num_processes, len(group.global_devices)
    if every % count:
        raise ValueError(f"group {group.group!r}: {every} devices for {count} processes, and no shares to say "
                         "whose is which")
    return (every // count,) * count


def _at(field: str) -> str:
    return f"{field}: " if field else ""


def _listing(devices: Sequence[JobDevice]) -> str:
    return ", ".join(d.keras for d in devices) or "none"


def _tasks(devices: Sequence[JobDevice]) -> str:
    return ", ".join(d.task_name for d in devices) or "none"


def _kind_count(devices: Sequence[JobDevice], kind: str) -> int:
    return sum(DeviceName.parse(d.name).device_type == kind for d in devices)


_last: tuple[ProcessGroup, JobDevices] | None = None


def job_devices(group: ProcessGroup) -> JobDevices:
    """The :class:`JobDevices` of ``group``, made once for the group in use (a call names a few devices, a
    job may have thousands)."""
    global _last
    last = _last
    if last is not None and last[0] is group:
        return last[1]
    made = JobDevices(group)
    _last = (group, made)
    return made


# --- what the SDK's entries call -------------------------------------------------------------------------------


def to_daemon(spec: str, group: ProcessGroup | None, field: str) -> str:
    """The name on this process's daemon of this process's device ``spec`` (any form): what requests carry.

    Raises:
        ValueError: not a device name.
        xreduce.InvalidArgumentError: another process's device (the message says whose and lists this
            process's names), or a task-qualified name of a task other than 0 outside a job.
        xreduce.NotFoundError: no such device in the job (outside a job, the daemon says so).

    Example:
        >>> to_daemon("/job:worker/replica:0/task:0/device:CPU:1", None, "devices[0]")
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    if group is not None:
        return job_devices(group).own(spec, field).daemon_name
    name = DeviceName.parse(spec)
    if name.job != "localhost":
        if name.task != 0:
            raise InvalidArgumentError(
                f"{_at(field)}device {spec!r} is process {name.task}'s, but this process is in no multi-process job "
                "(it is process 0 of 1: xreduce.distribution.initialize makes a job)", grpc.StatusCode.INVALID_ARGUMENT)
        return DeviceName(name.device_type, name.index).canonical
    return name.canonical


def sdk_name(spec: str, group: ProcessGroup | None, field: str) -> str:
    """The canonical name the SDK gives out for this process's device ``spec`` (any form).

    Raises:
        as :func:`to_daemon`.

    Example:
        >>> sdk_name("/job:worker/task:0/device:CPU:1", None, "devices[0]")
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    if group is not None:
        return job_devices(group).own(spec, field).name
    return to_daemon(spec, None, field)


def reduce_to(spec: str, group: ProcessGroup | None) -> str:
    """What a request's ``reduce_to_device`` carries for ``spec`` (any form, any process's device): see
    :meth:`JobDevices.on_node`.

    Example:
        >>> reduce_to("gpu:1", None)
        '/job:localhost/replica:0/task:0/device:GPU:1'
    """
    if group is not None:
        return job_devices(group).on_node(spec, "reduce_to_device")
    return to_daemon(spec, None, "reduce_to_device")
