"""Concurrent clients against one daemon, every answer checked (a small ``bench/load.py``),
and the daemon's memory within the stated bound (``xreduced.memory.memory_bound``).

4 clients, each on its own connection, make 30 mixed calls each (ListDevices,
Reduce, BatchReduce, Broadcast; float32, float16 and int32 replicas of 4 B to
256 KiB on random device subsets); every reply must match numpy, no call may
fail, and the daemon's peak RSS must stay within idle + the in-flight limit +
the stated overhead. Then 16 clients send 8 MiB Reduces at once, again and
again, against an in-flight limit that admits one at a time: the refused calls
and the admitted ones together must stay within the bound too.
"""

from __future__ import annotations

import collections
import threading

import grpc
import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce_bench import load
from xreduced import admission, memory

CLIENTS = 4
CALLS = 30
MAX_SIZE = 256 << 10
LIMIT = 64 << 20


@pytest.fixture(scope="module")
def loaded(start_module_daemon):
    proc = start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices",
                               str(load.NUM_DEVICES), "--max-inflight-bytes", str(LIMIT))
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
    bound = memory.memory_bound(idle, LIMIT, report.largest_message)
    assert peak <= bound, f"peak RSS {peak >> 20} MiB over {bound >> 20} MiB (idle {idle >> 20} MiB)"
    assert sampler.peak_inflight <= LIMIT


@pytest.mark.slow
def test_concurrent_large_requests_stay_within_the_limit_plus_overhead(start_daemon):
    """16 clients x 5 Reduces of 8 x 1 MiB float32: the limit admits one at a time (its working set is
    2 x 8 MiB + 4 x 8 MiB of results), the others are refused; every request still costs memory while gRPC
    receives it, before it can be counted, so the bound counts 16 messages in transfer."""
    clients, calls = 16, 5
    array = np.ones(1 << 18, np.float32)  # 1 MiB a replica, 8 MiB a request and a reply
    request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=[
        pb.Component(device=f"CPU:{d}", tensor=codec.encode(array)) for d in range(8)]))
    size = request.ByteSize()
    working_set = admission.working_set(request, size)
    limit = working_set + size  # room for one call, not two
    proc = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8",
                        "--max-inflight-bytes", str(limit))
    try:
        idle = load.rss_kib(proc.proc.pid) * 1024
        codes = collections.Counter()
        wrong = []

        def client():
            with grpc.insecure_channel(proc.address, options=load.CHANNEL_OPTIONS) as channel:
                stub = pb_grpc.CrossDeviceOpsStub(channel)
                for _ in range(calls):
                    try:
                        reply = stub.Reduce(request, timeout=60)
                    except grpc.RpcError as e:
                        codes[e.code().name] += 1
                        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "--max-inflight-bytes" not in (
                                e.details() or ""):
                            wrong.append(e.details())
                        continue
                    codes["OK"] += 1
                    if any(codec.decode(c.tensor).tolist() != [8.0] * array.size for c in reply.result.components):
                        wrong.append("a wrong sum")

        with load.Sampler(proc.proc.pid, proc.address) as sampler:
            threads = [threading.Thread(target=client) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        peak = load.rss_kib(proc.proc.pid, "VmHWM") * 1024
    finally:
        proc.terminate()
    assert wrong == [], wrong[:3]
    assert codes["OK"] + codes["RESOURCE_EXHAUSTED"] == clients * calls and codes["OK"] >= 1, codes
    assert sampler.peak_inflight <= limit
    bound = memory.memory_bound(idle, limit, size, transfers=clients)
    assert peak <= bound, (f"VmHWM {peak >> 20} MiB over {bound >> 20} MiB (idle {idle >> 20} MiB, "
                           f"limit {limit >> 20} MiB, request {size >> 20} MiB; {dict(codes)})")
