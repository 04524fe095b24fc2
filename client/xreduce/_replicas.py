"""The replica threads of ``MirroredStrategy.run`` and where they meet (TF's ``mirrored_run``).

Each local replica runs the replica function in a thread of its own, all at
once. A replica that calls ``merge_call`` (every collective of a
``ReplicaContext`` is one) pauses there; once every replica has paused, the
calling thread runs the merge function once, on the replicas' arguments
regrouped into ``PerReplica`` values, and hands each replica its part of the
result (:func:`select_replica`). Collectives across processes happen inside
the merge function, through the daemon, like any other call.

A run fails as a whole, and leaves no replica waiting:

* a replica raises: the run raises that exception (the first one raised);
  replicas paused in a ``merge_call`` are released (they stop there), and so
  is every replica that reaches one later;
* the merge function raises: the run raises that exception;
* some replicas return while others wait in a ``merge_call``, or replicas
  wait in different collectives: ``RuntimeError`` naming them;
* once a replica waits, every other must reach its ``merge_call`` within the
  meeting's timeout (the daemon's collective timeout):
  ``xreduce.DeadlineExceededError`` naming the replicas that did not.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from xreduce._errors import DeadlineExceededError
from xreduce._values import DistributedValues, PerReplica


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _rebuild(template: Any, items: Sequence[Any]) -> Any:
    """A tuple, namedtuple or list like ``template`` holding ``items``."""
    if _is_namedtuple(template):
        return type(template)(*items)
    return type(template)(items)


def select_replica(index: int, structure: Any) -> Any:
    """Replica ``index``'s part of ``structure``: each ``DistributedValues`` in it (lists,
    tuples, namedtuples and dicts are followed) becomes its ``values[index]``.

    Example:
        >>> select_replica(1, {"x": PerReplica([0, 1]), "y": (PerReplica([2, 3]), "same")})
        {'x': 1, 'y': (3, 'same')}
    """
    if isinstance(structure, DistributedValues):
        return structure.values[index]
    if isinstance(structure, (tuple, list)):
        return _rebuild(structure, [select_replica(index, s) for s in structure])
    if isinstance(structure, dict):
        return {k: select_replica(index, v) for k, v in structure.items()}
    return structure


def regroup(values: Sequence[Any], devices: Sequence[str], always_wrap: bool = False) -> Any:
    """One structure from each replica's: leaves become ``PerReplica`` values on ``devices``
    (TF's ``regroup``). A leaf that is the same object on every replica stays itself, unless
    ``always_wrap``; so does a single replica's.

    Raises:
        ValueError: the replicas' structures differ (TF asserts), naming the replica.

    Example:
        >>> out = regroup([(1, "a"), (2, "a")], ["CPU:0", "CPU:1"])
        >>> out[0].values, out[1]
        ((1, 2), 'a')
    """
    first = values[0]
    if isinstance(first, (tuple, list)) or isinstance(first, dict):
        for i, v in enumerate(values[1:], start=1):
            if type(v) is not type(first) or len(v) != len(first) or (
                    isinstance(first, dict) and set(v) != set(first)):
                raise ValueError(f"replica {i} gave {_shape_of(v)} but replica 0 gave {_shape_of(first)}; every "
                                 "replica must return (and pass to merge_call) the same structure")
        if isinstance(first, dict):
            return {k: regroup([v[k] for v in values], devices, always_wrap) for k in first}
        return _rebuild(first, [regroup([v[j] for v in values], devices, always_wrap) for j in range(len(first))])
    if not always_wrap and all(v is first for v in values):
        return first
    return PerReplica(list(values), devices=devices)


def _shape_of(structure: Any) -> str:
    if isinstance(structure, dict):
        return f"a dict with keys {sorted(map(str, structure))}"
    if isinstance(structure, (tuple, list)):
        return f"a {type(structure).__name__} of {len(structure)}"
    return f"a {type(structure).__name__}"


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` (lists, tuples, namedtuples and dicts, by sorted key, are
    followed), in the order :func:`pack_as` takes them.

    Example:
        >>> flatten({"b": [1, 2], "a": (3,)})
        [3, 1, 2]
    """
    if isinstance(structure, dict):
        return [leaf for k in sorted(structure) for leaf in flatten(structure[k])]
    if isinstance(structure, (tuple, list)):
        return [leaf for s in structure for leaf in flatten(s)]
    return [structure]


def pack_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """``structure`` with its leaves replaced by ``leaves`` (as :func:`flatten` lists them).

    Example:
        >>> pack_as({"b": [1, 2], "a": (3,)}, [30, 10, 20])
        {'b': [10, 20], 'a': (30,)}
    """
    it = iter(leaves)

    def build(s: Any) -> Any:
        if isinstance(s, dict):
            built = {k: build(s[k]) for k in sorted(s)}
            return {k: built[k] for k in s}
        if isinstance(s, (tuple, list)):
            return _rebuild(s, [build(x) for x in s])
        return next(it)

    return build(structure)


class Stopped(BaseException):
    """Unwinds a replica thread whose run failed elsewhere (a BaseException, so that the
    replica function's ``except Exception`` does not swallow it)."""


@dataclasses.dataclass
class Merge:
    """One replica's request to meet: the collective's name, its merge function and arguments.

    Example:
        >>> Merge("all_reduce", print, (1,), {}).name
        'all_reduce'
    """

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    always_wrap: bool = False
    """Wrap every argument in a ``PerReplica``, even one object passed by every replica."""


@dataclasses.dataclass
class _Replica:
    index: int
    merge: Merge | None = None
    answered: bool = False
    answer: Any = None
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    failed_at: int = 0


class Meeting:
    """The replicas of one ``run`` and the thread that called it.

    Args:
        size: the number of local replicas.
        timeout_seconds: how long every replica has to join a meeting once one waits there.
        first_id: the global id of the first local replica, for the messages.

    Example:
        >>> meeting = Meeting(2, 5.0)
        >>> def body(i):
        ...     return meeting.merge_call(i, Merge("merge_call", lambda *a: sum(a), (i + 1,), {}))
        >>> meeting.run([lambda: body(0), lambda: body(1)],
        ...             regroup=lambda parts, wrap: (tuple(a for (a,), _ in parts), {}), select=lambda i, r: r)
        [3, 3]
    """

    def __init__(self, size: int, timeout_seconds: float, first_id: int = 0):
        self._replicas = [_Replica(i) for i in range(size)]
        self._cond = threading.Condition()
        self._stopped = False
        self._seconds = float(timeout_seconds)
        self._first_id = first_id
        self._failures = itertools.count(1)

    def merge_call(self, index: int, merge: Merge) -> Any:
        """Called by replica ``index``: waits until the calling thread has run the merge, and
        returns this replica's part of its result.

        Raises:
            Stopped: the run failed elsewhere.
        """
        replica = self._replicas[index]
        with self._cond:
            if self._stopped:
                raise Stopped
            replica.merge, replica.answered = merge, False
            self._cond.notify_all()
            # The calling thread answers every merge or stops the run, within its own bounded waits.
            while not (replica.answered or self._stopped):
                self._cond.wait()
            if not replica.answered:
                raise Stopped
            answer, replica.answer = replica.answer, None
            return answer

    def run(self, bodies: Sequence[Callable[[], Any]], regroup: Callable[[list[tuple], bool], tuple],
            select: Callable[[int, Any], Any], name: str = "xreduce-replica") -> list[Any]:
        """Runs each body in its own thread and meets them at each ``merge_call``.

        Args:
            bodies: one per replica; each sets up its replica context and calls the function.
            regroup: ``regroup([(args, kwargs) of each replica], always_wrap)``: the merge's
                ``(args, kwargs)``, each leaf a ``PerReplica`` (see :func:`regroup`).
            select: ``select(index, merge_result)``: a replica's part of a merge's result.
            name: the threads' name prefix.

        Returns:
            Each body's result, in replica order.
        """
        threads = [threading.Thread(target=self._body, args=(r, body), name=f"{name}-{r.index}", daemon=True)
                   for r, body in zip(self._replicas, bodies)]
        for t in threads:
            t.start()
        try:
            while True:
                self._wait_for_all()
                if all(r.finished for r in self._replicas):
                    return [r.result for r in self._replicas]
                self._merge(regroup, select)
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()
            # A replica still computing stops at its next merge_call; the run does not wait past the timeout.
            end = time.monotonic() + self._seconds
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))

    def _body(self, replica: _Replica, body: Callable[[], Any]) -> None:
        try:
            result = body()
        except Stopped:
            result = None
        except BaseException as e:  # noqa: BLE001 - the calling thread raises it
            with self._cond:
                replica.error, replica.failed_at = e, next(self._failures)
        else:
            replica.result = result
        with self._cond:
            replica.finished = True
            self._cond.notify_all()

    def _wait_for_all(self) -> None:
        """Until every replica waits in a merge_call or has finished; raises a replica's error."""
        deadline = None
        with self._cond:
            while True:
                failed = [r for r in self._replicas if r.error is not None]
                if failed:
                    raise min(failed, key=lambda r: r.failed_at).error
                running = [r for r in self._replicas if not r.finished and r.merge is None]
                if not running:
                    return
                waiting = [r for r in self._replicas if r.merge is not None]
                if waiting and deadline is None:
                    deadline = time.monotonic() + self._seconds
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"replica {_ids(running, self._first_id)} did not reach {_calls(waiting)} within "
                        f"{self._seconds:g} s while replica {_ids(waiting, self._first_id)} waited there: every "
                        "replica must make the same collective calls in the same order",
                        grpc.StatusCode.DEADLINE_EXCEEDED)
                # Until a replica waits for the others, they are computing: no bound but their own.
                self._cond.wait(None if deadline is None else deadline - time.monotonic())

    def _merge(self, regroup: Callable[[list[tuple], bool], tuple], select: Callable[[int, Any], Any]) -> None:
        done = [r for r in self._replicas if r.finished]
        waiting = [r for r in self._replicas if r.merge is not None]
        if done:
            raise RuntimeError(
                "Some replicas made a different number of replica_context().merge_call() calls: replica "
                f"{_ids(done, self._first_id)} returned while replica {_ids(waiting, self._first_id)} waited in "
                f"{_calls(waiting)}")
        names = {r.merge.name for r in waiting}
        if len(names) > 1:
            raise RuntimeError("replicas called different collectives at the same step: "
                               + ", ".join(f"replica {self._first_id + r.index} {r.merge.name}" for r in waiting))
        first = waiting[0].merge
        args, kwargs = regroup([(tuple(r.merge.args), dict(r.merge.kwargs)) for r in waiting], first.always_wrap)
        result = first.fn(*args, **kwargs)
        with self._cond:
            for r in waiting:
                r.answer, r.answered, r.merge = select(r.index, result), True, None
            self._cond.notify_all()


def _ids(replicas: Sequence[_Replica], first_id: int) -> str:
    return ", ".join(str(first_id + r.index) for r in replicas)


def _calls(replicas: Sequence[_Replica]) -> str:
    return " / ".join(sorted({r.merge.name for r in replicas if r.merge is not None}))
