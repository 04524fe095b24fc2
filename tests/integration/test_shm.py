"""The shared-memory transport: sessions, regions, their misuse, and the SDK's use of them.

Every test talks to a real daemon subprocess; regions are real POSIX shared
memory, and "released" is checked in the daemon's own ``/proc/PID/maps``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import xreduce
from children import child_env
from xreduce import _segments, _shared_arrays, _shared_memory
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import SESSION_METADATA
from xreduce_bench.daemon import DaemonProcess

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

F32 = pb.DATA_TYPE_FLOAT32
DEVICES = ["CPU:0", "CPU:1"]


@pytest.fixture(scope="module")
def d(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--virtual-devices", "4", "--collective-timeout", "20")


@pytest.fixture()
def stub(d):
    with grpc.insecure_channel(d.address) as channel:
        yield pb_grpc.CrossDeviceOpsStub(channel)


class Session:
    """A raw session: the open stream, its id, and segments registered under it."""

    def __init__(self, stub, probe: bool = True):
        self.stub = stub
        request = pb.OpenSessionRequest()
        self.probe = None
        if probe:
            self.probe = _segments.Segment(64, "xrt")
            request.probe_shm_key = self.probe.name
            request.probe_nonce = b"n" * 16
            self.probe.base[:16] = ord("n")
        self.stream = stub.OpenSession(request, timeout=60)
        self.first = next(self.stream)
        self.id = self.first.session_id
        self.segments: list[_segments.Segment] = []

    @property
    def md(self):
        return ((SESSION_METADATA, self.id),)

    def segment(self, size: int, name: str | None = None) -> _segments.Segment:
        seg = _segments.Segment(size, "xrt")
        self.segments.append(seg)
        self.stub.RegisterRegion(pb.RegisterRegionRequest(name=name or seg.name, shm_key=seg.name, byte_size=size),
                                 metadata=self.md, timeout=10)
        return seg

    def close(self):
        self.stream.cancel()
        for seg in self.segments:
            seg.unlink()
        if self.probe is not None:
            self.probe.unlink()


@pytest.fixture()
def session(stub):
    s = Session(stub)
    yield s
    s.close()


def region_tensor(name: str, offset: int, n: int) -> pb.Tensor:
    return pb.Tensor(dtype=F32, shape=[n], region=pb.RegionSlice(name=name, offset=offset, byte_size=4 * n))


def reduce_request(name: str, n: int, output: pb.RegionSlice | None = None, **kw) -> pb.ReduceRequest:
    value = pb.DistributedValue(components=[
        pb.Component(device=dev, tensor=region_tensor(name, i * 4 * n, n)) for i, dev in enumerate(DEVICES)])
    return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value, output=output, **kw)


def mapped(d: DaemonProcess, name: str) -> bool:
    with open(f"/proc/{d.proc.pid}/maps") as f:
        return name in f.read()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def assert_serves(stub):
    """The daemon still answers a plain reduce."""
    t = pb.Tensor(dtype=F32, shape=[1], float_values=[1.0])
    reply = stub.Reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=[
        pb.Component(device=dev, tensor=t) for dev in DEVICES])), timeout=10)
    assert list(reply.result.components[0].tensor.float_values) == [2.0]


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# --- sessions and the probe ------------------------------------------------------------------------------------


def test_the_probe_tells_whether_the_daemon_reads_our_memory(stub, session):
    assert session.first.shared_memory and session.first.shared_memory_error == ""
    other = stub.OpenSession(pb.OpenSessionRequest(probe_shm_key="xrt-no-such-object", probe_nonce=b"x"),
                             timeout=10)
    first = next(other)
    other.cancel()
    assert not first.shared_memory
    assert "xrt-no-such-object" in first.shared_memory_error
    assert first.session_id != session.id and len(first.session_id) >= 32


# --- the data path -------------------------------------------------------------------------------------------------


def test_reduce_reads_regions_and_writes_into_the_output_region(d, stub, session):
    n = 1000
    inputs = session.segment(2 * 4 * n)
    out = session.segment(4096 * 4)
    x = inputs.base[:8 * n].view(np.float32)
    x[:n] = np.arange(n)
    x[n:] = 0.5
    reply = stub.Reduce(reduce_request(inputs.name, n, pb.RegionSlice(name=out.name, byte_size=out.size)),
                        metadata=session.md, timeout=10)
    want = np.arange(n, dtype=np.float32) + np.float32(0.5)
    assert len(reply.result.components) == 2
    for comp in reply.result.components:
        t = comp.tensor
        assert t.raw_data == b"" and t.HasField("region") and t.region.name == out.name
        assert t.region.offset % 64 == 0 and t.region.byte_size == 4 * n
        got = out.base[t.region.offset:t.region.offset + 4 * n].view(np.float32)
        assert got.tobytes() == want.tobytes()
    # Without an output region the result comes back as bytes, in the request's encoding.
    reply = stub.Reduce(reduce_request(inputs.name, n), metadata=session.md, timeout=10)
    assert np.frombuffer(reply.result.components[1].tensor.raw_data, np.float32).tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["Reduce", "BatchReduce"])
@pytest.mark.parametrize("n", [1000, 300_000])  # one chunk of the fused path, and several
def test_output_one_copy_writes_one_copy_and_names_it_for_every_destination(stub, session, kind, n):
    """The same layout, the first destination's place written, the second's left as it was; MEAN too."""
    inputs = session.segment(2 * 4 * n)
    out = session.segment(2 * 4 * n + 128)
    x = inputs.base[:8 * n].view(np.float32)
    x[:n] = np.arange(n) % 1013
    x[n:] = 0.5
    out.base[:] = 0xAB
    output = pb.RegionSlice(name=out.name, byte_size=out.size)
    if kind == "Reduce":
        reply = stub.Reduce(reduce_request(inputs.name, n, output, output_one_copy=True), metadata=session.md,
                            timeout=30).result
    else:
        single = reduce_request(inputs.name, n)
        reply = stub.BatchReduce(pb.BatchReduceRequest(
            reduce_op=pb.REDUCE_OP_MEAN, pairs=[pb.ReducePair(value=single.value, destinations=DEVICES)],
            output=output, output_one_copy=True), metadata=session.md, timeout=30).results[0].result
    want = (np.arange(n) % 1013).astype(np.float32) + np.float32(0.5)
    if kind == "BatchReduce":
        want /= np.float32(2)
    regions = [c.tensor.region for c in reply.components]
    assert [c.device.rsplit("device:", 1)[-1] for c in reply.components] == DEVICES
    assert len({(r.name, r.offset, r.byte_size) for r in regions}) == 1 and regions[0].offset == 0
    assert out.base[:4 * n].view(np.float32).tobytes() == want.tobytes()
    second = -(-4 * n // 64) * 64  # where the full layout puts the second destination: not written
    assert (out.base[second:second + 4 * n] == 0xAB).all()


def test_output_one_copy_without_output_is_invalid(stub, session):
    inputs = session.segment(2 * 4 * 4)
    code, details = code_and_details(lambda: stub.Reduce(reduce_request(inputs.name, 4, output_one_copy=True),
                                                         metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("output_one_copy: true without output"), details
    assert_serves(stub)


def test_broadcast_and_batch_reduce_through_regions(stub, session):
    seg = session.segment(1 << 16)
    seg.base[:16].view(np.float32)[:] = [1, 2, 3, 4]
    out = pb.RegionSlice(name=seg.name, offset=4096, byte_size=1 << 15)
    reply = stub.Broadcast(pb.BroadcastRequest(tensor=region_tensor(seg.name, 0, 4), destinations=["CPU:2", "CPU:3"],
                                               output=out), metadata=session.md, timeout=10)
    for comp in reply.result.components:
        r = comp.tensor.region
        assert seg.base[r.offset:r.offset + 16].view(np.float32).tolist() == [1, 2, 3, 4]
    value = pb.DistributedValue(components=[pb.Component(device=dev, tensor=region_tensor(seg.name, 0, 4))
                                            for dev in DEVICES])
    reply = stub.BatchReduce(pb.BatchReduceRequest(
        reduce_op=pb.REDUCE_OP_MEAN, pairs=[pb.ReducePair(value=value), pb.ReducePair(value=value,
                                                                                      destinations=["CPU:3"])],
        output=out), metadata=session.md, timeout=10)
    placed = [c.tensor.region for r in reply.results for c in r.result.components]
    assert len(placed) == 3 and len({r.offset for r in placed}) == 3
    for r in placed:
        assert seg.base[r.offset:r.offset + 16].view(np.float32).tolist() == [1, 2, 3, 4]


# --- misuse --------------------------------------------------------------------------------------------------------


def test_an_unregistered_region_is_not_found(stub, session):
    session.segment(4096, name="mine")
    code, details = code_and_details(lambda: stub.Reduce(reduce_request("nope", 4), metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "value.components[0].tensor.region.name" in details and "'nope'" in details and "'mine'" in details
    assert_serves(stub)


@pytest.mark.parametrize("case", ["past-the-end", "negative", "size-mismatch", "misaligned", "output-too-small",
                                  "data-and-region"])
def test_bad_offsets_and_sizes_are_invalid(stub, session, case):
    seg = session.segment(4096)
    request = reduce_request(seg.name, 4)
    tensor = request.value.components[1].tensor
    want = "value.components[1].tensor"
    if case == "past-the-end":
        tensor.region.offset = 4096 - 8
        want = "outside region"
    elif case == "negative":
        tensor.region.offset = -16
        want = "outside region"
    elif case == "size-mismatch":
        tensor.region.byte_size = 12
        want = "region.byte_size: 12 bytes for float32[4], expected 16"
    elif case == "misaligned":
        tensor.region.offset = 18
        want = "region.offset: must be a multiple of the float32 item size (4); got 18"
    elif case == "output-too-small":
        request.output.CopyFrom(pb.RegionSlice(name=seg.name, offset=0, byte_size=70))
        want = "output.byte_size: the results need 80 bytes"
    else:
        tensor.raw_data = b"\0" * 16
        want = "names a region and carries raw_data"
    code, details = code_and_details(lambda: stub.Reduce(request, metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert want in details
    assert_serves(stub)


def test_another_clients_region_is_refused(stub, session):
    seg = session.segment(4096)
    other = Session(stub, probe=False)
    try:
        code, details = code_and_details(
            lambda: stub.Reduce(reduce_request(seg.name, 4), metadata=other.md, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "belongs to another session" in details
        # Its own id is the only way to a session's regions; without one, or with a closed one, there are none.
        code, details = code_and_details(lambda: stub.Reduce(reduce_request(seg.name, 4), timeout=10))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "x-xreduce-session" in details
    finally:
        other.close()
    code, details = code_and_details(lambda: stub.Reduce(
        reduce_request(seg.name, 4), metadata=((SESSION_METADATA, "forged-session-id"),), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "is not open" in details
    assert_serves(stub)


@pytest.mark.parametrize("key,want", [("../etc/passwd", "shm_key: must be a shared-memory object name"),
                                      ("xrt-does-not-exist", "no shared-memory object 'xrt-does-not-exist'")])
def test_registering_a_bad_object_is_invalid(stub, session, key, want):
    code, details = code_and_details(lambda: stub.RegisterRegion(
        pb.RegisterRegionRequest(name="r", shm_key=key, byte_size=16), metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and want in details


def test_registering_past_the_objects_end_or_twice_is_invalid(stub, session):
    seg = session.segment(4096, name="r")
    code, details = code_and_details(lambda: stub.RegisterRegion(pb.RegisterRegionRequest(
        name="s", shm_key=seg.name, offset=4000, byte_size=200), metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "4000 + 200 = 4200 bytes" in details and "holds 4096" in details
    code, details = code_and_details(lambda: stub.RegisterRegion(pb.RegisterRegionRequest(
        name="r", shm_key=seg.name, byte_size=16), metadata=session.md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "already registered" in details
    assert [r.name for r in stub.ListRegions(pb.ListRegionsRequest(), metadata=session.md, timeout=10).regions] == ["r"]


def test_a_region_freed_mid_call_stays_valid_until_the_call_ends(d, stub, session):
    """Process 0 waits in a collective using its region; meanwhile it unregisters and unlinks it."""
    n = 256
    seg = session.segment(1 << 16)
    seg.base[:4 * n].view(np.float32)[:] = 3.0
    other = Session(stub, probe=False)
    try:
        theirs = other.segment(1 << 16)
        theirs.base[:4 * n].view(np.float32)[:] = 4.0
        group = f"freed-{os.getpid()}-{time.monotonic_ns()}"

        def part(s: Session, name: str, pid: int, device: str) -> pb.ReduceRequest:
            value = pb.DistributedValue(components=[pb.Component(device=device, tensor=region_tensor(name, 0, n))])
            return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value, output=pb.RegionSlice(
                name=name, offset=8192, byte_size=8192), collective=pb.CollectiveSpec(
                group=group, num_processes=2, process_id=pid))

        replies = {}
        first = threading.Thread(target=lambda: replies.setdefault(0, stub.Reduce(
            part(session, seg.name, 0, "CPU:0"), metadata=session.md, timeout=30)))
        first.start()
        assert wait_until(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5).collectives_waiting == 1)
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name=seg.name), metadata=session.md, timeout=10)
        seg.unlink()
        assert mapped(d, seg.name), "still mapped: the waiting call uses it"
        replies[1] = stub.Reduce(part(other, theirs.name, 1, "CPU:1"), metadata=other.md, timeout=30)
        first.join(30)
        for pid, s in ((0, seg), (1, theirs)):
            r = replies[pid].result.components[0].tensor.region
            assert s.base[r.offset:r.offset + 4 * n].view(np.float32).tolist() == [7.0] * n
        assert wait_until(lambda: not mapped(d, seg.name)), "released once the call ended"
        code, details = code_and_details(lambda: stub.Reduce(reduce_request(seg.name, 4), metadata=session.md,
                                                             timeout=10))
        assert code == grpc.StatusCode.NOT_FOUND
    finally:
        other.close()


def test_closing_the_session_releases_its_regions(d, stub):
    s = Session(stub)
    seg = s.segment(1 << 16)
    assert mapped(d, seg.name)
    s.close()
    assert wait_until(lambda: not mapped(d, seg.name))


def test_a_killed_client_process_releases_its_regions(d, tmp_path):
    code = f"""
import sys, numpy as np, xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
x = [xreduce.shared_array(1000, "float32") for _ in range(2)]
ops = HierarchicalCopyAllReduce(address={d.address!r}, transport="shm")
ops.reduce("sum", PerReplica(x, devices=["CPU:0", "CPU:1"]), "CPU:0")
from xreduce import _shared_arrays
print(" ".join(_shared_arrays.find(a)[0] for a in x), flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2 and all(mapped(d, n) for n in names)
    finally:
        proc.kill()
        proc.wait(10)
    assert wait_until(lambda: not any(mapped(d, n) for n in names))
    assert wait_until(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names)), "its reaper unlinks them"


# --- the SDK -------------------------------------------------------------------------------------------------------


def _bytes_in(stub, method: str) -> int:
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    return next((m.bytes_in for m in status.methods if m.method.endswith("/" + method)), 0)


@pytest.mark.parametrize("transport", ["auto", "shm", "wire"])
def test_the_sdk_sends_no_tensor_bytes_over_shared_memory(d, stub, monkeypatch, transport):
    if transport == "auto":
        monkeypatch.delenv("XREDUCE_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("XREDUCE_TRANSPORT", transport)
    ops = HierarchicalCopyAllReduce(address=d.address)
    x = np.arange(1 << 14, dtype=np.float32)  # under the SDK's streaming threshold: one BatchReduce
    before = _bytes_in(stub, "BatchReduce")
    got = ops.batch_reduce("sum", [(PerReplica([x, x], devices=DEVICES), DEVICES)])[0]
    sent = _bytes_in(stub, "BatchReduce") - before
    assert got.values[1].tobytes() == (2 * x).tobytes()
    if transport == "wire":
        assert sent > 2 * x.nbytes
    else:
        assert sent < 1024, f"{sent} bytes went over the wire"


def test_shared_arrays_are_not_copied_and_results_are_views_of_the_output(d, stub, monkeypatch):
    n = _shared_memory.COPY_RESULTS_UP_TO // 4 + 1024  # results over the copy threshold stay views of the output
    a, b = xreduce.shared_array(n, "float32"), xreduce.shared_array(n, "float32")
    a[:], b[:] = 1.0, 2.0
    ops = HierarchicalCopyAllReduce(address=d.address, transport="shm")
    transport = ops.client.shared_memory()
    staged = []
    acquire = transport._staging.acquire
    monkeypatch.setattr(transport._staging, "acquire", lambda n: staged.append(n) or acquire(n))
    got = ops.reduce("sum", PerReplica([a, b], devices=DEVICES), DEVICES)
    assert got.values[0].tolist() == [3.0] * n
    assert staged == [], "nothing was copied into staging"
    names = [r.name for r in ops.client.list_regions(10, session=transport.session_id()).regions]
    assert _shared_arrays.find(a)[0] in names and _shared_arrays.find(b)[0] in names
    small = ops.reduce("sum", PerReplica([np.ones(4), np.ones(4)], devices=DEVICES), DEVICES)
    assert staged == [64 + 32], "plain arrays are staged"
    assert small.values[0].base is None, "a small result is copied out: it pins no segment"
    assert isinstance(got.values[0].base, np.ndarray), "a view of the output segment, not a copy"
    # A result keeps its output segment busy: the next call gets another one, and the first stays intact.
    again = ops.reduce("sum", PerReplica([b, b], devices=DEVICES), DEVICES)
    assert again.values[0][0] == 4.0 and got.values[0][0] == 3.0
    a_name = _shared_arrays.find(a)[0]
    del a, got
    assert wait_until(lambda: a_name not in [r.name for r in ops.client.list_regions(
        10, session=transport.session_id()).regions]), "freed arrays are unregistered"


def test_transport_names_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="transport must be one of auto, shm, wire; got 'udp'"):
        xreduce.Client("127.0.0.1:1", transport="udp")
    monkeypatch.setenv("XREDUCE_TRANSPORT", "tcp")
    with pytest.raises(ValueError, match="XREDUCE_TRANSPORT must be one of auto, shm, wire; got 'tcp'"):
        _ = xreduce.Client("127.0.0.1:1").transport


def test_the_sdk_reopens_its_session_after_a_daemon_restart(tmp_path, start_daemon):
    sock = f"unix:{tmp_path}/x.sock"
    proc = start_daemon("--listen", sock, "--virtual-devices", "2")
    try:
        x = xreduce.shared_array(100, "float32")
        x[:] = 1.0
        ops = HierarchicalCopyAllReduce(address=sock, transport="shm")
        value = PerReplica([x, x], devices=DEVICES)
        assert ops.reduce("sum", value, "CPU:0")[0] == 2.0
        old = ops.client.shared_memory().session()
        proc.kill()
        assert wait_until(lambda: not old.alive.is_set()), "the session's stream ended with the daemon"
        proc = start_daemon("--listen", sock, "--virtual-devices", "2")
        assert ops.reduce("sum", value, "CPU:0")[1] == 2.0
        assert ops.client.shared_memory().session() is not old
    finally:
        proc.terminate()


# --- what a review found --------------------------------------------------------------------------------------------


def test_symlinks_and_shrunk_objects_are_refused_and_the_daemon_survives(d, stub, session, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s3cret!!" * 512)
    link = f"xrt-link-{os.getpid()}-{time.monotonic_ns()}"
    os.symlink(secret, f"/dev/shm/{link}")
    try:
        code, details = code_and_details(lambda: stub.RegisterRegion(pb.RegisterRegionRequest(
            name="link", shm_key=link, byte_size=16), metadata=session.md, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "is a symbolic link" in details
    finally:
        os.unlink(f"/dev/shm/{link}")
    seg = session.segment(1 << 16)
    os.truncate(f"/dev/shm/{seg.name}", 0)  # would be a SIGBUS in the daemon at the next read
    code, details = code_and_details(lambda: stub.Reduce(reduce_request(seg.name, 4), metadata=session.md,
                                                         timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shrank" in details
    assert_serves(stub)


def test_threads_sharing_a_new_shared_array_register_it_once(d):
    x = xreduce.shared_array(1000, "float32")
    x[:] = 1.0
    ops = HierarchicalCopyAllReduce(address=d.address, transport="shm")
    value = PerReplica([x, x], devices=DEVICES)
    errors, results = [], []

    def work():
        try:
            results.append(float(ops.reduce("sum", value, "CPU:0")[0]))
        except Exception as e:  # collected: the assertion below names it
            errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [2.0] * 8


def test_a_forked_child_leaves_its_parents_segments_alone(d):
    """A child forked after the SDK was used exits normally (atexit, finalizers): the parent's
    segments and regions must survive it. Run in a fresh process, away from pytest's threads."""
    code = f"""
import os, sys, numpy as np, xreduce
from xreduce import _shared_arrays
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
x = xreduce.shared_array(1000, "float32")
x[:] = 2.0
ops = HierarchicalCopyAllReduce(address={d.address!r}, transport="shm")
value = PerReplica([x, x], devices=["CPU:0", "CPU:1"])
assert ops.reduce("sum", value, "CPU:0")[0] == 4.0
pid = os.fork()
if pid == 0:
    del value, x
    sys.exit(0)  # a normal exit: atexit handlers and finalizers run in the child
_, status = os.waitpid(pid, 0)
print(status, os.path.exists("/dev/shm/" + _shared_arrays.find(x)[0]), ops.reduce("sum", value, "CPU:0")[0], flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(),
                          timeout=60)
    assert done.stdout.split() == ["0", "True", "4.0"], done.stderr


@pytest.mark.slow
def test_too_many_sessions_fall_back_to_the_wire(tmp_path, start_daemon):
    proc = start_daemon("--listen", f"unix:{tmp_path}/s.sock", "--virtual-devices", "2", "--workers", "4")
    code = f"""
import numpy as np, sys, xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
ops = HierarchicalCopyAllReduce(address={f"unix:{tmp_path}/s.sock"!r}, transport=sys.argv[1])
print(ops.reduce("sum", PerReplica([np.ones(3)] * 2, devices=["CPU:0", "CPU:1"]), "CPU:0")[0], flush=True)
print(ops.client.shared_memory() is not None, flush=True)
sys.stdin.read()
"""
    children = []
    try:
        for _ in range(2):  # --workers 4: two sessions at most
            children.append(subprocess.Popen([sys.executable, "-c", code, "shm"], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True, env=child_env()))
            assert children[-1].stdout.readline().strip() == "2.0"
            assert children[-1].stdout.readline().strip() == "True"
        third = subprocess.run([sys.executable, "-c", code, "auto"], input="", capture_output=True, text=True,
                               env=child_env(), timeout=60)
        assert third.stdout.split() == ["2.0", "False"], third.stderr
        insist = subprocess.run([sys.executable, "-c", code, "shm"], input="", capture_output=True, text=True,
                                env=child_env(), timeout=60)
        assert insist.returncode != 0 and "sessions are open, the most this daemon serves" in insist.stderr
    finally:
        for c in children:
            c.kill()
            c.wait(10)
        proc.terminate()


def test_sigterm_ends_sessions_instead_of_waiting_out_the_grace(tmp_path, start_daemon):
    proc = start_daemon("--listen", f"unix:{tmp_path}/g.sock", "--virtual-devices", "2", "--grace-seconds", "120")
    code = f"""
import numpy as np, sys, xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
ops = HierarchicalCopyAllReduce(address={f"unix:{tmp_path}/g.sock"!r}, transport="shm")
print(ops.reduce("sum", PerReplica([np.ones(3)] * 2, devices=["CPU:0", "CPU:1"]), "CPU:0")[0], flush=True)
sys.stdin.read()
"""
    client = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=child_env())
    try:
        assert client.stdout.readline().strip() == "2.0"
        # A bounded wait far below the grace: the open session must not hold the daemon for 120 s.
        assert proc.terminate(timeout=60) == 0
    finally:
        client.kill()
        client.wait(10)


def _desync_worker(address: str, group: str, pid: int, fail: bool, queue) -> None:
    """Three collectives; in process ``fail``, staging the first one fails on this side (a full /dev/shm)."""
    os.environ.update(XREDUCE_ADDRESS=address, XREDUCE_GROUP=group)
    from xreduce import distribution
    from xreduce.distribute import CommunicationOptions

    info = distribution.initialize(num_processes=2, process_id=pid)
    del info
    from xreduce._runtime import process_group

    devices = list(process_group().local_devices)
    if fail:
        stage = _shared_memory.SharedMemory.stage

        def full_once(self, arrays):
            _shared_memory.SharedMemory.stage = stage
            raise OSError(28, "No space left on device")

        _shared_memory.SharedMemory.stage = full_once
    ops = HierarchicalCopyAllReduce(transport="shm")
    out = []
    for step in range(3):
        value = PerReplica([np.full(4, (pid + 1) * 10 ** step, np.float32)] * len(devices), devices=devices)
        try:
            got = ops.reduce("sum", value, value, options=CommunicationOptions(timeout_seconds=30))
            out.append(float(got.values[0][0]))
        except Exception as e:  # reported to the test, which names what it expected
            out.append(type(e).__name__)
    queue.put((pid, out))


def test_a_failure_on_one_side_aborts_the_collective_and_the_next_ones_pair_up(d):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    group = f"desync-{os.getpid()}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_desync_worker, args=(d.address, group, pid, pid == 1, queue)) for pid in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    # Each process has 2 of the daemon's 4 devices: 2 x 10**step from process 0, 2 x 2 x 10**step from process 1.
    assert results[1] == ["OSError", 60.0, 600.0]
    assert results[0] == ["AbortedError", 60.0, 600.0], "the others fail at once, and the next collectives pair up"
