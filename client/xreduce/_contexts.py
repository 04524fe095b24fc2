"""Where code runs (TF's ``distribute_lib`` contexts): the default strategy, a strategy's
cross-replica context, a replica's context and its collectives.

Each thread has a stack of modes, ``(strategy, replica context or None)``:
empty, it is the default strategy's replica 0 of 1; ``strategy.scope()`` and a
merge function push a cross-replica mode (no replica context); a replica thread
of ``run`` starts in its replica's mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from xreduce._ops import CommunicationOptions, ReduceOp, _mean
from xreduce._replicas import Meeting, Merge, flatten, pack_as

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class _Mode:
    strategy: Any
    replica: ReplicaContext | None


def _modes() -> list[_Mode]:
    if not hasattr(_state, "modes"):
        _state.modes = []
    return _state.modes


def _current() -> _Mode:
    modes = _modes()
    return modes[-1] if modes else _Mode(_DEFAULT_STRATEGY, _DEFAULT_REPLICA)


@contextlib.contextmanager
def entered(strategy: Any, replica: ReplicaContext | None) -> Iterator[None]:
    """This thread runs in ``strategy``'s replica context ``replica`` (None: cross-replica) inside the block.

    Example:
        >>> with entered(_DEFAULT_STRATEGY, None):
        ...     in_cross_replica_context()
        True
    """
    modes = _modes()
    modes.append(_Mode(strategy, replica))
    try:
        yield
    finally:
        modes.pop()


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the code running now (TF's ``tf.distribute.get_replica_context``).

    Inside ``strategy.run``, the replica's; outside any strategy, the default
    strategy's replica 0 of 1; None in cross-replica context (inside
    ``strategy.scope()`` or a ``merge_call``'s function).

    Example:
        >>> get_replica_context().num_replicas_in_sync
        1
        >>> with get_strategy().scope():
        ...     get_replica_context() is None
        True
    """
    return _current().replica


def get_strategy() -> Any:
    """The strategy of the code running now: the one whose ``scope()`` or ``run`` it is in,
    else the default strategy (one replica, this process; TF's ``tf.distribute.get_strategy``).

    Example:
        >>> s = get_strategy()
        >>> s.num_replicas_in_sync, has_strategy()
        (1, False)
    """
    return _current().strategy


def has_strategy() -> bool:
    """Whether code runs under a strategy other than the default one.

    Example:
        >>> has_strategy()
        False
    """
    return get_strategy() is not _DEFAULT_STRATEGY


def in_cross_replica_context() -> bool:
    """Whether code runs in a cross-replica context: inside ``strategy.scope()`` or a
    ``merge_call``'s function, not inside ``run`` (TF's ``tf.distribute.in_cross_replica_context``).

    Example:
        >>> in_cross_replica_context()
        False
        >>> with get_strategy().scope():
        ...     in_cross_replica_context()
        True
    """
    return _current().replica is None


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What ``experimental_distribute_values_from_function`` passes to its function.

    Example:
        >>> ValueContext(0, 2).num_replicas_in_sync
        2
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def in_replica_context_of_a_strategy() -> bool:
    """Whether code runs inside a strategy's ``run`` (not the default strategy's replica):
    where TF refuses the methods that need cross-replica or default context.

    Example:
        >>> in_replica_context_of_a_strategy()
        False
    """
    return _current().replica not in (None, _DEFAULT_REPLICA)


def _is_sparse(value: Any) -> bool:
    """TF's ``IndexedSlices`` and its twins: rows, their indices, the dense shape."""
    return all(hasattr(value, a) for a in ("values", "indices", "dense_shape"))


class ReplicaContext:
    """Where a replica function runs, and its collectives (TF's ``tf.distribute.ReplicaContext``).

    ``get_replica_context()`` returns it inside ``strategy.run``. Its collectives meet every
    replica of the step, in this process and the others of a multi-process job: every replica
    must make the same collective calls in the same order.

    Args:
        strategy: the strategy the replica runs under.
        replica_id_in_sync_group: the replica's global id.
        num_replicas_in_sync: the replicas of all processes.

    Example:
        >>> import numpy as np, xreduce
        >>> from xreduce.distribute import MirroredStrategy
        >>> with xreduce.serve_embedded(virtual_devices=2):
        ...     s = MirroredStrategy()
        ...     out = s.run(lambda: get_replica_context().all_reduce("sum", np.float32(1.0)))
        ...     s.experimental_local_results(out)
        (array(2., dtype=float32), array(2., dtype=float32))
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: int, num_replicas_in_sync: int = 1, *,
                 _meeting: Meeting | None = None, _local_index: int = 0):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._num_replicas = num_replicas_in_sync
        self._meeting = _meeting
        self._local_index = _local_index

    @property
    def strategy(self) -> Any:
        """The strategy this replica runs under."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica's global id: among every process's replicas, in process order."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas of every process."""
        return self._num_replicas

    def merge_call(self, merge_fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once for all local replicas, in
        cross-replica context, and returns each replica its part of the result.

        Each argument is regrouped over the replicas: a ``PerReplica`` of the replicas'
        values (one object that every replica passes stays itself). A ``PerReplica`` or
        ``Mirrored`` result gives each replica its own value; anything else is returned as is.

        Raises:
            RuntimeError: called in cross-replica context or from another replica's thread;
                the replicas did not all call it (see :mod:`xreduce._replicas`).

        Example:
            >>> import xreduce
            >>> from xreduce.distribute import MirroredStrategy
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     def fn():
            ...         ctx = get_replica_context()
            ...         return ctx.merge_call(lambda strategy, v: len(v.values), args=(ctx.replica_id_in_sync_group,))
            ...     s.run(fn)
            2
        """
        return self._merge(Merge("merge_call", merge_fn, tuple(args), dict(kwargs or {})))

    def _merge(self, merge: Merge) -> Any:
        if get_replica_context() is not self:
            raise RuntimeError(f"{merge.name} must be called in the replica context it belongs to (inside the "
                               "function given to strategy.run), not in cross-replica context or another replica")
        if self._meeting is None:
            with entered(self._strategy, None):
                return merge.fn(self._strategy, *merge.args, **merge.kwargs)
        # The calling thread of ``run`` runs it, already in cross-replica context.
        bound = dataclasses.replace(merge, fn=functools.partial(merge.fn, self._strategy))
        return self._meeting.merge_call(self._local_index, bound)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        """Reduces ``value`` (an array, or a nest of them in lists, tuples and dicts) over every
        replica; each replica gets the result (TF's ``ReplicaContext.all_reduce``).

        Every leaf goes to ``strategy.extended.batch_reduce_to`` in one call, destined to the
        replicas' own devices, so the strategy's cross-device ops decide how (sparse values too).

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.distribute import MirroredStrategy
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     def fn():
            ...         i = get_replica_context().replica_id_in_sync_group
            ...         return get_replica_context().all_reduce("mean", {"w": np.array([i, 2.0 * i])})
            ...     s.experimental_local_results(s.run(fn)["w"])
            (array([0.5, 1. ]), array([0.5, 1. ]))
        """
        op = ReduceOp.from_value(reduce_op)
        leaves = flatten(value)
        if not leaves:
            return value

        def batch_all_reduce(strategy: Any, *values: Any) -> list[Any]:
            return strategy.extended.batch_reduce_to(op, [(v, v) for v in values], options)

        return pack_as(value, self._merge(Merge("all_reduce", batch_all_reduce, tuple(leaves), {}, always_wrap=True)))

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis``, in replica id order, over
        every process; each replica gets the result (TF's ``ReplicaContext.all_gather``).

        ``value`` may be a nest of arrays; sizes along ``axis`` may differ between replicas,
        the other dimensions may not.

        Raises:
            NotImplementedError: a sparse value, as TF.
            ValueError: ``axis`` out of range, or replicas' shapes that differ off ``axis``.

        Example:
            >>> import numpy as np, xreduce
            >>> from xreduce.distribute import MirroredStrategy
            >>> with xreduce.serve_embedded(virtual_devices=2):
            ...     s = MirroredStrategy()
            ...     out = s.run(lambda: get_replica_context().all_gather(
            ...         np.full((1, 2), get_replica_context().replica_id_in_sync_group), axis=0))
            ...     s.experimental_local_results(out)[0]
            array([[0, 0],
                   [1, 1]])
        """
        leaves = flatten(value)
        if any(_is_sparse(v) for v in leaves):
            raise NotImplementedError("all_gather does not support IndexedSlices")
        if not leaves:
            return value

        def batch_all_gather(strategy: Any, *values: Any) -> list[Any]:
            return strategy.extended._batch_gather_to([(v, v) for v in values], axis, options)

        return pack_as(value, self._merge(Merge("all_gather", batch_all_gather, tuple(leaves), {}, always_wrap=True)))

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self._num_replicas})")


class _DefaultExtended:
    """``get_strategy().extended`` outside any strategy: one replica, no communication (TF's)."""

    def __init__(self, strategy: DefaultStrategy):
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Raises RuntimeError, as TF's default strategy does."""
        raise RuntimeError("worker_devices() method unsupported by default tf.distribute.Strategy.")

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """``value``: one replica has nothing to combine."""
        ReduceOp.from_value(reduce_op)
        return value

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None) -> list[Any]:
        """Each pair's value."""
        ReduceOp.from_value(reduce_op)
        return [v for v, _ in value_destination_pairs]

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """``tensor``: this process's one device already holds it."""
        return tensor

    def _batch_gather_to(self, pairs: Any, axis: int, options: CommunicationOptions | None = None) -> list[Any]:
        return [v for v, _ in pairs]


class DefaultStrategy:
    """The strategy outside any ``scope()``: one replica in this process, nothing to
    communicate (TF's default ``tf.distribute.Strategy``). ``get_strategy()`` returns it.

    Example:
        >>> s = get_strategy()
        >>> s.run(lambda x: x + get_replica_context().replica_id_in_sync_group, args=(41,))
        41
        >>> s.reduce("sum", 3.0, axis=None), s.experimental_local_results(3.0)
        (3.0, (3.0,))
    """

    num_replicas_in_sync = 1

    def __init__(self) -> None:
        self.extended = _DefaultExtended(self)

    @contextlib.contextmanager
    def scope(self) -> Iterator[DefaultStrategy]:
        """Cross-replica context of the default strategy inside the block."""
        with entered(self, None):
            yield self

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """``fn(*args, **kwargs)`` as replica 0 of 1."""
        with entered(self, _DEFAULT_REPLICA):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """``value``, summed (or averaged, as ``MirroredStrategy.reduce`` does) along ``axis`` if given."""
        op = ReduceOp.from_value(reduce_op)
        if axis is None:
            return value
        array = np.asarray(value)
        total = np.sum(array, axis=axis)
        if op is ReduceOp.SUM:
            return total
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        return _mean(np.asarray(total), int(np.prod([array.shape[a] for a in axes])))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """``(value,)``."""
        return (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """``value``: one replica's values are all there is."""
        return value

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """``value_fn(ValueContext())``, replica 0 of 1."""
        return value_fn(ValueContext())

    def __repr__(self) -> str:
        return "<default tf.distribute.Strategy: one replica>"


_DEFAULT_STRATEGY = DefaultStrategy()
_DEFAULT_REPLICA = ReplicaContext(_DEFAULT_STRATEGY, 0, 1)

