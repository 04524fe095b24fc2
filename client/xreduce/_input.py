"""Input for ``MirroredStrategy``: global batches split across replicas, ``InputContext``, ``InputOptions``.

The split is what TF 2.21's ``MirroredStrategy`` does to a batched dataset (its
rebatching, after the auto-shard rewrite, checked against TF itself in the tests):
a batch of ``b`` rows over ``N`` replicas gives each replica, in global
replica-id order, ``ceil(b / N)`` rows until the batch runs out, so the last
replicas may get fewer rows or none (an empty batch), as TF gives them. Each
batch is split on its own: a partial last batch too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xreduce._values import PerReplica


def split_sizes(rows: int, parts: int) -> list[int]:
    """TF's per-replica batch sizes of a global batch: as even as possible, the first ones larger.

    Example:
        >>> split_sizes(7, 2), split_sizes(10, 4), split_sizes(2, 3)
        ([4, 3], [3, 3, 2, 2], [1, 1, 0])
    """
    floor, ceil = divmod(rows, parts)
    return [floor + 1] * ceil + [floor] * (parts - ceil)


def fill(sizes: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """Each part's ``(start, stop)`` rows when a batch of ``rows`` fills parts of ``sizes`` in order.

    Example:
        >>> fill([2, 2, 2, 2], 5)  # a partial batch: the last replicas get fewer rows, or none
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    bounds, start = [], 0
    for size in sizes:
        stop = min(start + size, rows)
        bounds.append((start, stop))
        start = stop
    return bounds


# --- nested structures of arrays ------------------------------------------------------------------------------


def leaves(structure: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """Appends ``(path, leaf)`` for each leaf of nested dicts, lists and tuples."""
    if isinstance(structure, dict):
        for key, value in structure.items():
            leaves(value, f"{path}[{key!r}]", out)
    elif isinstance(structure, (list, tuple)):
        for i, value in enumerate(structure):
            leaves(value, f"{path}[{i}]", out)
    else:
        out.append((path, structure))


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``structure`` with ``fn(leaf)`` in place of each leaf; named tuples keep their type."""
    if isinstance(structure, dict):
        return {key: map_structure(fn, value) for key, value in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(map_structure(fn, value) for value in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(fn, value) for value in structure)
    return fn(structure)


def rows(where: str, path: str, leaf: Any) -> int:
    """The first dimension of an array leaf; a ValueError naming ``path`` for anything else."""
    shape = getattr(leaf, "shape", None)
    if shape is None or len(shape) == 0 or not hasattr(leaf, "__getitem__"):
        raise ValueError(
            f"{where}: {path} must be an array with a batch (first) dimension; got "
            f"{type(leaf).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else f" {leaf!r}")
        )
    return int(shape[0])


def batch_rows(where: str, batch: Any) -> int:
    """The rows every array of ``batch`` has; a ValueError when they differ or there are none."""
    found: list[tuple[str, Any]] = []
    leaves(batch, "batch", found)
    if not found:
        raise ValueError(f"{where}: the batch holds no arrays; got {batch!r}")
    counts = {path: rows(where, path, leaf) for path, leaf in found}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{p} has {n}" for p, n in counts.items())
        raise ValueError(f"{where}: every array of the batch must have the same number of rows; {listed}")
    return next(iter(counts.values()))


def elements(dataset: Any, where: str) -> Iterator[Any]:
    """The elements of a dataset: ``as_numpy_iterator()`` where it has one (a ``tf.data.Dataset``), else
    plain iteration, so TensorFlow tensors arrive as numpy arrays and TensorFlow is never imported."""
    if hasattr(dataset, "as_numpy_iterator"):
        return iter(dataset.as_numpy_iterator())
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__"):
        raise ValueError(f"{where}: dataset must be an iterable of batches (or a tf.data.Dataset); got "
                         f"{type(dataset).__name__}")
    return iter(dataset)


def per_replica_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Each replica's ``(start, stop)`` rows of a batch of ``rows`` (the module's rule).

    Example:
        >>> per_replica_rows(7, 3), per_replica_rows(10, 4)
        ([(0, 3), (3, 6), (6, 7)], [(0, 3), (3, 6), (6, 9), (9, 10)])
        >>> per_replica_rows(3, 4)  # fewer rows than replicas: the last ones get none
        [(0, 1), (1, 2), (2, 3), (3, 3)]
    """
    return fill([-(-rows // parts)] * parts, rows)


def global_batches(dataset: Any, parts: int, where: str) -> Iterator[tuple[Any, list[tuple[int, int]]]]:
    """Each global batch with every part's ``(start, stop)`` rows (the module's rule).

    Example:
        >>> import numpy as np
        >>> [b for _, b in global_batches([np.arange(4), np.arange(3)], 2, "here")]
        [[(0, 2), (2, 4)], [(0, 2), (2, 3)]]
    """
    for k, batch in enumerate(elements(dataset, where)):
        yield batch, per_replica_rows(batch_rows(f"{where}: batch {k}", batch), parts)


def keras_batches(dataset: Any, parts: int, where: str) -> Iterator[tuple[Any, list[tuple[int, int]]]]:
    """Each global batch with every process's ``(start, stop)`` rows by Keras' arithmetic
    (``DataParallel.distribute_dataset``: TF's ``batch_sizes_for_worker`` with one replica per process,
    the sizes set by the first batch, a later partial batch filling the processes in order).

    Example:
        >>> import numpy as np
        >>> [b for _, b in keras_batches([np.arange(7), np.arange(3)], 2, "here")]
        [[(0, 4), (4, 7)], [(0, 3), (3, 3)]]
    """
    sizes: list[int] | None = None
    first = 0
    for k, batch in enumerate(elements(dataset, where)):
        n = batch_rows(f"{where}: batch {k}", batch)
        if sizes is None:
            sizes, first = split_sizes(n, parts), n
        elif n > first:
            raise ValueError(f"{where}: batch {k} has {n} rows, more than the {first} of batch 0, which set the "
                             "global batch size; only a partial (smaller) batch may follow it")
        yield batch, fill(sizes, n)


def rows_of(batch: Any, start: int, stop: int) -> Any:
    """``batch`` (a nested structure of arrays) cut to rows ``[start, stop)``."""
    return map_structure(lambda leaf: leaf[start:stop], batch)


class Rows:
    """The rows of each global batch that belong to one process of ``parts``, by Keras' arithmetic
    (:func:`keras_batches`; re-iterable, like a dataset).

    Example:
        >>> import numpy as np
        >>> [b.tolist() for b in Rows([np.arange(4), np.arange(3)], 2, 1, "here")]
        [[2, 3], [2]]
    """

    def __init__(self, dataset: Any, parts: int, index: int, where: str):
        self._dataset, self._parts, self._index, self._where = dataset, parts, index, where

    def __iter__(self) -> Iterator[Any]:
        for batch, bounds in keras_batches(self._dataset, self._parts, self._where):
            yield rows_of(batch, *bounds[self._index])


# --- TF's names -----------------------------------------------------------------------------------------------


class InputReplicationMode(enum.Enum):
    """How often ``distribute_datasets_from_function`` calls its function (TF's ``InputReplicationMode``).

    ``PER_WORKER``: once per process, its replicas taking successive elements;
    ``PER_REPLICA``: once per replica, each replica reading its own dataset.

    Example:
        >>> InputReplicationMode("PER_REPLICA")
        <InputReplicationMode.PER_REPLICA: 'PER_REPLICA'>
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options of ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    (TF's ``tf.distribute.InputOptions``; a TF ``InputOptions`` object is accepted too).

    Elements are never copied: each per-replica value is a slice of what the
    dataset produced (a CuPy batch stays on its GPU), so
    ``experimental_fetch_to_device`` and ``experimental_per_replica_buffer_size``
    (no prefetching: a step is read when asked for) are checked and change
    nothing; ``experimental_place_dataset_on_device=True`` (TPU-only in TF) is refused.

    Raises:
        ValueError: a field of the wrong type or value; the message names it.

    Example:
        >>> InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        ...              experimental_fetch_to_device=False).experimental_replication_mode.name
        'PER_REPLICA'
        >>> InputOptions(experimental_per_replica_buffer_size=0)
        Traceback (most recent call last):
        ...
        ValueError: InputOptions.experimental_per_replica_buffer_size must be an integer >= 1; got 0
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self):
        mode = self.experimental_replication_mode
        name = getattr(mode, "name", mode)  # TF's enum, or the name
        if name not in InputReplicationMode.__members__:
            raise ValueError(f"InputOptions.experimental_replication_mode must be PER_WORKER or PER_REPLICA; "
                             f"got {mode!r}")
        object.__setattr__(self, "experimental_replication_mode", InputReplicationMode[name])
        if self.experimental_fetch_to_device not in (None, True, False):
            raise ValueError("InputOptions.experimental_fetch_to_device must be None, True or False; got "
                             f"{self.experimental_fetch_to_device!r}")
        if self.experimental_place_dataset_on_device not in (True, False):
            raise ValueError("InputOptions.experimental_place_dataset_on_device must be True or False; got "
                             f"{self.experimental_place_dataset_on_device!r}")
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"InputOptions.experimental_per_replica_buffer_size must be an integer >= 1; got {size!r}")


def check_options(options: Any, method: str) -> InputOptions:
    """``options`` as an :class:`InputOptions` (None: the defaults), with what ``method`` cannot honour refused."""
    if options is None:
        return InputOptions()
    fields = [f.name for f in dataclasses.fields(InputOptions)]
    if not isinstance(options, InputOptions):
        if not all(hasattr(options, f) for f in fields):
            raise ValueError(f"{method}: options must be an xreduce.distribute.InputOptions (or "
                             f"tf.distribute.InputOptions) or None; got {type(options).__name__}")
        options = InputOptions(**{f: getattr(options, f) for f in fields})
    if options.experimental_place_dataset_on_device:
        raise ValueError(f"{method}: options.experimental_place_dataset_on_device=True is not supported: xreduce "
                         "reads the dataset where it is and never places it on a device (TF supports it on TPUs only)")
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    if per_replica and method == "experimental_distribute_dataset":
        raise ValueError(f"{method}: options.experimental_replication_mode=PER_REPLICA is supported by "
                         "distribute_datasets_from_function only, as in TF")
    if per_replica and options.experimental_fetch_to_device:
        raise ValueError(f"{method}: options.experimental_fetch_to_device=True works with "
                         "experimental_replication_mode=PER_WORKER only, as in TF; pass False")
    return options


class InputContext:
    """What ``distribute_datasets_from_function`` tells its function (TF's ``tf.distribute.InputContext``).

    Args:
        num_input_pipelines: how many times the function is called in the
            job: one per process (one per replica with ``PER_REPLICA``).
        input_pipeline_id: this call's pipeline, in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: the replicas of the job, every process's.

    Raises:
        ValueError: a count below 1 or an id out of range.

    Example:
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
        >>> ctx.get_per_replica_batch_size(12), str(ctx)
        (2, 'xreduce.distribute.InputContext(input pipeline id 1, total: 2)')
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        for name, value, low in (("num_input_pipelines", num_input_pipelines, 1),
                                 ("num_replicas_in_sync", num_replicas_in_sync, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"InputContext: {name} must be an integer >= {low}; got {value!r}")
        if isinstance(input_pipeline_id, bool) or not isinstance(input_pipeline_id, int) \
                or not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(f"InputContext: input_pipeline_id must be in [0, num_input_pipelines); got "
                             f"input_pipeline_id={input_pipeline_id!r}, num_input_pipelines={num_input_pipelines}")
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas in sync, over every process."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """This input pipeline's id."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines the job has."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size of a global batch, which must divide evenly (TF's rule).

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``num_replicas_in_sync`` (TF's message).

        Example:
            >>> InputContext(1, 0, 6).get_per_replica_batch_size(13)
            Traceback (most recent call last):
            ...
            ValueError: The `global_batch_size` 13 is not divisible by `num_replicas_in_sync` 6
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                             f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}")
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        return f"xreduce.distribute.InputContext(input pipeline id {self._input_pipeline_id}, " \
               f"total: {self._num_input_pipelines})"

    __repr__ = __str__


# --- distributed datasets -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replicas:
    """This process's replicas of a strategy, as input distribution needs them.

    Example:
        >>> Replicas(("/cpu:2", "/cpu:3"), first=2, total=4, num_processes=2, process_id=1).ids
        range(2, 4)
    """

    devices: tuple[str, ...]
    first: int
    total: int
    num_processes: int = 1
    process_id: int = 0

    @property
    def ids(self) -> range:
        """The global ids of this process's replicas."""
        return range(self.first, self.first + len(self.devices))


class DistributedIterator:
    """An iterator of per-replica values; ``get_next()`` is ``next()``, as TF's has it.

    Example:
        >>> it = DistributedIterator(iter([1, 2]))
        >>> it.get_next(), next(it)
        (1, 2)
    """

    def __init__(self, steps: Iterator[Any]):
        self._steps = steps

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        return next(self._steps)

    def get_next(self) -> Any:
        """The next step's per-replica value; StopIteration at the end."""
        return next(self._steps)


class DistributedDataset:
    """Per-replica values of a dataset, step by step; each ``iter()`` reads the dataset afresh.

    Example:
        >>> ds = DistributedDataset(lambda: iter([1, 2]))
        >>> list(ds), list(ds)
        ([1, 2], [1, 2])
    """

    def __init__(self, steps: Callable[[], Iterator[Any]]):
        self._steps = steps

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._steps())


def distribute_dataset(replicas: Replicas, dataset: Any, options: Any = None) -> DistributedDataset:
    """``experimental_distribute_dataset``: each global batch split across the replicas in sync (TF's rule,
    see the module), this process's replicas' slices as ``PerReplica`` values in the batch's structure."""
    where = "experimental_distribute_dataset"
    check_options(options, where)
    elements(dataset, where)  # refuses a non-iterable now, not at the first step

    def steps() -> Iterator[Any]:
        for batch, bounds in global_batches(dataset, replicas.total, where):
            mine = [bounds[g] for g in replicas.ids]
            yield map_structure(
                lambda leaf, mine=mine: PerReplica([leaf[a:b] for a, b in mine], devices=replicas.devices), batch)

    return DistributedDataset(steps)


def distribute_datasets_from_function(replicas: Replicas, dataset_fn: Callable[[InputContext], Any],
                                      options: Any = None) -> DistributedDataset:
    """``distribute_datasets_from_function``: ``dataset_fn(InputContext)`` once per process (``PER_WORKER``:
    at step k, local replica i gets element k·R + i) or once per replica (``PER_REPLICA``); replicas left
    without an element at the last step get an empty batch (zero rows of the last element's shape)."""
    where = "distribute_datasets_from_function"
    options = check_options(options, where)
    if not callable(dataset_fn):
        raise ValueError(f"{where}: dataset_fn must be a function of an InputContext; got "
                         f"{type(dataset_fn).__name__}")
    local = len(replicas.devices)
    if options.experimental_replication_mode is InputReplicationMode.PER_WORKER:
        dataset = dataset_fn(InputContext(replicas.num_processes, replicas.process_id, replicas.total))
        elements(dataset, where)

        def steps() -> Iterator[Any]:
            stream = elements(dataset, where)
            while True:
                step = [next(stream, _END) for _ in range(local)]
                if step[0] is _END:
                    return
                yield _per_replica(step, replicas.devices, where)
    else:
        datasets = [dataset_fn(InputContext(replicas.total, g, replicas.total)) for g in replicas.ids]
        for ds in datasets:
            elements(ds, where)

        def steps() -> Iterator[Any]:
            streams = [elements(ds, where) for ds in datasets]
            while True:
                step = [next(s, _END) for s in streams]
                if all(e is _END for e in step):
                    return
                yield _per_replica(step, replicas.devices, where)

    return DistributedDataset(steps)


_END = object()


def _per_replica(step: list[Any], devices: Sequence[str], where: str) -> Any:
    """One step's elements, one per local replica, as PerReplica values in the elements' structure."""
    present = [e for e in step if e is not _END]
    template = present[-1]
    if len(present) < len(step):
        batch_rows(f"{where}: the last element (an empty batch of its shape goes to the replicas left without one)",
                   template)
        empty = rows_of(template, 0, 0)
        step = [empty if e is _END else e for e in step]
    found: list[list[tuple[str, Any]]] = []
    for element in step:
        found.append([])
        leaves(element, "element", found[-1])
    columns = iter(zip(*[[leaf for _, leaf in f] for f in found]))
    return map_structure(lambda _: PerReplica(list(next(columns)), devices=devices), template)
