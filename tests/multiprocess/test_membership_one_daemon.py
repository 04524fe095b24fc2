"""One membership for a group on one daemon: a process that dies is noticed through its session, at once.

Real processes (this module run as a script, one per process) join a group of one
real daemon with ``xreduce.distribution.initialize`` and reduce; one is SIGKILLed
(or leaves) while the other waits in a collective or before its next one. The
survivor's call must fail with ``AbortedError`` naming the process, not wait for
the collective timeout (set to 120 s here, so a wait would show as a test timeout),
and a new ``initialize`` of the same group must work at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from children import Started, child_env
from daemons import wait_log
from xreduce import Client

TIMEOUT = 60.0
"""Seconds a child may take; far below the daemon's collective timeout."""


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                               "--collective-timeout", "120", "--log-level", "INFO")


STARTED = Started()


@pytest.fixture(autouse=True)
def no_child_left():
    """Every child a test started is gone after it, whatever the test's outcome."""
    yield
    STARTED.end_all()


def child(daemon, group: str, pid: int, script: list[str], stall: str = "0") -> subprocess.Popen:
    env = dict(child_env(), XREDUCE_ADDRESS=daemon.address, XREDUCE_GROUP=group,
               XREDUCE_STALL_WARNING_SECONDS=stall)
    return STARTED.popen([sys.executable, __file__, str(pid), *script], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)


def events(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=TIMEOUT)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")] or [{"stderr": err}]


def test_a_process_killed_between_calls_fails_the_next_collective_of_the_others(daemon):
    survivor = child(daemon, "kill-between", 0, ["init", "reduce", "wait-file", "reduce", "reduce"])
    victim = child(daemon, "kill-between", 1, ["init", "reduce", "die"])
    victim.wait(TIMEOUT)
    wait_log(daemon, r'event=process_gone group="kill-between" process=1')
    open(f"/tmp/xreduce-membership-{survivor.pid}", "w").close()
    got = events(survivor)
    assert got[1] == {"step": "reduce", "ok": [2.0, 2.0]}
    for step in got[2:4]:
        assert step["error"] == "AbortedError"
        assert 'process 1 of group "kill-between" ended without leaving the group' in step["message"]
        assert "every process must shutdown() and initialize() again" in step["message"]
    assert got[2]["message"].startswith('collective 1 in group "kill-between" cannot complete')


def test_a_process_killed_while_the_other_waits_fails_that_collective(daemon):
    survivor = child(daemon, "kill-waiting", 0, ["init", "reduce", "reduce"])
    victim = child(daemon, "kill-waiting", 1, ["init", "reduce", "sleep", "die"])
    got = events(survivor)
    victim.wait(TIMEOUT)
    assert got[2]["error"] == "AbortedError"
    assert got[2]["message"].startswith('collective 1 in group "kill-waiting" was aborted: process 1 of group '
                                        '"kill-waiting" ended without leaving the group')


@pytest.mark.parametrize("end", ["die", "shutdown"])
def test_a_call_held_in_the_express_lane_fails_when_the_group_does_not_after_the_hold(start_daemon, end):
    """The survivor's second reduce has a shape the daemon validated in the first: the express lane holds it
    (here for up to 50 s, ``--lane-express-hold``). The other process then ends (killed, or shutdown()): the group
    fails, and the express lane hands the held call over at once (logged with the reason), for the full path to
    answer with the group's error; without that hand-over the call would wait out the hold, past ``TIMEOUT``."""
    held = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4",
                        "--collective-timeout", "120", "--lane-express-hold", "50", "--log-level", "DEBUG")
    group = f"express-{end}"
    survivor = child(held, group, 0, ["init", "reduce", "reduce"])
    other = child(held, group, 1, ["init", "reduce", "sleep", end])
    got = events(survivor)
    other.wait(TIMEOUT)
    assert got[1] == {"step": "reduce", "ok": [2.0, 2.0]}, got
    assert got[2]["error"] == "AbortedError", got
    why = "ended without leaving the group" if end == "die" else "left the group (shutdown()) while the others"
    assert f'process 1 of group "{group}" {why}' in got[2]["message"], got
    wait_log(held, rf"event=express_handed_over group=\"{group}\" collective=seq:1 processes=0 "
                   r"reason='the group failed'")


def test_a_process_that_leaves_while_the_other_waits_fails_it(daemon):
    waiter = child(daemon, "leave-waiting", 0, ["init", "reduce", "reduce"])
    leaver = child(daemon, "leave-waiting", 1, ["init", "reduce", "sleep", "shutdown"])
    got = events(waiter)
    assert events(leaver)[-1] == {"step": "shutdown", "ok": None}
    assert got[2]["error"] == "AbortedError"
    assert 'process 1 of group "leave-waiting" left the group (shutdown()) while the others still use it' in \
        got[2]["message"]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_after_a_loss_the_restarted_job_joins_at_once_with_the_same_ids(daemon, how):
    group = f"restart-{how.name.lower()}"
    survivor = child(daemon, group, 0, ["init", "reduce", "wait-file", "reduce", "shutdown", "init", "reduce"])
    victim = child(daemon, group, 1, ["init", "reduce", "sleep-long"])
    ready = f"/tmp/xreduce-membership-ready-{victim.pid}"
    while not os.path.exists(ready):  # the victim has reduced once, and sleeps
        assert victim.poll() is None
        time.sleep(0.02)
    os.unlink(ready)
    victim.send_signal(how)
    victim.wait(TIMEOUT)
    wait_log(daemon, rf'event=process_gone group="{group}" process=1')
    open(f"/tmp/xreduce-membership-{survivor.pid}", "w").close()
    restarted = child(daemon, group, 1, ["init", "reduce"])
    got, again = events(survivor), events(restarted)
    assert got[2]["error"] == "AbortedError"
    assert got[5] == again[1] == {"step": "reduce", "ok": [2.0, 2.0]}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["sigkill", "sigterm", "sigint"])
def test_a_process_ended_while_it_joins_leaves_no_registration_behind(daemon, how):
    """Process 0 waits in initialize() for process 1 and is ended by ``how``: the restarted job (the same
    process ids) joins at once and reduces."""
    group = f"join-{how.name.lower()}"
    victim = child(daemon, group, 0, ["init"])
    with Client(daemon.address) as client:
        while client.get_status().collectives_waiting == 0:  # its join waits in the daemon
            assert victim.poll() is None, events(victim)
            time.sleep(0.02)
    victim.send_signal(how)
    victim.wait(TIMEOUT)
    procs = [child(daemon, group, p, ["init", "reduce"]) for p in (0, 1)]
    for proc in procs:
        assert events(proc) == [{"step": "init", "ok": None}, {"step": "reduce", "ok": [2.0, 2.0]}]


def test_a_stopped_process_is_named_by_the_stall_warning_and_the_timeout(daemon):
    """A SIGSTOPped process keeps its session: the other waits, is told whom it waits for by the stall
    warning (1 s here), and its collective times out naming it; nothing waits past the timeout."""
    survivor = child(daemon, "stopped", 0, ["init", "reduce", "wait-file", "reduce-3s"], stall="1")
    victim = child(daemon, "stopped", 1, ["init", "reduce", "sleep-long"])
    ready = f"/tmp/xreduce-membership-ready-{victim.pid}"
    while not os.path.exists(ready):
        assert victim.poll() is None
        time.sleep(0.02)
    os.unlink(ready)
    victim.send_signal(signal.SIGSTOP)
    try:
        open(f"/tmp/xreduce-membership-{survivor.pid}", "w").close()
        out, err = survivor.communicate(timeout=TIMEOUT)
    finally:
        victim.send_signal(signal.SIGCONT)
    got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert got[2]["error"] == "DeadlineExceededError", got
    assert "waiting for process(es) [1]" in got[2]["message"], got[2]
    assert 'collective 1 in group "stopped" has not completed after 1 s (this is process 0 of 2; it waits ' \
        "for process 1)" in err, err


def test_a_clean_end_by_every_process_loses_nobody(daemon):
    procs = [child(daemon, "clean", p, ["init", "reduce", "shutdown"]) for p in (0, 1)]
    for proc in procs:
        assert events(proc)[-1] == {"step": "shutdown", "ok": None}
    assert 'event=process_gone group="clean"' not in daemon.log()


def _main(pid: int, script: list[str]) -> None:
    import numpy as np
    import xreduce
    from xreduce import distribute

    ops = distribute.HierarchicalCopyAllReduce()
    for step in script:
        event: dict = {"step": step}
        try:
            if step == "init":
                xreduce.distribution.initialize(num_processes=2, process_id=pid)
                event["ok"] = None
            elif step in ("reduce", "reduce-3s"):
                device = xreduce.distribution.process_info().local_devices[0]
                value = distribute.PerReplica([np.ones(2, np.float32)], devices=[device])
                options = distribute.CommunicationOptions(timeout_seconds=3) if step == "reduce-3s" else None
                event["ok"] = np.asarray(ops.reduce("sum", value, device, options=options)).tolist()
            elif step == "shutdown":
                xreduce.distribution.shutdown()
                event["ok"] = None
            elif step == "sleep":
                time.sleep(1.0)
                continue
            elif step == "sleep-long":
                open(f"/tmp/xreduce-membership-ready-{os.getpid()}", "w").close()
                time.sleep(TIMEOUT)
                continue
            elif step == "wait-file":
                flag = f"/tmp/xreduce-membership-{os.getpid()}"
                while not os.path.exists(flag):
                    time.sleep(0.02)
                os.unlink(flag)
                continue
            elif step == "die":
                os.kill(os.getpid(), signal.SIGKILL)
        except xreduce.XReduceError as e:
            event.update(error=type(e).__name__, message=str(e))
        print(json.dumps(event), flush=True)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2:])
