"""A rank SIGKILLed while DDP trains over the "xreduce" backend: the others' next step fails naming it, and
they exit; nothing waits for the daemon's collective timeout (60 s).

The daemon sees the killed rank's session with it close and fails the group's collectives at once, naming the
process. DDP's reducer raises that error from ``backward()`` as a ``RuntimeError`` whose message is
``Got the following error when running the callback: DistBackendError: <the daemon's message>``: a backend
written in Python completes DDP's future with an error through a callback, and PyTorch wraps the error so.
"""

from __future__ import annotations

import signal
import time

import pytest
from torch_ranks import COLLECTIVE_TIMEOUT

pytestmark = pytest.mark.slow

START_TIMEOUT = 60.0
"""Seconds the ranks may take to start, form the group and train a few steps."""
END_TIMEOUT = COLLECTIVE_TIMEOUT / 2
"""Seconds the survivors may take to fail and exit once a rank is killed: half the collective timeout, so a
survivor that waited for that timeout fails the test."""


@pytest.mark.parametrize("world_size, victim", [(2, 1), (4, 2)])
def test_a_rank_killed_during_ddp_fails_the_others_next_step_naming_it(ranks, world_size, victim):
    job = ranks(world_size, "train")
    for rank in range(world_size):
        job.wait_for(rank, "training", START_TIMEOUT)
    job.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    statuses = job.wait(END_TIMEOUT)
    assert statuses[victim] == -signal.SIGKILL
    for rank in range(world_size):
        if rank == victim:
            continue
        error = job.events(rank)[-1]
        assert error["event"] == "error", f"rank {rank} (exit status {statuses[rank]}): {error}\n{job.stderr(rank)}"
        print(f"\nrank {rank} of {world_size}: its step failed {error['at'] - killed_at:.2f} s after rank "
              f"{victim} was killed")
        assert statuses[rank] == 1
        assert "RuntimeError" in error["mro"], error
        message = error["message"]
        assert "DistBackendError: collective " in message, message
        assert (f'cannot complete: process {victim} of group "torch-' in message
                or f'was aborted: process {victim} of group "torch-' in message), message
        assert "ended without leaving the group (its session with the daemon closed: it was killed, crashed or " \
               "exited without shutdown())" in message
