"""Shared fixtures: real daemon subprocesses and channels to them."""

from __future__ import annotations

import grpc
import pytest
from daemons import Daemons


@pytest.fixture(scope="session")
def daemon():
    """One real ``xreduced`` (8 host virtual devices) on a free loopback port."""
    with Daemons() as start:
        yield start("--listen", "127.0.0.1:0", "--backend", "numpy")


@pytest.fixture(scope="session")
def channel(daemon):
    ch = grpc.insecure_channel(daemon.address)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel):
    """A raw ``CrossDeviceOps`` stub on the session daemon."""
    # Imported here, so that a grpcio or protobuf too old for the stubs fails only the tests that use them.
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc

    return pb_grpc.CrossDeviceOpsStub(channel)


@pytest.fixture
def start_daemon():
    """``start_daemon(*flags, env=None, timeout=30.0)`` starts a private ``xreduced`` with exactly
    ``flags``; every daemon it started and that still runs is stopped (SIGTERM) after the test."""
    with Daemons() as start:
        yield start


@pytest.fixture(scope="module")
def start_module_daemon():
    """:func:`start_daemon` for module-scoped fixtures: its daemons are stopped after the module."""
    with Daemons() as start:
        yield start
