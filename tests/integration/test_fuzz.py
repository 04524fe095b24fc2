"""Malformed requests against a real daemon: no crash, no hang, only client-error codes.

The generator lives in ``xreduce_bench.fuzzing`` (``bench/fuzz.py`` runs the full 10,000); here a
derandomized hypothesis run sends ~600 generated requests (the region and
session methods among them), ~300 raw-byte calls, ~300 ReduceStream calls and
~25 session churn rounds (a session closed while calls using its regions are
in flight) to a private daemon, then checks that it is alive, still reduces
correctly, unmapped every closed session's shared memory, and logged no
internal error that a known bug does not explain.

Daemon bugs the fuzz found are listed in ``fuzz.KNOWN_BUGS``, each with a
reproducer; the fuzz runs tolerate exactly their signatures (when one is
fixed, its entry should go).
"""

from __future__ import annotations

import types

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from hypothesis import HealthCheck, given, settings
from xreduce import _segments
from xreduce.v1 import xreduce_pb2 as pb
from xreduce_bench import fuzzing as fuzz

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

MESSAGES = 600
RAW_CALLS = 300
STREAMS = 300
CHURN_ROUNDS = 25
FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(start_module_daemon):
    """A private daemon (the fuzz must not disturb the session daemon), the fuzzer's world, and the tally."""
    proc = start_module_daemon(*fuzz.DAEMON_ARGS)
    world = fuzz.World(proc.address, proc.proc.pid)
    yield types.SimpleNamespace(proc=proc, world=world, channel=world.channel, tally=fuzz.Tally())
    world.close()


def send(fuzzed, action) -> list[tuple[str, str, object, fuzz.Outcome]]:
    """Runs one generated call, stream or churn round, records it; returns (verdict, method, sent, outcome)
    per call."""
    return [(fuzzed.tally.add(method, request, outcome), method, request, outcome)
            for method, request, outcome in fuzzed.world.perform(action)]


def check(fuzzed, action) -> None:
    for verdict, method, request, outcome in send(fuzzed, action):
        assert verdict == "ok" or verdict.removeprefix("known:") in fuzz.KNOWN_BUGS, (
            f"{verdict}: {outcome.code.name} {outcome.details[:400]!r} {outcome.problem} after "
            f"{outcome.seconds:.3f}s <- " + fuzz.describe(method, request, 2000))


def outcome_of(fuzzed, method: str, request, session: str = "none") -> fuzz.Outcome:
    [(_, _, _, outcome)] = send(fuzzed, fuzz.Call(method, request, session))
    return outcome


@pytest.mark.slow
@settings(FUZZ, max_examples=MESSAGES)
@given(call=fuzz.requests())
def test_malformed_requests_get_client_error_codes(fuzzed, call):
    check(fuzzed, call)


@settings(FUZZ, max_examples=RAW_CALLS)
@given(call=fuzz.raw_calls())
def test_random_bytes_to_the_raw_handlers_get_client_error_codes(fuzzed, call):
    check(fuzzed, call)


@pytest.mark.slow
@settings(FUZZ, max_examples=STREAMS)
@given(stream=fuzz.streams())
def test_malformed_streams_get_client_error_codes(fuzzed, stream):
    check(fuzzed, stream)


@settings(FUZZ, max_examples=CHURN_ROUNDS)
@given(churn=fuzz.churns())
def test_sessions_closed_under_their_calls_get_client_error_codes_and_are_unmapped(fuzzed, churn):
    check(fuzzed, churn)
    assert not fuzzed.world.leaks, fuzzed.world.leaks


@pytest.mark.parametrize("method", fuzz.UNARY_METHODS)
@pytest.mark.parametrize("data", [b"\xff\xff", b"\x12\x05\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08"],
                         ids=["bad-tag", "short-field", "huge-length", "truncated-varint"])
def test_undecodable_bytes_are_invalid_argument(fuzzed, method, data):
    """(The committed daemon answered INTERNAL 'Exception deserializing request!'.)"""
    assert fuzz.parse(method, data) is None
    outcome = outcome_of(fuzzed, method, data, "main")
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details}"


def tensor(shape, raw: bytes = b"") -> pb.Tensor:
    return pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=shape, raw_data=raw)


def on_cpu0(t: pb.Tensor) -> pb.DistributedValue:
    return pb.DistributedValue(components=[pb.Component(device="CPU:0", tensor=t)])


@pytest.mark.parametrize("shape, raw", [
    ([2**61, 0], b""), ([2**40, 2**40, 0], b""), ([0] * 70, b""), ([1] * 70, bytes(4)),
], ids=["zero-size-2^61", "zero-size-2^80", "70-dims-zero", "70-dims-one-element"])
def test_shapes_numpy_cannot_build_are_invalid_argument(fuzzed, shape, raw):
    outcome = outcome_of(fuzzed, "Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=on_cpu0(
        tensor(shape, raw))))
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details}"
    assert "shape" in outcome.details


@pytest.mark.parametrize("field", ["destinations", "component-device", "reduce_to_device"])
def test_a_huge_device_name_is_rejected_with_readable_details(fuzzed, field):
    huge = "x" * 20_000
    request = pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=on_cpu0(tensor([1], bytes(4))))
    if field == "destinations":
        request.destinations.append(huge)
    elif field == "component-device":
        request.value.components[0].device = huge
    else:
        request.algorithm = pb.ALGORITHM_REDUCTION_TO_ONE_DEVICE
        request.reduce_to_device = huge
    outcome = outcome_of(fuzzed, "Reduce", request)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details[:300]}"


def test_a_collective_of_many_processes_times_out_with_bounded_details(fuzzed):
    """The most processes a group may have: the timeout names the first missing ones, not all."""
    request = pb.JoinGroupRequest(group="fuzz-many", num_processes=65_536, process_id=0,
                                  timeout=Duration(nanos=1000))
    outcome = outcome_of(fuzzed, "JoinGroup", request)
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, f"{outcome.code.name}: {outcome.details[:300]}"
    assert "and more" in outcome.details and len(outcome.details) < 2000, outcome.details[:300]


def test_too_many_processes_are_invalid(fuzzed):
    request = pb.JoinGroupRequest(group="fuzz-many", num_processes=2**31 - 1, process_id=0,
                                  timeout=Duration(nanos=1000))
    outcome = outcome_of(fuzzed, "JoinGroup", request)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.details == "collective.num_processes: must be in [1, 65536]; got 2147483647"


@pytest.mark.parametrize("session, code", [
    ("main", grpc.StatusCode.OK), ("none", grpc.StatusCode.FAILED_PRECONDITION),
    ("scratch", grpc.StatusCode.PERMISSION_DENIED), ("closed", grpc.StatusCode.PERMISSION_DENIED),
    ("near-main", grpc.StatusCode.PERMISSION_DENIED), ("forged-then-main", grpc.StatusCode.PERMISSION_DENIED),
    ("forged:", grpc.StatusCode.FAILED_PRECONDITION),
])
def test_a_region_is_read_only_with_its_own_open_session(fuzzed, session, code):
    """The world's sessions are what the fuzz relies on: only the main session's id reaches its regions."""
    t = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[4], region=pb.RegionSlice(name="in", offset=16, byte_size=16))
    outcome = outcome_of(fuzzed, "Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=on_cpu0(t)), session)
    assert outcome.code == code, f"{outcome.code.name}: {outcome.details}"


def test_the_daemon_survives_the_fuzz(fuzzed):
    """Alive, still reducing correctly, every internal error in its log a known bug's, and once the world's
    sessions close, none of its shared memory mapped."""
    tally = fuzzed.tally
    assert fuzzed.proc.proc.poll() is None, "the daemon died:\n" + fuzzed.proc.log()[-3000:]
    for array in fuzz.normal_reduce(fuzzed.channel):
        np.testing.assert_array_equal(array, np.array([11, 22], np.float32))
    unexplained = fuzz.unexplained_internal_errors(fuzzed.proc.log())
    assert not unexplained, (dict(tally.verdicts), unexplained[:3])
    assert tally.verdicts["hang"] == tally.verdicts["unexpected"] == 0, dict(tally.examples)
    if sum(tally.codes.values()) >= MESSAGES:  # the whole module ran: the fuzz reached past validation
        assert tally.codes["OK"] >= MESSAGES // 10, dict(tally.codes)
        for method in ("RegisterRegion", "UnregisterRegion", "ListRegions", "OpenSession", "ReduceStream"):
            assert tally.by_method[method]["OK"], (method, dict(tally.by_method[method]))
    fuzzed.world.close()
    assert not fuzzed.world.leaks, fuzzed.world.leaks
