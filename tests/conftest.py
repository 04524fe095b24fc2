"""Shared fixtures: real daemon subprocesses and channels to them."""

from __future__ import annotations

import grpc
import pytest
from daemons import Daemons

HOST_WIDE = frozenset({
    "tests/integration/test_docs.py",  # its stand-in for the README's daemon listens on 127.0.0.1:50551
    "tests/integration/test_containers.py",  # a Docker engine, and the compose files' host ports
    "tests/integration/test_deploy_runs.py",  # the compose services' host ports
    "tests/multinode/test_multinode_bench.py",  # network namespaces, shaped links: measured alone
    "tests/multinode/test_netns_harness.py",  # sweeps leftover namespaces
    "tests/multinode/test_seed_cluster.py",  # namespaces at the seed's addresses
    "tests/multinode/test_nodes_names.py",  # namespaces at the seed's addresses
    "tests/multinode/test_tf_nodes.py",  # namespaces at the seed's addresses
    "tests/multinode/test_torch_nodes.py",  # namespaces at the seed's addresses
})
"""Test modules that use something of the whole host (a fixed port, Docker, network namespaces): under
pytest-xdist one worker runs them all, one after another."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` (pytest-xdist), a module's tests run on one worker, so its module fixtures start once,
    and the :data:`HOST_WIDE` modules all run on one worker, one after another."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "host-wide" if module in HOST_WIDE else module

    return ByModule(config, log)


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
    """``start_daemon(*flags, env=None, timeout=30.0, wrapper=None)`` starts a private ``xreduced`` with exactly
    ``flags``; every daemon it started and that still runs is stopped (SIGTERM) after the test."""
    with Daemons() as start:
        yield start


@pytest.fixture(scope="module")
def start_module_daemon():
    """:func:`start_daemon` for module-scoped fixtures: its daemons are stopped after the module."""
    with Daemons() as start:
        yield start
