"""The CrossDeviceOps service: decode, dispatch to the engine, encode.

Handlers only validate (:mod:`xreduced.decode`), dispatch (the engine, or the
rendezvous for a collective of several processes) and encode the reply; the
call pipeline (:mod:`xreduced.pipeline`) does everything around them: admission,
the regions of the call's session, status codes, counters and the call log.
Every failure is a :class:`~xreduced.errors.ServiceError` whose message names
the field and the values received.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire import sparse as wire_sparse
from xreduce.wire.contract import METHOD_PREFIX
from xreduce.wire.devices import DeviceName

from xreduced import across, decode, oom, planner, repeated, streaming
from xreduced.admission import Admission, LimitExceeded
from xreduced.cluster import ClusterGroup
from xreduced.collective import (
    BroadcastShare,
    Contribution,
    Reductions,
    assign_devices,
    broadcast_together,
    laid_out,
    reduce_together,
)
from xreduced.config import Config
from xreduced.deadline import Deadline
from xreduced.deferred import Deferred, then
from xreduced.devices import DeviceTable
from xreduced.engine import Engine, Result, Value, check_destinations, is_sparse, result_dtype
from xreduced.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ServiceError
from xreduced.membership import LocalGroups
from xreduced.metrics import Stats
from xreduced.peers import Peers
from xreduced.pipeline import current_call
from xreduced.prepared import Prepared, PreparedCalls
from xreduced.region_service import Lane, RegionService
from xreduced.regions import CallRegions, RegionTable, session_of
from xreduced.rendezvous import Meeting, Participant, Rendezvous

log = logging.getLogger("xreduced.service")


def _version() -> str:
    try:
        return importlib.metadata.version("xreduce")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout
        return "unknown"


VERSION = _version()

GROUP_RUNS_KEPT = 64
"""Combinations of a group's held repeats whose prepared reduction the service keeps (the least recent forgotten)."""


class LaneStatus(Lane, Protocol):
    """What the service reports of the local lane (:class:`~xreduced.lane.LocalLane`).

    Example:
        >>> from types import SimpleNamespace
        >>> lane: LaneStatus = SimpleNamespace(address="unix-abstract:lane", counts=lambda: (1, 7))
        >>> lane.counts()
        (1, 7)
    """

    def counts(self) -> tuple[int, int]:
        """(connections open now, calls served since the start)."""


def default_peers(config: Config, devices: DeviceTable, backend_name: str) -> Peers:
    """The daemon's links to the other nodes' daemons (:class:`~xreduced.peers.Peers`), for ``devices``.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> default_peers(Config(), DeviceTable(NumpyBackend(2).devices()), "numpy").devices
        ['CPU:0', 'CPU:1']
    """
    return Peers(config, [devices.name(i).short for i in range(len(devices))], backend_name)


class CrossDeviceOpsService(pb_grpc.CrossDeviceOpsServicer):
    """Serves ``xreduce.v1.CrossDeviceOps`` on an engine's devices.

    Requests with a ``collective`` of several processes meet in the rendezvous;
    the last to arrive runs the reduction for all of them. The session and
    region RPCs are its :class:`~xreduced.region_service.RegionService`'s.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
        >>> [d.short_name for d in service.ListDevices(pb.ListDevicesRequest(), None).devices]
        ['CPU:0', 'CPU:1']
    """

    def __init__(self, engine: Engine, backend_name: str, collective_timeout: float = Config.collective_timeout,  # noqa: PLR0913
                 rendezvous: Rendezvous | None = None, config: Config | None = None,
                 regions: RegionTable | None = None, *, devices: DeviceTable | None = None,
                 prepared: PreparedCalls | None = None, admission: Admission | None = None,
                 stats: Stats | None = None, peers: Peers | None = None,
                 held_elsewhere: Callable[[], int] = lambda: 0, lane: Callable[[], LaneStatus | None] = lambda: None):
        """Each part not given is built here, for this service alone (the daemon builds them all and passes
        them in, :class:`~xreduced.server.Daemon`).

        Args:
            held_elsewhere: how many collectives wait outside the rendezvous now (the express lane's,
                :meth:`xreduced.express.Express.collectives`).
            lane: the local lane once it is open (:class:`~xreduced.lane.LocalLane`), or None.
        """
        self.engine = engine
        self.backend_name = backend_name
        self.devices = DeviceTable(engine.backend.devices()) if devices is None else devices
        self.collective_timeout = collective_timeout
        self.config = config or Config()
        self.rendezvous = rendezvous or Rendezvous(report_after=self.config.stall_warning_seconds)
        self.prepared = PreparedCalls() if prepared is None else prepared
        """The request shapes validated before (:mod:`xreduced.prepared`)."""
        self._group_reductions = Reductions(GROUP_RUNS_KEPT)
        """The reductions of the combinations of a group's held repeats met lately, prepared once."""
        self.admission = Admission.from_config(self.config) if admission is None else admission
        self.held_elsewhere = held_elsewhere
        self.lane = lane
        if stats is None:
            stats = Stats(inflight=lambda: self.admission.inflight.value, collectives_waiting=self.collectives_waiting)
        self.stats = stats
        backend = engine.backend
        self.regions = regions or RegionTable(ipc_opener=backend.open_ipc if backend.cuda_ipc else None,
                                              max_sessions=max(1, self.config.workers // 2),
                                              mapped=oom.MappedBytes.from_config(self.config))
        self.region_service = RegionService(self.regions, lane)
        self.peers = default_peers(self.config, self.devices, backend_name) if peers is None else peers
        self.regions.on_session_end(self.peers.session_ended)
        self.local_groups = LocalGroups(self.rendezvous.fail_group)
        """Who is in each group of this daemon, tied to their sessions (:mod:`xreduced.membership`)."""
        self.regions.on_session_end(self.local_groups.session_ended)
        self.stats.watch_groups(self.peers.status)

    def ListDevices(self, request, context):
        """The daemon's devices, its backend and which devices reach which directly.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> reply = service.ListDevices(pb.ListDevicesRequest(), None)
            >>> reply.backend, [list(row.can_access) for row in reply.peer_access]
            ('numpy', [[False, True], [True, False]])
        """
        out = pb.ListDevicesResponse(backend=self.backend_name, devices=self._device_messages())
        for row in self.engine.backend.peer_access():
            out.peer_access.add(can_access=row)
        return out

    def GetStatus(self, request, context):
        """The daemon's version, devices, limits, counters per method, security settings and memory guards
        (the shared memory mapped, its budget, the process's ``oom_score_adj``).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> status = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy").GetStatus(pb.GetStatusRequest(), None)
            >>> status.backend, len(status.devices), status.limits.max_collectives, status.token_auth
            ('numpy', 2, 1024, False)
        """
        c = self.config
        lane = self.lane()
        lane_connections, lane_calls = (0, 0) if lane is None else lane.counts()
        return pb.GetStatusResponse(
            version=VERSION,
            backend=self.backend_name,
            devices=self._device_messages(),
            uptime_seconds=time.monotonic() - self.stats.started,
            limits=pb.Limits(
                max_message_bytes=c.max_message_bytes, max_request_bytes=c.max_request_bytes,
                max_inflight_bytes=c.max_inflight_bytes, max_collectives=c.max_collectives,
                collective_timeout_seconds=self.collective_timeout, workers=c.workers,
                max_mapped_bytes=self.regions.mapped.limit or 0,
            ),
            methods=[
                pb.MethodStats(method=m, calls_by_code=v["calls_by_code"], bytes_in=v["bytes_in"],
                               bytes_out=v["bytes_out"])
                for m, v in sorted(self.stats.snapshot().items())
            ],
            inflight_bytes=self.admission.inflight.value,
            collectives_waiting=self.collectives_waiting(),
            tls=c.tls_cert is not None,
            mutual_tls=c.tls_client_ca is not None,
            token_auth=c.auth_token_file is not None,
            groups=self.peers.status(),
            local_lane="" if lane is None else lane.address,
            local_lane_connections=lane_connections,
            local_lane_calls=lane_calls,
            mapped_bytes=self.regions.mapped.value,
            node_id=self.peers.node_id,
            oom_score_adj=oom.score_adj() or 0,
        )

    def collectives_waiting(self) -> int:
        """Multi-process collectives waiting for participants now: in the rendezvous, or held in the express lane.

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy").collectives_waiting()
            0
        """
        return self.rendezvous.pending() + self.held_elsewhere()

    def _device_messages(self) -> list[pb.Device]:
        out = []
        for i, info in enumerate(self.devices.infos):
            name = self.devices.name(i)
            out.append(pb.Device(
                name=name.canonical, short_name=name.short, device_type=info.device_type,
                index=info.index, memory_bytes=info.memory_bytes, physical_device=info.physical_device,
            ))
        return out

    def Reduce(self, request, context):
        """Reduces one value across its devices onto ``destinations`` (default: the value's devices).

        Example:
            >>> import numpy as np
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> parts = [pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.ones(2, np.float32))) for i in range(2)]
            >>> request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=parts))
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> context = SimpleNamespace(time_remaining=lambda: None)  # a call without a gRPC deadline
            >>> reply = service.Reduce(request, context)
            >>> codec.decode(reply.result.components[1].tensor)
            array([2., 2.], dtype=float32)
        """
        encoding = _encoding(lambda: [request.value])
        return self._reduce("Reduce", request, context, lambda: (
            [(request.value, request.destinations)], ["value"], ["destinations"]),
            lambda reduced: self._reply("Reduce", *reduced, encoding))

    def BatchReduce(self, request, context):
        """Reduces each pair's value onto its destinations, in one call.

        Example:
            >>> import numpy as np
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> parts = [pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.arange(2.0) * i)) for i in range(2)]
            >>> pair = pb.ReducePair(value=pb.DistributedValue(components=parts), destinations=["CPU:1"])
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> context = SimpleNamespace(time_remaining=lambda: None)  # a call without a gRPC deadline
            >>> reply = service.BatchReduce(pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, pairs=[pair]), context)
            >>> [codec.decode(r.result.components[0].tensor) for r in reply.results]
            [array([0. , 0.5])]
        """
        encoding = _encoding(lambda: [p.value for p in request.pairs])
        n = len(request.pairs)
        return self._reduce("BatchReduce", request, context, lambda: (
            [(p.value, p.destinations) for p in request.pairs],
            [f"pairs[{i}].value" for i in range(n)], [f"pairs[{i}].destinations" for i in range(n)],
        ), lambda reduced: self._reply("BatchReduce", *reduced, encoding))

    def _reply(self, kind: str, results: list[Result], slots: list[dict[int, decode.Slot] | None], encoding: str):
        """The ReduceResponse (one result) or BatchReduceResponse of a reduction."""
        if kind == "Reduce":
            (result,), (slot,) = results, slots
            return pb.ReduceResponse(result=self._encode(result, encoding, slot), route=decode.ROUTES[result.route])
        return pb.BatchReduceResponse(results=[
            pb.ReduceResult(result=self._encode(r, encoding, s), route=decode.ROUTES[r.route])
            for r, s in zip(results, slots)
        ])

    def express(self, kind: str, label: str, requests: Mapping[int, tuple[Any, Prepared, bytes]]) -> dict[int, bytes]:
        """Each process's serialized reply to a collective on this node whose requests all have shapes
        validated before (the express lane's, :mod:`xreduced.express`): ``requests`` maps each process to its
        (request, :class:`~xreduced.prepared.Prepared` of its shape, shape). The tensors are decoded by their
        shapes, reduced once by :func:`~xreduced.collective.reduce_together` (which checks the processes agree
        unless these shapes passed together before), and each reply is encoded as the full path encodes it. The
        next collective of the same shapes takes the layout that reduction kept (:func:`~xreduced.collective.laid_out`)
        and refills the replies it encoded: the same engine call, the same bytes. Only the lane's one thread
        calls this (the replies it refills are its own).

        Raises:
            Whatever decoding or the reduction raises; nothing has changed then (the express lane hands the
            calls to the full path, which answers them).

        Example (what the express lane calls, once both requests have arrived):
            replies = service.express("Reduce", 'collective 3 in group "g"',
                                      {0: (request0, prepared0, shape0), 1: (request1, prepared1, shape1)})
        """
        if any(isinstance(prepared, repeated.Held) for _, prepared, _ in requests.values()):
            return self._express_repeats(kind, label, requests)
        layout = laid_out(self.engine, kind, {pid: shape for pid, (_, _, shape) in requests.items()})
        deadline = decode.deadline(requests[max(requests)][0], None, self.collective_timeout)
        if layout is None:  # the first time: joined and checked as any collective, which lays it out
            shares = {}
            for pid, (request, prepared, shape) in requests.items():
                _, resolved = prepared.decode(request)
                shares[pid] = Contribution(kind, prepared.op, prepared.num_packs, prepared.algorithm,
                                           prepared.reduce_to, tuple(resolved), shape=shape)
            results = self._timed(kind, sum(_replica_bytes(v) for v, _ in resolved),
                                  lambda: reduce_together(self.engine, shares, label, deadline))
            return {pid: self._reply(kind, rs, [None] * len(rs), codec.RAW).SerializeToString()
                    for pid, rs in results.items()}
        arrays = {pid: prepared.arrays(request) for pid, (request, prepared, _) in requests.items()}
        results = self._timed(kind, sum(int(a[0].nbytes) for a in arrays[min(arrays)]),
                              lambda: layout.reduce(self.engine, arrays, label, deadline))
        out = {}
        to_host = self.engine.backend.to_host
        for pid, rs in results.items():
            filled = layout.replies.get(pid)
            if filled is None:  # a reply of this collective's kind, devices, dtypes and shapes: refilled each time
                message = self._reply(kind, rs, [None] * len(rs), codec.RAW)
                values = [message.result] if kind == "Reduce" else [r.result for r in message.results]
                layout.replies[pid] = filled = (message, [c.tensor for v in values for c in v.components])
            message, tensors = filled
            for tensor, array in zip(tensors, (a for r in rs for a in r.arrays)):
                tensor.raw_data = codec.raw_bytes(to_host(array))
            out[pid] = message.SerializeToString()
        return out

    def _express_repeats(self, kind: str, label: str, requests: Mapping[int, tuple[Any, Any, bytes]]
                         ) -> dict[int, bytes]:
        """:meth:`express` of a collective every process sent as a repeat (:class:`~xreduced.repeated.Held`: the
        same request as a collective the full path served before, tensors and output in its session's shared
        memory, but for the sequence number): each process's regions pinned and checked as a call checks them,
        one :func:`~xreduced.collective.reduce_together` into their output slots, and each process's kept reply.

        Raises:
            xreduced.repeated.Stale: a region is not the one validated; InvalidArgument: a process that did not
                send its request as a repeat; or what the reduction raises (the express lane then hands the
                calls to the full path).
        """
        deadline = decode.deadline(requests[max(requests)][0], None, self.collective_timeout)
        with contextlib.ExitStack() as stack:
            shares = {}
            for pid, (_, held, key) in requests.items():
                if not isinstance(held, repeated.Held):
                    raise InvalidArgument(f"process {pid} of {label} did not send a repeat")
                r = held.repeat
                pairs, outs = stack.enter_context(r.views(
                    lambda names, s=held.session_id: self.regions.pin_named(s, names), self.regions.unpin))
                shares[pid] = Contribution(kind, r.op, r.num_packs, r.algorithm, r.reduce_to, tuple(pairs),
                                           out=tuple(outs), shape=key)
            repeats = tuple(requests[pid][1].repeat for pid in sorted(requests))
            self._timed(kind, sum(_replica_bytes(v) for v, _ in shares[min(shares)].pairs),
                        lambda: self._group_reductions.reduce(self.engine, shares, repeats, label, deadline))
        return {pid: held.reply for pid, (_, held, _) in requests.items()}

    def Broadcast(self, request, context):
        """Copies the tensor to every destination (from the source process, in a collective).

        Example:
            >>> import numpy as np
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> request = pb.BroadcastRequest(tensor=codec.encode(np.arange(3)), destinations=["CPU:0", "CPU:1"])
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> context = SimpleNamespace(time_remaining=lambda: None)  # a call without a gRPC deadline
            >>> reply = service.Broadcast(request, context)
            >>> [(c.device[-5:], codec.decode(c.tensor).tolist()) for c in reply.result.components]
            [('CPU:0', [0, 1, 2]), ('CPU:1', [0, 1, 2])]
        """
        group = decode.group(request)
        regions = _regions()
        with self._failing(group):
            deadline = self._deadline(request, context, group)
            is_source = group is None or group.process_id == request.source_process
            if is_source and not request.HasField("tensor"):
                raise InvalidArgument("tensor: broadcast needs a tensor; got none")
            array = decode.tensor(request.tensor, "tensor", regions) if request.HasField("tensor") else None
            source = self.devices.resolve(request.source_device, "source_device") if request.source_device else None
            dests = decode.devices(request.destinations, "destinations", self.devices)
            if group is not None:  # alone, the engine checks them; here, before the others wait for this process
                if not 0 <= request.source_process < group.num_processes:
                    raise InvalidArgument(
                        f"source_process: must be in [0, {group.num_processes}); got {request.source_process}"
                    )
                check_destinations(dests, "destinations", self.engine.label, required="broadcast")
            slots = None
            if request.HasField("output"):
                if array is None:
                    raise InvalidArgument("output: a process that sends no tensor cannot size its output; send "
                                          "the tensor's dtype and shape with an empty region, or omit output")
                slots = decode.layout(request.output, [(dests, array.dtype, array.shape)], regions)[0]
        if group is None:
            result = self._timed("Broadcast", array.nbytes, lambda: self.engine.broadcast(
                array, source or 0, dests, deadline, out=decode.views(slots)))
        else:
            share = BroadcastShare(request.source_process, array, source, dests, out=decode.views(slots))
            cluster = self._cluster(group)
            if cluster is not None and cluster.spans_nodes:
                def broadcast(shares):
                    return across.broadcast_across(cluster, self.engine, shares, group.label, deadline, group.sequence)
            else:
                def broadcast(shares):
                    return broadcast_together(self.engine, shares, group.label, deadline)
            result = self._meet(group, share, deadline, context, lambda shares: self._timed(
                "Broadcast", _broadcast_bytes(shares), lambda: broadcast(shares)), cluster=cluster)
        encoding = codec.encoding_of(request.tensor) if request.HasField("tensor") else codec.RAW
        return pb.BroadcastResponse(result=self._encode(result, encoding, slots))

    def JoinGroup(self, request, context):
        """Meets the group's other processes and assigns each its devices.

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> request = pb.JoinGroupRequest(group="g", num_processes=1, devices=["CPU:1"])
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> context = SimpleNamespace(time_remaining=lambda: None)  # a call without a gRPC deadline
            >>> reply = service.JoinGroup(request, context)
            >>> list(reply.local_devices)
            ['/job:localhost/replica:0/task:0/device:CPU:1']
        """
        group = decode.collective(pb.CollectiveSpec(group=request.group, num_processes=request.num_processes,
                                                    process_id=request.process_id, name=decode.JOIN))
        deadline = self._deadline(request, context, group)
        devices = decode.devices(request.devices, "devices", self.devices)
        check_destinations(devices, "devices", self.engine.label)
        if request.coordinator and group.num_processes > 1:
            return self._join_across(request, devices, deadline, context)
        what = f'the join of group "{request.group}"'
        if group.num_processes == 1:
            assigned = {0: devices or tuple(range(len(self.devices)))}
        else:
            session = self._open_session(context)

            def join(shares):
                assigned = assign_devices(shares, len(self.devices), self.engine.label, what)
                # A new job of this group name: earlier jobs' failures no longer apply.
                self.rendezvous.forget_failures(request.group)
                generation = self.local_groups.start(request.group, group.num_processes)
                return {pid: (assigned, generation) for pid in shares}

            assigned, generation = self._meet(group, devices, deadline, context, join, remember_failure=False,
                                              joining=True)
            if session is not None:
                self.local_groups.watch(request.group, generation, group.process_id, session)
                if self.regions.session(session) is None:  # it ended while the process joined: the process is gone
                    self.local_groups.session_ended(session)
        names = {pid: [self.devices.canonical(d) for d in devs] for pid, devs in assigned.items()}
        return pb.JoinGroupResponse(
            local_devices=names[group.process_id],
            global_devices=[n for pid in sorted(names) for n in names[pid]],
            processes=[pb.ProcessDevices(process_id=pid, devices=names[pid]) for pid in sorted(names)],
        )

    def LeaveGroup(self, request, context):
        """A process is done with a group across nodes (see :meth:`xreduced.peers.Peers.leave`).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> service.LeaveGroup(pb.LeaveGroupRequest(group="default@10.0.0.1:1234", epoch=1), None)
            Traceback (most recent call last):
            ...
            xreduced.errors.NotFound: group: this daemon is in no group 'default@10.0.0.1:1234' of epoch 1
        """
        if request.epoch or not self.local_groups.leave(request.group, request.process_id):
            self.peers.leave(request.group, request.epoch, request.process_id)
        return pb.LeaveGroupResponse()

    def _join_across(self, request, devices: tuple[int, ...], deadline: Deadline, context) -> pb.JoinGroupResponse:
        """JoinGroup through the group's coordinator: its processes may be on several nodes. A call that names
        a session (the SDK's ``initialize`` opens one for the group) ties the process to it: if the session ends
        before the process leaves (it exited or was killed), the epoch ends for everyone
        (:meth:`xreduced.peers.Peers.session_ended`)."""
        session = self._open_session(context)
        cluster = self.peers.join(request.group, request.num_processes, request.process_id, request.coordinator,
                                  [self.devices.name(d).short for d in devices], max(deadline.remaining() or 0.0, 0.0),
                                  getattr(context, "add_callback", None))
        if session is not None:
            self.peers.watch(session, cluster.gid, cluster.epoch, request.process_id)
            if self.regions.session(session) is None:  # it ended while the process joined: the process is gone
                self.peers.session_ended(session)
        self.rendezvous.forget_failures(cluster.gid)
        names = {}
        for node in cluster.nodes:
            for p in node.processes:
                names[p.process_id] = [_global_name(d, node.index, cluster.spans_nodes) for d in p.devices]
        mine = next(p for p in cluster.nodes[cluster.node_index].processes if p.process_id == request.process_id)
        return pb.JoinGroupResponse(
            local_devices=[DeviceName.parse(d).canonical for d in mine.devices],
            global_devices=[n for pid in sorted(names) for n in names[pid]],
            processes=[pb.ProcessDevices(process_id=pid, devices=names[pid]) for pid in sorted(names)],
            epoch=cluster.epoch, group=cluster.gid, nodes=cluster.nodes, node_index=cluster.node_index,
            engine=cluster.engine_name,
        )

    def _open_session(self, context) -> str | None:
        """The session a JoinGroup names, which ties its process to the group; None when it names none.

        Raises:
            FailedPrecondition: the session is not open (closed, or opened with a daemon that restarted)."""
        session = session_of(context)
        if session is not None and self.regions.session(session) is None:
            raise FailedPrecondition(f"x-xreduce-session: {session[:8]}... is not an open session of this daemon "
                                     "(it was closed, or the daemon restarted); open a new one, or send none")
        return session

    def ReduceStream(self, request_iterator, context):
        """A BatchReduce whose tensors arrive and leave in chunks; :func:`xreduced.streaming.reduce_stream`
        shows a whole stream.

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> list(service.ReduceStream(iter([]), SimpleNamespace(time_remaining=lambda: None)))
            Traceback (most recent call last):
            ...
            xreduced.errors.InvalidArgument: header: the stream ended before its header (a BatchReduceRequest)
        """
        return streaming.reduce_stream(self, request_iterator, context)

    def OpenSession(self, request, context):
        """Opens a session (see :meth:`RegionService.OpenSession`).

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> context = SimpleNamespace(add_callback=lambda callback: None, peer=lambda: "unix:")
            >>> next(service.OpenSession(pb.OpenSessionRequest(), context)).cuda_ipc
            False
        """
        return self.region_service.OpenSession(request, context)

    def RegisterRegion(self, request, context):
        """Maps a region of the caller's memory (see :meth:`RegionService.RegisterRegion`).

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> remote = SimpleNamespace(peer=lambda: "ipv4:10.0.0.5:1")  # the call's context
            >>> service.RegisterRegion(pb.RegisterRegionRequest(name="in"), remote)
            Traceback (most recent call last):
            ...
            xreduced.errors.PermissionDenied: name: regions are for callers on the daemon's host (a unix socket or
            loopback); this call came from ipv4:10.0.0.5:1
        """
        return self.region_service.RegisterRegion(request, context)

    def UnregisterRegion(self, request, context):
        """Releases regions of the session (see :meth:`RegionService.UnregisterRegion`).

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> session = service.regions.open_session()
            >>> context = SimpleNamespace(invocation_metadata=lambda: [("x-xreduce-session", session.id)])
            >>> service.UnregisterRegion(pb.UnregisterRegionRequest(name=""), context) == pb.UnregisterRegionResponse()
            True
        """
        return self.region_service.UnregisterRegion(request, context)

    def ListRegions(self, request, context):
        """The session's regions (see :meth:`RegionService.ListRegions`).

        Example:
            >>> from types import SimpleNamespace
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> session = service.regions.open_session()
            >>> context = SimpleNamespace(invocation_metadata=lambda: [("x-xreduce-session", session.id)])
            >>> list(service.ListRegions(pb.ListRegionsRequest(), context).regions)
            []
        """
        return self.region_service.ListRegions(request, context)

    def refused(self, request, error: LimitExceeded) -> None:
        """A request was refused at admission: the collective it belonged to fails for every process
        (they would otherwise wait for this one until their timeout).

        Example:
            >>> from xreduced.backends.numpy_backend import NumpyBackend
            >>> service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy")
            >>> request = pb.ReduceRequest(collective=pb.CollectiveSpec(group="g", num_processes=2, process_id=0))
            >>> service.refused(request, LimitExceeded("over --max-request-bytes", "max_request_bytes"))
            >>> service.rendezvous.remembered_failures()  # process 1 of the collective now fails at once
            1
        """
        if "collective" not in request.DESCRIPTOR.fields_by_name:
            return
        with contextlib.suppress(ServiceError):  # a bad collective spec: there is nobody to tell
            group = decode.group(request)
            if group is not None:
                self._fail_for_others(group, error)

    def _reduce(self, kind, request, context, describe: Callable[[], tuple[list, list[str], list[str]]],
                reply: Callable[[tuple[list[Result], list[dict[int, decode.Slot] | None]]], Any]) -> Any:
        """``reply((results, slots))`` of a reduction; a :class:`~xreduced.deferred.Deferred` of it for a lane
        call that waits for the other processes of its collective. ``describe()`` says the request's
        (value, destinations) pairs and their fields' names; a request of a shape validated before
        (:mod:`xreduced.prepared`) never asks. Decoding (:meth:`_decode`) and placing the results
        (:meth:`_slots`) fail the collective for its other processes; running it (:meth:`_run`) fails it in the
        rendezvous."""
        group = decode.group(request)
        call = current_call()
        with self._failing(group):
            if group is not None and request.collective.abort:
                raise _GaveUp(f"process {group.process_id} gave up {group.label}: {request.collective.abort}")
            decoded = self._decode(request, context, group, call, describe)
            slots = self._slots(decoded, request, group, call)
        return self._run(kind, decoded, slots, request, context, group, call, reply)

    def _decode(self, request, context, group: decode.Group | None, call,
                describe: Callable[[], tuple[list, list[str], list[str]]]) -> _Decoded:
        """The request's reduction: from what a shape validated before kept (only the tensors' bytes are new),
        else decoded and validated field by field (and its shape remembered)."""
        regions = None if call is None else call.regions
        shape = None if call is None else call.shape
        deadline = self._deadline(request, context, group)
        prepared = self.prepared.get(shape)
        if prepared is not None:
            pairs, resolved = prepared.decode(request)
            return _Decoded(prepared.op, decode.Options(prepared.num_packs, prepared.algorithm, prepared.reduce_to,
                                                        deadline), pairs, resolved, prepared.dest_fields)
        raw_pairs, value_fields, dest_fields = describe()
        op = decode.op(request.reduce_op)
        options = decode.options(request, self.devices, deadline)
        pairs = [(decode.value(v, vf, self.devices, regions), decode.devices(d, df, self.devices))
                 for (v, d), vf, df in zip(raw_pairs, value_fields, dest_fields)]
        resolved = self.engine.validate(op, pairs, options.num_packs, dest_fields)
        self.prepared.remember(shape, op, options.num_packs, options.algorithm, options.reduce_to, pairs, resolved,
                               dest_fields)
        return _Decoded(op, options, pairs, resolved, dest_fields)

    def _slots(self, decoded: _Decoded, request, group: decode.Group | None,
               call) -> list[dict[int, decode.Slot] | None]:
        """Where each result goes in the request's ``output`` region (None each without one)."""
        if request.output_one_copy and not request.HasField("output"):
            raise InvalidArgument("output_one_copy: true without output; it says how results are written into "
                                  "the output region: send output too, or leave output_one_copy unset")
        if not request.HasField("output"):
            return [None] * len(decoded.resolved)
        for value, _ in decoded.resolved:
            if is_sparse(value):
                raise InvalidArgument(f"output: {value.field} is sparse (indexed_slices), whose result's size is "
                                      "known only once reduced; send sparse values without an output region")
        op, options = decoded.op, decoded.options
        # Across processes a value always has several replicas: never the identity route.
        routes = [planner.HIERARCHICAL_COPY] * len(decoded.resolved) if group is not None else self.engine.routes(
            op, decoded.pairs, algorithm=options.algorithm, num_packs=options.num_packs,
            dest_fields=decoded.dest_fields)
        return decode.layout(request.output, [
            (dests, result_dtype(op, value.arrays[0].dtype, route), value.arrays[0].shape)
            for (value, dests), route in zip(decoded.resolved, routes)
        ], None if call is None else call.regions, one_copy=request.output_one_copy)

    def _run(self, kind, decoded: _Decoded, slots: list[dict[int, decode.Slot] | None], request, context,
             group: decode.Group | None, call, reply) -> Any:
        """Reduces ``decoded`` (alone, or with the other processes of its collective) and replies; keeps a
        repeat of it for a lane connection that keeps them."""
        op, options, resolved, dest_fields = decoded.op, decoded.options, decoded.resolved, decoded.dest_fields
        regions = None if call is None else call.regions
        outs = [decode.views(s) for s in slots]
        replica_bytes = sum(_replica_bytes(v) for v, _ in decoded.pairs)
        keeps = getattr(context, "keeps_repeats", False) and regions is not None and request.HasField("output")
        if group is None:
            results = self._timed(kind, replica_bytes, lambda: self.engine.batch_reduce(
                op, decoded.pairs, num_packs=options.num_packs, algorithm=options.algorithm,
                reduce_to=options.reduce_to, deadline=options.deadline, dest_fields=dest_fields, out=outs))
            if keeps:
                context.repeat = self._kept(kind, request, decoded, slots, call)
            return reply((results, slots))
        share = Contribution(kind, op, options.num_packs, options.algorithm, options.reduce_to, tuple(resolved),
                             out=tuple(outs), shape=None if call is None else call.shape)
        deadline = options.deadline
        cluster = self._cluster(group)
        if cluster is None and keeps:  # the lane keeps it once the collective has its reply
            context.repeat = self._kept(kind, request, decoded, slots, call)
        if cluster is not None and cluster.spans_nodes:
            def reduce(shares):
                return across.reduce_across(cluster, self.engine, shares, group.label, deadline, group.sequence)
        else:
            def reduce(shares):
                return reduce_together(self.engine, shares, group.label, deadline)
        result = self._meet(group, share, deadline, context,
                            lambda shares: self._timed(kind, replica_bytes, lambda: reduce(shares)), cluster=cluster,
                            deferrable=True)
        return then(result, lambda r: reply((r, slots)))

    @staticmethod
    def _kept(kind, request, decoded: _Decoded, slots: list[dict[int, decode.Slot] | None],
              call) -> repeated.Repeat | None:
        """The repeat a lane connection keeps of this call (:func:`xreduced.repeated.kept`)."""
        options = decoded.options
        return repeated.kept(kind, request, decoded.op, options.num_packs, options.algorithm, options.reduce_to,
                             decoded.dest_fields, decoded.resolved, slots, call.regions.pinned(), call.held)

    def repeat(self, repeat: repeated.Repeat, session_id: str, call_seconds: float | None) -> None:
        """Serves a kept repeat (:mod:`xreduced.repeated`) of session ``session_id``: the engine reduces its
        regions' bytes into its output slots, timed as the full path times a reduction.

        Raises:
            xreduced.repeated.Stale: a region of the request is not the one validated; or what the region checks
                and the engine raise. The lane then serves the call by the full path.
        """
        self._timed(repeat.kind, repeat.replica_bytes, lambda: repeat.run(
            lambda names: self.regions.pin_named(session_id, names), self.regions.unpin, self.engine,
            call_seconds))

    def _cluster(self, group: decode.Group | None) -> ClusterGroup | None:
        """The group across nodes ``group`` belongs to, checked for its epoch; None for a one-daemon group."""
        if group is None:
            return None
        cluster = self.peers.lookup(group.key.group)
        if cluster is None:
            if group.epoch:
                raise NotFound(f'collective.group: this daemon is in no group "{group.key.group}" of epoch '
                               f"{group.epoch} (it may have restarted); initialize again")
            return None
        cluster.check(group.epoch, group.label)
        if cluster.spans_nodes and group.sequence is None:
            raise InvalidArgument(f"collective.name: {group.label} is named, but collectives across nodes go in "
                                  "sequence order: leave the name empty")
        return cluster

    def _meet(self, group: decode.Group, share, deadline: Deadline, context, compute, remember_failure=True,  # noqa: PLR0913
              cluster: ClusterGroup | None = None, deferrable: bool = False, joining: bool = False):
        """This process's share of the collective; with ``deferrable``, for a caller that can wait without a
        thread (a local-lane call: ``context.defers``) in a group on this node, a
        :class:`~xreduced.deferred.Deferred` of it when the others have not all arrived. A collective of a
        group of this daemon that lost a process fails at once (not a join, which starts a new membership)."""
        across_nodes = cluster is not None and cluster.spans_nodes
        if cluster is None and not joining:
            self.local_groups.check(group.key.group, group.label)
        defers = deferrable and getattr(context, "defers", False) and not across_nodes
        try:
            self.admission.collectives.enter(group.key, group.label)
        except LimitExceeded as e:
            if remember_failure:  # the others fail at once instead of waiting for this process
                self._fail_for_others(group, e)
            raise
        waits = False
        try:
            meeting = Meeting(group.key, group.label, group.num_processes,
                              expected=cluster.local if cluster is not None else None,
                              remember_failure=remember_failure,
                              abandoned=cluster.abandoned if across_nodes else None)
            participant = Participant(group.process_id, share, max(deadline.remaining(), 0.0),
                                      on_leave=context.add_callback, defer=defers)
            out = self.rendezvous.run(meeting, participant, compute)
            if defers and isinstance(out, Deferred):
                waits = True
                out.on_done(lambda *_: self.admission.collectives.leave(group.key))
            return out
        except ServiceError as e:
            if across_nodes and not cluster.entered(group.sequence):  # the other nodes would wait for this one
                self._fail_across(cluster, group, e, refusal=isinstance(e, InvalidArgument))
            raise
        finally:
            if not waits:
                self.admission.collectives.leave(group.key)

    def _fail_for_others(self, group: decode.Group, error: Exception) -> None:
        """Process ``group.process_id``'s request was rejected: its collective fails for every process, on
        this node and (in sequence order, :func:`across.refuse_across`) on the others; the group goes on."""
        reason = str(error) if isinstance(error, _GaveUp) else \
            f"process {group.process_id}'s request was rejected: {error}"
        cluster = None
        with contextlib.suppress(ServiceError):
            cluster = self._cluster(group)
        if cluster is not None and cluster.spans_nodes:  # claimed first: the failure below must not end the epoch
            self._fail_across(cluster, group, Aborted(reason), refusal=True)
        self.rendezvous.fail(group.key, group.label, group.num_processes,
                             Aborted(f"{group.label} was aborted: {reason}"))

    def _fail_across(self, cluster: ClusterGroup, group: decode.Group, error: ServiceError, refusal: bool) -> None:
        """A collective across nodes failed on this node before it entered the engine. A ``refusal`` (a bad
        request) takes its turn there, so the other nodes fail it with ``error`` and go on; anything else (a
        timeout, a lost process) broke the lockstep and ends the epoch for everyone."""
        if not refusal:
            cluster.fail(f"{group.label} failed on {cluster.describe(cluster.node_index)}: {error}", report=True,
                         process_ids=list(error.process_ids))
        elif cluster.claim(group.sequence):
            deadline = Deadline(self.collective_timeout)

            def refuse():
                with contextlib.suppress(ServiceError):  # the epoch ended meanwhile: its processes know
                    across.refuse_across(cluster, group.sequence, str(error), group.label, deadline)

            threading.Thread(target=refuse, name="xreduced-refusal", daemon=True).start()

    def _timed(self, kind: str, replica_bytes: int, reduce):
        """Runs ``reduce()`` and records its seconds and algbw under method ``kind``."""
        start = time.perf_counter()
        result = reduce()
        self.stats.observe_reduction(METHOD_PREFIX + kind, time.perf_counter() - start, replica_bytes)
        return result

    def _failing(self, group: decode.Group | None) -> _Failing:
        """A ``with`` block in which a member's bad request (a service or codec error) fails the collective for
        every member."""
        return _Failing(self, group)

    def _deadline(self, request, context, group: decode.Group | None) -> Deadline:
        return decode.deadline(request, decode.call_deadline(context),
                               self.collective_timeout if group is not None else None)

    def _encode(self, result: Result, encoding: str, slots: dict[int, decode.Slot] | None) -> pb.DistributedValue:
        """A result as the reply carries it: tensors in the request's encoding, or, for a result the
        engine wrote into an output region, components that name its slices."""
        if slots is None:
            return pb.DistributedValue(components=[
                pb.Component(device=self.devices.canonical(d), indexed_slices=wire_sparse.encode(a, encoding))
                if isinstance(a, wire_sparse.Slices) else
                pb.Component(device=self.devices.canonical(d),
                             tensor=codec.encode(self.engine.backend.to_host(a), encoding))
                for d, a in zip(result.devices, result.arrays)
            ])
        components = []
        for d in result.devices:
            slot = slots[d]
            components.append(pb.Component(device=self.devices.canonical(d), tensor=pb.Tensor(
                dtype=codec.dtype_enum(slot.view.dtype), shape=slot.view.shape,
                region=pb.RegionSlice(name=slot.region, offset=slot.offset, byte_size=slot.view.nbytes))))
        return pb.DistributedValue(components=components)


@dataclasses.dataclass(frozen=True)
class _Decoded:
    """A reduction request as :meth:`CrossDeviceOpsService._reduce` runs it, from either way of decoding it.

    Example:
        >>> import numpy as np
        >>> value = Value((0, 1), (np.ones(2), np.ones(2)), "pairs[0].value")
        >>> _Decoded("SUM", decode.Options(1, "hierarchical_copy", None, None), [(value, ())], [(value, (0, 1))],
        ...          ["pairs[0].destinations"]).resolved[0][1]
        (0, 1)
    """

    op: str
    options: decode.Options
    pairs: list
    """(value, destinations as the request names them)."""
    resolved: list
    """(value, destinations resolved: the value's own devices for none)."""
    dest_fields: list[str]


class _GaveUp(Aborted):
    """A process gave up its collective before it could make its request (``CollectiveSpec.abort``, e.g. a
    device name its SDK refused): every process gets its reason."""


class _Failing:
    """See :meth:`CrossDeviceOpsService._failing`; a class, not a generator, as every call enters it."""

    __slots__ = ("service", "group")

    def __init__(self, service: CrossDeviceOpsService, group: decode.Group | None):
        self.service, self.group = service, group

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if self.group is not None and isinstance(error, (ServiceError, codec.CodecError)):
            self.service._fail_for_others(self.group, error)
        return False


def _global_name(short: str, node: int, across: bool) -> str:
    """A device's name in a group's global list: ``/job:worker/replica:0/task:<node>/...`` across nodes.

    Example:
        >>> _global_name("CPU:1", 1, True), _global_name("CPU:1", 0, False)[-5:]
        ('/job:worker/replica:0/task:1/device:CPU:1', 'CPU:1')
    """
    name = DeviceName.parse(short)
    if across:
        name = dataclasses.replace(name, job="worker", task=node)
    return name.canonical


def _encoding(values: Callable[[], list[pb.DistributedValue]]) -> str:
    """The encoding a reply answers in: raw for a request with a shape (:func:`xreduced.prepared.shape_of` has
    seen no typed values), else what :func:`xreduced.decode.encoding` finds in ``values()``."""
    call = current_call()
    if call is not None and call.shape is not None:
        return codec.RAW
    return decode.encoding(values())


def _regions() -> CallRegions | None:
    """The regions the current call may name (none outside the call pipeline)."""
    call = current_call()
    return None if call is None else call.regions


def _replica_bytes(value: Value) -> int:
    """Bytes of one replica of a value (what algbw divides by the seconds)."""
    return int(value.arrays[0].nbytes) if value.arrays else 0


def _broadcast_bytes(shares) -> int:
    return next((int(s.array.nbytes) for s in shares.values() if s.array is not None), 0)
