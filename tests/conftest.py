"""Shared fixtures: a real daemon subprocess and channels to it."""

from __future__ import annotations

import grpc
import pytest
from daemon import DaemonProcess
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc


@pytest.fixture(scope="session")
def daemon():
    """One real ``xreduced`` (8 host virtual devices) on a free loopback port."""
    proc = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy"])
    yield proc
    proc.terminate()


@pytest.fixture(scope="session")
def channel(daemon):
    ch = grpc.insecure_channel(daemon.address)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel):
    """A raw ``CrossDeviceOps`` stub on the session daemon."""
    return pb_grpc.CrossDeviceOpsStub(channel)
