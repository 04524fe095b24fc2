"""The daemon protects itself from the OOM killer: the budget on the shared memory it maps
(``--max-mapped-bytes``) and its own ``oom_score_adj`` (``--oom-score-adj``).

A real daemon subprocess, real POSIX shared memory; "nothing mapped, nothing open" is read from the
daemon's own ``/proc/PID/maps`` and ``/proc/PID/fd``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from daemons import wait_log
from xreduce import _segments
from xreduce._cli import describe_status
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import SESSION_METADATA

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

BUDGET = 1 << 20
"""The daemon's --max-mapped-bytes here: 1 MiB."""


@pytest.fixture(scope="module")
def d(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2",
                               "--max-mapped-bytes", "1MiB", "--metrics-listen", "127.0.0.1:0")


@pytest.fixture()
def stub(d):
    with grpc.insecure_channel(d.address) as channel:
        yield pb_grpc.CrossDeviceOpsStub(channel)


class Session:
    """An open session (its stream, with the probe) and the segments made for it, unlinked at the end."""

    def __init__(self, stub):
        self.stub = stub
        self.segments: list[_segments.Segment] = []
        self.probe = self.make(64)
        self.probe.base[:16] = ord("p")
        self.stream = stub.OpenSession(pb.OpenSessionRequest(probe_shm_key=self.probe.name, probe_nonce=b"p" * 16),
                                       timeout=60)
        first = next(self.stream)
        assert first.shared_memory, first.shared_memory_error
        self.md = ((SESSION_METADATA, first.session_id),)

    def make(self, size: int) -> _segments.Segment:
        seg = _segments.Segment(size, "xrt")
        self.segments.append(seg)
        return seg

    def register(self, seg: _segments.Segment, size: int) -> None:
        self.stub.RegisterRegion(pb.RegisterRegionRequest(name=seg.name, shm_key=seg.name, byte_size=size),
                                 metadata=self.md, timeout=10)

    def unregister(self, seg: _segments.Segment) -> None:
        self.stub.UnregisterRegion(pb.UnregisterRegionRequest(name=seg.name), metadata=self.md, timeout=10)

    def close(self) -> None:
        self.stream.cancel()
        for seg in self.segments:
            seg.unlink()


@pytest.fixture()
def session(stub):
    assert wait_until(lambda: mapped_bytes(stub) == 0), "the last test's sessions are gone"
    s = Session(stub)
    yield s
    s.close()


def mapped_bytes(stub) -> int:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=10).mapped_bytes


def shm_fds(pid: int) -> list[str]:
    """The shared-memory objects process ``pid`` holds open."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith(_segments.SHM_DIR + "/"):
            found.append(target)
    return found


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def in_maps(pid: int, name: str) -> bool:
    return name in read(f"/proc/{pid}/maps")


def may_lower_oom_score() -> bool:
    """Whether this process has CAP_SYS_RESOURCE (root in a container may not)."""
    (effective,) = [line.split()[1] for line in read("/proc/self/status").splitlines() if line.startswith("CapEff:")]
    return bool(int(effective, 16) >> 24 & 1)  # CAP_SYS_RESOURCE is capability 24


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_a_region_over_the_budget_is_refused_before_anything_is_opened(d, stub, session):
    pid = d.proc.pid
    first, second = session.make(768 << 10), session.make(512 << 10)
    session.register(first, 768 << 10)
    assert mapped_bytes(stub) == 768 << 10  # the probe's 16 bytes were given back once it was read
    fds, maps = shm_fds(pid), read(f"/proc/{pid}/maps")
    with pytest.raises(grpc.RpcError) as info:
        session.register(second, 512 << 10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == (
        f"max-mapped-bytes: region {second.name!r} of 524288 bytes (512 KiB) would bring the shared memory this "
        "daemon maps to 1310720 bytes (1.25 MiB), over its budget of 1048576 bytes (1 MiB) (--max-mapped-bytes / "
        "XREDUCE_MAX_MAPPED_BYTES)")
    assert not in_maps(pid, second.name) and in_maps(pid, first.name)
    assert sorted(shm_fds(pid)) == sorted(fds) and not any(second.name in f for f in shm_fds(pid))
    assert read(f"/proc/{pid}/maps").count(_segments.SHM_DIR) == maps.count(_segments.SHM_DIR)
    regions = stub.ListRegions(pb.ListRegionsRequest(), metadata=session.md, timeout=10).regions
    assert [r.name for r in regions] == [first.name]
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert (status.mapped_bytes, status.limits.max_mapped_bytes) == (768 << 10, BUDGET)


def test_a_released_region_gives_its_bytes_back(d, stub, session):
    other = Session(stub)  # opened first: its probe, too, needs room in the budget
    try:
        a, b, c = session.make(BUDGET), session.make(BUDGET), other.make(4096)
        session.register(a, BUDGET)  # the whole budget
        with pytest.raises(grpc.RpcError) as info:
            session.register(b, 1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        session.unregister(a)
        session.register(b, BUDGET)
        assert mapped_bytes(stub) == BUDGET
        with pytest.raises(grpc.RpcError) as info:  # another session's region too, until the first one ends
            other.register(c, 4096)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A session opened now is told its shared memory cannot be mapped (its process takes gRPC).
        late = stub.OpenSession(pb.OpenSessionRequest(probe_shm_key=session.probe.name, probe_nonce=b"p" * 16),
                                timeout=60)
        first = next(late)
        late.cancel()
        assert not first.shared_memory
        assert first.shared_memory_error.startswith(f"max-mapped-bytes: the probe {session.probe.name!r} of 16 "
                                                    "bytes (16 B) would bring"), first.shared_memory_error
        session.stream.cancel()  # the session ends: its regions go, and their bytes
        assert wait_until(lambda: mapped_bytes(stub) == 0)
        assert not in_maps(d.proc.pid, b.name)
        other.register(c, 4096)
        assert mapped_bytes(stub) == 4096
    finally:
        other.close()
    assert wait_until(lambda: mapped_bytes(stub) == 0)


def test_status_and_metrics_show_the_budget_and_the_oom_score(d, stub, session):
    seg = session.make(4096)
    session.register(seg, 4096)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    in_effect = int(read(f"/proc/{d.proc.pid}/oom_score_adj"))
    assert status.oom_score_adj == in_effect
    text = describe_status(status, d.address)
    for line in ("  max mapped bytes     1 MiB (1048576)", "  mapped bytes         4 KiB (4096)",
                 f"  oom_score_adj        {in_effect}"):
        assert line + "\n" in text, text
    metrics_address = wait_log(d, r"event=metrics address=(\S+)").group(1)
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        samples = dict(line.split(" ", 1) for line in r.read().decode().splitlines() if not line.startswith("#"))
    assert {name: float(samples[name]) for name in ("xreduce_mapped_bytes", "xreduce_mapped_bytes_limit",
                                                   "xreduce_oom_score_adj")} == {
        "xreduce_mapped_bytes": 4096, "xreduce_mapped_bytes_limit": BUDGET, "xreduce_oom_score_adj": in_effect}


def test_the_daemon_sets_its_oom_score_adj(start_daemon):
    """Raising the score needs no privilege: the setting is applied whatever this process may do."""
    inherited = int(read("/proc/self/oom_score_adj"))
    wanted = max(inherited + 1, 300)
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "1",
                     env={"XREDUCE_OOM_SCORE_ADJ": str(wanted)})
    assert int(read(f"/proc/{d.proc.pid}/oom_score_adj")) == wanted
    assert "oom_score_adj" not in d.log()  # no warning


def assert_refused_and_serving(d) -> None:
    """The daemon ``d``, which could not lower its score, said so once and what to do, and serves."""
    inherited = int(read("/proc/self/oom_score_adj"))
    warning = wait_log(d, r"WARNING xreduced event=oom_score_adj_refused (.*)").group(1)
    assert warning.startswith(f"wanted=-900 in_effect={inherited} error='Permission denied': lowering "
                              "oom_score_adj needs CAP_SYS_RESOURCE"), warning
    for advice in ("docker run --oom-score-adj -900", "compose oom_score_adj: -900", "system-node-critical",
                   "Guaranteed-QoS", "--oom-score-adj / XREDUCE_OOM_SCORE_ADJ"):
        assert advice in warning, advice
    assert d.log().count("oom_score_adj_refused") == 1
    assert int(read(f"/proc/{d.proc.pid}/oom_score_adj")) == inherited
    with grpc.insecure_channel(d.address) as channel:
        status = pb_grpc.CrossDeviceOpsStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.oom_score_adj == inherited


def test_the_default_oom_score_adj_is_minus_900_where_the_kernel_lets_the_daemon(d):
    """Here the daemon has CAP_SYS_RESOURCE, or (root in some containers) it has not and warns."""
    if int(read("/proc/self/oom_score_adj")) <= -900:
        pytest.skip("this process's oom_score_adj is -900 or lower already")
    if may_lower_oom_score():
        assert int(read(f"/proc/{d.proc.pid}/oom_score_adj")) == -900
        assert "oom_score_adj" not in d.log()
    else:
        assert_refused_and_serving(d)


@pytest.mark.skipif(not may_lower_oom_score() or shutil.which("setpriv") is None,
                    reason="needs CAP_SYS_RESOURCE and setpriv to start a daemon without it (without it, the "
                    "test above sees the warning)")
def test_without_cap_sys_resource_the_daemon_warns_and_serves(start_daemon):
    if int(read("/proc/self/oom_score_adj")) <= -900:
        pytest.skip("this process's oom_score_adj is -900 or lower already")
    drop = ["setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource", "--"]
    assert_refused_and_serving(start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices",
                                            "1", wrapper=drop))


def test_an_oom_score_adj_out_of_range_is_refused_at_start():
    """(Its environment twin is refused alike: tests/unit/test_config.py.)"""
    run = subprocess.run([sys.executable, "-m", "xreduced", "--listen", "127.0.0.1:0", "--oom-score-adj", "-2000"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr == ("xreduced: --oom-score-adj must be an integer in [-1000, 1000] (the kernel's range for "
                          "oom_score_adj); got -2000\n")
