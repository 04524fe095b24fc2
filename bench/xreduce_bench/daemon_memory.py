"""The daemon's memory over a run of ``xreduce bench --embedded``, against its stated bound.

The daemon started for the run is sampled every 50 ms (``/proc/PID/status``):
its resident set, split into its own memory (``RssAnon``) and the pages of
the callers' shared-memory regions it maps (``RssShmem``, the callers'
memory, which the SDK counts too), and the kernel's peak (``VmHWM``). The
bound is :func:`xreduced.memory.memory_bound`: idle RSS + ``--max-inflight-bytes``
+ the allowance for the largest message, read from the daemon's call log.
"""

from __future__ import annotations

import re
import threading

from xreduced import memory
from xreduced.config import Config

FIELDS = ("VmRSS", "RssAnon", "RssShmem", "VmHWM")


def status_kib(pid: int) -> dict[str, int]:
    """The :data:`FIELDS` of ``/proc/PID/status``, in KiB (0 when the kernel has none).

    Example:
        >>> import os
        >>> sorted(status_kib(os.getpid()))
        ['RssAnon', 'RssShmem', 'VmHWM', 'VmRSS']
    """
    found = dict.fromkeys(FIELDS, 0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in found:
                found[name] = int(rest.split()[0])
    return found


class Sampler:
    """A thread that calls :meth:`_sample` every ``period`` seconds inside a ``with`` block, and once more when
    it stops; subclasses say what a sample is.

    Example:
        >>> class Count(Sampler):
        ...     n = 0
        ...     def _sample(self):
        ...         self.n += 1
        >>> with Count(0.01) as c:
        ...     pass
        >>> c.n >= 1
        True
    """

    def __init__(self, period: float):
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"xreduce-bench-{type(self).__name__}")

    def _sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops sampling, after a last sample (once; later calls do nothing)."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sample()

    def __exit__(self, *exc) -> None:
        self.stop()


class MemoryWatch(Sampler):
    """Samples a process's :func:`status_kib` every ``period`` seconds inside a ``with`` block; keeps the peaks.

    Example:
        >>> import os
        >>> with MemoryWatch(os.getpid(), period=0.01) as watch:
        ...     pass
        >>> watch.idle["VmRSS"] > 0 and watch.peak["VmRSS"] >= 0
        True
    """

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(period)
        self.pid = pid
        self.idle = status_kib(pid)
        self.peak = dict.fromkeys(FIELDS, 0)
        self.samples = 0

    def _sample(self) -> None:
        try:
            now = status_kib(self.pid)
        except OSError:  # the daemon is gone; the run reports why
            return
        self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
        self.samples += 1


def largest_message(log: str) -> int:
    """The largest request or reply of the daemon's call log (``event=call`` lines), in bytes.

    Example:
        >>> largest_message("event=call id=1 method=/x bytes_in=62 bytes_out=36 ms=1.0\\n"
        ...                 "event=call id=2 method=/y bytes_in=10 bytes_out=4096 ms=2.0")
        4096
    """
    sizes = [int(n) for pair in re.findall(r"bytes_in=(\d+) bytes_out=(\d+)", log) for n in pair]
    return max(sizes, default=0)


def report(watch: MemoryWatch, log: str) -> str:
    """The line ``xreduce bench`` prints: peak RSS, its split, and the stated bound with the verdict.

    Example:
        >>> class W:
        ...     idle = {"VmRSS": 60 << 10, "RssAnon": 50 << 10, "RssShmem": 0, "VmHWM": 60 << 10}
        ...     peak = {"VmRSS": 900 << 10, "RssAnon": 90 << 10, "RssShmem": 800 << 10, "VmHWM": 910 << 10}
        ...     samples = 10
        >>> print(report(W(), "bytes_in=1024 bytes_out=100"))  # doctest: +NORMALIZE_WHITESPACE
        # daemon memory over the run (10 samples, 50 ms): idle RSS 60.0 MiB; peak RSS 900.0 MiB
        (its own memory 90.0 MiB, the callers' shared-memory regions it maps 800.0 MiB), VmHWM 910.0 MiB;
        bound: idle + --max-inflight-bytes 4096.0 MiB + 6 x largest message 1024 B = 4156.0 MiB: within
    """
    limit = Config().max_inflight_bytes
    big = largest_message(log)
    idle = watch.idle["VmRSS"] << 10
    bound = memory.memory_bound(idle, limit, big)
    peak = max(watch.peak["VmRSS"], watch.peak["VmHWM"]) << 10
    verdict = "within" if peak <= bound else "OVER"

    def mib(kib: int) -> str:
        return f"{kib / 1024:.1f} MiB"

    return (f"# daemon memory over the run ({watch.samples} samples, 50 ms): idle RSS {mib(watch.idle['VmRSS'])}; "
            f"peak RSS {mib(watch.peak['VmRSS'])} (its own memory {mib(watch.peak['RssAnon'])}, the callers' "
            f"shared-memory regions it maps {mib(watch.peak['RssShmem'])}), VmHWM {mib(watch.peak['VmHWM'])}; "
            f"bound: idle + --max-inflight-bytes {limit / (1 << 20):.1f} MiB + "
            f"{memory.TRANSFER_FACTOR + memory.OVERHEAD_FACTOR} x largest message {big} B = "
            f"{bound / (1 << 20):.1f} MiB: {verdict}")
