"""xreduced.repeated: what a solo request keeps, when a kept repeat is stale, and how many are kept."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.engine import Engine
from xreduced.regions import RegionTable
from xreduced.repeated import REPEAT_MAX_REQUEST_BYTES, Repeats, Stale
from xreduced.service import CrossDeviceOpsService

N = 16


class _Context:
    """What the service sees of a lane call that may leave a repeat."""

    def __init__(self, session_id: str):
        self._metadata = (("x-xreduce-session", session_id),)
        self.keeps_repeats = True
        self.repeat = None

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return None


@pytest.fixture()
def served(tmp_path):
    """A service with a session whose regions ``in`` and ``out`` are shared-memory objects of this test."""
    table = RegionTable()
    service = CrossDeviceOpsService(Engine(NumpyBackend(2)), "numpy", regions=table)
    session = table.open_session()
    names = []
    for name, size in (("in", 2 * 64 * 4), ("out", 2 * 64 * 4)):
        key = f"xrt-unit-{name}-{session.id[:8]}"
        with open(f"/dev/shm/{key}", "wb") as f:
            f.truncate(size)
        table.register(session.id, name, "shm", key, 0, size)
        names.append(key)
    yield service, table, session
    table.close_all()
    for key in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{key}")


def _request() -> pb.ReduceRequest:
    components = [pb.Component(device=f"CPU:{i}", tensor=pb.Tensor(
        dtype=codec.dtype_enum(np.dtype(np.float32)), shape=[N],
        region=pb.RegionSlice(name="in", offset=i * 256, byte_size=N * 4))) for i in range(2)]
    return pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=components),
                            destinations=["CPU:0", "CPU:1"], output=pb.RegionSlice(name="out", byte_size=512))


def _call(service, session, request):
    """Serves ``request`` through the service as the pipeline would, with the call's regions."""
    from xreduced import pipeline

    call = pipeline.Call(1, "/xreduce.v1.CrossDeviceOps/Reduce", regions=service.regions.for_call(session.id))
    context = _Context(session.id)
    with pipeline._Current(call):
        service.Reduce(request, context)
    call.regions.release()
    return context.repeat


def _regions(table, session):
    return {name: r.view(0, np.dtype(np.float32), (r.byte_size // 4,)) for name, r in session.regions.items()}


def test_a_solo_region_request_leaves_a_repeat_that_reduces_new_bytes(served):
    service, table, session = served
    views = _regions(table, session)
    views["in"][:N], views["in"][64:64 + N] = 1.0, 2.0
    repeat = _call(service, session, _request())
    assert repeat is not None and repeat.kind == "Reduce" and [name for name, _ in repeat.regions] == ["in", "out"]
    views["in"][:N], views["in"][64:64 + N] = 5.0, 7.0
    service.repeat(repeat, session.id, None)
    assert views["out"][:N].tolist() == [12.0] * N and views["out"][16:16 + N].tolist() == [12.0] * N
    (prepared,) = repeat.prepared  # the first run prepared the reduction; the next ones only run it
    assert prepared is not None
    views["in"][:N], views["in"][64:64 + N] = np.arange(N), -1.5
    service.repeat(repeat, session.id, None)
    assert repeat.prepared == [prepared]
    assert views["out"][:N].tolist() == (np.arange(N) - 1.5).tolist() == views["out"][16:16 + N].tolist()


def test_a_repeat_of_output_one_copy_writes_the_first_destinations_place_alone(served):
    service, table, session = served
    views = _regions(table, session)
    request = _request()
    request.output_one_copy = True
    views["out"][:] = -9.0
    views["in"][:N], views["in"][64:64 + N] = 1.0, 2.0
    repeat = _call(service, session, request)
    (pair,) = repeat.pairs
    assert len({piece for _, piece in pair.outputs}) == 1  # both destinations name the first one's place
    views["in"][:N], views["in"][64:64 + N] = np.arange(N), 0.5
    service.repeat(repeat, session.id, None)
    assert views["out"][:N].tolist() == (np.arange(N) + 0.5).tolist()
    assert views["out"][16:16 + N].tolist() == [-9.0] * N  # the second destination's place: never written


def test_a_repeat_binds_its_views_once_and_lets_them_go_when_a_region_closes(served):
    """The first run binds the reduction to views of the regions; later runs reduce new bytes through them; a
    region unregistered drops them, so its mapping goes (nothing of the repeat keeps it mapped)."""
    service, table, session = served
    repeat = _call(service, session, _request())
    key = session.regions["in"].key
    service.repeat(repeat, session.id, None)
    bound = repeat.binding.bound
    assert bound is not None
    views = _regions(table, session)
    views["in"][:N], views["in"][64:64 + N] = 3.0, np.arange(N)
    service.repeat(repeat, session.id, None)
    assert repeat.binding.bound is bound and views["out"][:N].tolist() == (np.arange(N) + 3.0).tolist()
    del views, bound  # the test's own references to the mapping
    table.unregister(session.id, "in")
    assert repeat.binding.bound is None
    with open("/proc/self/maps") as f:
        assert key not in f.read()  # unmapped: no view of it is left


def test_a_repeat_is_stale_once_a_region_is_registered_again(served):
    service, table, session = served
    repeat = _call(service, session, _request())
    key = session.regions["in"].key
    table.unregister(session.id, "in")
    with pytest.raises(Stale, match="a region is gone"):
        service.repeat(repeat, session.id, None)
    table.register(session.id, "in", "shm", key, 0, 512)
    with pytest.raises(Stale, match="registered again"):
        service.repeat(repeat, session.id, None)
    assert all(r.in_use == 0 for r in session.regions.values())  # nothing stays pinned


def test_requests_with_tensors_in_the_message_or_without_output_leave_no_repeat(served):
    service, _, session = served
    request = _request()
    request.ClearField("output")
    assert _call(service, session, request) is None
    inline = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=pb.DistributedValue(components=[
        pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.ones(2, np.float32))) for i in range(2)]))
    assert _call(service, session, inline) is None


def test_a_connection_keeps_its_most_recent_repeats_and_no_long_request():
    repeats = Repeats(kept=2)
    for k in range(3):
        repeats.keep(bytes([k]), f"repeat {k}", b"reply")
    assert repeats.get(b"\x00") is None and len(repeats) == 2
    repeats.get(b"\x01")  # used: the least recently used is now 2
    repeats.keep(b"\x03", "repeat 3", b"reply")
    assert repeats.get(b"\x02") is None and repeats.get(b"\x01") is not None
    repeats.keep(b"x" * (REPEAT_MAX_REQUEST_BYTES + 1), "long", b"reply")
    assert repeats.get(b"x" * (REPEAT_MAX_REQUEST_BYTES + 1)) is None
