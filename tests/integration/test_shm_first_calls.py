"""The first shared-memory calls cost no more in the daemon than the next ones.

The daemon maps a region when it is registered. Mapped lazily, each 4 KiB
page faulted in at the first call that read or wrote it: 0.2–0.5 s per GiB
that a user saw as a slow first call (and a slow second one, whose output
segment is new too). The daemon populates the mapping as it makes it, so the
region is resident in the daemon before any call touches it; the kernel's
zeroing of fresh segments, on the SDK's side, is what is left
(docs/transports.md, "The first calls").
"""

from __future__ import annotations

import grpc
import pytest
from xreduce import _segments
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import SESSION_METADATA

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

SIZE = 16 << 20


def resident_kib(pid: int, name: str) -> tuple[int, int]:
    """(Size, Rss) in KiB of the mapping of shared-memory object ``name`` in process ``pid``."""
    size = rss = None
    with open(f"/proc/{pid}/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = line.rstrip().endswith("/" + name)
            elif inside and fields[0] in ("Size:", "Rss:"):
                size, rss = (int(fields[1]), rss) if fields[0] == "Size:" else (size, int(fields[1]))
    assert size is not None, f"{name} is not mapped in process {pid}"
    return size, rss


def test_a_registered_region_is_resident_in_the_daemon_before_any_call(start_daemon):
    d = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2")
    seg = _segments.Segment(SIZE, "xrt")
    try:
        with grpc.insecure_channel(d.address) as channel:
            stub = pb_grpc.CrossDeviceOpsStub(channel)
            stream = stub.OpenSession(pb.OpenSessionRequest(), timeout=60)
            session = next(stream).session_id
            try:
                stub.RegisterRegion(pb.RegisterRegionRequest(name="r", shm_key=seg.name, byte_size=SIZE),
                                    metadata=((SESSION_METADATA, session),), timeout=10)
                assert resident_kib(d.proc.pid, seg.name) == (SIZE >> 10, SIZE >> 10)
            finally:
                stream.cancel()
    finally:
        seg.unlink()
