"""Concurrent clients against one daemon, every answer checked (a small ``bench/load.py``).

4 clients, each on its own connection, make 30 mixed calls each (ListDevices,
Reduce, BatchReduce, Broadcast; float32, float16 and int32 replicas of 4 B to
256 KiB on random device subsets); every reply must match numpy, no call may
fail, and the daemon must stay within a bounded RSS. A strict xfail shows
that under concurrency of large requests it does not (the in-flight limit
bounds the bytes it counts, not the memory).
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from daemon import DaemonProcess
from xreduce import _codec as codec
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import load  # noqa: E402

CLIENTS = 4
CALLS = 30
MAX_SIZE = 256 << 10
LIMIT = 64 << 20


@pytest.fixture(scope="module")
def loaded():
    proc = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices",
                          str(load.NUM_DEVICES), "--max-inflight-bytes", str(LIMIT)])
    try:
        idle = load.rss_kib(proc.proc.pid) * 1024
        with load.Sampler(proc.proc.pid, proc.address) as sampler:
            report = load.run_clients(proc.address, CLIENTS, CALLS, MAX_SIZE, seed=7, timeout=60)
        yield proc, report, idle, sampler
    finally:
        proc.terminate()


def test_concurrent_mixed_calls_all_succeed_with_the_right_numbers(loaded):
    proc, report, _, _ = loaded
    assert report.total == CLIENTS * CALLS
    assert report.unexpected == []
    assert report.wrong == []
    assert report.limit_rejections == 0  # 4 clients of <= 2 MiB never come near 64 MiB
    assert set(report.calls) == {"ListDevices", "Reduce", "BatchReduce", "Broadcast"}
    assert proc.proc.poll() is None


def test_the_daemon_memory_stays_bounded(loaded):
    proc, report, idle, sampler = loaded
    peak = load.rss_kib(proc.proc.pid, "VmHWM") * 1024
    bound = idle + LIMIT + load.OVERHEAD_FACTOR * report.largest_request
    assert peak <= bound, f"peak RSS {peak >> 20} MiB over {bound >> 20} MiB (idle {idle >> 20} MiB)"
    assert sampler.peak_inflight <= LIMIT


@pytest.mark.xfail(strict=True, reason=(
    "The in-flight limit does not bound the daemon's memory: it counts a request's bytes only while its "
    "handler runs, after gRPC has received and parsed it (so refused calls cost memory too) and before the "
    "reply is serialized and sent, and one call's working set is ~12x its request. Measured: 16 clients "
    "x 5 Reduces of 8 x 1 MiB float32 under --max-inflight-bytes 16 MiB: ~65 of 80 refused, yet VmHWM "
    "+650..730 MiB over idle; bench/load.py 32 x 500 under 256 MiB: peak 1.3-1.6 GB."))
def test_concurrent_large_requests_stay_within_the_limit_plus_overhead():
    """idle + limit + OVERHEAD_FACTOR x the request, whatever the concurrency."""
    limit = 16 << 20
    proc = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8",
                          "--max-inflight-bytes", str(limit)])
    try:
        idle = load.rss_kib(proc.proc.pid) * 1024
        array = np.ones(1 << 18, np.float32)  # 1 MiB a replica, 8 MiB a request
        request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=[
            pb.Component(device=f"CPU:{d}", tensor=codec.encode(array)) for d in range(8)]))
        codes = collections.Counter()

        def client():
            with grpc.insecure_channel(proc.address, options=load.CHANNEL_OPTIONS) as channel:
                stub = pb_grpc.CrossDeviceOpsStub(channel)
                for _ in range(5):
                    try:
                        stub.Reduce(request, timeout=60)
                        codes["OK"] += 1
                    except grpc.RpcError as e:
                        codes[e.code().name] += 1

        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = load.rss_kib(proc.proc.pid, "VmHWM") * 1024
    finally:
        proc.terminate()
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    bound = idle + limit + load.OVERHEAD_FACTOR * request.ByteSize()
    assert peak <= bound, (f"VmHWM {peak >> 20} MiB over {bound >> 20} MiB (idle {idle >> 20} MiB, "
                           f"limit {limit >> 20} MiB, request {request.ByteSize() >> 20} MiB; {dict(codes)})")
