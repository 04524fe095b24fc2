"""Malformed requests against a real daemon: no crash, no hang, only client-error codes.

The generator lives in ``bench/fuzz.py`` (which runs the full 10,000); here a
derandomized hypothesis run sends ~500 generated requests and ~300 raw-byte
calls to a private daemon, then checks that it is alive, still reduces
correctly, and logged no internal error that a known bug does not explain.

Daemon bugs the fuzz found are listed in ``fuzz.KNOWN_BUGS``; the fuzz runs
tolerate exactly their signatures, and each has a strict xfail below that
reproduces it (when one is fixed, its xfail passes, fails as strict, and the
entry should go).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import grpc
import numpy as np
import pytest
from daemon import DaemonProcess
from google.protobuf.duration_pb2 import Duration
from hypothesis import HealthCheck, given, settings
from xreduce.v1 import xreduce_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz  # noqa: E402

MESSAGES = 500
RAW_CALLS = 300
FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed():
    """A private daemon (the fuzz must not disturb the session daemon), a channel, and the tally."""
    proc = DaemonProcess(fuzz.DAEMON_ARGS)
    channel = grpc.insecure_channel(proc.address)
    grpc.channel_ready_future(channel).result(timeout=30)
    yield types.SimpleNamespace(proc=proc, channel=channel, tally=fuzz.Tally())
    channel.close()
    proc.terminate()


def send(fuzzed, method: str, request) -> tuple[str, fuzz.Outcome]:
    """Sends one request, records it; returns its verdict and outcome."""
    outcome = fuzz.call(fuzzed.channel, method, request)
    return fuzzed.tally.add(method, request, outcome), outcome


def check(fuzzed, method: str, request) -> None:
    verdict, outcome = send(fuzzed, method, request)
    assert verdict == "ok" or verdict.removeprefix("known:") in fuzz.KNOWN_BUGS, (
        f"{verdict}: {outcome.code.name} {outcome.details[:400]!r} after {outcome.seconds:.3f}s <- "
        + fuzz.describe(method, request, 2000))


@settings(FUZZ, max_examples=MESSAGES)
@given(call=fuzz.requests())
def test_malformed_requests_get_client_error_codes(fuzzed, call):
    check(fuzzed, *call)


@settings(FUZZ, max_examples=RAW_CALLS)
@given(call=fuzz.raw_calls())
def test_random_bytes_to_the_raw_handlers_get_client_error_codes(fuzzed, call):
    check(fuzzed, *call)


@pytest.mark.parametrize("method", fuzz.METHODS)
@pytest.mark.parametrize("data", [b"\xff\xff", b"\x12\x05\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08"],
                         ids=["bad-tag", "short-field", "huge-length", "truncated-varint"])
def test_undecodable_bytes_are_invalid_argument(fuzzed, method, data):
    """(The committed daemon answered INTERNAL 'Exception deserializing request!'.)"""
    assert fuzz.parse(method, data) is None
    verdict, outcome = send(fuzzed, method, data)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details}"


def tensor(shape, raw: bytes = b"") -> pb.Tensor:
    return pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=shape, raw_data=raw)


def on_cpu0(t: pb.Tensor) -> pb.DistributedValue:
    return pb.DistributedValue(components=[pb.Component(device="CPU:0", tensor=t)])


@pytest.mark.parametrize("shape, raw", [
    ([2**61, 0], b""), ([2**40, 2**40, 0], b""), ([0] * 70, b""), ([1] * 70, bytes(4)),
], ids=["zero-size-2^61", "zero-size-2^80", "70-dims-zero", "70-dims-one-element"])
def test_shapes_numpy_cannot_build_are_invalid_argument(fuzzed, shape, raw):
    verdict, outcome = send(fuzzed, "Reduce", pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=on_cpu0(
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
    verdict, outcome = send(fuzzed, "Reduce", request)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details[:300]}"


def test_a_collective_of_many_processes_times_out_with_bounded_details(fuzzed):
    """The most processes a group may have: the timeout names the first missing ones, not all."""
    request = pb.JoinGroupRequest(group="fuzz-many", num_processes=65_536, process_id=0,
                                  timeout=Duration(nanos=1000))
    verdict, outcome = send(fuzzed, "JoinGroup", request)
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, f"{outcome.code.name}: {outcome.details[:300]}"
    assert "and more" in outcome.details and len(outcome.details) < 2000, outcome.details[:300]


def test_too_many_processes_are_invalid(fuzzed):
    request = pb.JoinGroupRequest(group="fuzz-many", num_processes=2**31 - 1, process_id=0,
                                  timeout=Duration(nanos=1000))
    verdict, outcome = send(fuzzed, "JoinGroup", request)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.details == "collective.num_processes: must be in [1, 65536]; got 2147483647"


def test_the_daemon_survives_the_fuzz(fuzzed):
    """Alive, still reducing correctly, and every internal error in its log is a known bug's."""
    tally = fuzzed.tally
    assert fuzzed.proc.proc.poll() is None, "the daemon died:\n" + fuzzed.proc.log()[-3000:]
    for array in fuzz.normal_reduce(fuzzed.channel):
        np.testing.assert_array_equal(array, np.array([11, 22], np.float32))
    assert fuzz.internal_errors(fuzzed.proc.log()) == 0, (dict(tally.verdicts), fuzzed.proc.log()[-3000:])
    assert tally.verdicts["hang"] == tally.verdicts["unexpected"] == 0, dict(tally.examples)
    if sum(tally.codes.values()) >= MESSAGES:  # the whole module ran: the fuzz reached past validation
        assert tally.codes["OK"] >= MESSAGES // 10, dict(tally.codes)


