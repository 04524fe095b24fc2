"""The SDK's transport layer, at its seams: what a collective sends when this side fails, and the fields
each algorithm puts on the wire."""

from __future__ import annotations

import grpc
import pytest
from xreduce import ConnectionOptions
from xreduce._call import ReduceCall
from xreduce._errors import InvalidArgumentError, from_rpc_error
from xreduce._runtime import ProcessGroup
from xreduce._transports import _fields, collective
from xreduce.distribute import HierarchicalCopyAllReduce, ReductionToOneDevice


class _Seam:
    """The one Client method ``collective`` uses, recording what it is asked to send."""

    def __init__(self):
        self.sent = []

    def batch_reduce(self, request, timeout=None):
        self.sent.append(request)


def _group() -> ProcessGroup:
    return ProcessGroup("g", 2, 0, ("CPU:0",), ("CPU:0", "CPU:1"))


def test_a_refusal_made_in_this_process_abandons_the_collective_for_every_process():
    seam = _Seam()
    with pytest.raises(InvalidArgumentError), collective(seam, _group()) as spec:
        raise InvalidArgumentError("transport='shm' needs POSIX shared memory", grpc.StatusCode.FAILED_PRECONDITION)
    # The collective given up, with the reason: the daemon fails it for the others at once.
    (sent,) = seam.sent
    assert (sent.collective.group, sent.collective.sequence) == (spec.group, spec.sequence) and not sent.pairs
    assert sent.collective.abort.startswith("InvalidArgumentError: transport='shm' needs POSIX shared memory")


def test_an_error_the_daemon_answered_is_not_sent_again():
    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "pairs[0]: shapes differ"

    seam = _Seam()
    with pytest.raises(InvalidArgumentError), collective(seam, _group()):
        raise from_rpc_error(Refused(), "127.0.0.1:1")
    assert seam.sent == []


def test_reduction_to_one_device_sends_no_num_packs():
    nowhere = ConnectionOptions(address="127.0.0.1:1")
    fields = _fields(ReduceCall("SUM", (), ReductionToOneDevice(options=nowhere)._algorithm()))
    assert fields.get("num_packs") is None  # unset: the daemon's default, as TF's and older SDKs' requests
    assert _fields(ReduceCall("SUM", (), HierarchicalCopyAllReduce(num_packs=0, options=nowhere)._algorithm())
                   )["num_packs"] == 0
