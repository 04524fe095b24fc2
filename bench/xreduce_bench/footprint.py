"""A job's memory over a run of ``xreduce bench --big-tensors``, sampled from ``/proc``, and the machine's guard.

Every ``period`` seconds (20 ms) a thread reads, for each process of the job
(its workers and the daemon, or gloo's ranks), ``RssAnon`` and ``RssShmem``
from ``/proc/PID/status``, and how far the used bytes of ``/dev/shm``
(``statvfs``) grew since the watch began. The job's **footprint** is the sum
of its processes' ``RssAnon`` plus that growth: shared memory counted once,
however many processes map it (a sum of ``RssShmem`` would count a segment
once per process that maps it). Other processes' shared memory counts too
when it comes or goes during a run: a window in which ``/dev/shm`` fell below
its start says so (:attr:`Window.disturbed`).

The phases of a run (idle after initialize, then each size) are windows of
time that the workers report; :meth:`Footprint.window` folds the samples of
one window into its peaks and forgets every sample up to its end, so what is
kept is the phase that runs (at most :data:`MAX_SAMPLES`).

The watch also guards a shared machine: when ``MemAvailable`` falls under
``floor`` bytes it kills the job's workers (SIGKILL, by their pids, each while
it is still this process's child; never the daemon, which the run stops
itself) and says why in :attr:`Footprint.starved`, before the kernel's OOM
killer picks someone else's process.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterable
from typing import Any

from xreduce_bench.daemon_memory import Sampler, status_kib

PERIOD = 0.02
MAX_SAMPLES = 1 << 16
"""Samples kept at most (22 minutes at 20 ms): the oldest go first."""
FLOOR = 512 << 20
"""MemAvailable under which the watched workers are killed."""
SHM = "/dev/shm"


def shm_used(path: str = SHM) -> int:
    """Bytes used in the file system at ``path`` (``/dev/shm``: POSIX shared memory), from ``statvfs``.

    Example:
        >>> shm_used() >= 0
        True
    """
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes: what can be allocated without swapping.

    Example:
        >>> mem_available() > 0
        True
    """
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise OSError("/proc/meminfo has no MemAvailable line")


@dataclasses.dataclass(frozen=True)
class Window:
    """What the samples of one window of time hold, in bytes.

    Attributes:
        samples: the samples in which every process of the job was read.
        peak: the largest footprint (sum of ``RssAnon`` + ``/dev/shm`` growth).
        median: the median footprint (the idle baseline is the idle window's).
        shm: the ``/dev/shm`` growth in the sample of the peak.
        processes: each process's peaks: ``{"rss_anon": ..., "rss_shmem": ...}``.
        shm_low: the lowest ``/dev/shm`` growth; below 0, shared memory of processes outside the job went
            away during it, and the footprint undercounts (see :attr:`disturbed`).

    Example:
        >>> w = Window(3, 300, 200, 100, {"daemon": {"rss_anon": 50, "rss_shmem": 100}})
        >>> w.to_dict()["processes"]["daemon"]["rss_shmem"]
        100
    """

    samples: int
    peak: int
    median: int
    shm: int
    processes: dict[str, dict[str, int]]
    shm_low: int = 0

    @property
    def disturbed(self) -> bool:
        """Whether ``/dev/shm`` fell below where it was when the watch began: other processes' doing."""
        return self.shm_low < 0

    def to_dict(self) -> dict[str, Any]:
        """The fields, as ``--json`` writes them."""
        return {**dataclasses.asdict(self), "disturbed": self.disturbed}


_Sample = tuple[float, int, tuple[tuple[str, int, int], ...]]
"""(monotonic time, /dev/shm growth, ((process name, RssAnon, RssShmem), ...)), bytes."""


class Footprint(Sampler):
    """Samples the memory of the processes it is told to :meth:`watch`, inside a ``with`` block (and once
    more when it stops).

    Args:
        period: seconds between samples.
        floor: ``MemAvailable`` in bytes under which the workers are killed (see the module's docstring).

    Example:
        >>> with Footprint(period=0.01) as fp:
        ...     fp.watch("process 0", os.getpid())
        ...     start = time.monotonic()
        >>> w = fp.window(start, time.monotonic(), ["process 0"])  # stopping took a last sample
        >>> w.samples > 0, w.peak >= w.median > 0, sorted(w.processes["process 0"])
        (True, True, ['rss_anon', 'rss_shmem'])
    """

    def __init__(self, period: float = PERIOD, floor: int = FLOOR):
        super().__init__(period)
        self.floor = floor
        self.shm_start = shm_used()
        self.starved: str | None = None
        self._pids: dict[str, tuple[int, bool]] = {}
        self._samples: collections.deque[_Sample] = collections.deque(maxlen=MAX_SAMPLES)
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int, worker: bool = True) -> None:
        """Samples process ``pid`` as ``name`` from now on; a ``worker`` is killed if memory runs out."""
        with self._lock:
            self._pids[name] = (pid, worker)

    def window(self, start: float, end: float, names: Iterable[str]) -> Window:
        """The peaks of the samples from ``start`` to ``end`` (``time.monotonic()``) in which every process of
        ``names`` was read; the samples up to ``end`` are forgotten."""
        names = set(names)
        with self._lock:
            chosen = [s for s in self._samples if start <= s[0] <= end and names <= {n for n, _, _ in s[2]}]
            while self._samples and self._samples[0][0] <= end:
                self._samples.popleft()
        totals = [(shm + sum(anon for n, anon, _ in procs if n in names), shm) for _, shm, procs in chosen]
        processes: dict[str, dict[str, int]] = {n: {"rss_anon": 0, "rss_shmem": 0} for n in sorted(names)}
        for _, _, procs in chosen:
            for n, anon, shmem in procs:
                if n in processes:
                    peak = processes[n]
                    peak["rss_anon"], peak["rss_shmem"] = max(peak["rss_anon"], anon), max(peak["rss_shmem"], shmem)
        peak, shm = max(totals, default=(0, 0))
        return Window(len(chosen), peak, int(statistics.median(t for t, _ in totals)) if totals else 0, shm,
                      processes, min((s for _, s in totals), default=0))

    def _sample(self) -> None:
        with self._lock:
            pids = dict(self._pids)
        procs = []
        for name, (pid, _) in pids.items():
            try:
                kib = status_kib(pid)
            except OSError:  # gone: the samples without it are not the whole job's
                continue
            procs.append((name, kib["RssAnon"] << 10, kib["RssShmem"] << 10))
        sample = (time.monotonic(), shm_used() - self.shm_start, tuple(procs))
        with self._lock:
            self._samples.append(sample)
        available = mem_available()
        if available < self.floor:
            self.starved = self.starved or (
                f"MemAvailable fell to {available / (1 << 20):.0f} MiB (under {self.floor / (1 << 20):.0f} MiB): "
                "the workers were stopped before the machine ran out")
            for pid, worker in pids.values():
                if worker and _parent(pid) == os.getpid():  # still this process's child: not a pid reused
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _parent(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc/PID/stat``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
