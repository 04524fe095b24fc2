"""xreduced.oom: the default budget of the shared memory the daemon maps (a pure function of the node's
``/proc/meminfo`` and cgroup files), the budget's accounting in the region table, and ``oom_score_adj``."""

from __future__ import annotations

import logging
import math
import os
import threading

import numpy as np
import pytest
from xreduce import _segments
from xreduced import oom
from xreduced.admission import LimitExceeded
from xreduced.config import Config
from xreduced.metrics import Stats
from xreduced.oom import MappedBytes, cgroup_limit_files, default_max_mapped_bytes
from xreduced.regions import RegionTable

GiB = 1 << 30
MEMINFO = """MemTotal:       65536000 kB
MemFree:        60000000 kB
MemAvailable:   62000000 kB
Shmem:            123456 kB
"""
V1_NO_LIMIT = "9223372036854771712\n"


@pytest.mark.parametrize("meminfo, limits, want", [
    (MEMINFO, [], 65536000 * 1024 // 2),
    (MEMINFO, ["max\n"], 65536000 * 1024 // 2),  # cgroup v2: no limit
    (MEMINFO, [V1_NO_LIMIT], 65536000 * 1024 // 2),  # cgroup v1: no limit is a page-rounded 2**63
    (MEMINFO, [f"{16 * GiB}\n"], 8 * GiB),  # a container's limit below the node's memory
    (MEMINFO, [f"{32 * GiB}\n", "max\n", f"{12 * GiB}\n"], 6 * GiB),  # the tightest of the cgroup and its parents
    (MEMINFO, [f"{512 * GiB}\n"], 65536000 * 1024 // 2),  # a limit above the node's memory limits nothing
    ("", [f"{4 * GiB}\n"], 2 * GiB),  # no meminfo: the cgroup's limit alone
    ("", [], None),  # neither: no budget
    ("MemTotal: lots\n", ["garbage", ""], None),
], ids=["meminfo", "v2-max", "v1-unlimited", "container", "tightest", "above-node", "no-meminfo", "nothing",
        "malformed"])
def test_the_default_budget_is_half_the_smaller_of_memtotal_and_the_cgroup_limit(meminfo, limits, want):
    assert default_max_mapped_bytes(meminfo, limits) == want


@pytest.mark.parametrize("proc_cgroup, want", [
    ("0::/\n", ["/cg/memory.max"]),  # cgroup v2, a container with its own cgroup namespace
    ("0::/system.slice/xreduced.service\n", ["/cg/system.slice/xreduced.service/memory.max",
                                             "/cg/system.slice/memory.max", "/cg/memory.max"]),
    ("12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n",  # v1 (hybrid: v2 too)
     ["/cg/memory/docker/abc/memory.limit_in_bytes", "/cg/memory/docker/memory.limit_in_bytes",
      "/cg/memory/memory.limit_in_bytes", "/cg/memory.max"]),
    ("5:memory,hugetlb:/\n", ["/cg/memory/memory.limit_in_bytes"]),
    ("", []),  # not Linux, or no cgroups
], ids=["v2-namespaced", "v2-systemd", "v1-docker", "v1-joined", "none"])
def test_the_cgroup_files_read_are_those_of_the_process_and_above(proc_cgroup, want):
    assert cgroup_limit_files(proc_cgroup, "/cg") == want


def test_the_budget_of_a_configuration():
    assert MappedBytes.from_config(Config(max_mapped_bytes=GiB)).limit == GiB
    assert MappedBytes.from_config(Config()).limit == oom.node_max_mapped_bytes()


def test_the_budget_is_counted_exactly_under_threads():
    budget = MappedBytes(1000)
    refused = []

    def work():
        for _ in range(200):
            try:
                budget.reserve(7, "region 'x'")
            except LimitExceeded:
                refused.append(1)
                continue
            budget.release(7)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert budget.value == 0 and not refused  # 8 x 7 bytes at most at once
    budget.reserve(1000, "region 'all'")  # up to the budget exactly
    with pytest.raises(LimitExceeded) as info:
        budget.reserve(1, "region 'one'")
    assert info.value.limit == "max_mapped_bytes" and info.value.code.name == "RESOURCE_EXHAUSTED"
    assert budget.value == 1000  # a refusal counts nothing


def test_the_budget_gauges():
    budget = MappedBytes(4096)
    budget.reserve(100, "region 'a'")
    r = Stats(mapped=budget).registry
    assert r.get_sample_value("xreduce_mapped_bytes") == 100
    assert r.get_sample_value("xreduce_mapped_bytes_limit") == 4096
    assert r.get_sample_value("xreduce_oom_score_adj") == oom.score_adj()
    assert Stats().registry.get_sample_value("xreduce_mapped_bytes_limit") == math.inf


# --- the region table's accounting, on real shared memory -------------------------------------------------------

shm = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")


@pytest.fixture()
def segments():
    made = []

    def make(size: int) -> _segments.Segment:
        made.append(_segments.Segment(size, "xrt"))
        return made[-1]

    yield make
    for seg in made:
        seg.unlink()


def open_shm_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@shm
def test_a_refused_region_opens_nothing_and_files_nothing(segments):
    table = RegionTable(mapped=MappedBytes(8192))
    session = table.open_session()
    a, b = segments(8192), segments(4096)
    table.register(session.id, "a", "shm", a.name, 0, 8192)
    fds = open_shm_fds()
    with pytest.raises(LimitExceeded, match=r"^max-mapped-bytes: region 'b' \(shared-memory object 'xrt-"):
        table.register(session.id, "b", "shm", b.name, 0, 4096)
    assert open_shm_fds() == fds
    assert [r.name for r in table.list(session.id)] == ["a"] and table.mapped.value == 8192
    table.close_session(session.id)
    assert table.mapped.value == 0


@shm
def test_a_region_that_cannot_be_mapped_gives_its_bytes_back(segments):
    table = RegionTable(mapped=MappedBytes(8192))
    session = table.open_session()
    with pytest.raises(Exception, match="no shared-memory object"):
        table.register(session.id, "gone", "shm", "xrt-no-such-object", 0, 4096)
    with pytest.raises(Exception, match="holds 4096"):  # past the object's end
        table.register(session.id, "short", "shm", segments(4096).name, 0, 8192)
    assert table.mapped.value == 0


@shm
def test_a_region_in_use_gives_its_bytes_back_when_its_call_ends(segments):
    table = RegionTable(mapped=MappedBytes(None))
    session = table.open_session()
    seg = segments(4096)
    table.register(session.id, "r", "shm", seg.name, 0, 4096)
    call = table.for_call(session.id)
    view = call.view("r", 0, 16, np.dtype(np.float32), (4,), "tensor.region")
    table.unregister(session.id, "r")
    assert table.mapped.value == 4096  # still mapped: the call reads it
    del view
    call.release()
    assert table.mapped.value == 0
    table.close_session(session.id)


# --- oom_score_adj ---------------------------------------------------------------------------------------------


def test_set_score_adj_writes_the_value(tmp_path):
    path = tmp_path / "oom_score_adj"
    path.write_text("0\n")
    assert oom.set_score_adj(-900, str(path)) == -900
    assert path.read_text() == "-900\n"


def test_a_score_that_cannot_be_set_is_a_warning_not_a_failure(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="xreduced"):
        assert oom.set_score_adj(-900, str(tmp_path)) is None  # a directory: neither read nor written
    (record,) = caplog.records
    assert record.getMessage().startswith("event=oom_score_adj_failed wanted=-900 in_effect=None error=")
    assert "serving anyway" in record.getMessage()
