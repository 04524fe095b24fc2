"""The CrossDeviceOps service: validate, decode, dispatch to the engine, encode.

Every failure leaves as a gRPC status whose message names the field and the
values received; nothing escapes as a stray exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import time

import grpc
import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce.wire.contract import METHOD_PREFIX

from xreduced import planner, streaming
from xreduced.collective import BroadcastShare, Contribution, assign_devices, broadcast_together, label, reduce_together
from xreduced.config import Config
from xreduced.devices import DeviceTable
from xreduced.engine import MAX_NUM_PACKS, MEAN, SUM, Engine, Result, Value, check_destinations, result_dtype
from xreduced.errors import Aborted, InvalidArgument, ServiceError
from xreduced.executor import Deadline
from xreduced.limits import CollectiveSlots, LimitExceeded, Limits
from xreduced.observability import REQUEST_BYTES, Stats
from xreduced.region_service import RegionMixin, _arrays
from xreduced.regions import RegionTable, session_of
from xreduced.rendezvous import Rendezvous

log = logging.getLogger("xreduced.service")


def _version() -> str:
    try:
        return importlib.metadata.version("xreduce")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout
        return "unknown"


VERSION = _version()

_OPS = {pb.REDUCE_OP_SUM: SUM, pb.REDUCE_OP_MEAN: MEAN}
_ALGORITHMS = {
    pb.ALGORITHM_UNSPECIFIED: planner.HIERARCHICAL_COPY,
    pb.ALGORITHM_HIERARCHICAL_COPY: planner.HIERARCHICAL_COPY,
    pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE: planner.REDUCTION_TO_ONE_DEVICE,
}
_ROUTES = {
    planner.IDENTITY: pb.ROUTE_IDENTITY,
    planner.HIERARCHICAL_COPY: pb.ROUTE_HIERARCHICAL_COPY,
    planner.REDUCTION_TO_ONE_DEVICE: pb.ROUTE_REDUCTION_TO_ONE_DEVICE,
}


def _status(handler):
    """Turns engine and codec errors into statuses; logs and hides the rest."""

    @functools.wraps(handler)
    def wrapper(self, request, context):
        log.debug("event=handling method=%s peer=%s", handler.__name__, context.peer())
        try:
            with self._admitted(request, handler.__name__), self.regions.call(session_of(context)):
                return handler(self, request, context)
        except ServiceError as e:
            context.abort(e.code, _short(str(e)))
        except codec.CodecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _short(str(e)))
        except MemoryError:
            log.exception("event=out_of_memory method=%s", handler.__name__)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the daemon ran out of memory for this request")
        except Exception:  # a bug: keep serving, say so
            log.exception("event=internal_error method=%s", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {handler.__name__}; see the daemon's log")

    return wrapper


MAX_PROCESSES = 65536
"""The most processes a collective may have."""

MAX_MESSAGE_CHARS = 2000
"""Error messages are cut to this: a client drops metadata over 8 KiB, and with it the real error."""


def _short(message: str) -> str:
    """The message in ASCII (non-ASCII escaped: gRPC sends it percent-encoded, up to 6 bytes a
    character), cut to MAX_MESSAGE_CHARS; the field name comes first, so it survives.

    Example:
        >>> print(_short("device 'é'"))
        device '\\xe9'

        >>> len(_short("é" * 10000)) <= MAX_MESSAGE_CHARS
        True
    """
    message = message.encode("ascii", "backslashreplace").decode("ascii")
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + "... (message cut)"


def _enum_label(enum_type, value: int) -> str:
    try:
        return f"{enum_type.Name(value)} ({value})"
    except ValueError:
        return str(value)


@dataclasses.dataclass(frozen=True)
class _Group:
    """A validated CollectiveSpec."""

    key: tuple[str, str]
    label: str
    num_processes: int
    process_id: int


class CrossDeviceOpsService(RegionMixin, pb_grpc.CrossDeviceOpsServicer):
    """Serves ``xreduce.v1.CrossDeviceOps`` on an engine's devices.

    Requests with a ``collective`` of several processes meet in the rendezvous;
    the last to arrive runs the reduction for all of them.
    """

    def __init__(self, engine: Engine, backend_name: str, collective_timeout: float = 300.0,
                 rendezvous: Rendezvous | None = None, config: Config | None = None,
                 stats: Stats | None = None, regions: RegionTable | None = None):
        self.engine = engine
        self.backend_name = backend_name
        self.devices = DeviceTable(engine.backend.devices())
        self.collective_timeout = collective_timeout
        self.rendezvous = rendezvous or Rendezvous()
        self.config = config or Config()
        self.stats = stats or Stats()
        self.stats.configure(Limits.from_config(self.config), self.rendezvous.pending)
        self.collective_slots = CollectiveSlots(self.config.max_collectives)
        self.regions = regions or RegionTable(ipc_opener=getattr(engine.backend, "open_ipc", None),
                                              max_sessions=max(1, self.config.workers // 2))

    @_status
    def ListDevices(self, request, context):
        out = pb.ListDevicesResponse(backend=self.backend_name, devices=self._device_messages())
        for row in self.engine.backend.peer_access():
            out.peer_access.add(can_access=row)
        return out

    @_status
    def GetStatus(self, request, context):
        c = self.config
        return pb.GetStatusResponse(
            version=VERSION,
            backend=self.backend_name,
            devices=self._device_messages(),
            uptime_seconds=time.monotonic() - self.stats.started,
            limits=pb.Limits(
                max_message_bytes=c.max_message_bytes, max_request_bytes=c.max_request_bytes,
                max_inflight_bytes=c.max_inflight_bytes, max_collectives=c.max_collectives,
                collective_timeout_seconds=self.collective_timeout, workers=c.workers,
            ),
            methods=[
                pb.MethodStats(method=m, calls_by_code=v["calls_by_code"], bytes_in=v["bytes_in"],
                               bytes_out=v["bytes_out"])
                for m, v in sorted(self.stats.snapshot().items())
            ],
            inflight_bytes=self.stats.inflight_bytes,
            collectives_waiting=self.rendezvous.pending(),
            tls=c.tls_cert is not None,
            mutual_tls=c.tls_client_ca is not None,
            token_auth=c.auth_token_file is not None,
        )

    def _device_messages(self) -> list[pb.Device]:
        out = []
        for i, info in enumerate(self.devices.infos):
            name = self.devices.name(i)
            out.append(pb.Device(
                name=name.canonical, short_name=name.short, device_type=info.device_type,
                index=info.index, memory_bytes=info.memory_bytes, physical_device=info.physical_device,
            ))
        return out

    @_status
    def Reduce(self, request, context):
        encoding = _encoding([request.value])
        (result,), (out,) = self._reduce("Reduce", request, context, [(request.value, request.destinations)],
                                         ["value"], ["destinations"])
        return pb.ReduceResponse(result=self._encode(result, encoding, out), route=_ROUTES[result.route])

    @_status
    def BatchReduce(self, request, context):
        encoding = _encoding([p.value for p in request.pairs])
        n = len(request.pairs)
        results, outs = self._reduce(
            "BatchReduce", request, context, [(p.value, p.destinations) for p in request.pairs],
            [f"pairs[{i}].value" for i in range(n)], [f"pairs[{i}].destinations" for i in range(n)],
        )
        return pb.BatchReduceResponse(
            results=[
                pb.ReduceResult(result=self._encode(r, encoding, out), route=_ROUTES[r.route])
                for r, out in zip(results, outs)
            ]
        )

    def OpenSession(self, request, context):
        return self._open_session(request, context)

    @_status
    def RegisterRegion(self, request, context):
        return self._register_region(request, context)

    @_status
    def UnregisterRegion(self, request, context):
        return self._unregister_region(request, context)

    @_status
    def ListRegions(self, request, context):
        return self._list_regions(request, context)

    @_status
    def Broadcast(self, request, context):
        group = self._group(request)
        with self._failing(group):
            deadline = self._deadline(request, context, group)
            is_source = group is None or group.process_id == request.source_process
            if is_source and not request.HasField("tensor"):
                raise InvalidArgument("tensor: broadcast needs a tensor; got none")
            array = self._array(request.tensor, "tensor") if request.HasField("tensor") else None
            source = self.devices.resolve(request.source_device, "source_device") if request.source_device else None
            dests = self._devices(request.destinations, "destinations")
            if group is not None:
                if not 0 <= request.source_process < group.num_processes:
                    raise InvalidArgument(
                        f"source_process: must be in [0, {group.num_processes}); got {request.source_process}"
                    )
                if not dests:
                    raise InvalidArgument("destinations: broadcast needs at least one destination; got none")
                check_destinations(dests, "destinations", self.engine.label)
            out = None
            if request.HasField("output"):
                if array is None:
                    raise InvalidArgument("output: a process that sends no tensor cannot size its output; send "
                                          "the tensor's dtype and shape with an empty region, or omit output")
                out = self._layout(request.output, [(dests, array.dtype, array.shape)])[0]
        if group is None:
            result = self._timed("Broadcast", array.nbytes, lambda: self.engine.broadcast(
                array, source or 0, dests, deadline, out=None if out is None else _arrays([out])[0]))
        else:
            share = BroadcastShare(request.source_process, array, source, dests,
                                   out=None if out is None else _arrays([out])[0])
            result = self._meet(group, share, deadline, context, lambda shares: self._timed(
                "Broadcast", _broadcast_bytes(shares),
                lambda: broadcast_together(self.engine, shares, group.label, deadline)))
        encoding = codec.encoding_of(request.tensor) if request.HasField("tensor") else codec.RAW
        return pb.BroadcastResponse(result=self._encode(result, encoding, out))

    @_status
    def JoinGroup(self, request, context):
        spec = pb.CollectiveSpec(group=request.group, num_processes=request.num_processes,
                                 process_id=request.process_id, name="join")
        group = self._check_group(spec)
        deadline = self._deadline(request, context, group)
        devices = self._devices(request.devices, "devices")
        check_destinations(devices, "devices", self.engine.label)
        label = f'the join of group "{request.group}"'
        if group.num_processes == 1:
            assigned = {0: devices or tuple(range(len(self.devices)))}
        else:
            def join(shares):
                assigned = assign_devices(shares, len(self.devices), self.engine.label, label)
                # A new job of this group name: earlier jobs' failures no longer apply.
                self.rendezvous.forget_failures(request.group)
                return {pid: assigned for pid in shares}

            assigned = self._meet(group, devices, deadline, context, join, remember_failure=False)
        names = {pid: [self.devices.name(d).canonical for d in devs] for pid, devs in assigned.items()}
        return pb.JoinGroupResponse(
            local_devices=names[group.process_id],
            global_devices=[n for pid in sorted(names) for n in names[pid]],
            processes=[pb.ProcessDevices(process_id=pid, devices=names[pid]) for pid in sorted(names)],
        )

    def ReduceStream(self, request_iterator, context):
        return streaming.reduce_stream(self, request_iterator, context)

    def _reduce(self, kind, request, context, raw_pairs, value_fields, dest_fields) -> list[Result]:
        group = self._group(request)
        with self._failing(group):
            op = self._op(request.reduce_op)
            options = self._options(request, context, group)
            pairs = [
                (self._value(v, vf), self._devices(d, df))
                for (v, d), vf, df in zip(raw_pairs, value_fields, dest_fields)
            ]
            resolved = self.engine.validate(op, pairs, options["num_packs"], dest_fields)
            outs = [None] * len(resolved)
            if request.HasField("output"):
                # Across processes a value always has several replicas: never the identity route.
                routes = [planner.HIERARCHICAL_COPY] * len(resolved) if group is not None else self.engine.routes(
                    op, pairs, algorithm=options["algorithm"], num_packs=options["num_packs"], dest_fields=dest_fields)
                outs = self._layout(request.output, [
                    (dests, result_dtype(op, value.arrays[0].dtype, route), value.arrays[0].shape)
                    for (value, dests), route in zip(resolved, routes)
                ])
        replica_bytes = sum(_replica_bytes(v) for v, _ in pairs)
        if group is None:
            return self._timed(kind, replica_bytes, lambda: self.engine.batch_reduce(
                op, pairs, dest_fields=dest_fields, out=_arrays(outs), **options)), outs
        share = Contribution(kind, op, options["num_packs"], options["algorithm"], options["reduce_to"],
                             tuple(resolved), out=tuple(_arrays(outs)))
        deadline = options["deadline"]
        return self._meet(group, share, deadline, context, lambda shares: self._timed(
            kind, replica_bytes, lambda: reduce_together(self.engine, shares, group.label, deadline))), outs

    def _meet(self, group: _Group, share, deadline: Deadline, context, compute, remember_failure=True):
        try:
            self.collective_slots.enter(group.key, group.label)
        except LimitExceeded as e:
            self.stats.rejected(e.limit)
            if remember_failure:  # the others fail at once instead of waiting for this process
                self._fail_for_others(group, e)
            raise
        try:
            return self.rendezvous.run(
                group.key, group.label, group.num_processes, group.process_id, share,
                max(deadline.remaining(), 0.0), compute, context.add_callback, remember_failure,
            )
        finally:
            self.collective_slots.leave(group.key)

    @contextlib.contextmanager
    def _admitted(self, request, method: str):
        """Holds the call's working set in the in-flight budget from admission until its reply is
        serialized (Stats.admit).

        Raises:
            LimitExceeded: over --max-request-bytes (when no interceptor checked it
                already) or --max-inflight-bytes; a collective it belonged to fails
                for every process.
        """
        size = REQUEST_BYTES.get()
        if size is None:  # no interceptor measured it (the service used on its own)
            size = request.ByteSize()
        try:
            self.stats.limits.check_request(size, METHOD_PREFIX + method)
            release = self.stats.admit(request, size)
        except LimitExceeded as e:
            self.stats.rejected(e.limit)
            if "collective" in request.DESCRIPTOR.fields_by_name:
                with contextlib.suppress(ServiceError):
                    group = self._group(request)
                    if group is not None:
                        self._fail_for_others(group, e)
            raise
        try:
            yield
        finally:
            release()

    def _fail_for_others(self, group: _Group, error: ServiceError) -> None:
        self.rendezvous.fail(group.key, group.label, group.num_processes, Aborted(
            f"{group.label} was aborted: process {group.process_id}'s request was rejected: {error}"))

    def _timed(self, kind: str, replica_bytes: int, reduce):
        """Runs ``reduce()`` and records its seconds and algbw under method ``kind``."""
        start = time.perf_counter()
        result = reduce()
        self.stats.observe_reduction(METHOD_PREFIX + kind, time.perf_counter() - start, replica_bytes)
        return result

    @contextlib.contextmanager
    def _failing(self, group: _Group | None):
        """A collective whose member sent a bad request fails for every member."""
        try:
            yield
        except (ServiceError, codec.CodecError) as e:
            if group is not None:
                self.rendezvous.fail(group.key, group.label, group.num_processes, Aborted(
                    f"{group.label} was aborted: process {group.process_id}'s request was rejected: {e}"))
            raise

    def _group(self, request) -> _Group | None:
        """The request's collective, or None when one process does it alone."""
        if not request.HasField("collective"):
            return None
        group = self._check_group(request.collective)
        return group if group.num_processes > 1 else None

    def _check_group(self, spec: pb.CollectiveSpec) -> _Group:
        if not spec.group:
            raise InvalidArgument("collective.group: a group name is required; got ''")
        if not 1 <= spec.num_processes <= MAX_PROCESSES:
            raise InvalidArgument(
                f"collective.num_processes: must be in [1, {MAX_PROCESSES}]; got {spec.num_processes}"
            )
        if not 0 <= spec.process_id < spec.num_processes:
            raise InvalidArgument(
                f"collective.process_id: must be in [0, num_processes); got process_id={spec.process_id}, "
                f"num_processes={spec.num_processes}"
            )
        if spec.sequence < 0:
            raise InvalidArgument(f"collective.sequence: must be >= 0; got {spec.sequence}")
        key = (spec.group, f"name:{spec.name}" if spec.name else f"seq:{spec.sequence}")
        return _Group(key, label(spec.group, spec.sequence, spec.name), spec.num_processes, spec.process_id)

    def _op(self, op: int) -> str:
        if op not in _OPS:
            raise InvalidArgument(
                f"reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got {_enum_label(pb.ReduceOp, op)}"
            )
        return _OPS[op]

    def _options(self, request, context, group: _Group | None) -> dict:
        if request.algorithm not in _ALGORITHMS:
            raise InvalidArgument(
                f"algorithm: must be ALGORITHM_HIERARCHICAL_COPY or ALGORITHM_REDUCTION_TO_ONE_DEVICE; "
                f"got {_enum_label(pb.Algorithm, request.algorithm)}"
            )
        num_packs = request.num_packs if request.HasField("num_packs") else 1
        if not 0 <= num_packs <= MAX_NUM_PACKS:
            raise InvalidArgument(f"num_packs: must be in [0, {MAX_NUM_PACKS}]; got num_packs={num_packs}")
        algorithm = _ALGORITHMS[request.algorithm]
        reduce_to = None
        if request.reduce_to_device:
            if algorithm != planner.REDUCTION_TO_ONE_DEVICE:
                raise InvalidArgument(
                    f"reduce_to_device: only used with ALGORITHM_REDUCTION_TO_ONE_DEVICE; got "
                    f"{request.reduce_to_device!r} with {_enum_label(pb.Algorithm, request.algorithm)}"
                )
            reduce_to = self.devices.resolve(request.reduce_to_device, "reduce_to_device")
        return {
            "num_packs": num_packs,
            "algorithm": algorithm,
            "reduce_to": reduce_to,
            "deadline": self._deadline(request, context, group),
        }

    def _deadline(self, request, context, group: _Group | None) -> Deadline:
        limits = []
        if request.HasField("timeout"):
            limits.append(_timeout_seconds(request.timeout))
        elif group is not None:
            limits.append(self.collective_timeout)
        remaining = call_deadline(context)
        if remaining is not None:
            limits.append(remaining)
        return Deadline(min(limits) if limits else None)

    def _devices(self, names, field: str) -> tuple[int, ...]:
        return tuple(self.devices.resolve(n, f"{field}[{i}]") for i, n in enumerate(names))

    def _value(self, message: pb.DistributedValue, field: str) -> Value:
        devices, arrays = [], []
        for p, comp in enumerate(message.components):
            devices.append(self.devices.resolve(comp.device, f"{field}.components[{p}].device"))
            arrays.append(self._array(comp.tensor, f"{field}.components[{p}].tensor"))
        return Value(tuple(devices), tuple(arrays), field)

    def _encode(self, result: Result, encoding: str, out=None) -> pb.DistributedValue:
        if out is None:
            return pb.DistributedValue(components=[
                pb.Component(device=self.devices.name(d).canonical, tensor=codec.encode(_host(a), encoding))
                for d, a in zip(result.devices, result.arrays)
            ])
        return self._encode_regions(result, out)


def _host(array) -> np.ndarray:
    """A result as a numpy array (a CuPy one is copied from its GPU)."""
    return array if isinstance(array, np.ndarray) else array.get() if hasattr(array, "get") else np.asarray(array)


MAX_TIMEOUT_SECONDS = 86400
"""The longest ``timeout`` a request may ask for: one day."""


def call_deadline(context) -> float | None:
    """Seconds left before the call's gRPC deadline, or None without one (gRPC then says about 2**63 s)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining <= MAX_TIMEOUT_SECONDS else None


def _timeout_seconds(timeout) -> float:
    """A request's ``timeout`` in seconds, checked as protobuf defines a Duration."""
    s, n = timeout.seconds, timeout.nanos
    if not -999_999_999 <= n <= 999_999_999 or (s and n and (s < 0) != (n < 0)):
        raise InvalidArgument(f"timeout: not a valid Duration; got {{seconds: {s}, nanos: {n}}}")
    seconds = s + n / 1e9
    label = f"{seconds:g}s"
    if seconds <= 0:
        raise InvalidArgument(f"timeout: must be positive; got {label}")
    if seconds > MAX_TIMEOUT_SECONDS:
        raise InvalidArgument(f"timeout: must be at most {MAX_TIMEOUT_SECONDS}s (one day); got {label}")
    return seconds


def _replica_bytes(value: Value) -> int:
    """Bytes of one replica of a value (what algbw divides by the seconds)."""
    return int(value.arrays[0].nbytes) if value.arrays else 0


def _broadcast_bytes(shares) -> int:
    return next((int(s.array.nbytes) for s in shares.values() if s.array is not None), 0)


def _encoding(values) -> str:
    """The request's encoding: typed if any tensor carries typed values."""
    for value in values:
        for comp in value.components:
            if codec.encoding_of(comp.tensor) == codec.TYPED:
                return codec.TYPED
    return codec.RAW
