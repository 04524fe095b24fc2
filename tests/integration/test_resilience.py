"""The SDK across a daemon restart: a real daemon SIGKILLed and started again on the same port.

The client objects are built once and kept: the channel reconnects by itself,
idempotent calls (ListDevices, GetStatus, health) ride out the restart on the
SDK's retry policy, collectives fail fast while the daemon is down. Timings are printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import xreduce
from xreduce import _client
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce_bench.daemon import DaemonProcess

TWO = ["CPU:0", "CPU:1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Restartable:
    """A daemon on a fixed port that can be SIGKILLed and started again there (by ``start_daemon``)."""

    def __init__(self, start_daemon: Callable[..., DaemonProcess]):
        self.address = f"127.0.0.1:{_free_port()}"
        self.args = ["--listen", self.address, "--backend", "numpy", "--virtual-devices", "2"]
        self._start = start_daemon
        self.proc = start_daemon(*self.args)

    def sigkill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        assert self.proc.proc.wait(10) == -signal.SIGKILL

    def start(self) -> DaemonProcess:
        self.proc = self._start(*self.args)
        assert self.proc.address == self.address
        return self.proc


@pytest.fixture
def restartable(start_daemon):
    return Restartable(start_daemon)


def _value() -> PerReplica:
    return PerReplica([np.array([1.0, 2.0]), np.array([10.0, 20.0])], devices=TWO)


def test_the_retry_policy_covers_only_idempotent_calls():
    assert _client.IDEMPOTENT_METHODS == (
        ("xreduce.v1.CrossDeviceOps", "ListDevices"),
        ("xreduce.v1.CrossDeviceOps", "GetStatus"),
        ("grpc.health.v1.Health", "Check"),
    )
    policy = _client.RETRY_POLICY
    assert (policy.max_attempts, policy.initial_backoff, policy.max_backoff, policy.multiplier) == (5, 0.1, 2.0, 4.0)
    # The SDK retries, not gRPC (which cannot tell a TLS mismatch from a restart): no service config retries.
    options = dict(_client.CHANNEL_OPTIONS)
    assert "grpc.service_config" not in options
    assert options["grpc.initial_reconnect_backoff_ms"] == 100
    assert options["grpc.max_reconnect_backoff_ms"] == 2000


def test_the_same_sdk_objects_work_after_sigkill_and_restart(restartable):
    address = restartable.address
    client = xreduce.Client(address)
    ops = HierarchicalCopyAllReduce(address=address)
    strategy = MirroredStrategy(address=address)
    assert len(client.list_devices().devices) == 2
    assert ops.reduce("sum", _value(), "CPU:0").tolist() == [11.0, 22.0]
    assert strategy.num_replicas_in_sync == 2

    restartable.sigkill()

    # While the daemon is down a collective fails fast, naming the address.
    for attempt in range(2):
        started = time.monotonic()
        with pytest.raises(xreduce.UnavailableError, match=f"xreduce daemon at {address} is unavailable"):
            ops.reduce("sum", _value(), "CPU:0")
        print(f"\nreduce #{attempt + 1} with the daemon down: UnavailableError after "
              f"{time.monotonic() - started:.3f}s")
    started = time.monotonic()
    with pytest.raises(xreduce.UnavailableError, match=address):
        client.broadcast(pb.BroadcastRequest(destinations=["CPU:0"]))
    print(f"Broadcast with the daemon down: UnavailableError after {time.monotonic() - started:.3f}s")

    proc = restartable.start()
    started = time.monotonic()
    assert len(client.list_devices(refresh=True).devices) == 2
    print(f"daemon serving {proc.serving_after:.3f}s after its start; the first ListDevices after it took "
          f"{time.monotonic() - started:.3f}s")
    assert ops.reduce("sum", _value(), "CPU:0").tolist() == [11.0, 22.0]
    assert strategy.reduce("sum", strategy.run(lambda: np.ones(2)), axis=None).tolist() == [2.0, 2.0]
    assert client.health() == "SERVING"
    assert "event=serving" in proc.log()


def test_list_devices_during_a_restart_succeeds_by_retrying(restartable):
    address = restartable.address
    client = xreduce.Client(address)
    ops = HierarchicalCopyAllReduce(address=address)
    assert len(client.list_devices().devices) == 2
    assert ops.reduce("sum", _value(), "CPU:0").tolist() == [11.0, 22.0]

    restartable.sigkill()
    killed = time.monotonic()
    restarted: list[DaemonProcess] = []
    thread = threading.Thread(target=lambda: restarted.append(restartable.start()))
    thread.start()
    try:
        reply = client.list_devices(refresh=True)  # issued right after the kill, before the daemon is back
        answered = time.monotonic() - killed
    except xreduce.UnavailableError as e:
        thread.join(60)
        took = restarted[0].serving_after if restarted else None
        pytest.fail(f"ListDevices gave up after {time.monotonic() - killed:.3f}s, the retries' window; the "
                    f"daemon took {took}s to serve again: {e}")
    finally:
        thread.join(60)
    assert restarted, "the daemon did not restart"
    serving = restarted[0].serving_after
    print(f"\nListDevices issued at the kill answered after {answered:.3f}s "
          f"(the new daemon served {serving:.3f}s after its start)")
    assert len(reply.devices) == 2
    assert ops.reduce("sum", _value(), "CPU:0").tolist() == [11.0, 22.0]


@pytest.mark.slow
def test_idempotent_calls_give_up_with_unavailable_naming_the_address():
    dead = f"127.0.0.1:{_free_port()}"
    client = xreduce.Client(dead)
    started = time.monotonic()
    with pytest.raises(xreduce.UnavailableError, match=f"xreduce daemon at {dead} is unavailable"):
        client.list_devices()
    print(f"\nListDevices to a dead address: UnavailableError after {time.monotonic() - started:.3f}s "
          "(5 attempts)")
    with pytest.raises(xreduce.UnavailableError, match=dead):
        client.health()
