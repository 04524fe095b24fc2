"""All-reduce benchmark of the xreduce engine, in the style of nccl-tests.

Runs the engine's hierarchical-copy all-reduce (SUM) over ``--devices`` logical
devices of one backend for every size from ``--min-bytes`` to ``--max-bytes``
(doubling), and in the same run times one device-to-device copy of the same
size on the same backend, so each all-reduce is reported against a peer
measured in the same place at the same time.

Run ``python bench/reduce_bench.py --help`` for the columns.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _sub in ("server", "client"):  # runnable from a checkout without installing
    if str(_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(_ROOT / _sub))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from xreduced.engine import SUM, Engine, Value  # noqa: E402

COLUMNS = """\
columns (one row per size; times are medians over --iters timed runs after --warmup):
  size(B)          bytes of each device's tensor (count x itemsize)
  count(elements)  elements of each device's tensor
  type             the dtype
  time(us)         one all-reduce: Engine.reduce(SUM, value on every device), from the
                   backend synchronized to the backend synchronized again
  algbw(GB/s)      size / time (GB = 1e9 bytes)
  busbw(GB/s)      algbw * 2(n-1)/n with n = --devices, as nccl-tests defines it for
                   all-reduce: the per-link bandwidth an optimal ring would need
  #wrong           result elements (on the first and last device) that differ from
                   the exactly known sum; anything but 0 is a bug
  copy(us)         one backend.copy of the same size from device 0 to device 1, timed
                   the same way
  copybw(GB/s)     size / copy(us): the device-to-device bandwidth of this backend
  algbw/copybw     the all-reduce against that copy, measured in the same run; the
                   hierarchical copy moves 2(n-1) buffers per pack, mostly in
                   sequence, so expect well under 1 (compare runs, not absolutes)

By default inputs are uploaded once before timing and results stay on the devices
(nccl-tests times device-resident buffers too); --end-to-end instead times the full
Engine.reduce with every host upload and download the daemon does for an RPC.
"""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``'1MiB'``, ``'256M'``, ``'4096'`` -> bytes (K, M, G are binary).

    Example:
        >>> parse_bytes("1MiB"), parse_bytes("16M"), parse_bytes("512")
        (1048576, 16777216, 512)
    """
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1MiB, 256MiB, 4096)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def sizes(lo: int, hi: int) -> list[int]:
    """``lo, 2*lo, ...`` up to ``hi`` inclusive (``hi`` itself when it is not on the ladder)."""
    out, s = [], max(lo, 1)
    while s <= hi:
        out.append(s)
        s *= 2
    if not out or out[-1] != hi:
        out.append(hi)
    return out


def make_backend(name: str, devices: int):
    if name == "numpy":
        from xreduced.backends.numpy_backend import NumpyBackend

        return NumpyBackend(devices)
    from xreduced.backends import cupy_backend

    reason = cupy_backend.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--backend cupy: {reason}")
    return cupy_backend.CupyBackend(devices)


class Resident:
    """Wraps a backend so the engine runs on buffers already on the devices.

    ``upload`` of an array registered with :meth:`put` returns its device buffer
    (the executor never writes into its inputs); ``download`` keeps the device
    buffer in ``kept`` and returns nothing to the host. Everything else is the
    wrapped backend's.
    """

    def __init__(self, backend):
        self._b = backend
        self._bufs: dict[tuple[int, int], object] = {}
        self._hold: list[np.ndarray] = []
        self.kept: list[object] = []

    def put(self, device: int, array: np.ndarray) -> None:
        self._hold.append(array)  # keeps id(array) unique while registered
        self._bufs[(device, id(array))] = self._b.upload(device, array)

    def upload(self, device, array):
        buf = self._bufs.get((device, id(array)))
        return self._b.upload(device, array) if buf is None else buf

    def download(self, buf):
        self.kept.append(buf)
        return np.empty(0, np.uint8)

    def __getattr__(self, name):
        return getattr(self._b, name)


def inputs(count: int, dtype: np.dtype, n: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Every device's input and the exact all-reduce sum.

    Device ``d`` holds ``(i % 7) + d``: small integers, so every partial sum is
    exact in every float dtype (bfloat16 included) and integers wrap alike.
    """
    base = (np.arange(count, dtype=np.int32) % 7).astype(dtype)
    arrays = [base + np.array(d).astype(dtype) for d in range(n)]
    want = base * np.array(n).astype(dtype) + np.array(n * (n - 1) // 2).astype(dtype)
    return arrays, want


def timed(fn, sync, iters: int, warmup: int) -> float:
    """Median seconds of ``fn()`` between two ``sync()`` calls."""
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="nccl-tests-style all-reduce benchmark of the xreduce engine (no gRPC), with the "
        "backend's device-to-device copy bandwidth measured in the same run.",
        epilog=COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=["numpy", "cupy"], default="numpy", help="default numpy")
    p.add_argument("--devices", type=int, default=8, help="logical devices (>= 2); default 8")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1MiB"), help="default 1MiB")
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256MiB"), help="default 256MiB")
    p.add_argument("--dtype", default="float32", help="any dtype the wire carries; default float32")
    p.add_argument("--num-packs", type=int, default=1, help="TF's num_packs; default 1")
    p.add_argument("--iters", type=int, default=10, help="timed runs per size; default 10")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per size first; default 3")
    p.add_argument("--end-to-end", action="store_true",
                   help="time Engine.reduce with its host uploads and downloads (the RPC's work)")
    args = p.parse_args(argv)
    if args.devices < 2:
        p.error(f"--devices must be >= 2; got {args.devices}")
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.iters < 1 or args.warmup < 0 or args.num_packs < 0:
        p.error("--iters must be >= 1, --warmup and --num-packs >= 0")
    try:
        dtype = _dtype(args.dtype)
    except TypeError:
        p.error(f"--dtype: unknown dtype {args.dtype!r}")

    backend = make_backend(args.backend, args.devices)
    infos = backend.devices()
    physical = collections.Counter(i.physical_device for i in infos)
    n = args.devices
    print(f"# xreduce all-reduce benchmark: backend={backend.name} devices={n} dtype={dtype.name} "
          f"num_packs={args.num_packs} op=SUM algorithm=hierarchical_copy")
    print(f"# devices: {', '.join(f'{i.device_type}:{i.index}' for i in infos)}")
    print(f"# physical: {'; '.join(f'{name} x{k}' for name, k in physical.items())}")
    print(f"# memory per device: {infos[0].memory_bytes / 2**30:.1f} GiB; peer access 0->1: "
          f"{backend.peer_access()[0][1]}")
    print(f"# timing: median of {args.iters} runs after {args.warmup} warm-up runs, backend synchronized "
          f"around each; {'end to end (host transfers included)' if args.end_to_end else 'device-resident'}")
    print(f"# {'size(B)':>12} {'count(elements)':>16} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} "
          f"{'busbw(GB/s)':>12} {'#wrong':>7} {'copy(us)':>10} {'copybw(GB/s)':>13} {'algbw/copybw':>13}")
    sys.stdout.flush()

    wrong_total, busbws = 0, []
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        count = max(nbytes // dtype.itemsize, 1)
        size = count * dtype.itemsize
        arrays, want = inputs(count, dtype, n)
        value = Value(tuple(range(n)), tuple(arrays))
        resident = None if args.end_to_end else Resident(backend)
        if resident is not None:
            for d, a in enumerate(arrays):
                resident.put(d, a)
        engine = Engine(backend if resident is None else resident)

        def run(engine=engine, resident=resident, value=value):
            if resident is not None:
                resident.kept.clear()
            return engine.reduce(SUM, value, (), num_packs=args.num_packs)

        t = timed(run, backend.synchronize, args.iters, args.warmup)
        result = run()
        backend.synchronize()
        if resident is None:
            outs = [result.arrays[0], result.arrays[-1]]
        else:
            outs = [np.asarray(backend.download(resident.kept[i])) for i in (0, -1)]
        wrong = sum(
            int(np.count_nonzero(o.reshape(-1) != want)) if o.size == count else count for o in outs
        )
        wrong_total += wrong
        del result, outs, resident, engine, run

        src = backend.upload(0, arrays[0])
        backend.synchronize()
        tc = timed(lambda src=src: backend.copy(src, 1), backend.synchronize, args.iters, args.warmup)
        del src, arrays, value

        algbw = size / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        copybw = size / tc / 1e9
        busbws.append(busbw)
        print(f"  {size:>12} {count:>16} {dtype.name:>9} {t * 1e6:>11.1f} {algbw:>12.2f} {busbw:>12.2f} "
              f"{wrong:>7} {tc * 1e6:>10.1f} {copybw:>13.2f} {algbw / copybw:>13.3f}", flush=True)
    print(f"# wrong values: {wrong_total} {'OK' if wrong_total == 0 else 'WRONG'}")
    print(f"# avg busbw: {statistics.fmean(busbws):.2f} GB/s (busbw = algbw * 2({n}-1)/{n})")
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
