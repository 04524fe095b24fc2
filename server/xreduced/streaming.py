"""ReduceStream: BatchReduce for payloads of any size, received, reduced and answered in chunks.

The first request message is a header (a ``BatchReduceRequest`` whose tensors
say ``streamed: true`` and carry no data); then come ``TensorChunk`` messages,
which error messages number from 0 ("chunk 17"). Each tensor's chunks arrive
in offset order, without gaps or overlaps, in whole elements.

Numbers do not depend on how elements are packed or split into ranges
(DESIGN.md §3: each element is ``fold(x[0:G]) + fold(x[G:N])`` or a left fold,
MEAN divides elementwise), so a pair is reduced range by range: as soon as
every component of a pair has delivered the bytes of a range, the range is
reduced by the engine (1-D slices, same op, algorithm and ``reduce_to``) and
its result leaves as chunks, while the next range is still arriving. The
reply is a ``BatchReduceResponse`` header (routes, devices, dtypes, shapes;
components after the first carry ``copy_of: 0``, since every result is
mirrored, so one component's data travels per pair) and then the chunks of
each result's first component.

Memory stays bounded: a thread receives messages into a short queue (gRPC's
flow control stops the client when it is full), and only the bytes not yet
reducible are buffered. Received bytes count against ``--max-inflight-bytes``
until their range is reduced; a stream that would go over it (e.g. one that
sends a component entirely before the others) gets RESOURCE_EXHAUSTED.
``--max-request-bytes`` does not apply: each message is bounded by
``--max-message-bytes``, the whole stream by the in-flight budget.

Limitations: a multi-process ``collective`` is refused (multi-process callers
use BatchReduce or shared memory), and so is an ``output`` region. The wait for
each message is bounded by the header's ``timeout`` and the call's deadline,
or, with neither, by ``--collective-timeout`` per message.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.contract import method_path
from xreduce.wire.framing import CHUNK_OVERHEAD_BYTES, REPLY_CHUNK_BYTES

from xreduced import decode, planner
from xreduced.admission import InflightBytes, LimitExceeded
from xreduced.deadline import Deadline
from xreduced.engine import Value, result_dtype
from xreduced.errors import DeadlineExceeded, InvalidArgument, ServiceError

METHOD = method_path("ReduceStream")

INBOX_MESSAGES = 4
"""Received messages waiting for the reducer, at most; then the receiver stops reading."""


class _Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


@dataclasses.dataclass
class _Input:
    """One streamed component of a request pair: what arrived and is not reduced yet."""

    field: str
    dtype: np.dtype
    nbytes: int
    received: int = 0
    pieces: collections.deque = dataclasses.field(default_factory=collections.deque)

    def take(self, n: int) -> memoryview | bytes:
        """The next ``n`` buffered bytes (joined only when they span several chunks)."""
        parts, left = [], n
        while left:
            head = self.pieces[0]
            if len(head) <= left:
                parts.append(self.pieces.popleft())
                left -= len(head)
            else:
                parts.append(head[:left])
                self.pieces[0] = head[left:]
                left = 0
        return parts[0] if len(parts) == 1 else b"".join(parts)


@dataclasses.dataclass
class _Pair:
    """One pair of the header, validated, with what the reply will hold."""

    inputs: list[_Input]
    order: tuple[int, ...]
    """Components in the order the batch folds them (the engine's device order)."""
    devices: tuple[int, ...]
    destinations: tuple[int, ...]
    out_dtype: np.dtype
    done: int = 0
    """Elements reduced and answered so far."""


class _Inbox:
    """A bounded queue from the receiving thread to the reducing one; closing it frees both."""

    def __init__(self, capacity: int):
        self._items: collections.deque = collections.deque()
        self._capacity = capacity
        self._cond = threading.Condition()
        self._consumer_waiting = False
        self.closed = False

    def put(self, item) -> bool:
        """Waits for room; False once the inbox is closed."""
        with self._cond:
            while len(self._items) >= self._capacity and not self.closed:
                self._cond.wait()
            if self.closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None):
        """The next item; raises TimeoutError after ``timeout`` seconds without one."""
        with self._cond:
            self._consumer_waiting = True
            self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: self._items, timeout):
                    raise TimeoutError
            finally:
                self._consumer_waiting = False
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def wait_drained(self) -> None:
        """Waits until the consumer has taken every item and asks for the next (or the inbox closes)."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or (not self._items and self._consumer_waiting))

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


_END = object()


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A received ``TensorChunk``; ``data`` read out of the message once."""

    pair: int
    component: int
    offset: int
    data: bytes


@dataclasses.dataclass
class _Failed:
    error: BaseException


class _Receiver:
    """Reads the request stream in its own thread, reserving each chunk's bytes as it arrives."""

    def __init__(self, inflight: InflightBytes, request_iterator):
        self.inflight = inflight
        self.inbox = _Inbox(INBOX_MESSAGES)
        self._held = 0
        self._closed = False
        self._lock = threading.Lock()
        self._iterator = request_iterator
        self._thread = threading.Thread(target=self._run, name="xreduced-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        chunks = 0
        try:
            for message in self._iterator:
                if message.WhichOneof("kind") == "chunk":
                    c = message.chunk
                    message = _Chunk(c.pair, c.component, c.offset, c.data)
                    self._hold(len(message.data), f"chunk {chunks} (pairs[{c.pair}].value.components[{c.component}])")
                    chunks += 1
                if not self.inbox.put(message):
                    return
            self.inbox.put(_END)
        except grpc.RpcError:
            self.inbox.put(_Failed(_Cancelled("the client cancelled the stream")))
        except Exception as e:  # handed to the reducing thread, which answers with it
            self.inbox.put(_Failed(e))

    def _hold(self, n: int, what: str) -> None:
        """Counts ``n`` received bytes in the in-flight budget until they are reduced.

        When the budget is full, what this stream holds may only be waiting for
        the reducer: once it has taken everything, the stream holds just the
        bytes it cannot reduce yet, and one more try decides.
        """
        for last in (False, True):
            with self._lock:
                if self._closed:  # the call ended: nothing would release them
                    return
                try:
                    self.inflight.reserve(n)
                    self._held += n
                    return
                except LimitExceeded as e:
                    if last:
                        now = self.inflight.value
                        raise LimitExceeded(
                            f"{what}: its {n} bytes would bring in-flight bytes to {now + n}, over "
                            f"--max-inflight-bytes {self.inflight.limit} ({now} in flight now, {self._held} of them "
                            "this stream's, waiting for the other components of their ranges); send the components' "
                            "chunks interleaved", e.limit) from None
            self.inbox.wait_drained()

    def release(self, n: int) -> None:
        """``n`` buffered bytes were reduced."""
        with self._lock:
            self._held -= n
            self.inflight.release(n)

    def close(self) -> None:
        """Stops receiving and releases every byte still held."""
        self.inbox.close()
        with self._lock:
            self._closed = True
            self.inflight.release(self._held)
            self._held = 0


def reduce_stream(service, request_iterator, context) -> Iterator[pb.ReduceStreamResponse]:
    """Serves one ReduceStream call for ``service`` (a ``CrossDeviceOpsService``): its replies.

    The call pipeline answers its failures and counts and logs it, as it does
    every call's.

    Example:
        >>> from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
        >>> from xreduce.wire.framing import streamed_tensor
        >>> from xreduced.config import Config
        >>> from xreduced.server import Daemon
        >>> x = [np.arange(4, dtype="<i4"), np.arange(4, dtype="<i4") + 1]
        >>> header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN, pairs=[pb.ReducePair(
        ...     value=pb.DistributedValue(components=[
        ...         pb.Component(device=f"CPU:{i}", tensor=streamed_tensor(a)) for i, a in enumerate(x)]))])
        >>> requests = [pb.ReduceStreamRequest(header=header)] + [
        ...     pb.ReduceStreamRequest(chunk=pb.TensorChunk(component=i, data=a.tobytes())) for i, a in enumerate(x)]
        >>> daemon = Daemon(Config(listen="127.0.0.1:0", backend="numpy", virtual_devices=2)).start()
        >>> with grpc.insecure_channel(daemon.address) as channel:
        ...     replies = list(pb_grpc.CrossDeviceOpsStub(channel).ReduceStream(iter(requests)))
        >>> daemon.stop()
        >>> np.frombuffer(replies[1].chunk.data, "<f8")
        array([0.5, 1.5, 2.5, 3.5])
    """
    receiver = _Receiver(service.admission.inflight, request_iterator)
    try:
        yield from _Stream(service, context, receiver).replies()
    finally:
        receiver.close()


class _Stream:
    """One call's state: the validated header, what each input has received, what is answered."""

    def __init__(self, service, context, receiver: _Receiver):
        self.service = service
        self.engine = service.engine
        self.context = context
        self.receiver = receiver
        self.chunks = 0
        self.reduce_seconds = 0.0
        self.deadline = Deadline(decode.call_deadline(context))
        """The call's deadline until the header's ``timeout`` joins it."""

    def replies(self) -> Iterator[pb.ReduceStreamResponse]:
        """The reply messages."""
        header = self._next("the header")
        if header is _END:
            raise InvalidArgument("header: the stream ended before its header (a BatchReduceRequest)")
        if isinstance(header, _Chunk) or header.WhichOneof("kind") != "header":
            got = "chunk" if isinstance(header, _Chunk) else "a message with neither header nor chunk"
            raise InvalidArgument(f"header: the first message must be a header (a BatchReduceRequest); got {got}")
        yield pb.ReduceStreamResponse(header=self._accept(header.header))
        while True:
            message = self._next(f"chunk {self.chunks}")
            if message is _END:
                break
            if not isinstance(message, _Chunk):
                kind = message.WhichOneof("kind")
                what = "a second header" if kind == "header" else "a message with neither header nor chunk"
                raise InvalidArgument(f"chunk {self.chunks}: got {what}; after the header only chunks may follow")
            pair = self._receive(message)
            self.chunks += 1
            yield from self._reduce_ready(pair)
        for pair in self.pairs:
            for t in pair.inputs:
                if t.received != t.nbytes:
                    raise InvalidArgument(f"{t.field}: the stream ended after {t.received} of its {t.nbytes} bytes "
                                          f"({t.dtype.name}); every tensor must be sent whole")
        self.service.stats.observe_reduction(METHOD, self.reduce_seconds, self.replica_bytes)

    def _next(self, what: str):
        """The next message; bounded by the deadline, or by --collective-timeout without one."""
        left = self.deadline.remaining()
        try:
            item = self.receiver.inbox.get(self.service.collective_timeout if left is None else max(left, 0.0))
        except TimeoutError:
            if left is None:
                raise DeadlineExceeded(f"no message for {self.service.collective_timeout:g} s while waiting for "
                                       f"{what} (--collective-timeout bounds each wait of a stream without a "
                                       "timeout or deadline)") from None
            raise DeadlineExceeded(f"timed out after {self.deadline.seconds:g} s while waiting for {what}") from None
        if isinstance(item, _Failed):
            raise item.error
        return item

    def _accept(self, header: pb.BatchReduceRequest) -> pb.BatchReduceResponse:
        """Validates the header as BatchReduce would, and builds the reply's header."""
        service = self.service
        if decode.group(header) is not None:
            raise InvalidArgument(
                f"collective: ReduceStream serves one process; got a collective of {header.collective.num_processes} "
                "processes (multi-process callers use BatchReduce or shared memory)")
        if header.HasField("output"):
            raise InvalidArgument(f"output: ReduceStream answers in chunks; got an output region "
                                  f"{header.output.name!r} (use BatchReduce for that)")
        self.op = decode.op(header.reduce_op)
        deadline = decode.deadline(header, decode.call_deadline(self.context), None)
        options = decode.options(header, service.devices, deadline)
        self.deadline = options.deadline
        self.algorithm, self.reduce_to = options.algorithm, options.reduce_to
        dest_fields = [f"pairs[{i}].destinations" for i in range(len(header.pairs))]
        shaped, inputs = [], []
        for i, pair in enumerate(header.pairs):
            field = f"pairs[{i}].value"
            devices, views, ins = [], [], []
            for c, comp in enumerate(pair.value.components):
                devices.append(service.devices.resolve(comp.device, f"{field}.components[{c}].device"))
                if comp.HasField("indexed_slices"):
                    raise InvalidArgument(f"{field}.components[{c}].indexed_slices: ReduceStream carries dense "
                                          "tensors only; send sparse values with Reduce or BatchReduce")
                dtype, shape = decode.streamed(comp.tensor, f"{field}.components[{c}].tensor")
                try:
                    views.append(np.broadcast_to(np.zeros((), dtype), shape))  # the shape, without its memory
                except ValueError as e:  # e.g. a zero-size shape whose other dimensions overflow numpy's size type
                    raise InvalidArgument(f"{field}.components[{c}].tensor.shape: numpy cannot make an array of "
                                          f"shape {list(shape)} ({e})") from None
                ins.append(_Input(f"{field}.components[{c}]", dtype, math.prod(shape) * dtype.itemsize))
            shaped.append((Value(tuple(devices), tuple(views), field),
                           decode.devices(pair.destinations, dest_fields[i], service.devices)))
            inputs.append(ins)
        routes = self.engine.routes(self.op, shaped, algorithm=self.algorithm, num_packs=options.num_packs,
                                    dest_fields=dest_fields)
        folds = self.engine.fold_devices(shaped, algorithm=self.algorithm)
        self.pairs = []
        reply = pb.BatchReduceResponse()
        for (value, dests), ins, route, fold in zip(shaped, inputs, routes, folds):
            own = value.devices
            order = tuple(own.index(d) for d in fold)
            out_dtype = result_dtype(self.op, ins[0].dtype, route)
            self.pairs.append(_Pair(ins, order, fold, dests or own, out_dtype))
            result_devices = fold if route in (planner.HIERARCHICAL_COPY, planner.NCCL) else (dests or own)
            out = reply.results.add(route=decode.ROUTES[route])
            for k, d in enumerate(result_devices):
                comp = out.result.components.add(device=service.devices.canonical(d))
                comp.tensor.CopyFrom(pb.Tensor(dtype=codec.dtype_enum(out_dtype), shape=value.arrays[0].shape,
                                               streamed=True))
                if k:
                    comp.copy_of = 0
        self.replica_bytes = sum(p.inputs[0].nbytes for p in self.pairs)
        return reply

    def _receive(self, chunk: _Chunk) -> int:
        """Checks a chunk and buffers its bytes; returns its pair."""
        k = self.chunks
        if not 0 <= chunk.pair < len(self.pairs):
            raise InvalidArgument(f"chunk {k}: pair must be in [0, {len(self.pairs)}) (the header's pairs); "
                                  f"got {chunk.pair}")
        inputs = self.pairs[chunk.pair].inputs
        if not 0 <= chunk.component < len(inputs):
            raise InvalidArgument(f"chunk {k} (pairs[{chunk.pair}]): component must be in [0, {len(inputs)}) "
                                  f"(the pair's components); got {chunk.component}")
        t = inputs[chunk.component]
        n = len(chunk.data)
        if chunk.offset != t.received:
            raise InvalidArgument(f"chunk {k} ({t.field}): offset {chunk.offset} but {t.received} bytes were "
                                  "received; a tensor's chunks must arrive in order, without gaps or overlaps")
        if n % t.dtype.itemsize:
            raise InvalidArgument(f"chunk {k} ({t.field}): data of {n} bytes is not a whole number of "
                                  f"{t.dtype.name} elements ({t.dtype.itemsize} bytes each)")
        if chunk.offset + n > t.nbytes:
            raise InvalidArgument(f"chunk {k} ({t.field}): bytes [{chunk.offset}, {chunk.offset + n}) run past "
                                  f"the tensor's end at {t.nbytes} bytes")
        if n:
            t.pieces.append(memoryview(chunk.data))
            t.received += n
        return chunk.pair

    def _reduce_ready(self, p: int) -> Iterator[pb.ReduceStreamResponse]:
        """Reduces and answers the range every component of pair ``p`` has sent."""
        pair = self.pairs[p]
        ready = min(t.received // t.dtype.itemsize for t in pair.inputs)
        if ready <= pair.done:
            return
        lo, hi = pair.done, ready
        arrays = []
        for t in pair.inputs:
            data = t.take((hi - lo) * t.dtype.itemsize)
            arrays.append(np.frombuffer(data, t.dtype.newbyteorder("<")).astype(t.dtype, copy=False))
        value = Value(pair.devices, tuple(arrays[i] for i in pair.order), f"pairs[{p}].value")
        started = time.perf_counter()
        (result,) = self.engine.batch_reduce(self.op, [(value, pair.destinations)], num_packs=1,
                                             algorithm=self.algorithm, reduce_to=self.reduce_to,
                                             deadline=self.deadline)
        self.reduce_seconds += time.perf_counter() - started
        out = self.engine.backend.to_host(result.arrays[0])
        data = memoryview(out.astype(out.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8))
        self.receiver.release(sum(a.nbytes for a in arrays))
        pair.done = hi
        base = lo * pair.out_dtype.itemsize
        itemsize = pair.out_dtype.itemsize
        most = min(REPLY_CHUNK_BYTES, self.service.config.max_message_bytes - CHUNK_OVERHEAD_BYTES)
        step = max(1, most // itemsize) * itemsize
        for start in range(0, len(data), step):
            yield pb.ReduceStreamResponse(chunk=pb.TensorChunk(pair=p, offset=base + start,
                                                               data=bytes(data[start:start + step])))
