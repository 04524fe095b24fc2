"""Request shapes the service has validated, remembered: a training loop sends the same small call every step.

A ``Reduce`` or ``BatchReduce`` request is validated field by field (:mod:`xreduced.decode`,
:meth:`~xreduced.engine.Engine.validate`): devices resolved, dtypes and shapes checked, options
looked up. All of that depends only on the request's *shape*, everything in it but the tensors'
bytes and the collective's sequence number. :class:`PreparedCalls` keeps, for the shapes of
small requests (at most :data:`PREPARED_MAX_BYTES`) whose tensors are raw bytes in the message,
what validation found; a later request of the same shape (the same bytes once its ``raw_data``
and ``collective.sequence`` are cleared) skips straight to decoding its tensors' bytes.

Nothing is trusted that was not checked: the shape is compared byte for byte, and each tensor's
byte count is checked against its dtype and shape as :func:`xreduce.wire.codec.decode` does
(with the same error). Requests with typed values, regions, sparse values or an ``output`` are
never remembered: they take the full path every time.

Example:
    >>> import numpy as np
    >>> from xreduce.wire import codec
    >>> from xreduced.backends import DeviceInfo
    >>> from xreduced.devices import DeviceTable
    >>> from xreduced.engine import Value
    >>> table = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(2)])
    >>> def request(x):
    ...     value = pb.DistributedValue(components=[pb.Component(device="CPU:0", tensor=codec.encode(x))])
    ...     return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value)
    >>> calls = PreparedCalls()
    >>> key = shape_of(request(np.float32([1, 2])), 100)
    >>> calls.get(key) is None
    True
    >>> value = Value((0,), (np.float32([1, 2]),), "value")
    >>> calls.remember(key, "SUM", 1, "hierarchical_copy", None, [(value, ())], [(value, (0,))], ["destinations"])
    >>> pairs, resolved = calls.get(shape_of(request(np.float32([3, 4])), 100)).decode(request(np.float32([3, 4])))
    >>> resolved[0][0].arrays[0], resolved[0][1]
    (array([3., 4.], dtype=float32), (0,))
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec

from xreduced.engine import Value

PREPARED_MAX_BYTES = 64 << 10
"""Requests up to this size are looked up (copying one to find its shape costs little); larger ones take the
full path, whose cost their data dwarfs anyway."""

PREPARED_KEPT = 256
"""Shapes remembered; the least recently used is forgotten first."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MAX_KEY_BYTES = 4096
"""A shape this long (many pairs or components) is not remembered: the memory stays under a megabyte."""

SHAPED_METHODS = ("/xreduce.v1.CrossDeviceOps/Reduce", "/xreduce.v1.CrossDeviceOps/BatchReduce")
"""The methods whose requests have a shape (:func:`shape_of`)."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    little: np.dtype
    """The dtype as the wire holds it (little-endian)."""
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    field: str


@dataclasses.dataclass(frozen=True)
class _Pair:
    devices: tuple[int, ...]
    destinations: tuple[int, ...]
    """As the request names them (empty: the value's devices)."""
    resolved: tuple[int, ...]
    """The destinations, empty replaced by the value's devices."""
    field: str
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    tensors: tuple[_Tensor, ...]


class Prepared:
    """What validating one request shape found: the op, the options, each pair's devices, dtypes and shapes."""

    def __init__(self, op: str, num_packs: int, algorithm: str, reduce_to: int | None, pairs: Sequence[_Pair],
                 dest_fields: Sequence[str]):
        self.op = op
        self.num_packs = num_packs
        self.algorithm = algorithm
        self.reduce_to = reduce_to
        self.pairs = tuple(pairs)
        self.dest_fields = list(dest_fields)

    def decode(self, request) -> tuple[list[tuple[Value, tuple[int, ...]]], list[tuple[Value, tuple[int, ...]]]]:
        """(pairs as the request names their destinations, pairs with destinations resolved) of a request of
        this shape, its tensors decoded from their bytes.

        Raises:
            xreduce.wire.codec.CodecError: a tensor's bytes do not match its dtype and shape (as
                :func:`~xreduce.wire.codec.decode` says it).
        """
        pairs, resolved = [], []
        for arrays, pair in zip(self.arrays(request), self.pairs):
            value = Value(pair.devices, arrays, pair.field, pair.parts)
            pairs.append((value, pair.destinations))
            resolved.append((value, pair.resolved))
        return pairs, resolved

    def arrays(self, request) -> list[tuple[np.ndarray, ...]]:
        """Each pair's component arrays of a request of this shape, decoded from their bytes (see :meth:`decode`).

        Raises:
            xreduce.wire.codec.CodecError: a tensor's bytes do not match its dtype and shape.
        """
        values = [request.value] if type(request) is pb.ReduceRequest else [p.value for p in request.pairs]
        out = []
        for message, pair in zip(values, self.pairs):
            arrays = []
            for component, tensor in zip(message.components, pair.tensors):
                raw = component.tensor.raw_data
                if len(raw) != tensor.nbytes:
                    codec.decode(component.tensor, tensor.field)  # raises, naming the field
                array = np.frombuffer(raw, tensor.little)
                if tensor.little is not tensor.dtype:
                    array = array.astype(tensor.dtype)
                arrays.append(array.reshape(tensor.shape))
            out.append(tuple(arrays))
        return out


def shape_of(request, size: int) -> bytes | None:
    """The shape of a ``Reduce`` or ``BatchReduce`` request of ``size`` serialized bytes: the request with its
    tensors' ``raw_data`` and its ``collective.sequence`` cleared, serialized; None when requests like it are
    never remembered (too large, an ``output``, a tensor with typed values or a region, a sparse value).

    Example:
        >>> import numpy as np
        >>> from xreduce.wire import codec
        >>> def request(x, sequence):
        ...     value = pb.DistributedValue(components=[pb.Component(device="CPU:0", tensor=codec.encode(x))])
        ...     return pb.ReduceRequest(value=value, collective=pb.CollectiveSpec(group="g", sequence=sequence))
        >>> shape_of(request(np.float32([1]), 1), 50) == shape_of(request(np.float32([2]), 2), 50)
        True
        >>> shape_of(request(np.float64([1]), 1), 50) == shape_of(request(np.float32([2]), 2), 50)
        False
        >>> shape_of(pb.ReduceRequest(output=pb.RegionSlice(name="out")), 10) is None
        True
    """
    if size > PREPARED_MAX_BYTES or request.HasField("output"):
        return None
    shape = type(request)()
    shape.CopyFrom(request)
    if shape.HasField("collective"):
        shape.collective.ClearField("sequence")
    for value in [shape.value] if type(shape) is pb.ReduceRequest else [p.value for p in shape.pairs]:
        for component in value.components:
            tensor = component.tensor
            if (component.HasField("indexed_slices") or tensor.HasField("region") or tensor.float_values
                    or tensor.int_values or tensor.uint_values):
                return None
            tensor.ClearField("raw_data")
    key = shape.DESCRIPTOR.name.encode() + b":" + shape.SerializeToString(deterministic=True)
    return key if len(key) <= _MAX_KEY_BYTES else None


class Recent(Generic[K, V]):
    """A map shared by threads that keeps at most ``kept`` keys, the least recently used forgotten first.

    Example:
        >>> recent = Recent(2)
        >>> recent.put("a", 1); recent.put("b", 2); recent.get("a"); recent.put("c", 3)
        1
        >>> recent.get("b") is None, len(recent)
        (True, 2)
    """

    def __init__(self, kept: int):
        self._kept = kept
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        """Keeps ``value`` for ``key``, forgetting the least recently used keys over ``kept``."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._kept:
                self._items.popitem(last=False)


class PreparedCalls:
    """The shapes remembered, shared by the service's threads.

    Example:
        >>> len(PreparedCalls())
        0
    """

    def __init__(self, kept: int = PREPARED_KEPT):
        self._shapes: Recent[bytes, Prepared] = Recent(kept)

    def __len__(self) -> int:
        return len(self._shapes)

    def get(self, key: bytes | None) -> Prepared | None:
        """What validating requests of shape ``key`` found, or None."""
        return None if key is None else self._shapes.get(key)

    def remember(self, key: bytes | None, op: str, num_packs: int, algorithm: str, reduce_to: int | None,
                 pairs: Sequence[tuple[Value, tuple[int, ...]]], resolved: Sequence[tuple[Value, tuple[int, ...]]],
                 dest_fields: Sequence[str]) -> None:
        """Keeps what validating a request of shape ``key`` found: its op and options, and its pairs as
        decoded (``pairs``) and validated (``resolved``)."""
        if key is None:
            return
        prepared_pairs = []
        for (value, destinations), (_, resolved_dests) in zip(pairs, resolved):
            tensors = []
            for p, array in enumerate(value.arrays):
                if not isinstance(array, np.ndarray):
                    return  # sparse: never remembered
                dtype = array.dtype
                little = codec.little_endian(dtype)
                tensors.append(_Tensor(dtype if little == dtype else little, dtype, array.shape, array.nbytes,
                                       f"{value.field}.components[{p}].tensor"))
            prepared_pairs.append(_Pair(value.devices, tuple(destinations), tuple(resolved_dests), value.field,
                                        value.parts, tuple(tensors)))
        self._shapes.put(key, Prepared(op, num_packs, algorithm, reduce_to, prepared_pairs, dest_fields))
