"""The ranks of a ``torch.distributed`` job for the torch tests: real processes, and the store they meet at.

This process serves the job's ``TCPStore`` on a port the kernel picks (port 0: no free port guessed, none
raced for); every rank connects to it and gives it to ``init_process_group(store=...)``. Each rank's stdout
and stderr go to files, so no pipe can fill and stall a rank; its JSON lines are its events.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys
import time

import torch.distributed as dist
from children import Started, child_env

STORE_TIMEOUT = datetime.timedelta(seconds=120)
"""How long the job's store waits for a key (the ranks' own waits are bounded by the tests' timeouts)."""

WORKER = pathlib.Path(__file__).resolve().parents[1] / "torch" / "torch_worker.py"
"""The ranks' program in the torch tests."""

COLLECTIVE_TIMEOUT = 60
"""The torch tests' daemons' ``--collective-timeout``: far above every wait of those tests, so an error they
wait for comes from elsewhere (a lost rank, ``init_process_group``'s own timeout), never from this one."""

DAEMON_FLAGS = ("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                "--collective-timeout", str(COLLECTIVE_TIMEOUT))
"""The torch tests' daemon: 4 host devices (each rank of a job drives one)."""


class Ranks:
    """``world_size`` processes of ``python SCRIPT --rank R --world-size N --store-port P ARGS...``.

    Args:
        script: the rank's program; it prints JSON lines (its events) on stdout.
        args: what follows the rank's own flags.
        world_size: how many ranks.
        address: the daemon (``XREDUCE_ADDRESS``).
        logs: a folder for the ranks' stdout and stderr.

    Example:
        >>> import tempfile
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "rank.py"
        >>> _ = script.write_text("import json, sys; print(json.dumps({'rank': int(sys.argv[2])}))")
        >>> with Ranks(script, [], 2, "127.0.0.1:1", script.parent) as ranks:
        ...     ranks.finish(30)
        [[{'rank': 0}], [{'rank': 1}]]
    """

    def __init__(self, script: pathlib.Path, args: list[str], world_size: int, address: str,
                 logs: pathlib.Path):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        self._started = Started()
        self._logs = [(logs / f"rank{r}.out", logs / f"rank{r}.err") for r in range(world_size)]
        # One thread per rank's ops as torchrun sets it; a rank that crashes prints its threads' stacks.
        env = dict(child_env(), XREDUCE_ADDRESS=address, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        self.procs = []
        for rank, (out, err) in enumerate(self._logs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                self.procs.append(self._started.popen(
                    [sys.executable, str(script), "--rank", str(rank), "--world-size", str(world_size),
                     "--store-port", str(self.store.port), *args], stdout=stdout, stderr=stderr, env=env))

    def events(self, rank: int) -> list[dict]:
        """The events ``rank`` has printed so far."""
        text = self._logs[rank][0].read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{") and line.endswith("}")]

    def stderr(self, rank: int) -> str:
        """The end of ``rank``'s stderr (for failure messages)."""
        return self._logs[rank][1].read_text()[-4000:]

    def wait_for(self, rank: int, event: str, timeout: float) -> dict:
        """The first event named ``event`` of ``rank``, waiting at most ``timeout`` seconds for it.

        Raises:
            AssertionError: none came in time, or the rank ended first; with its stderr.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(rank) if e.get("event") == event]
            if found:
                return found[0]
            ended = self.procs[rank].poll() is not None
            assert not ended and time.monotonic() < deadline, (
                f"rank {rank} printed no {event!r} event ({'it ended' if ended else f'{timeout} s'}):\n"
                f"{self.events(rank)}\n{self.stderr(rank)}")
            time.sleep(0.02)

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit status, waiting at most ``timeout`` seconds in all.

        Raises:
            AssertionError: a rank still ran then (every rank is killed); with the ranks' stderr.
        """
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                stderr = "\n".join(f"--- rank {r}:\n{self.stderr(r)}" for r in range(len(self.procs)))
                raise AssertionError(f"rank {rank} still ran after {timeout} s\n{stderr}") from None
        return [proc.returncode for proc in self.procs]

    def finish(self, timeout: float) -> list[list[dict]]:
        """Every rank's events once all have exited with status 0, waiting at most ``timeout`` seconds.

        Raises:
            AssertionError: a rank still ran then, or failed; with its stderr.
        """
        for rank, status in enumerate(self.wait(timeout)):
            assert status == 0, f"rank {rank} exited with status {status}:\n{self.stderr(rank)}"
        return [self.events(rank) for rank in range(len(self.procs))]

    def close(self) -> None:
        """Kills the ranks still running and reaps them all."""
        self._started.end_all()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
