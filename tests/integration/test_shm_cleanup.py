"""Shared memory leaves nothing behind: not after a call the SDK or the daemon refuses, nor one that
times out, nor at exit, nor when a process of a job is killed; and a clean exit prints nothing and
counts no error in the daemon.

"Left behind" is counted in ``/dev/shm`` (the entries named for this process) and in the daemon's own
``/proc/PID/maps``.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import xreduce
from children import child_env
from xreduce import _runtime, _segments
from xreduce.distribute import CommunicationOptions, HierarchicalCopyAllReduce, PerReplica, ReductionToOneDevice
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not _segments.available(), reason="no POSIX shared memory (/dev/shm) on this host")

DEVICES = ["CPU:0", "CPU:1"]


@pytest.fixture(scope="module")
def d(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--virtual-devices", "4", "--collective-timeout", "20")


def ours(pid: int | None = None) -> set[str]:
    """The ``/dev/shm`` entries of process ``pid`` (this one by default)."""
    tag = f"-{os.getpid() if pid is None else pid}-"
    return {n for n in os.listdir(_segments.SHM_DIR) if tag in n}


def mapped_by(daemon, names: set[str]) -> set[str]:
    """Those of ``names`` that the daemon has mapped."""
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        maps = f.read()
    return {n for n in names if n in maps}


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def status_codes(address: str) -> dict[str, set[str]]:
    """Every method the daemon counted, with the status codes it counted for it."""
    with grpc.insecure_channel(address) as channel:
        status = pb_grpc.CrossDeviceOpsStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    return {m.method.rsplit("/", 1)[-1]: set(m.calls_by_code) for m in status.methods}


# --- item 1: a refused or failed call ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: np.array([True] * (1 << 20)), lambda: np.array(["abc"] * (1 << 16)),
                                  lambda: np.array([object()] * (1 << 16))], ids=["bool", "str", "object"])
def test_a_dtype_the_daemon_does_not_reduce_stages_nothing(d, make):
    ops = ReductionToOneDevice(address=d.address, transport="shm")
    before = ours()
    for _ in range(20):
        value = PerReplica([make(), make()], devices=DEVICES)
        with pytest.raises(ValueError):
            ops.reduce("sum", value, "CPU:0")
    assert ours() - before == set()


@pytest.mark.parametrize("shape, dtype", [(8, object), (4, bool), (2, "U4"), ((-1, 4), "float32"), ((2.5,), "float32")])
def test_a_shared_array_the_daemon_could_not_reduce_is_refused_before_anything_is_made(shape, dtype):
    before = ours()
    with pytest.raises(ValueError, match=r"^(shape|dtype): "):
        xreduce.shared_array(shape, dtype)
    assert ours() - before == set()


def _refused(ops, call, error) -> set[str]:
    """After a call that succeeds, runs ``call(ops)`` 10 times, each raising ``error``; the segments left."""
    warm = ops.reduce("sum", PerReplica([np.ones(4, np.float32)] * 2, devices=DEVICES), "CPU:0")
    assert warm.tolist() == [2.0] * 4
    before = ours()
    for _ in range(10):
        with pytest.raises(error):
            call(ops)
    return ours() - before


def test_a_call_the_daemon_refuses_leaves_nothing_here_or_there(d):
    """INVALID_ARGUMENT: replicas that disagree in shape, which the daemon checks."""
    ops = ReductionToOneDevice(address=d.address, transport="shm")
    value = PerReplica([np.ones(1 << 18, np.float32), np.ones(5, np.float32)], devices=DEVICES)
    names = ours()
    left = _refused(ops, lambda ops: ops.reduce("sum", value, "CPU:0"), xreduce.InvalidArgumentError)
    assert wait_until(lambda: ours() & left == set())
    assert wait_until(lambda: not mapped_by(d, (names | left) - ours())), "the daemon let go of what the SDK unlinked"


def test_a_call_refused_over_a_limit_leaves_nothing_behind(start_daemon, monkeypatch):
    """RESOURCE_EXHAUSTED: a batch whose request is over --max-request-bytes."""
    monkeypatch.setenv("XREDUCE_FUSION", "0")  # fused, the 40 values would be one small tensor in the request
    small = start_daemon("--listen", "127.0.0.1:0", "--virtual-devices", "2", "--max-request-bytes", "2048")
    ops = ReductionToOneDevice(address=small.address, transport="shm")
    value = PerReplica([np.ones(1 << 12, np.float32)] * 2, devices=DEVICES)
    names = ours()
    left = _refused(ops, lambda ops: ops.batch_reduce("sum", [(value, "CPU:0")] * 40), xreduce.ResourceExhaustedError)
    assert wait_until(lambda: ours() & left == set())
    assert wait_until(lambda: not mapped_by(small, (names | left) - ours()))


def test_a_call_that_times_out_leaves_nothing_and_its_segments_are_never_reused(d):
    """A collective whose partner never comes: the daemon gives up after the call's timeout. The
    segments the call took are unlinked, not reused: a call that did not answer may still use them."""
    ops = HierarchicalCopyAllReduce(address=d.address, transport="shm")
    ops.reduce("sum", PerReplica([np.ones(4, np.float32)], devices=["CPU:0"]), "CPU:0")
    before = ours()
    group = _runtime.ProcessGroup(f"nobody-{os.getpid()}", 2, 0, ("/job:localhost/replica:0/task:0/device:CPU:0",),
                                  ("/job:localhost/replica:0/task:0/device:CPU:0",
                                   "/job:localhost/replica:0/task:0/device:CPU:1"))
    _runtime.set_process_group(d.address, group)
    try:
        with pytest.raises(xreduce.DeadlineExceededError):
            ops.reduce("sum", PerReplica([np.ones(1 << 16, np.float32)], devices=["CPU:0"]), "CPU:0",
                       options=CommunicationOptions(timeout_seconds=0.5))
    finally:
        _runtime.set_process_group(d.address, None)
    # Nothing new is left (its output segment), and the free staging segment the call took is gone.
    assert wait_until(lambda: ours() < before), (sorted(before), sorted(ours()))
    assert wait_until(lambda: not mapped_by(d, before - ours()))


# --- item 2: exit, and a killed process ----------------------------------------------------------------------

def _docs_snippet() -> str:
    """The shared-memory example of docs/transports.md, as a script."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "transports.md").read_text()
    block = next(b for b in re.findall(r"```pycon\n(.*?)```", text, re.S) if "shared_array" in b)
    return "\n".join(line[4:] for line in block.splitlines() if line.startswith((">>> ", "... ")))


def test_the_docs_snippet_exits_without_a_word_or_an_error(start_daemon):
    """docs/transports.md's shared-memory example as a script, six times: nothing on stderr, nothing left in
    /dev/shm, only OK in the daemon's counters (no UnregisterRegion after the session closed)."""
    daemon = start_daemon("--listen", "127.0.0.1:0", "--virtual-devices", "8")
    script = _docs_snippet() + "\nprint(value.values[0].sum())\n"
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(child_env(), XREDUCE_ADDRESS=daemon.address))
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out.split()[-1], err) == (0, "0.0", "")
        assert ours(proc.pid) == set()
    codes = status_codes(daemon.address)
    assert codes["Reduce"] == {"OK"} and all(c == {"OK"} for c in codes.values()), codes


KILLED = """
import multiprocessing, os, signal, sys
import numpy as np


def work(address, kill_me, ready):
    import xreduce
    from xreduce.distribute import ReductionToOneDevice, PerReplica
    x = [xreduce.shared_array(1 << 16, "float32") for _ in range(2)]
    ops = ReductionToOneDevice(address=address, transport="shm")
    ops.reduce("sum", PerReplica([np.ones(1 << 16, np.float32)] * 2, devices=["CPU:0", "CPU:1"]), "CPU:0")
    ops.reduce("sum", PerReplica(x, devices=["CPU:0", "CPU:1"]), "CPU:0")
    ready.put(os.getpid())
    if kill_me:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    import xreduce  # the parent uses shared memory too, before its children start
    xreduce.shared_array(8, "float32")
    ctx = multiprocessing.get_context(sys.argv[2])
    ready = ctx.SimpleQueue()
    procs = [ctx.Process(target=work, args=(sys.argv[1], i == 0, ready)) for i in range(2)]
    for p in procs:
        p.start()
    pids = [ready.get() for _ in procs]
    for p in procs:
        p.join(60)
    print(" ".join(str(p) for p in pids), procs[0].exitcode, procs[1].exitcode, flush=True)
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_killed_process_leaves_nothing_and_the_survivors_say_nothing(d, start, tmp_path):
    """A job of a parent and two children, all using shared memory; one child is killed. The others
    exit without a warning (no "leaked shared_memory objects"), and the killed one's segments go."""
    (tmp_path / "job.py").write_text(KILLED)
    done = subprocess.run([sys.executable, str(tmp_path / "job.py"), d.address, start], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    *pids, killed, survived = done.stdout.split()
    assert (killed, survived) == (str(-signal.SIGKILL), "0"), done.stderr
    assert done.stderr == ""
    assert wait_until(lambda: all(ours(int(pid)) == set() for pid in pids)), "the killed process's reaper unlinked them"
