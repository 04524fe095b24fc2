"""The memory-traffic floor of an all-reduce on the daemon's host devices, against the machine's copy bandwidth.

On host memory the daemon runs a plan fused (``xreduced.executor``): for every
chunk it reads each device's input once, adds in a cache-sized scratch, and
writes the result once into each destination. Through shared memory nothing
else moves: the inputs are read where the callers put them and the results
written where they read them. So one all-reduce over ``n`` devices of ``S``
bytes each reads ``n x S`` and writes ``n x S`` bytes at least, and no plan
can beat that traffic divided by what the machine moves per second when it
copies (each copied byte read once and written once, as numpy's ``copyto``
does).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

PROBE_BYTES = 64 << 20
"""The size of the copy that measures the bandwidth: well past the caches of the machines measured here."""


def copy_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Bytes read plus bytes written per second by ``np.copyto`` of ``nbytes``, median of ``repeats``.

    Example:
        >>> copy_bandwidth(1 << 20, 3) > 0
        True
    """
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # the destination's pages, faulted in before the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


def floor_line(devices: int, size: int, bandwidth: float, measured: dict[str, float]) -> str:
    """What ``xreduce bench`` prints: the traffic of one all-reduce over ``devices`` of ``size`` bytes, the floor
    at ``bandwidth`` (bytes per second), and each measured median (name -> seconds) as a multiple of it.

    Example:
        >>> print(floor_line(4, 64 << 20, 10e9, {"shm": 0.0537}))  # doctest: +NORMALIZE_WHITESPACE
        # memory-traffic floor: 4 devices x 64 MiB read + 4 x 64 MiB written = 512 MiB per all-reduce; at the
        measured copy bandwidth 10.00 GB/s (reads + writes of np.copyto, 64 MiB) that is 53.7 ms; measured:
        shm 53.7 ms = 1.00 x the floor
    """
    traffic = 2 * devices * size
    floor = traffic / bandwidth
    each = ", ".join(f"{name} {t * 1e3:.1f} ms = {t / floor:.2f} x the floor" for name, t in measured.items())
    return (f"# memory-traffic floor: {devices} devices x {size / (1 << 20):.4g} MiB read + {devices} x "
            f"{size / (1 << 20):.4g} MiB written = {traffic / (1 << 20):.4g} MiB per all-reduce; at the measured copy "
            f"bandwidth {bandwidth / 1e9:.2f} GB/s (reads + writes of np.copyto, {PROBE_BYTES >> 20} MiB) that is "
            f"{floor * 1e3:.1f} ms; measured: {each}")
