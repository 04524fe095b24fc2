"""The torch tests' daemon and jobs: a real ``xreduced`` per module, real rank processes per test."""

from __future__ import annotations

import pytest
from torch_ranks import DAEMON_FLAGS, WORKER, Ranks


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    """One daemon of 4 host devices (:data:`torch_ranks.DAEMON_FLAGS`)."""
    return start_module_daemon(*DAEMON_FLAGS)


@pytest.fixture
def ranks(daemon, tmp_path):
    """``ranks(world_size, MODE, *args)`` starts a job of ``torch_worker.py`` on the module's daemon
    (a :class:`torch_ranks.Ranks`); its ranks still running after the test are killed."""
    jobs: list[Ranks] = []

    def start(world_size: int, *args: str) -> Ranks:
        logs = tmp_path / f"job{len(jobs)}"
        logs.mkdir()
        jobs.append(Ranks(WORKER, list(args), world_size, daemon.address, logs))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()
