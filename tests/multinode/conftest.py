"""The multi-node tests' node daemons: real ``xreduced`` subprocesses on loopback, one per node."""

from __future__ import annotations

import pytest
from daemons import Daemons
from multinode import NODE_FLAGS
from xreduce_bench.faults import Cluster


@pytest.fixture(scope="session")
def start_session_daemon():
    """A daemon factory whose daemons are stopped (SIGTERM) at the end of the session."""
    with Daemons() as start:
        yield start


@pytest.fixture(scope="session")
def three_nodes(start_session_daemon) -> Cluster:
    """Three node daemons of 4 devices each, with Prometheus metrics and a 20 s collective timeout,
    shared by the session's jobs: a job of two nodes uses nodes 0 and 1. Each job has its own
    coordinator address (``new_job()``)."""
    return Cluster(3, [*NODE_FLAGS, "--metrics-listen", "127.0.0.1:0", "--collective-timeout", "20"],
                   start=start_session_daemon)


@pytest.fixture
def nodes(three_nodes) -> Cluster:
    """:func:`three_nodes` with a coordinator address of this test's own."""
    three_nodes.new_job()
    return three_nodes

