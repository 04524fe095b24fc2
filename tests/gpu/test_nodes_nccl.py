"""NCCL between node daemons (engine ``gloo+nccl``): two daemons on one GPU as two nodes on loopback.

Each daemon (``--backend cupy``, 2 logical devices on GPU 0) gets its own ``NCCL_HOSTID``, so NCCL takes its
two ranks for two hosts (it refuses two ranks on one GPU of one host) and joins them with its socket
transport on ``lo`` (the interface of their ``--node-address`` 127.0.0.1); ``NCCL_IB_DISABLE=1`` keeps it off
any InfiniBand of the machine. One SDK process per node, with CuPy values, runs this file as a script
(``python tests/gpu/test_nodes_nccl.py worker CONFIG``) and prints one JSON object per line.

Checked: the group forms with the engine ``gloo+nccl`` (``xreduce status`` and ``GetStatus``), a float32
SUM and MEAN of 4 MiB per replica are exact on both nodes (small integers: every order of additions gives
them), and a daemon SIGKILLed while large collectives run makes the survivor's call fail with ABORTED or
UNAVAILABLE within the fault bound the multi-node tests use.

Skipped, with the reason, without CuPy, a GPU, NCCL or torch; run with ``pytest -m gpu
tests/gpu/test_nodes_nccl.py`` on a GPU machine (``bench/gpu_check.sh`` does).
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from children import child_env
from xreduce_bench.faults import free_address

HERE = pathlib.Path(__file__).resolve()
SHAPE = (1024, 1024)  # float32: 4 MiB per replica
LARGE = (16, 1024, 1024)  # 64 MiB per replica: what is in flight when a daemon is killed
PEER_TIMEOUT = 2.0
FAILS_WITHIN = 2 * PEER_TIMEOUT + 5.0
"""The bound on a fault's detection, as tests/support/multinode.py's."""


def _reason() -> str | None:
    from xreduced import gloo, nccl_engine
    from xreduced.backends import cupy_backend

    for why in (cupy_backend.unavailable_reason(), nccl_engine.unavailable_reason("cupy"),
                gloo.unavailable_reason()):
        if why is not None:
            return why
    return None


_REASON = _reason() if __name__ != "__main__" else None

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(140),
              pytest.mark.skipif(_REASON is not None, reason=f"NCCL between nodes unavailable: {_REASON}")]


def _daemons(start_daemon) -> list:
    flags = ["--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", "2", "--collective-timeout",
             "60", "--peer-timeout", str(PEER_TIMEOUT), "--heartbeat-interval", "0.5", "--grace-seconds", "1"]
    return [start_daemon(*flags, env={"NCCL_HOSTID": host, "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"},
                         timeout=90) for host in ("node-a", "node-b")]


class Worker:
    """One SDK process of the job on one node's daemon; its JSON lines are collected by a thread."""

    def __init__(self, daemon, process_id: int, job: str, mode: str):
        env = child_env()
        env.update(XREDUCE_ADDRESS=daemon.address, KERAS_DISTRIBUTION_JOB_ADDRESSES=job,
                   KERAS_DISTRIBUTION_NUM_PROCESSES="2", KERAS_DISTRIBUTION_PROCESS_ID=str(process_id))
        self.proc = subprocess.Popen([sys.executable, str(HERE), "worker", json.dumps({"mode": mode})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def next(self, event: str, timeout: float = 120.0) -> dict:
        """The next line whose ``event`` is ``event`` (a ``failed`` line fails the test, unless awaited)."""
        end = time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {event!r} from the worker within {timeout:.0f}s; its stderr:\n"
                                     + "".join(self.stderr)[-4000:]) from None
            if e["event"] == event:
                return e
            if e["event"] == "failed":
                raise AssertionError(f"the worker failed: {e}\n" + "".join(self.stderr)[-4000:])

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _status(daemon) -> tuple[list, str]:
    """The daemon's groups (GetStatus) and what ``xreduce status`` prints."""
    from xreduce import Client

    with Client(daemon.address) as client:
        groups = list(client.get_status(timeout=10).groups)
    printed = subprocess.run([sys.executable, "-m", "xreduce._cli", "status", "--address", daemon.address],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    return groups, printed.stdout + printed.stderr


def test_two_nodes_sum_on_nccl(start_daemon):
    daemons = _daemons(start_daemon)
    job = f"{free_address()},{free_address()}"
    workers = [Worker(d, p, job, "sums") for p, d in enumerate(daemons)]
    try:
        inits = [w.next("ready") for w in workers]
        assert [i["num_nodes"] for i in inits] == [2, 2]
        assert [i["engine"] for i in inits] == ["gloo+nccl"] * 2  # what initialize() says
        for d in daemons:
            groups, printed = _status(d)
            assert [g.engine for g in groups] == ["gloo+nccl"], groups
            assert "gloo+nccl" in printed, printed
        for w in workers:
            w.go()
        reports = [w.next("done") for w in workers]
    finally:
        for w in workers:
            w.close()
    for p, report in enumerate(reports):
        for op in ("sum", "mean"):
            for got in report[op]:
                assert got["cupy"], f"process {p} {op}: a host result"
                assert got["exact"], f"process {p} {op}: {got['wrong']} items differ"
    for d in daemons:
        groups, _ = _status(d)
        assert groups[0].cross_node_collectives >= 2 and groups[0].engine == "gloo+nccl"


def test_a_daemon_killed_during_a_large_collective_fails_the_survivor_within_the_bound(start_daemon):
    daemons = _daemons(start_daemon)
    job = f"{free_address()},{free_address()}"
    workers = [Worker(d, p, job, "loop") for p, d in enumerate(daemons)]
    try:
        for w in workers:
            w.next("ready")
        for w in workers:
            w.go()
        for _ in range(2):  # NCCL has carried whole collectives; the next is in flight now
            workers[0].next("step")
        killed_at = time.monotonic()
        daemons[1].proc.send_signal(signal.SIGKILL)
        failed = workers[0].next("failed_step", timeout=FAILS_WITHIN + 60)
    finally:
        for w in workers:
            w.close()
    assert failed["code"] in ("ABORTED", "UNAVAILABLE"), failed
    assert failed["t"] - killed_at < FAILS_WITHIN, f"the survivor failed {failed['t'] - killed_at:.1f}s after the kill"
    assert daemons[0].proc.poll() is None, "the surviving daemon died"
    groups, _ = _status(daemons[0])
    assert groups[0].state == "failed" and "node 1" in groups[0].reason, groups[0]


# --- the worker: one SDK process of the job ------------------------------------------------------------------


def _replica(r: int, shape) -> np.ndarray:
    """Global replica ``r``'s values: small integers in float32, so any order of additions is exact."""
    size = int(np.prod(shape))
    return ((np.arange(size, dtype=np.int64) * (r + 1)) % 13 - 6).astype(np.float32).reshape(shape)


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def _worker(config: dict) -> None:
    import cupy
    from xreduce import distribution
    from xreduce.distribute import CommunicationOptions, HierarchicalCopyAllReduce, MirroredStrategy, PerReplica

    info = distribution.initialize()
    local = list(MirroredStrategy().extended.worker_devices)  # the job's names of this process's devices
    replicas = [info.devices.index(d) for d in info.local_devices]
    _emit(event="ready", num_nodes=info.num_nodes, engine=info.engine, replicas=replicas)
    sys.stdin.readline()
    ops = HierarchicalCopyAllReduce()
    options = CommunicationOptions(timeout_seconds=60)
    try:
        if config["mode"] == "sums":
            xs = PerReplica([cupy.asarray(_replica(r, SHAPE)) for r in replicas], devices=local)
            total = sum(_replica(r, SHAPE) for r in range(len(info.devices)))
            report = {}
            for op, want in (("sum", total), ("mean", total / np.float32(len(info.devices)))):
                got = ops.reduce(op, xs, xs, options=options)
                values = list(got.values) if hasattr(got, "values") else [got]
                report[op] = [{"cupy": isinstance(v, cupy.ndarray),
                               "exact": bool(np.array_equal(cupy.asnumpy(v), want)),
                               "wrong": int(np.count_nonzero(cupy.asnumpy(v) != want))} for v in values]
            _emit(event="done", **report)
        else:
            xs = PerReplica([cupy.asarray(_replica(r, LARGE)) for r in replicas], devices=local)
            for i in range(1000):
                try:
                    ops.reduce("sum", xs, xs, options=options)
                except Exception as e:  # noqa: BLE001 -- the failure is what the test waits for
                    code = getattr(e, "code", None)
                    _emit(event="failed_step", i=i, t=time.monotonic(), code=getattr(code, "name", None),
                          error=type(e).__name__, message=str(e)[:2000])
                    return
                _emit(event="step", i=i, t=time.monotonic())
    finally:
        ops.close()
        try:
            distribution.shutdown()
        except Exception:  # noqa: BLE001 -- after a lost node the group is over already
            pass


def _main(argv: list[str]) -> None:
    """Runs the worker; any failure becomes a ``failed`` line. Exits without the interpreter's teardown."""
    import traceback

    code = 0
    try:
        {"worker": _worker}[argv[1]](json.loads(argv[2]))
    except BaseException as e:  # noqa: BLE001 -- reported to the test, which fails with it
        _emit(event="failed", error=type(e).__name__, message=str(e)[:2000], traceback=traceback.format_exc())
        code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    _main(sys.argv)
