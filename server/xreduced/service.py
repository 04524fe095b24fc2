"""The CrossDeviceOps service: validate, decode, dispatch to the engine, encode.

Every failure leaves as a gRPC status whose message names the field and the
values received; nothing escapes as a stray exception.
"""

from __future__ import annotations

import functools
import logging

import grpc
import numpy as np
from xreduce import _codec as codec
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc

from xreduced import planner
from xreduced.devices import DeviceTable
from xreduced.engine import MAX_NUM_PACKS, MEAN, SUM, Engine, Result, Value
from xreduced.errors import InvalidArgument, ServiceError
from xreduced.executor import Deadline

log = logging.getLogger("xreduced.service")

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
            return handler(self, request, context)
        except ServiceError as e:
            context.abort(e.code, str(e))
        except codec.CodecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except MemoryError:
            log.exception("event=out_of_memory method=%s", handler.__name__)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the daemon ran out of memory for this request")
        except Exception:  # a bug: keep serving, say so
            log.exception("event=internal_error method=%s", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {handler.__name__}; see the daemon's log")

    return wrapper


def _enum_label(enum_type, value: int) -> str:
    try:
        return f"{enum_type.Name(value)} ({value})"
    except ValueError:
        return str(value)


class CrossDeviceOpsService(pb_grpc.CrossDeviceOpsServicer):
    """Serves ``xreduce.v1.CrossDeviceOps`` on an engine's devices."""

    def __init__(self, engine: Engine, backend_name: str):
        self.engine = engine
        self.backend_name = backend_name
        self.devices = DeviceTable(engine.backend.devices())

    @_status
    def ListDevices(self, request, context):
        out = pb.ListDevicesResponse(backend=self.backend_name)
        for i, info in enumerate(self.devices.infos):
            name = self.devices.name(i)
            out.devices.add(
                name=name.canonical, short_name=name.short, device_type=info.device_type,
                index=info.index, memory_bytes=info.memory_bytes, physical_device=info.physical_device,
            )
        for row in self.engine.backend.peer_access():
            out.peer_access.add(can_access=row)
        return out

    @_status
    def Reduce(self, request, context):
        encoding = _encoding([request.value])
        value = self._value(request.value, "value")
        dests = self._devices(request.destinations, "destinations")
        result = self.engine.reduce(
            self._op(request.reduce_op), value, dests, **self._options(request, context)
        )
        return pb.ReduceResponse(result=self._encode(result, encoding), route=_ROUTES[result.route])

    @_status
    def BatchReduce(self, request, context):
        encoding = _encoding([p.value for p in request.pairs])
        pairs = [
            (self._value(p.value, f"pairs[{i}].value"), self._devices(p.destinations, f"pairs[{i}].destinations"))
            for i, p in enumerate(request.pairs)
        ]
        results = self.engine.batch_reduce(
            self._op(request.reduce_op), pairs, **self._options(request, context)
        )
        return pb.BatchReduceResponse(
            results=[
                pb.ReduceResult(result=self._encode(r, encoding), route=_ROUTES[r.route]) for r in results
            ]
        )

    @_status
    def Broadcast(self, request, context):
        if not request.HasField("tensor"):
            raise InvalidArgument("tensor: broadcast needs a tensor; got none")
        array = codec.decode(request.tensor, "tensor")
        source = (
            self.devices.resolve(request.source_device, "source_device") if request.source_device else 0
        )
        dests = self._devices(request.destinations, "destinations")
        result = self.engine.broadcast(array, source, dests, self._deadline(request, context))
        return pb.BroadcastResponse(result=self._encode(result, codec.encoding_of(request.tensor)))

    def _op(self, op: int) -> str:
        if op not in _OPS:
            raise InvalidArgument(
                f"reduce_op: must be REDUCE_OP_SUM or REDUCE_OP_MEAN; got {_enum_label(pb.ReduceOp, op)}"
            )
        return _OPS[op]

    def _options(self, request, context) -> dict:
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
            "deadline": self._deadline(request, context),
        }

    def _deadline(self, request, context) -> Deadline:
        limits = []
        if request.HasField("timeout"):
            limits.append(_timeout_seconds(request.timeout))
        remaining = context.time_remaining()
        if remaining is not None:
            limits.append(remaining)
        return Deadline(min(limits) if limits else None)

    def _devices(self, names, field: str) -> tuple[int, ...]:
        return tuple(self.devices.resolve(n, f"{field}[{i}]") for i, n in enumerate(names))

    def _value(self, message: pb.DistributedValue, field: str) -> Value:
        devices, arrays = [], []
        for p, comp in enumerate(message.components):
            devices.append(self.devices.resolve(comp.device, f"{field}.components[{p}].device"))
            arrays.append(codec.decode(comp.tensor, f"{field}.components[{p}].tensor"))
        return Value(tuple(devices), tuple(arrays), field)

    def _encode(self, result: Result, encoding: str) -> pb.DistributedValue:
        return pb.DistributedValue(
            components=[
                pb.Component(device=self.devices.name(d).canonical, tensor=codec.encode(np.asarray(a), encoding))
                for d, a in zip(result.devices, result.arrays)
            ]
        )


MAX_TIMEOUT_SECONDS = 86400
"""The longest ``timeout`` a request may ask for: one day."""


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


def _encoding(values) -> str:
    """The request's encoding: typed if any tensor carries typed values."""
    for value in values:
        for comp in value.components:
            if codec.encoding_of(comp.tensor) == codec.TYPED:
                return codec.TYPED
    return codec.RAW
