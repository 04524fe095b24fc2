"""The executor: runs a :class:`~xreduced.planner.Plan` on a backend.

Two ways to run a plan, with bit-identical numbers:

* **generic** (any backend; the GPU path): every input is uploaded to its
  device, each pack gathered into one buffer per device, the plan's copies and
  sums run as the backend's operations, and the results are unpacked and
  downloaded. Algorithms never touch numpy or cupy arithmetic here. An
  NCCL plan (:func:`~xreduced.planner.nccl_all_reduce`) has no steps: each
  pack's buffers go to the backend's ``nccl_all_reduce`` instead.
* **fused** (backends whose buffers are host memory, :class:`~xreduced.backends.HostMemory`):
  copies between host "devices" would only copy memory to itself, so each
  pack's steps are evaluated chunk by chunk (:data:`CHUNK_BYTES`) on views of
  the inputs: a copy is an alias, a sum writes a small scratch buffer, and the
  plan's result goes straight into each destination's output array. The same
  additions run on the same operands in the same order and dtype, element by
  element, so the numbers are those of the generic way. Large inputs are
  spread over :data:`THREADS` threads (numpy releases the GIL).

Inputs are only read (they may be read-only views of shared memory); results
go into fresh arrays or into the caller's ``out`` arrays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from xreduce.wire.contract import mean_dtype

from xreduced.backends import Backend, HostMemory
from xreduced.backends.numpy_backend import divide
from xreduced.deadline import Deadline
from xreduced.errors import InvalidArgument
from xreduced.planner import NCCL, Copy, Plan, Sum

CHUNK_BYTES = 256 << 10
"""Bytes of one tensor evaluated at once on the fused path, so that the sums' scratch buffers stay in cache
(8 devices x 64 MiB float32 on one thread: 128 to 512 KiB are within the noise of each other, 64 KiB and
1 MiB or more were 15-30% slower)."""

PARALLEL_BYTES = 8 << 20
"""The fused path runs inline below this many input bytes (all devices together), on threads above it."""

THREADS = os.cpu_count() or 1
"""Threads of the fused path for one large call (the calling thread is one of them)."""

Out = Mapping[int, Sequence[np.ndarray | None]]
"""Caller-provided result arrays: destination device -> one array (or None) per tensor."""


def check_out(array: Any, dtype: np.dtype, shape: tuple[int, ...], field: str,
              backend: Backend | None = None) -> Any:
    """Checks one caller-provided result array and returns it.

    Raises:
        InvalidArgument: not a writable numpy array (or one of ``backend``'s device arrays) of exactly
            ``dtype`` and ``shape``.

    Example:
        >>> check_out(np.zeros(3, np.float16), np.dtype(np.float32), (3,), "out[0]")
        Traceback (most recent call last):
        ...
        xreduced.errors.InvalidArgument: out[0]: must be a writable float32[3] array; got float16[3]
    """
    # The messages are made only on failure: a batch checks one array per tensor and destination.
    def want() -> str:
        return f"{field}: must be a writable {dtype.name}{list(shape)} array; got"

    def got() -> str:
        return f"{np.dtype(array.dtype).name}{list(array.shape)}"

    device = backend is not None and backend.is_device_array(array)  # e.g. a view of a caller's GPU memory
    if not isinstance(array, np.ndarray) and not device:
        raise InvalidArgument(f"{want()} {type(array).__name__}")
    if np.dtype(array.dtype) != dtype or tuple(array.shape) != tuple(shape):
        raise InvalidArgument(f"{want()} {got()}")
    if not device and not array.flags.writeable:
        raise InvalidArgument(f"{want()} a read-only {got()}")
    return array


def execute(
    plan: Plan,
    backend: Backend,
    inputs: Sequence[Sequence[np.ndarray]],
    mean: bool = False,
    deadline: Deadline | None = None,
    out: Out | None = None,
) -> dict[int, list[np.ndarray]]:
    """Runs ``plan`` and returns, per destination device, one array per tensor.

    Host-memory backends (:class:`~xreduced.backends.HostMemory`) run it fused
    (:func:`execute_fused`), others the generic way (:func:`execute_generic`); the numbers are the same.
    An NCCL plan always goes the generic way, to the backend's ``nccl_all_reduce``.

    Args:
        plan: from the planner.
        backend: where the devices live.
        inputs: ``inputs[p][t]`` is tensor ``t`` of the component on
            ``plan.devices[p]``; every component has the same shapes. Never
            written to.
        mean: divide the sum by the number of replicas (integers promoted).
        deadline: checked before every step (every chunk on the fused path).
        out: where to write results: ``out[d][t]`` receives tensor ``t`` on
            destination ``d`` (the result's dtype and shape, writable) and is
            the array returned for it; a device or tensor it leaves out (or
            None) gets a fresh array.

    Raises:
        InvalidArgument: an ``out`` array of the wrong dtype or shape, or read-only.
        ValueError: a pack that mixes dtypes (the engine refuses such batches); an NCCL plan on a
            backend without NCCL (the engine refuses those first).
        DeadlineExceeded: ``deadline`` passed.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> from xreduced.planner import hierarchical_copy
        >>> plan = hierarchical_copy([0, 1], [2], 4)
        >>> out = execute(plan, NumpyBackend(2), [[np.ones(2, np.float32)]] * 2)
        >>> out[1][0]
        array([2., 2.], dtype=float32)
    """
    _check_packs(plan, inputs)
    if isinstance(backend, HostMemory) and plan.algorithm != NCCL:
        return execute_fused(plan, inputs, mean, deadline, out)
    return execute_generic(plan, backend, inputs, mean, deadline, out)


def _check_packs(plan: Plan, inputs: Sequence[Sequence[np.ndarray]]) -> None:
    for pack in plan.packs:
        dtypes = {inputs[0][s.tensor].dtype for s in pack.segments}
        if len(dtypes) > 1:
            found = ", ".join(f"tensor {s.tensor} {inputs[0][s.tensor].dtype.name}" for s in pack.segments)
            raise ValueError(f"pack {pack.index} mixes dtypes ({found}); packed tensors must share one dtype")


def _targets(plan: Plan, templates: Sequence[np.ndarray], mean: bool, out: Out | None,
             backend: Backend | None = None) -> dict[int, list[np.ndarray]]:
    """The array each result goes into: the caller's, checked, else a fresh one."""
    dtypes = [mean_dtype(a.dtype) if mean else a.dtype for a in templates]
    if not out:
        return {d: [np.empty(a.shape, dt) for a, dt in zip(templates, dtypes)] for d in plan.destinations}
    given = out
    for d in given:
        if d not in plan.destinations:
            raise InvalidArgument(f"out[{d}]: device {d} is not a destination; the destinations are "
                                  f"{list(plan.destinations)}")
    targets = {}
    for d in plan.destinations:
        mine = list(given.get(d, ()))
        if len(mine) > len(templates):
            raise InvalidArgument(f"out[{d}]: one array per tensor; got {len(mine)} for {len(templates)} tensors")
        mine += [None] * (len(templates) - len(mine))
        targets[d] = [
            np.empty(a.shape, dt) if o is None else check_out(o, dt, a.shape, f"out[{d}][{t}]", backend)
            for t, (a, dt, o) in enumerate(zip(templates, dtypes, mine))
        ]
    return targets


# --- the generic way ------------------------------------------------------------------------------------------


def execute_generic(
    plan: Plan,
    backend: Backend,
    inputs: Sequence[Sequence[np.ndarray]],
    mean: bool = False,
    deadline: Deadline | None = None,
    out: Out | None = None,
) -> dict[int, list[np.ndarray]]:
    """Runs ``plan`` as the backend's uploads, gathers, copies, sums and downloads;
    see :func:`execute` for the arguments.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> from xreduced.planner import broadcast
        >>> execute_generic(broadcast(0, [1], 2, 8), NumpyBackend(2), [[np.arange(2.0)]])[1][0]
        array([0., 1.])
    """
    deadline = deadline or Deadline(None)
    templates = list(inputs[0])
    targets = None if out is None else _targets(plan, templates, mean, out, backend)
    flat = {
        (t, d): backend.upload(d, arr)
        for d, component in zip(plan.devices, inputs)
        for t, arr in enumerate(component)
    }
    steps_of: dict[int, list] = {}
    for step in plan.steps:
        steps_of.setdefault(step.pack, []).append(step)
    results: dict[tuple[int, int], Any] = {}
    for pack in plan.packs:
        if not pack.elements:
            continue
        deadline.check(f"reducing pack {pack.index} of {len(plan.packs)}")
        bufs = {
            (f"in@{d}", d): backend.gather(
                d, [(flat[(s.tensor, d)], s.start, s.stop) for s in pack.segments]
            )
            for d in plan.devices
        }
        if plan.algorithm == NCCL:
            summed = backend.nccl_all_reduce([bufs[(f"in@{d}", d)] for d in plan.devices])
            bufs.update(((plan.result, d), buf) for d, buf in zip(plan.devices, summed))
        for step in steps_of.get(pack.index, []):
            deadline.check(f"running pack {pack.index}")
            if isinstance(step, Copy):
                bufs[(step.buffer, step.dst)] = backend.copy(bufs[(step.buffer, step.src)], step.dst)
            elif isinstance(step, Sum):
                first, *rest = (bufs[(name, step.device)] for name in step.inputs)
                acc = backend.add(first, rest[0]) if rest else first
                for other in rest[1:]:
                    backend.add_into(acc, other)
                bufs[(step.out, step.device)] = acc
        for d in plan.destinations:
            results[(pack.index, d)] = bufs[(plan.result, d)]
    backend.synchronize()
    return {
        d: _unpack(plan, backend, results, d, templates, mean, None if targets is None else targets[d])
        for d in plan.destinations
    }


def _unpack(plan, backend, results, device, templates, mean, targets) -> list[np.ndarray]:
    pieces: dict[int, list[tuple[Any, int, int]]] = {}
    for pack in plan.packs:
        if not pack.elements:
            continue
        offset = 0
        for s in pack.segments:
            size = s.stop - s.start
            pieces.setdefault(s.tensor, []).append((results[(pack.index, device)], offset, offset + size))
            offset += size
    bufs = []
    for t, template in enumerate(templates):
        if math.prod(template.shape) == 0:
            buf = backend.upload(device, np.empty(template.shape, template.dtype))
        else:
            buf = backend.reshape(backend.gather(device, pieces[t]), template.shape)
        if mean:
            buf = backend.divide(buf, len(plan.devices))
        bufs.append(buf)
    backend.synchronize()
    if targets is None:
        return [np.asarray(backend.download(buf)) for buf in bufs]
    for dst, buf in zip(targets, bufs):
        backend.write(dst, buf)
    backend.synchronize()
    return targets


# --- the fused way --------------------------------------------------------------------------------------------


class _Program:
    """One pack's steps with the copies resolved: every buffer is an input
    (``("in", p)``, the component on ``plan.devices[p]``) or a sum
    (``("sum", i)``), and ``sums[i]`` lists its operands, left fold order."""

    def __init__(self, plan: Plan, steps: Sequence) -> None:
        where: dict[tuple[str, int], tuple[str, int]] = {
            (f"in@{d}", d): ("in", p) for p, d in enumerate(plan.devices)
        }
        self.sums: list[tuple[tuple[str, int], ...]] = []
        for step in steps:
            if isinstance(step, Copy):
                where[(step.buffer, step.dst)] = where[(step.buffer, step.src)]
            elif isinstance(step, Sum):
                operands = tuple(where[(name, step.device)] for name in step.inputs)
                if len(operands) == 1:
                    where[(step.out, step.device)] = operands[0]
                else:
                    self.sums.append(operands)
                    where[(step.out, step.device)] = ("sum", len(self.sums) - 1)
        self.results = [where[(plan.result, d)] for d in plan.destinations]


_PROGRAMS: collections.OrderedDict[int, tuple[Plan, dict[int, _Program]]] = collections.OrderedDict()
_PROGRAMS_LOCK = threading.Lock()
_PROGRAMS_KEPT = 128


def _programs(plan: Plan) -> dict[int, _Program]:
    """Each pack's program, kept for the last plans run (plans are immutable, and the engine reuses them)."""
    with _PROGRAMS_LOCK:
        kept = _PROGRAMS.get(id(plan))
        if kept is not None and kept[0] is plan:
            _PROGRAMS.move_to_end(id(plan))
            return kept[1]
    steps_of: dict[int, list] = {}
    for step in plan.steps:
        steps_of.setdefault(step.pack, []).append(step)
    programs = {pack.index: _Program(plan, steps_of.get(pack.index, [])) for pack in plan.packs if pack.elements}
    with _PROGRAMS_LOCK:
        _PROGRAMS[id(plan)] = (plan, programs)  # the plan is held: its id is not reused while kept
        while len(_PROGRAMS) > _PROGRAMS_KEPT:
            _PROGRAMS.popitem(last=False)
    return programs


def execute_fused(
    plan: Plan,
    inputs: Sequence[Sequence[np.ndarray]],
    mean: bool = False,
    deadline: Deadline | None = None,
    out: Out | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int | None = None,
) -> dict[int, list[np.ndarray]]:
    """Runs ``plan`` on host arrays, chunk by chunk on views of the inputs; see
    :func:`execute` (and the module docstring) for the arguments.

    Args:
        chunk_bytes: bytes of one tensor's chunk.
        threads: threads to spread the chunks over; default :data:`THREADS`
            when the inputs reach :data:`PARALLEL_BYTES`, else 1.

    Example:
        >>> from xreduced.planner import hierarchical_copy
        >>> plan = hierarchical_copy([0, 1, 2], [3], 8, num_packs=2)
        >>> xs = [np.arange(3.0) * (p + 1) for p in range(3)]
        >>> execute_fused(plan, [[x] for x in xs], mean=True)[2][0]
        array([0., 2., 4.])
    """
    targets = _targets(plan, list(inputs[0]), mean, out)
    # The caller's arrays may be views that are not contiguous: those are written through a copy.
    sinks = {d: [a if a.flags.c_contiguous else np.empty(a.shape, a.dtype) for a in arrays]
             for d, arrays in targets.items()} if out else targets
    fused = Fused(plan, inputs, sinks, chunk_bytes=chunk_bytes, threads=threads)
    fused.run(inputs, sinks, mean, deadline)
    for copy in _copies(sinks, targets):
        copy()
    return targets


class Fused:
    """:func:`execute_fused`'s work for one shape of call, worked out once: the chunks of each tensor, the
    threads, whether a result shares memory with an input. :meth:`run` then reduces arrays of that shape, at
    those addresses relative to each other (a training step's all-reduce through shared memory: the same
    regions every step), with none of it worked out again.

    Args:
        plan: from the planner (not an NCCL plan).
        inputs: ``inputs[p][t]``, as :func:`execute` takes them.
        sinks: destination -> one C-contiguous array per tensor, the results' dtype and shape.
        chunk_bytes, threads: as :func:`execute_fused` takes them.

    Example:
        >>> from xreduced.planner import hierarchical_copy
        >>> plan = hierarchical_copy([0, 1], [2], 4)
        >>> xs, outs = [[np.ones(2, np.float32)], [np.full(2, 2, np.float32)]], {0: [np.empty(2, np.float32)],
        ...                                                                     1: [np.empty(2, np.float32)]}
        >>> fused = Fused(plan, xs, outs)
        >>> fused.run(xs, outs); outs[1][0]
        array([3., 3.], dtype=float32)
    """

    def __init__(self, plan: Plan, inputs: Sequence[Sequence[np.ndarray]], sinks: Mapping[int, Sequence[np.ndarray]],
                 *, chunk_bytes: int = CHUNK_BYTES, threads: int | None = None):
        self.plan = plan
        templates = list(inputs[0])
        programs = _programs(plan)
        self.units = []  # (pack, program, tensor, start, stop): one chunk of one segment
        for pack in plan.packs:
            if not pack.elements:
                continue
            program = programs[pack.index]
            for s in pack.segments:
                chunk = max(1, chunk_bytes // templates[s.tensor].dtype.itemsize)
                self.units.extend((pack, program, s.tensor, a, min(a + chunk, s.stop))
                                  for a in range(s.start, s.stop, chunk))
        if threads is None:
            input_bytes = sum(a.nbytes for component in inputs for a in component)
            threads = THREADS if input_bytes >= PARALLEL_BYTES else 1
        self.threads = threads
        self.aliased = _aliases(plan, inputs, sinks)
        """Whether a sink shares memory with an input (an in-place reduce: a caller's output region is its
        input's): False; the :class:`_Aliases` of sinks that are exactly inputs; or True."""
        first = sinks.get(plan.destinations[0], []) if plan.destinations else []
        self._dtypes = [(a.dtype, first[t].dtype if t < len(first) else a.dtype) for t, a in enumerate(templates)]
        self._private: dict[bool, bool] = {}

    def private(self, mean: bool = False) -> bool:
        """Whether the results go to arrays of their own first, then to the sinks once every chunk is done: a
        sink overlaps an input other than exactly, or a chunk would read an input a sink over it has already
        written (exact sinks that no later operation reads are written straight into, :class:`_Aliases`)."""
        private = self._private.get(mean)
        if private is None:
            aliased = self.aliased
            private = self._private[mean] = aliased is True or (aliased is not False and not all(
                aliased.allows(program, t, _direct(program, mean, *self._dtypes[t]))
                for _, program, t, _, _ in self.units))
        return private

    def run(self, inputs: Sequence[Sequence[np.ndarray]], sinks: Mapping[int, Sequence[np.ndarray]],
            mean: bool = False, deadline: Deadline | None = None) -> None:
        """Reduces ``inputs`` into ``sinks`` (arrays of the shape this was made for; see the class)."""
        targets, sinks = sinks, _own(sinks) if self.private(mean) else sinks
        run = self._runner(inputs, sinks, mean)
        run.deadline = deadline or Deadline(None)
        run.parallel(self._groups(), run)
        for copy in _copies(sinks, targets):
            copy()

    def bind(self, inputs: Sequence[Sequence[np.ndarray]], sinks: Mapping[int, Sequence[np.ndarray]],
             mean: bool = False) -> Bound:
        """:meth:`run` of these very arrays, worked out once for a caller that reduces them again and again (a
        kept repeat: the same views of the same regions every step): :meth:`Bound.run` then only does the
        arithmetic.

        Example:
            >>> from xreduced.planner import hierarchical_copy
            >>> xs = [[np.ones(2, np.float32)], [np.ones(2, np.float32)]]
            >>> outs = {0: [np.empty(2, np.float32)], 1: [np.empty(2, np.float32)]}
            >>> bound = Fused(hierarchical_copy([0, 1], [2], 4), xs, outs).bind(xs, outs)
            >>> xs[1][0][:] = 5; bound.run(), outs[1][0]
            (True, array([6., 6.], dtype=float32))

        Raises:
            ValueError: an input or sink array is not C-contiguous (its flat view would be a copy, made once).
        """
        if not all(a.flags.c_contiguous for arrays in [*inputs, *sinks.values()] for a in arrays):
            raise ValueError("Fused.bind: every input and sink array must be C-contiguous")
        targets, sinks = sinks, _own(sinks) if self.private(mean) else sinks
        return Bound(self._runner(inputs, sinks, mean), self._groups(), _copies(sinks, targets))

    def _groups(self) -> list[list]:
        """The chunks as each thread takes them: all in one run, or split over :attr:`threads`."""
        return _split(self.units, self.threads) if self.threads > 1 and len(self.units) > 1 else [self.units]

    def _runner(self, inputs, sinks, mean: bool) -> _Runner:
        # One flat view per input and per sink array (destinations given one array, as output_one_copy gives
        # them, share its view: it is written once); ravel copies an input only when it is not C-contiguous.
        sources = [[a.ravel() for a in component] for component in inputs]
        flat = _Shared(lambda a: a.reshape(-1))
        flat_sinks = {d: [flat(a) for a in arrays] for d, arrays in sinks.items()}
        return _Runner(self.plan, sources, flat_sinks, mean, Deadline(None))


def _own(sinks: Mapping[int, Sequence[np.ndarray]]) -> dict[int, list[np.ndarray]]:
    """An array of its own for each sink array (one for an array several destinations are given)."""
    own = _Shared(np.empty_like)
    return {d: [own(a) for a in arrays] for d, arrays in sinks.items()}


def _copies(made: Mapping[int, Sequence[np.ndarray]], targets: Mapping[int, Sequence[np.ndarray]]) -> list:
    """The copies of arrays ``made`` apart (:func:`_own`'s, or :func:`execute_fused`'s for sinks that are not
    C-contiguous) into their ``targets``, one per target array; none for an array that is its own target."""
    if made is targets:
        return []
    pairs = {id(t): (t, m) for d, arrays in targets.items() for t, m in zip(arrays, made[d]) if m is not t}
    return [functools.partial(np.copyto, t, m) for t, m in pairs.values()]


class Bound:
    """A :class:`Fused` reduction of fixed arrays (:meth:`Fused.bind`): each chunk's numpy operations made once,
    on views made once, with scratch of their own; :meth:`run` calls them (then ``after``: the results' copies
    into the sinks when they were made apart, :meth:`Fused.private`). One call at a time: a caller that finds it
    running (:meth:`run` returns False) reduces another way."""

    def __init__(self, runner: _Runner, groups: list[list], after: Sequence[Callable[[], Any]] = ()):
        self._runner = runner
        self._groups = []
        for units in groups:
            scratch: dict = {}  # each thread's own
            self._groups.append([(unit, runner.steps(unit, scratch)) for unit in units])
        self._after = list(after)
        self._lock = threading.Lock()

    def run(self, deadline: Deadline | None = None) -> bool:
        """Reduces the bound inputs' current values into the bound sinks; False, with nothing done, while
        another thread runs it."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            run = self._runner
            run.deadline, run.failed = deadline or Deadline(None), False
            run.parallel(self._groups, run.evaluate)
            for copy in self._after:
                copy()
        finally:
            self._lock.release()
        return True


def _split(units: list, threads: int) -> list[list]:
    """``units`` in at most ``threads`` runs of about equal elements, in order.

    Example:
        >>> [len(g) for g in _split([(None, None, 0, 0, 4)] * 5, 2)]
        [3, 2]
    """
    total = sum(stop - start for *_, start, stop in units)
    groups: list[list] = [[]]
    done = 0
    for unit in units:
        if done >= total * len(groups) / threads and len(groups) < threads:
            groups.append([])
        groups[-1].append(unit)
        done += unit[4] - unit[3]
    return groups


class _Runner:
    """Evaluates chunks of a plan; one instance per call (or per :class:`Bound`), shared by its threads."""

    def __init__(self, plan, sources, sinks, mean, deadline):
        self.plan, self.sources, self.sinks, self.mean, self.deadline = plan, sources, sinks, mean, deadline
        self.failed = False
        """Set by a thread that failed: the others stop at their next chunk."""

    def __call__(self, units) -> None:
        scratch: dict[tuple[int, np.dtype], np.ndarray] = {}  # this thread's, reused chunk after chunk
        self.evaluate((unit, self.steps(unit, scratch)) for unit in units)

    def evaluate(self, steps) -> None:
        """Runs each chunk's operations, ``steps`` as (unit, :meth:`steps`) pairs, the deadline checked before
        each chunk."""
        for unit, operations in steps:
            if self.failed:
                return
            self.deadline.check(lambda: f"reducing pack {unit[0].index} of {len(self.plan.packs)}")  # noqa: B023
            for operation in operations:
                operation()

    def steps(self, unit, scratch: dict) -> list[Callable[[], Any]]:
        """One chunk's numpy operations, in order, as calls without arguments (``scratch``: the thread's sums'
        buffers, reused chunk after chunk)."""
        pack, program, t, start, stop = unit
        n = len(self.plan.devices)
        if start == 0 and stop == len(self.sources[0][t]):  # the whole tensor: no views to make
            inputs = [src[t] for src in self.sources]
            sinks = [self.sinks[d][t] for d in self.plan.destinations]
        else:
            inputs = [src[t][start:stop] for src in self.sources]
            cut = _Shared(lambda a: a[start:stop])
            sinks = [cut(self.sinks[d][t]) for d in self.plan.destinations]
        dtype = inputs[0].dtype
        # The sum that is a result goes straight into the first destination that takes it (and a float MEAN
        # divides it there, in place): no scratch write and read, no array made per chunk.
        # (A sink over an input is written so only where that is safe: Fused.private.)
        first = _direct(program, self.mean, dtype, sinks[0].dtype)
        direct = {} if first is None else {first: sinks[0]}
        operations: list[Callable[[], Any]] = []
        sums = []
        for i, operands in enumerate(program.sums):
            acc = direct.get(i)
            if acc is None:
                buf = scratch.get((i, dtype))
                if buf is None or buf.size < stop - start:
                    buf = scratch[(i, dtype)] = np.empty(stop - start, dtype)
                acc = buf[: stop - start]
            first, second, *rest = (inputs[p] if kind == "in" else sums[p] for kind, p in operands)
            operations.append(functools.partial(np.add, first, second, out=acc, dtype=dtype))
            operations.extend(functools.partial(np.add, acc, other, out=acc, dtype=dtype) for other in rest)
            if self.mean and i in direct:
                operations.append(functools.partial(np.true_divide, acc, dtype.type(n), out=acc))
            sums.append(acc)
        written = {id(a) for a in direct.values()}
        for sink, (kind, p) in zip(sinks, program.results):
            if id(sink) in written:
                continue
            value = direct.get(p) if kind == "sum" else None
            if value is None:
                value = inputs[p] if kind == "in" else sums[p]
                if self.mean:
                    operations.append(functools.partial(_copy_divided, sink, value, n))
                    written.add(id(sink))
                    continue
            operations.append(functools.partial(np.copyto, sink, value))
            written.add(id(sink))
        return operations

    def parallel(self, groups: list[list], work: Callable[[list], None]) -> None:
        """``work(group)`` for each of ``groups`` on the pool's threads; this thread takes the last (a single
        group: this thread alone)."""
        futures = [_POOL.submit(self._guarded, work, g) for g in groups[:-1]]
        error = None
        try:
            self._guarded(work, groups[-1])
        except BaseException as e:  # raised once every thread has stopped writing
            error = e
        for f in futures:
            error = error or f.exception()
        if error is not None:
            raise error

    def _guarded(self, work: Callable[[list], None], group: list) -> None:
        try:
            work(group)
        except BaseException:
            self.failed = True  # the other threads stop at their next chunk
            raise


def _copy_divided(sink: np.ndarray, value: np.ndarray, n: int) -> None:
    """MEAN's result that is not divided in place: ``value / n`` (:func:`divide`) copied into ``sink``."""
    np.copyto(sink, divide(np, value, n))


class _Shared:
    """``make(array)`` once per array: callers that pass the same array (destinations that share one sink, as
    ``output_one_copy`` gives them) get the same view back, so the runner sees one sink and writes it once.

    Example:
        >>> a = np.zeros(4)
        >>> flat = _Shared(lambda x: x.reshape(-1))
        >>> flat(a) is flat(a), flat(a) is flat(np.zeros(4))
        (True, False)
    """

    __slots__ = ("_make", "_made")

    def __init__(self, make: Callable[[np.ndarray], np.ndarray]):
        self._make, self._made = make, {}

    def __call__(self, array: np.ndarray) -> np.ndarray:
        view = self._made.get(id(array))
        if view is None:
            view = self._made[id(array)] = (array, self._make(array))
        return view[1]


def _aliases(plan: Plan, sources: Sequence[Sequence[np.ndarray]],
             sinks: Mapping[int, Sequence[np.ndarray]]) -> bool | _Aliases:
    """Whether a sink shares memory with an input (by bounds: cheap, and cautious): False; the :class:`_Aliases`
    when each sink that does is exactly one component's input of its own tensor (the same bytes, dtype and size:
    an in-place reduce, the result over a replica's input) and no two sink arrays are one input; else True.

    Example:
        >>> from xreduced.planner import hierarchical_copy
        >>> plan, a, b = hierarchical_copy([0, 1], [4], 8), np.zeros(4), np.ones(4)
        >>> _aliases(plan, [[a], [b]], {0: [np.zeros(4)]}), _aliases(plan, [[a], [b]], {0: [a[:2]]})
        (False, True)
        >>> _aliases(plan, [[a], [b]], {0: [a], 1: [a]}).of
        {(0, 0): (0, 0), (1, 0): (0, 0)}
    """
    overlaps = [(k, t, sink) for k, d in enumerate(plan.destinations) for t, sink in enumerate(sinks.get(d, ()))
                if any(np.may_share_memory(sink, component[t2]) for component in sources
                       for t2 in range(len(component)))]
    if not overlaps:
        return False
    of: dict[tuple[int, int], tuple[int, int]] = {}
    owner: dict[tuple[int, int], int] = {}  # (component, tensor) -> id of the one sink array over it
    for k, t, sink in overlaps:
        same = [p for p, component in enumerate(sources) if _same_bytes(sink, component[t])]
        others = sum(np.may_share_memory(sink, a) for component in sources for a in component)
        if len(same) != 1 or others != 1 or owner.setdefault((same[0], t), id(sink)) != id(sink):
            return True
        first = next(k2 for k2, d in enumerate(plan.destinations) if sinks.get(d) and sinks[d][t] is sink)
        of[(k, t)] = (same[0], first)
    return _Aliases(of)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same memory, read the same way (C-contiguous, one dtype and size)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.dtype == b.dtype
            and a.size == b.size and a.flags.c_contiguous and b.flags.c_contiguous)


class _Aliases:
    """Sinks that are exactly inputs (:func:`_aliases`): ``of[(k, t)]`` is (the component whose input tensor ``t``
    the sink of destination ``plan.destinations[k]`` is, the first destination index given that same sink array).

    Example:
        >>> from xreduced.planner import hierarchical_copy
        >>> from xreduced.planner import reduction_to_one_device
        >>> program = _programs(hierarchical_copy([0, 1], [4], 8))[0]
        >>> aliases = _Aliases({(0, 0): (0, 0), (1, 0): (0, 0)})  # one sink over replica 0's input
        >>> aliases.allows(program, 0, 0), aliases.allows(program, 0, None)
        (True, True)
        >>> fold = _programs(reduction_to_one_device([0, 1, 2], [0], [4], 8))[0]  # in0 + in1, then + in2
        >>> _Aliases({(0, 0): (0, 0)}).allows(fold, 0, 0), _Aliases({(0, 0): (2, 0)}).allows(fold, 0, 0)
        (True, False)
    """

    def __init__(self, of: dict[tuple[int, int], tuple[int, int]]):
        self.of = of
        self._allowed: dict[tuple[int, int, int | None], tuple[_Program, bool]] = {}

    def allows(self, program: _Program, t: int, direct: int | None) -> bool:
        """Whether tensor ``t``'s chunks can run ``program`` as though nothing aliased (sum ``direct``, or None,
        straight into the first destination's sink): no operation reads an input after a sink over it was
        written, in the order :meth:`_Runner.steps` makes them."""
        key = (id(program), t, direct)
        kept = self._allowed.get(key)
        if kept is None or kept[0] is not program:
            kept = self._allowed[key] = (program, self._simulate(program, t, direct))
        return kept[1]

    def _simulate(self, program: _Program, t: int, direct: int | None) -> bool:
        over: set[int] = set()  # the inputs written over so far

        def fresh(operands) -> bool:
            return not any(kind == "in" and p in over for kind, p in operands)

        first = self.of.get((0, t))
        for i, operands in enumerate(program.sums):
            if not fresh(operands[:2]):  # one operation reads both and writes elementwise: it may write either
                return False
            if i == direct and first is not None:
                over.add(first[0])
            if not fresh(operands[2:]):
                return False

        def sink(k: int):  # a destination's sink: the first index given that array, or its own
            alias = self.of.get((k, t))
            return alias[1] if alias else ("own", k)

        written = {sink(0)} if direct is not None else set()
        for k, (kind, p) in enumerate(program.results):
            alias = self.of.get((k, t))
            if sink(k) in written:
                continue
            if kind == "in" and p in over:
                return False
            written.add(sink(k))
            if alias:
                over.add(alias[0])
        return True


def _direct(program: _Program, mean: bool, dtype: np.dtype, result: np.dtype) -> int | None:
    """The sum that goes straight into the first destination's sink (the first result, when it is a sum that
    needs no conversion), or None."""
    if program.results:
        kind, p = program.results[0]
        if kind == "sum" and (not mean or _divides_in_place(dtype, result)):
            return p
    return None


def _divides_in_place(dtype: np.dtype, result: np.dtype) -> bool:
    """Whether MEAN's division of a ``dtype`` sum is one in-place true divide by ``dtype.type(n)`` into a
    ``result`` array: floating-point sums divide in their own dtype (see
    :func:`xreduced.backends.numpy_backend.divide`); integers are promoted and complex parts divided apart."""
    return dtype == result and (dtype.kind == "f" or dtype.name == "bfloat16")


class _Pool:
    """The fused path's worker threads, started on first use and shared by every call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max(THREADS - 1, 1), thread_name_prefix="xreduced-executor")
        return self._pool.submit(fn, *args)


_POOL = _Pool()
