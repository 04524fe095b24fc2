"""Many concurrent clients against one daemon: every answer right, memory bounded by the in-flight limit.

Starts ``xreduced`` (numpy backend, 8 host devices, ``--max-inflight-bytes``),
measures its idle RSS, then runs ``--clients`` threads, each on its own
channel (its own TCP connection), each making ``--calls`` mixed calls:

* ListDevices (10%),
* Reduce (40%): SUM or MEAN of float32, float16 or int32 replicas on a random
  subset of the 8 devices, to the value's own devices (all-reduce) or to a
  random subset, with hierarchical copy or reduction to one device and a
  random ``num_packs``,
* BatchReduce (25%): 1-4 pairs on one device set, one dtype (or mixed dtypes
  with ``num_packs=0``),
* Broadcast (25%): from a random source to a random set of destinations.

A replica's size is log-uniform between 4 B and ``--max-size`` (4 MiB); a
batch splits that size among its pairs. Inputs are small integers, so sums are
exact in every dtype; every reply is checked against numpy (devices, dtype,
shape and values). RESOURCE_EXHAUSTED from the in-flight limit is expected
and counted; any other error is unexpected.

While it runs, the daemon's RSS (``/proc/PID/status`` VmRSS) is sampled
every 50 ms and its in-flight bytes (GetStatus) likewise; at the end its
VmHWM (the kernel's peak) is read too. The stated bound is the daemon's
(``xreduced.memory.memory_bound``, one largest message in transfer at once):

    idle RSS + max-inflight-bytes + (TRANSFER_FACTOR + OVERHEAD_FACTOR) x the largest message

Usage:
    .venv/bin/python bench/load.py [--clients 32] [--calls 500] [--max-inflight-mib 256]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import sys
import threading
import time

import grpc
import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduced import memory

from xreduce_bench.daemon import DaemonProcess

NUM_DEVICES = 8
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32))
MIB = 1 << 20

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.use_local_subchannel_pool", 1),  # each client its own connection
]


def canonical(index: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:CPU:{index}"


def device_index(name: str) -> int:
    return int(name.rsplit(":", 1)[1])


# --- generating calls and what they must answer -------------------------------------------------------------


@dataclasses.dataclass
class Expected:
    """What a reply must hold: per result, destination -> array (dtype and shape included)."""

    results: list[dict[int, np.ndarray]]


def _size(rng: np.random.Generator, max_size: int) -> int:
    """Bytes, log-uniform in [4, max_size]."""
    return int(math.exp(rng.uniform(math.log(4), math.log(max_size))))


def _array(rng: np.random.Generator, dtype: np.dtype, nbytes: int) -> np.ndarray:
    n = max(1, nbytes // dtype.itemsize)
    flat = rng.integers(-8, 9, n, dtype=np.int8).astype(dtype)
    if n >= 4 and n % 2 == 0 and rng.random() < 0.5:
        return flat.reshape(2, n // 2)
    return flat


def _devices(rng: np.random.Generator, at_least: int = 1) -> list[int]:
    return [int(d) for d in rng.permutation(NUM_DEVICES)[: int(rng.integers(at_least, NUM_DEVICES + 1))]]


def _reduced(arrays: list[np.ndarray], mean: bool) -> np.ndarray:
    """What SUM or MEAN of the replicas must give, in the daemon's dtype (MEAN promotes int32 to float64, even
    for one replica; only a lone replica reduced onto its own device comes back as it is)."""
    dtype = arrays[0].dtype
    total = np.sum(np.stack([a.astype(np.float64) for a in arrays]), axis=0)
    if not mean:
        return total.astype(dtype)
    out_dtype = np.float64 if dtype.kind == "i" else dtype
    return (total / len(arrays)).astype(out_dtype)


def _value(rng, dtype, nbytes, devices) -> tuple[pb.DistributedValue, list[np.ndarray]]:
    shape_source = _array(rng, dtype, nbytes)
    arrays = [rng.integers(-8, 9, shape_source.shape, dtype=np.int8).astype(dtype) for _ in devices]
    value = pb.DistributedValue(components=[
        pb.Component(device=f"CPU:{d}", tensor=codec.encode(a)) for d, a in zip(devices, arrays)])
    return value, arrays


def make_reduce(rng, max_size):
    dtype = DTYPES[rng.integers(len(DTYPES))]
    devices = _devices(rng)
    value, arrays = _value(rng, dtype, _size(rng, max_size), devices)
    mean = rng.random() < 0.25
    request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_MEAN if mean else pb.REDUCE_OP_SUM, value=value)
    dests = devices
    if rng.random() < 0.5:
        dests = _devices(rng)
        request.destinations.extend(f"/cpu:{d}" for d in dests)
    if rng.random() < 0.2:
        request.algorithm = pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE
        if rng.random() < 0.5:
            request.reduce_to_device = f"CPU:{int(rng.integers(NUM_DEVICES))}"
    if rng.random() < 0.3:
        request.num_packs = int(rng.choice([0, 1, 2, 4, 7]))
    want = _reduced(arrays, mean)
    if set(dests) == set(devices) and len(devices) == 1:
        want = arrays[0]  # identity, even for MEAN
    return "Reduce", request, Expected([{d: want for d in dests}])


def make_batch(rng, max_size):
    devices = _devices(rng)
    n = int(rng.integers(1, 5))
    mixed = rng.random() < 0.2
    dtype = DTYPES[rng.integers(len(DTYPES))]
    mean = rng.random() < 0.25
    request = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_MEAN if mean else pb.REDUCE_OP_SUM)
    expected = []
    all_reduce = rng.random() < 0.6
    for _ in range(n):
        pair_dtype = DTYPES[rng.integers(len(DTYPES))] if mixed else dtype
        order = [int(d) for d in rng.permutation(devices)]
        value, arrays = _value(rng, pair_dtype, max(4, _size(rng, max_size) // n), order)
        dests = order if all_reduce else _devices(rng)
        request.pairs.add(value=value, destinations=[] if all_reduce else [f"CPU:{d}" for d in dests])
        want = arrays[0] if len(order) == 1 and set(dests) == set(order) else _reduced(arrays, mean)
        expected.append({d: want for d in dests})
    if mixed:
        request.num_packs = 0
    elif rng.random() < 0.3:
        request.num_packs = int(rng.choice([0, 1, 2, 3, 8]))
    return "BatchReduce", request, Expected(expected)


def make_broadcast(rng, max_size):
    dtype = DTYPES[rng.integers(len(DTYPES))]
    array = _array(rng, dtype, _size(rng, max_size))
    dests = _devices(rng)
    request = pb.BroadcastRequest(tensor=codec.encode(array), destinations=[f"CPU:{d}" for d in dests])
    if rng.random() < 0.5:
        request.source_device = f"CPU:{int(rng.integers(NUM_DEVICES))}"
    return "Broadcast", request, Expected([{d: array for d in dests}])


def make_call(rng: np.random.Generator, max_size: int):
    """(method, request, Expected or None)."""
    r = rng.random()
    if r < 0.10:
        return "ListDevices", pb.ListDevicesRequest(), None
    if r < 0.50:
        return make_reduce(rng, max_size)
    if r < 0.75:
        return make_batch(rng, max_size)
    return make_broadcast(rng, max_size)


def check_reply(method: str, reply, expected: Expected | None) -> str | None:
    """None when the reply is right, else what is wrong."""
    if method == "ListDevices":
        names = [d.name for d in reply.devices]
        return None if names == [canonical(i) for i in range(NUM_DEVICES)] else f"devices {names}"
    results = ([reply.result] if method in ("Reduce", "Broadcast")
               else [r.result for r in reply.results])
    if len(results) != len(expected.results):
        return f"{len(results)} results, expected {len(expected.results)}"
    for i, (result, want) in enumerate(zip(results, expected.results)):
        got = {device_index(c.device): codec.decode(c.tensor) for c in result.components}
        if set(got) != set(want) or len(result.components) != len(want):
            return f"result {i}: devices {sorted(got)}, expected {sorted(want)}"
        for d, array in got.items():
            w = want[d]
            if array.dtype != w.dtype or array.shape != w.shape:
                return f"result {i} on CPU:{d}: {array.dtype}{list(array.shape)}, expected {w.dtype}{list(w.shape)}"
            rtol = {2: 1e-3, 4: 1e-6}.get(w.dtype.itemsize, 0) if w.dtype.kind == "f" else 0
            if not np.allclose(array.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=0):
                bad = np.flatnonzero(array.astype(np.float64).ravel() != w.astype(np.float64).ravel())
                return (f"result {i} on CPU:{d}: {bad.size} wrong values, first at {int(bad[0])}: "
                        f"{array.ravel()[bad[0]]} vs {w.ravel()[bad[0]]}")
    return None


# --- running ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    codes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    limit_rejections: int = 0
    unexpected: list[str] = dataclasses.field(default_factory=list)
    wrong: list[str] = dataclasses.field(default_factory=list)
    largest_request: int = 0
    largest_reply: int = 0
    request_bytes: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @property
    def largest_message(self) -> int:
        return max(self.largest_request, self.largest_reply)


def run_clients(address: str, clients: int, calls: int, max_size: int = 4 * MIB, seed: int = 0,
                timeout: float = 120.0) -> Report:
    """``clients`` threads, each on its own channel, each making ``calls`` checked calls."""
    report = Report()
    lock = threading.Lock()

    def client(index: int) -> None:
        rng = np.random.default_rng([seed, index])
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.CrossDeviceOpsStub(channel)
            for _ in range(calls):
                method, request, expected = make_call(rng, max_size)
                size = request.ByteSize()
                problem = wrong = None
                code = "OK"
                reply_size = 0
                try:
                    reply = getattr(stub, method)(request, timeout=timeout)
                    reply_size = reply.ByteSize()
                    wrong = check_reply(method, reply, expected)
                except grpc.RpcError as e:
                    code = e.code().name
                    limited = (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                               and "--max-inflight-bytes" in (e.details() or ""))
                    if not limited:
                        problem = f"{method} ({size} B): {code}: {(e.details() or '')[:300]}"
                with lock:
                    report.calls[method] += 1
                    report.codes[code] += 1
                    report.request_bytes += size
                    report.largest_request = max(report.largest_request, size)
                    report.largest_reply = max(report.largest_reply, reply_size)
                    if code == "RESOURCE_EXHAUSTED" and problem is None:
                        report.limit_rejections += 1
                    if problem:
                        report.unexpected.append(problem)
                    if wrong:
                        report.wrong.append(f"{method} ({size} B): {wrong}")

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}") for i in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.seconds = time.monotonic() - start
    return report


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


class Sampler:
    """Samples the daemon's VmRSS and its in-flight bytes every ``period`` seconds."""

    def __init__(self, pid: int, address: str, period: float = 0.05):
        self.pid, self.period = pid, period
        self.peak_rss_kib = 0
        self.peak_inflight = 0
        self.samples = 0
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.CrossDeviceOpsStub(self._channel)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_rss_kib = max(self.peak_rss_kib, rss_kib(self.pid))
            try:
                status = self._stub.GetStatus(pb.GetStatusRequest(), timeout=5)
                self.peak_inflight = max(self.peak_inflight, status.inflight_bytes)
            except grpc.RpcError:
                pass
            self.samples += 1
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--calls", type=int, default=500, help="calls per client (default 500)")
    p.add_argument("--max-inflight-mib", type=int, default=256, help="the daemon's --max-inflight-bytes, in MiB")
    p.add_argument("--max-size", type=int, default=4 * MIB, help="largest replica, bytes (default 4 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for the daemon, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    args = p.parse_args(argv)

    limit = args.max_inflight_mib * MIB
    proc = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", str(NUM_DEVICES),
                          "--max-inflight-bytes", str(limit)],
                         env=dict(e.split("=", 1) for e in args.daemon_env))
    try:
        # idle: after a few small calls of each kind, so that lazily loaded code is in
        warm = run_clients(proc.address, 1, 20, max_size=64, seed=args.seed + 1)
        assert not warm.unexpected and not warm.wrong, (warm.unexpected, warm.wrong)
        time.sleep(0.5)
        idle = rss_kib(proc.proc.pid) * 1024
        with Sampler(proc.proc.pid, proc.address) as sampler:
            report = run_clients(proc.address, args.clients, args.calls, args.max_size, args.seed)
        hwm = rss_kib(proc.proc.pid, "VmHWM") * 1024
        alive = proc.proc.poll() is None
    finally:
        proc.terminate()

    peak = sampler.peak_rss_kib * 1024
    bound = memory.memory_bound(idle, limit, report.largest_message)
    factor = memory.TRANSFER_FACTOR + memory.OVERHEAD_FACTOR
    mib = lambda n: f"{n / MIB:.1f} MiB"  # noqa: E731
    if args.daemon_env:
        print("daemon environment: " + " ".join(args.daemon_env))
    print(f"xreduce load: {args.clients} clients x {args.calls} calls = {report.total} calls in "
          f"{report.seconds:.1f} s ({report.total / report.seconds:.0f} calls/s, "
          f"{report.request_bytes / MIB / report.seconds:.0f} MiB/s of requests)")
    print("calls: " + ", ".join(f"{m} {n}" for m, n in sorted(report.calls.items())))
    print("codes: " + ", ".join(f"{c} {n}" for c, n in report.codes.most_common()))
    print(f"replica sizes 4 B .. {mib(args.max_size)}; requests {mib(report.request_bytes)} in all, "
          f"largest {mib(report.largest_request)}; largest reply {mib(report.largest_reply)}")
    print(f"unexpected errors: {len(report.unexpected)}; wrong results: {len(report.wrong)}; "
          f"RESOURCE_EXHAUSTED from the in-flight limit (expected): {report.limit_rejections}")
    for line in (report.unexpected + report.wrong)[:10]:
        print("  " + line)
    print(f"daemon alive after the run: {alive}")
    print(f"daemon RSS: idle {mib(idle)}; peak {mib(peak)} ({sampler.samples} samples, 50 ms); "
          f"VmHWM {mib(hwm)}")
    print(f"in-flight bytes (GetStatus samples): peak {mib(sampler.peak_inflight)} of "
          f"--max-inflight-bytes {mib(limit)}")
    within = max(peak, hwm) <= bound
    print(f"bound: idle + limit + {factor} x largest message = {mib(idle)} + {mib(limit)} + "
          f"{factor} x {mib(report.largest_message)} = {mib(bound)}: peak "
          f"{'within' if within else 'OVER'} ({mib(max(peak, hwm) - idle)} above idle, "
          f"{mib(max(peak, hwm) - idle - limit)} above idle + limit)")
    return 0 if alive and within and not report.unexpected and not report.wrong else 1


if __name__ == "__main__":
    sys.exit(main())
