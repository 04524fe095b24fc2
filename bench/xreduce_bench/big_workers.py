"""The worker processes of ``xreduce bench --big-tensors``: one replica each, the sizes one after the other.

A worker (:func:`big_worker`, run by ``workers._run_pool``) readies its system
with ``start(spec, rank) -> (prepare, close)`` (:func:`xreduce_start`: the
SDK's ``distribution.initialize``; :func:`gloo_start`:
``init_process_group``), reports its pid (``("ready", rank, pid)``), stays idle
a moment once every process is ready (the idle baseline of the memory: the
parent's samples of the whole job before the first size), then for each size,
ascending:

1. waits at a barrier until every process has let the last size go;
2. ``prepare(size)`` allocates its float32 array, filled (every page touched);
3. makes ``iters`` calls, each after a barrier, timed alone; between calls the
   last result is checked at a few elements and the array refilled (untimed);
4. checks every element of the last result, and reports the window of time the
   size held memory (``("window", rank, index, begin, end)``) and its times
   (``("size", rank, index, times, wrong)``) to the parent.

The value of process k is k + 1 everywhere, so every result is known exactly:
P(P + 1) / 2.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable

import numpy as np

from xreduce_bench.workers import _fail

HOLD = 0.3
"""Seconds a worker holds a phase's memory at least (idle, then each size), so the parent's sampler sees it."""
CHUNK = 1 << 24
"""Elements compared at a time in the last check: its temporary stays at 16 MiB whatever the size."""
SPOTS = 9
"""Elements checked after each call but the last (first, last and evenly between)."""


@dataclasses.dataclass(frozen=True)
class BigSpec:
    """What every worker of one system needs: it travels to them.

    Attributes:
        processes: P, the workers (one replica each).
        in_place: xreduce reduces into the caller's array (``out=``); False: the SDK allocates the result.
        timeout: seconds any one wait may last.
        shared: xreduce's arrays are :func:`xreduce.shared_array` arrays (else numpy's).

    Example:
        >>> BigSpec(2, True, 900.0).expected
        3.0
    """

    processes: int
    in_place: bool
    timeout: float
    shared: bool = False

    @property
    def expected(self) -> float:
        """Every element of every result: the sum of k + 1 over the processes."""
        return self.processes * (self.processes + 1) / 2


def wrong_elements(result: np.ndarray, expected: float, spots: int | None = None) -> int:
    """Elements of ``result`` that are not ``expected``: all of them, a chunk at a time, or ``spots`` of
    them evenly spread (first and last included).

    Example:
        >>> a = np.full(10, 3.0, np.float32); a[9] = 0
        >>> wrong_elements(a, 3.0), wrong_elements(a, 3.0, spots=2), wrong_elements(a[:5], 3.0, spots=2)
        (1, 1, 0)
    """
    flat = result.reshape(-1)
    if spots is not None:
        return int(np.count_nonzero(flat[np.unique(np.linspace(0, flat.size - 1, spots).astype(np.int64))]
                                    != expected))
    return sum(int(np.count_nonzero(flat[a:a + CHUNK] != expected)) for a in range(0, flat.size, CHUNK))


class Calls:
    """The calls of one size in one worker, on ``buffer`` (filled with ``fill`` at once: touched before timing).

    ``call(buffer)`` makes one call and returns the result (None: it is ``buffer``, in place).

    Example:
        >>> calls = Calls(np.empty(4, np.float32), 1.0, 2.0, lambda v: v * 2)
        >>> for _ in range(3):
        ...     calls.reset(); calls.run()
        >>> calls.check()
        0
    """

    def __init__(self, buffer: np.ndarray, fill: float, expected: float,
                 call: Callable[[np.ndarray], np.ndarray | None]):
        self.buffer, self.fill, self.expected, self.call = buffer, fill, expected, call
        self.buffer[...] = fill
        self.result: np.ndarray | None = None
        self.wrong = 0

    def reset(self) -> None:
        """Before a call (untimed): the last result checked at a few elements, then let go; the buffer refilled."""
        if self.result is not None:
            self.wrong += wrong_elements(self.result, self.expected, SPOTS)
            self.result = None
            self.buffer[...] = self.fill

    def run(self) -> None:
        """One call (timed)."""
        result = self.call(self.buffer)
        self.result = self.buffer if result is None else result

    def check(self) -> int:
        """After the last call: wrong elements of every call (a few each) and of the last result (all)."""
        result, self.result = self.result, None
        return self.wrong + (0 if result is None else wrong_elements(result, self.expected))


def big_worker(start: Callable, spec: BigSpec, sweep, rank: int, barrier, queue) -> None:
    """One worker process: the sizes of ``sweep`` one after the other (see the module's docstring)."""
    try:
        prepare, close = start(spec, rank)
        queue.put(("ready", rank, os.getpid()))
        barrier.wait(sweep.timeout)
        time.sleep(HOLD)  # idle: the baseline
        for index, size in enumerate(sweep.sizes):
            barrier.wait(sweep.timeout)  # every process has let the last size go
            begin = time.monotonic()
            calls = prepare(size)
            times = []
            for _ in range(sweep.iters):
                calls.reset()
                barrier.wait(sweep.timeout)
                t = time.perf_counter()
                calls.run()
                times.append(time.perf_counter() - t)
            wrong = calls.check()
            time.sleep(max(0.0, begin + HOLD - time.monotonic()))
            end = time.monotonic()
            del calls
            gc.collect()
            queue.put(("window", rank, index, begin, end))
            queue.put(("size", rank, index, times, wrong))
        close()
        queue.put(("done", rank))
    except BaseException as e:  # noqa: BLE001 -- everything goes to the parent, which decides
        _fail(e, rank, barrier, queue)


def xreduce_start(spec: BigSpec, rank: int) -> tuple[Callable, Callable]:
    """Process ``rank`` of an xreduce job (``XREDUCE_ADDRESS``, ``XREDUCE_GROUP``, ``XREDUCE_LOCAL_DEVICES``
    set by the parent): ``HierarchicalCopyAllReduce().reduce("sum", v, v, out=v)`` of a numpy array (an
    :func:`xreduce.shared_array` with ``spec.shared``)."""
    import xreduce
    from xreduce import distribute, distribution

    distribution.initialize(num_processes=spec.processes, process_id=rank)
    ops = distribute.HierarchicalCopyAllReduce(options=xreduce.ConnectionOptions(timeout=spec.timeout))

    def call(v: np.ndarray) -> np.ndarray:
        return ops.reduce("sum", v, v, out=v) if spec.in_place else ops.reduce("sum", v, v)

    def prepare(size: int) -> Calls:
        v = xreduce.shared_array(size // 4, np.float32) if spec.shared else np.empty(size // 4, np.float32)
        return Calls(v, rank + 1, spec.expected, call)

    def close() -> None:
        ops.close()
        distribution.shutdown()

    return prepare, close


def gloo_start(spec: BigSpec, rank: int) -> tuple[Callable, Callable]:
    """Rank ``rank`` of torch.distributed's gloo (its store: ``XREDUCE_BENCH_STORE``): ``dist.all_reduce(t)`` of
    a CPU float32 tensor, in place; a fresh tensor per size."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["XREDUCE_BENCH_STORE"], rank=rank,
                            world_size=spec.processes, timeout=datetime.timedelta(seconds=spec.timeout))

    def prepare(size: int) -> Calls:
        t = torch.empty(size // 4, dtype=torch.float32)
        return Calls(t.numpy(), rank + 1, spec.expected, lambda v: dist.all_reduce(t))

    return prepare, dist.destroy_process_group
