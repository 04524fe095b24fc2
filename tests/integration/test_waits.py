"""Silent waits: a process whose partners never come hears about it, and so does the daemon's log.

This test process is process 0 of a two-process group (its group installed in
a fresh SDK runtime, or joined with ``initialize``); process 1 is either
absent or a raw ``Reduce`` call from a thread. The daemon reads
``XREDUCE_STALL_WARNING_SECONDS`` from its environment, as the SDK does.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time

import grpc
import numpy as np
import pytest
import xreduce
from xreduce import _runtime
from xreduce import distribution as dist
from xreduce.distribute import CommunicationOptions, HierarchicalCopyAllReduce, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format
_groups = itertools.count()


@pytest.fixture(scope="module")
def d(start_module_daemon):
    """A daemon that logs a waiting collective after 1 s and gives up on a join after 2 s."""
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                               "--collective-timeout", "2", env={"XREDUCE_STALL_WARNING_SECONDS": "1"})


@pytest.fixture
def group(d, monkeypatch):
    """A fresh group in which this process is process 0 of 2, on CPU:0 and CPU:1; tensors over the wire."""
    name = f"waits-{next(_groups)}"
    runtime = _runtime.Runtime()
    monkeypatch.setattr(_runtime, "_default", runtime)
    runtime.set_process_group(d.address, _runtime.ProcessGroup(name, 2, 0, (CPU(0), CPU(1)),
                                                               tuple(CPU(i) for i in range(4))))
    monkeypatch.setenv("XREDUCE_TRANSPORT", "wire")
    monkeypatch.setenv("XREDUCE_GROUP", name)
    return name


def _value() -> PerReplica:
    return PerReplica([np.ones(3, np.float32)] * 2, devices=["CPU:0", "CPU:1"])


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "xreduce.stall"]


def _waiting_lines(d, group: str) -> list[str]:
    return re.findall(rf'event=collective_waiting group="{group}" .*', d.log())


def test_a_lone_process_is_named_in_the_daemon_log_and_warned_by_the_sdk(d, group, monkeypatch, caplog):
    monkeypatch.setenv("XREDUCE_STALL_WARNING_SECONDS", "0.3")
    caplog.set_level(logging.WARNING, "xreduce.stall")
    ops = HierarchicalCopyAllReduce(address=d.address)
    with pytest.raises(xreduce.DeadlineExceededError, match=re.escape("waiting for process(es) [1]; arrived: [0]")):
        ops.reduce("sum", _value(), "CPU:0", options=CommunicationOptions(timeout_seconds=2.5))
    failed_at = time.time()
    lines = _waiting_lines(d, group)
    assert lines and re.fullmatch(r"collective=0 waited_s=1\.\d num_processes=2 arrived=0 missing=1",
                                  lines[0].split(f'group="{group}" ')[1]), d.log()[-2000:]
    records = _warnings(caplog)
    assert records, "the SDK warned before the collective timed out"
    assert records[0].created < failed_at - 1.5
    text = records[0].getMessage()
    assert re.match(rf'collective 0 in group "{group}" has not completed after 0\.[34] s \(this is process 0 of 2; '
                    r"it waits for process 1\)\. The daemon at \S+ has 1 collective\(s\) waiting "
                    r"\(--collective-timeout 2 s\); its log names who is missing \(event=collective_waiting\)\. "
                    r"Is process 1 running, with the same XREDUCE_GROUP\?", text), text


def test_a_lone_join_is_warned_too(d, group, monkeypatch, caplog):
    monkeypatch.setenv("XREDUCE_STALL_WARNING_SECONDS", "0.3")
    caplog.set_level(logging.WARNING, "xreduce.stall")
    state = dist.DistributionState(address=d.address)
    with pytest.raises(xreduce.DeadlineExceededError, match=re.escape(f'collective "join" in group "{group}" timed')):
        state.initialize(num_processes=2, process_id=0)
    assert _warnings(caplog)[0].getMessage().startswith(f'collective "join" in group "{group}" has not completed')
    assert re.search(r'collective="join" waited_s=1\.\d num_processes=2 arrived=0 missing=1',
                     "\n".join(_waiting_lines(d, group))), d.log()[-2000:]


def test_the_variable_at_0_turns_the_sdk_warning_off(d, group, monkeypatch, caplog):
    monkeypatch.setenv("XREDUCE_STALL_WARNING_SECONDS", "0")
    caplog.set_level(logging.WARNING, "xreduce.stall")
    with pytest.raises(xreduce.DeadlineExceededError):
        HierarchicalCopyAllReduce(address=d.address).reduce("sum", _value(), "CPU:0",
                                                            options=CommunicationOptions(timeout_seconds=1.5))
    assert _warnings(caplog) == []
    assert _waiting_lines(d, group), "the daemon has its own setting"


def test_nothing_is_said_when_the_collective_completes_quickly(d, group, monkeypatch, caplog):
    monkeypatch.setenv("XREDUCE_STALL_WARNING_SECONDS", "1")
    caplog.set_level(logging.WARNING, "xreduce.stall")
    channel = grpc.insecure_channel(d.address)
    grpc.channel_ready_future(channel).result(timeout=10)
    stub = pb_grpc.CrossDeviceOpsStub(channel)
    ops = HierarchicalCopyAllReduce(address=d.address)
    got = {}
    try:
        for sequence in range(3):
            reducing = threading.Thread(target=lambda: got.update(sdk=ops.reduce("sum", _value(), "CPU:0")))
            reducing.start()
            ones = codec.encode(np.ones(3, np.float32))
            value = pb.DistributedValue(components=[pb.Component(device=CPU(i), tensor=ones) for i in (2, 3)])
            other = stub.Reduce(pb.ReduceRequest(
                reduce_op=pb.REDUCE_OP_SUM, value=value, destinations=[CPU(2)],
                collective=pb.CollectiveSpec(group=group, num_processes=2, process_id=1, sequence=sequence)),
                timeout=10)
            reducing.join(10)
            assert got.pop("sdk").tolist() == [4.0] * 3
            assert codec.decode(other.result.components[0].tensor).tolist() == [4.0] * 3
    finally:
        channel.close()
    time.sleep(1.2)  # past when a warning would have been due
    assert _warnings(caplog) == []
    assert _waiting_lines(d, group) == []
