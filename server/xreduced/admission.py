"""Admission: which calls the daemon takes on now, within its limits.

A call over a limit is refused at once with ``RESOURCE_EXHAUSTED`` and a
message that names the figures and the flag; nothing blocks waiting for room,
and the daemon goes on serving.

What each limit counts:

* ``--max-request-bytes``: the request's serialized size, the bytes it arrived
  as, checked before the request is even parsed.
* ``--max-inflight-bytes``: the sum of the working sets of the calls being
  served now, each estimated by :func:`working_set` from its request:
  :data:`REQUEST_FACTOR` x its serialized size (the parsed message and the
  decoded arrays) plus :data:`REPLY_FACTOR` x the result bytes its reply will
  carry (the result arrays, the reply message, its serialized bytes). A call
  holds its share from admission until its reply has been serialized and
  handed to gRPC; a collective's participant holds it while it waits for the
  others.
* ``--max-collectives``: multi-process collectives (and joins) that have a
  participant in the daemon now. A call that would open one more is refused;
  a call joining one already open is always let in (refusing it would only
  make the others time out).

How the daemon's memory stays within these is :mod:`xreduced.memory`'s part.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
from collections.abc import Hashable, Iterator

import grpc
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.contract import mean_dtype

from xreduced.config import Config
from xreduced.errors import ServiceError

REQUEST_FACTOR = 2
"""Working-set bytes per request byte: the parsed message and the decoded arrays (the bytes received are
freed once parsed)."""

REPLY_FACTOR = 4
"""Working-set bytes per result byte a reply carries: the result arrays, the reply message as the service
builds it (each nesting level of a protobuf message built from parts copies them), the serialized reply.
Measured (VmHWM growth of a fresh daemon for one call, after :func:`~xreduced.memory.tune_malloc`): a
Reduce of 8 x 4 MiB float32 (32 MiB in, 32 MiB out) +161 to +182 MiB, estimated 192 MiB; a Broadcast of
4 MiB to 8 devices (4 MiB in, 32 MiB out) +143 MiB, estimated 136 MiB."""

class LimitExceeded(ServiceError):
    """A call over one of the daemon's limits; ``limit`` names the setting.

    Example:
        >>> e = LimitExceeded("request of 150 bytes is over --max-request-bytes 100", "max_request_bytes")
        >>> e.code.name, e.limit
        ('RESOURCE_EXHAUSTED', 'max_request_bytes')
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, limit: str = ""):
        super().__init__(message)
        self.limit = limit


@dataclasses.dataclass(frozen=True)
class Limits:
    """The configured limits; None means unbounded.

    Example:
        >>> Limits.from_config(Config(max_collectives=4)).max_collectives
        4
    """

    max_request_bytes: int | None = None
    max_inflight_bytes: int | None = None
    max_collectives: int | None = None

    @classmethod
    def from_config(cls, config: Config) -> Limits:
        """The limits of a daemon configured by ``config``.

        Example:
            >>> Limits.from_config(Config(max_collectives=4))
            Limits(max_request_bytes=1073741824, max_inflight_bytes=4294967296, max_collectives=4)
        """
        return cls(config.max_request_bytes, config.max_inflight_bytes, config.max_collectives)

    def check_request(self, size: int, method: str) -> None:
        """Refuses a request whose serialized size is over ``--max-request-bytes``.

        Example:
            >>> Limits(max_request_bytes=100).check_request(150, "/x.Y/Z")
            Traceback (most recent call last):
            ...
            xreduced.admission.LimitExceeded: /x.Y/Z: request of 150 bytes is over --max-request-bytes 100
        """
        limit = self.max_request_bytes
        if limit is not None and size > limit:
            raise LimitExceeded(f"{method}: request of {size} bytes is over --max-request-bytes {limit}",
                                "max_request_bytes")


class InflightBytes:
    """Bytes of the requests being served; reserving past the limit fails at once.

    Example:
        >>> b = InflightBytes(100)
        >>> b.reserve(60)
        >>> b.reserve(50)
        Traceback (most recent call last):
        ...
        xreduced.admission.LimitExceeded: request of 50 bytes would bring in-flight bytes to 110,
        over --max-inflight-bytes 100 (60 in flight now)
        >>> b.release(60); b.value
        0
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        """The bytes held now.

        Example:
            >>> b = InflightBytes()
            >>> b.reserve(60); b.value
            60
        """
        return self._value

    def reserve(self, n: int, request_bytes: int | None = None) -> None:
        """Adds ``n`` bytes, or raises LimitExceeded (and adds nothing).

        Args:
            n: the bytes to hold.
            request_bytes: the serialized request ``n`` was estimated from, for
                the message; None when ``n`` is the request itself.

        Example:
            >>> InflightBytes(1000).reserve(1200, request_bytes=100)
            Traceback (most recent call last):
            ...
            xreduced.admission.LimitExceeded: request of 100 bytes (working set 1200 bytes) would bring in-flight
            bytes to 1200, over --max-inflight-bytes 1000 (0 in flight now)
        """
        with self._lock:
            total = self._value + n
            if self.limit is not None and total > self.limit:
                what = f"request of {n} bytes" if request_bytes is None else (
                    f"request of {request_bytes} bytes (working set {n} bytes)")
                raise LimitExceeded(
                    f"{what} would bring in-flight bytes to {total}, over --max-inflight-bytes "
                    f"{self.limit} ({self._value} in flight now)", "max_inflight_bytes")
            self._value = total

    def release(self, n: int) -> None:
        """Gives back ``n`` bytes that :meth:`reserve` added.

        Example:
            >>> b = InflightBytes(100)
            >>> b.reserve(60); b.release(60); b.value
            0
        """
        with self._lock:
            self._value -= n

    @contextlib.contextmanager
    def held(self, n: int) -> Iterator[None]:
        """Reserves ``n`` bytes for the block; releases them however it ends.

        Example:
            >>> b = InflightBytes(100)
            >>> with b.held(60):
            ...     b.value
            60
            >>> b.value
            0
        """
        self.reserve(n)
        try:
            yield
        finally:
            self.release(n)


class CollectiveSlots:
    """Collectives with a participant in the daemon now, at most ``limit`` of them.

    Example:
        >>> slots = CollectiveSlots(1)
        >>> with slots.held("a", "collective 0"), slots.held("a", "collective 0"):
        ...     slots.open()
        1
        >>> with slots.held("a", "collective 0"), slots.held("b", "collective 1"):
        ...     pass
        Traceback (most recent call last):
        ...
        xreduced.admission.LimitExceeded: collective 1 would be the 2nd collective waiting at once,
        over --max-collectives 1
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._lock = threading.Lock()
        self._participants: collections.Counter[Hashable] = collections.Counter()

    def open(self) -> int:
        """Collectives with a participant in the daemon now.

        Example:
            >>> slots = CollectiveSlots()
            >>> slots.enter("a", "collective 0"); slots.enter("a", "collective 0"); slots.open()
            1
        """
        with self._lock:
            return len(self._participants)

    def enter(self, key: Hashable, label: str) -> None:
        """One more participant of collective ``key`` (named ``label`` in messages).

        Raises:
            LimitExceeded: ``key`` is not open yet and ``limit`` collectives are.

        Example:
            >>> slots = CollectiveSlots(1)
            >>> slots.enter("a", "collective 0")
            >>> slots.enter("b", "collective 1")
            Traceback (most recent call last):
            ...
            xreduced.admission.LimitExceeded: collective 1 would be the 2nd collective waiting at once,
            over --max-collectives 1
        """
        with self._lock:
            n = len(self._participants)
            if key not in self._participants and self.limit is not None and n >= self.limit:
                raise LimitExceeded(f"{label} would be the {_ordinal(n + 1)} collective waiting at once, over "
                                    f"--max-collectives {self.limit}", "max_collectives")
            self._participants[key] += 1

    def leave(self, key: Hashable) -> None:
        """One participant of ``key`` fewer.

        Example:
            >>> slots = CollectiveSlots(1)
            >>> slots.enter("a", "collective 0"); slots.leave("a"); slots.open()
            0
        """
        with self._lock:
            self._participants[key] -= 1
            if not self._participants[key]:
                del self._participants[key]

    @contextlib.contextmanager
    def held(self, key: Hashable, label: str) -> Iterator[None]:
        """One participant of collective ``key`` for the block; see :meth:`enter`.

        Example:
            >>> slots = CollectiveSlots(1)
            >>> with slots.held("a", "collective 0"):
            ...     slots.open()
            1
            >>> slots.open()
            0
        """
        self.enter(key, label)
        try:
            yield
        finally:
            self.leave(key)


WORKING_SETS_KEPT = 256
"""Request shapes whose working set :meth:`Admission.admit` remembers (all forgotten at once when full)."""


class Admission:
    """The daemon's limits and what counts against them: the in-flight bytes and the open collectives.

    Example:
        >>> a = Admission(Limits(max_inflight_bytes=1000))
        >>> a.inflight.limit, a.collectives.limit
        (1000, None)
    """

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.inflight = InflightBytes(self.limits.max_inflight_bytes)
        self.collectives = CollectiveSlots(self.limits.max_collectives)
        self._working_sets: dict[tuple[bytes, int], int] = {}
        """Working sets by request shape and size, for the shapes seen lately."""

    @classmethod
    def from_config(cls, config: Config) -> Admission:
        """The admission of a daemon configured by ``config``.

        Example:
            >>> Admission.from_config(Config(max_inflight_bytes=1 << 20)).inflight.limit
            1048576
        """
        return cls(Limits.from_config(config))

    def check_request(self, size: int, method: str) -> None:
        """Refuses a request of ``size`` serialized bytes over ``--max-request-bytes`` (see :class:`Limits`).

        Example:
            >>> Admission(Limits(max_request_bytes=100)).check_request(101, "/xreduce.v1.CrossDeviceOps/Reduce")
            Traceback (most recent call last):
            ...
            xreduced.admission.LimitExceeded: /xreduce.v1.CrossDeviceOps/Reduce: request of 101 bytes is over
            --max-request-bytes 100
        """
        self.limits.check_request(size, method)

    def admit(self, request, size: int, shape: bytes | None = None) -> int:
        """Reserves a call's working set (:func:`working_set` of ``request``, ``size``
        serialized bytes) in the in-flight budget; returns the bytes to :meth:`release`
        once its reply is serialized. A request with a ``shape`` (:func:`xreduced.prepared.shape_of`)
        seen before reuses its working set: it depends on the shape and the size alone.

        Raises:
            LimitExceeded: over ``--max-inflight-bytes``; nothing is reserved.

        Example:
            >>> a = Admission()
            >>> held = a.admit(pb.ListDevicesRequest(), 100)
            >>> a.inflight.value
            200
            >>> a.release(held); a.inflight.value
            0
        """
        n = None if shape is None else self._working_sets.get((shape, size))
        if n is None:
            n = working_set(request, size)
            if shape is not None:
                if len(self._working_sets) >= WORKING_SETS_KEPT:
                    self._working_sets.clear()
                self._working_sets[(shape, size)] = n
        self.inflight.reserve(n, size)
        return n

    def release(self, n: int) -> None:
        """Gives back ``n`` bytes :meth:`admit` reserved.

        Example:
            >>> a = Admission()
            >>> held = a.admit(pb.ListDevicesRequest(), 50)
            >>> a.release(held); a.inflight.value
            0
        """
        self.inflight.release(n)


def _ordinal(n: int) -> str:
    """Example:
    >>> [_ordinal(i) for i in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)]
    ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '22nd', '101st']
    """
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def working_set(request, size: int) -> int:
    """The bytes a call is estimated to hold from admission until its reply is
    serialized: ``REQUEST_FACTOR * size + REPLY_FACTOR * reply_bytes(request, size)``.

    Example:
        >>> import numpy as np
        >>> t = codec.encode(np.ones(256, np.float32))  # 1 KiB a replica
        >>> r = pb.ReduceRequest(value=pb.DistributedValue(components=[pb.Component(tensor=t)] * 4))
        >>> r.ByteSize(), reply_bytes(r, r.ByteSize()), working_set(r, r.ByteSize())
        (4159, 4096, 24702)
    """
    return REQUEST_FACTOR * size + REPLY_FACTOR * reply_bytes(request, size)


def reply_bytes(request, size: int) -> int:
    """Result bytes the reply to ``request`` (of ``size`` serialized bytes) will
    carry, from the request alone: per value, one replica's bytes (in the
    result's dtype) for every destination; none when results go to a region
    (``output``) or the method returns no tensors.

    A tensor's bytes come from its dtype and shape, capped by the data the
    request can hold (``size``, or the region slice it names), so an invalid
    shape is refused by validation, not by this estimate. Typed values count 10
    bytes an element (16 for complex). A collective's process that sends no
    broadcast tensor counts none (its size is not known before the others come).

    Example:
        >>> import numpy as np
        >>> b = pb.BroadcastRequest(tensor=codec.encode(np.ones(8, np.int16)), destinations=["CPU:0", "CPU:1"])
        >>> reply_bytes(b, b.ByteSize())
        32
    """
    kind = type(request)
    if kind is pb.BatchReduceRequest:
        if request.HasField("output"):
            return 0
        pairs = [(p.value, p.destinations) for p in request.pairs]
    elif kind is pb.ReduceRequest:
        if request.HasField("output"):
            return 0
        pairs = [(request.value, request.destinations)]
    elif kind is pb.BroadcastRequest:
        if request.HasField("output") or not request.HasField("tensor"):
            return 0
        return _tensor_bytes(request.tensor, False, size) * len(request.destinations)
    else:
        return 0
    mean = request.reduce_op == pb.REDUCE_OP_MEAN
    total = most = 0
    for value, destinations in pairs:
        if value.components:
            copies = len(destinations) or len(value.components)
            most = max(most, copies)
            total += _tensor_bytes(value.components[0].tensor, mean, size) * copies
    # The values' data share the request's bytes: the results can be no more than all of it, promoted
    # (at most 4x, int16 to float64... or 10 bytes an element typed), on every destination.
    return min(total, 10 * size * most)


def _tensor_bytes(tensor, mean: bool, size: int) -> int:
    try:
        dtype = codec.numpy_dtype(tensor.dtype)
    except codec.CodecError:
        return 0  # refused when it is decoded
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        return 0
    elements = math.prod(shape)
    out = mean_dtype(dtype) if mean else dtype
    if len(tensor.float_values) or len(tensor.int_values) or len(tensor.uint_values):
        return min(elements, size) * (16 if dtype.kind == "c" else 10)
    cap = tensor.region.byte_size if tensor.HasField("region") else size
    return min(elements, max(cap, 0) // dtype.itemsize) * out.itemsize
