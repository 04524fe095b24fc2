"""The SDK's seams: connection options, the typed client, the runtime state, values that make no calls."""

from __future__ import annotations

import numpy as np
import pytest
import xreduce
from xreduce import _client, _runtime
from xreduce.distribute import CommunicationOptions, HierarchicalCopyAllReduce, MirroredStrategy, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec


def test_connection_options_and_the_keywords_beside_them():
    remote = xreduce.ConnectionOptions(address="127.0.0.1:1", token="a", transport="wire")
    client = xreduce.Client(options=remote, token="b")
    assert (client.address, client.options.token, client.transport) == ("127.0.0.1:1", "b", "wire")
    assert remote.token == "a", "the options object is not changed"
    assert HierarchicalCopyAllReduce(num_packs=2, options=remote).client.options == remote
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        xreduce.ConnectionOptions(certificate_chain=b"pem")
    with pytest.raises(ValueError, match="transport must be one of auto, shm, wire; got 'udp'"):
        HierarchicalCopyAllReduce(options=remote, transport="udp")


def test_a_typed_method_per_rpc(daemon):
    value = pb.DistributedValue(components=[
        pb.Component(device=f"CPU:{i}", tensor=codec.encode(np.full(3, i, np.float32))) for i in range(3)])
    with xreduce.Client(daemon.address) as client:
        assert len(client.list_devices().devices) == len(client.get_status().devices) == 8
        reduced = client.reduce(pb.ReduceRequest(reduce_op=pb.REDUCE_OP_SUM, value=value, destinations=["CPU:7"]))
        assert codec.decode(reduced.result.components[0].tensor).tolist() == [3.0] * 3
        session = client.open_session(pb.OpenSessionRequest())
        try:
            assert session.alive.is_set() and list(client.list_regions(session=session.id).regions) == []
        finally:
            session.close()
        assert not hasattr(client, "call"), "one method per RPC replaces call(name, ...)"


def test_each_ops_uses_the_group_of_its_own_daemon(daemon, monkeypatch):
    runtime = _runtime.Runtime()  # a fresh runtime for this test: the process's own is left alone
    monkeypatch.setattr(_runtime, "_default", runtime)
    joined = "127.0.0.1:1"  # a daemon this process joined a two-process group with (never called here)
    runtime.set_process_group(joined, _runtime.ProcessGroup("g", 2, 0, ("/cpu:0",), ("/cpu:0", "/cpu:1")))
    assert MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce(address=joined)).num_replicas_in_sync == 2
    alone = HierarchicalCopyAllReduce(address=daemon.address)
    assert MirroredStrategy(cross_device_ops=alone).num_replicas_in_sync == 8
    value = PerReplica([np.ones(2)] * 2, devices=["CPU:0", "CPU:1"])
    # No collective spec of the other daemon's group: a single-process reduce, answered at once.
    got = alone.reduce("sum", value, "CPU:0", options=CommunicationOptions(timeout_seconds=20))
    assert got.tolist() == [2.0, 2.0]


def test_a_value_without_devices_makes_no_call(monkeypatch):
    monkeypatch.setenv("XREDUCE_ADDRESS", "127.0.0.1:1")
    value = PerReplica([np.ones(1)] * 2)
    with pytest.raises(ValueError, match="PerReplica was made without devices: they are the daemon's first 2"):
        _ = value.devices


def test_insisting_on_shared_memory_without_it_is_an_sdk_error(monkeypatch):
    monkeypatch.setattr(_client, "available", lambda: False)
    with pytest.raises(xreduce.InvalidArgumentError, match=r"transport='shm' needs POSIX shared memory") as info:
        xreduce.Client("127.0.0.1:1", transport="shm").shared_memory()
    assert isinstance(info.value, ValueError), "the SDK's errors are builtins too"
