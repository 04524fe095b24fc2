"""The rendezvous and the collective helpers, with threads standing in for processes."""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import pytest
from xreduced.backends.numpy_backend import NumpyBackend
from xreduced.collective import Contribution, assign_devices, reduce_together
from xreduced.deadline import Deadline
from xreduced.decode import CollectiveKey
from xreduced.deferred import Deferred
from xreduced.engine import Engine, Value
from xreduced.errors import Aborted, DeadlineExceeded, InvalidArgument
from xreduced.rendezvous import Meeting, Participant, Rendezvous

KEY = CollectiveKey("g", 0)
LABEL = KEY.label


def _total(contributions):
    return {p: sum(contributions.values()) for p in contributions}


def _run(r: Rendezvous, pid: int, value=1, *, num=2, timeout=5.0, compute=_total, key=KEY, on_leave=None,
         remember_failure=True, expected=None, abandoned=None, defer=False):
    """One participant's arrival, every option by name."""
    meeting = Meeting(key, LABEL, num, expected=expected, remember_failure=remember_failure, abandoned=abandoned)
    return r.run(meeting, Participant(pid, value, timeout, on_leave=on_leave, defer=defer), compute)


def _members(r: Rendezvous, contributions: dict, num: int, timeout=5.0, compute=None, leave=None, key=KEY):
    """Runs one thread per contribution; returns {pid: result or exception}."""
    out: dict = {}
    compute = compute or _total

    def member(pid, value):
        try:
            out[pid] = _run(r, pid, value, num=num, timeout=timeout, compute=compute, key=key,
                            on_leave=leave.get(pid) if leave else None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[pid] = e

    threads = [threading.Thread(target=member, args=(p, v)) for p, v in contributions.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_member_gets_its_share():
    r = Rendezvous()
    out = _members(r, {0: 1, 1: 2, 2: 3}, 3, compute=lambda c: {p: (p, sum(c.values())) for p in c})
    assert out == {0: (0, 6), 1: (1, 6), 2: (2, 6)}
    assert r.pending() == 0 and r.remembered_failures() == 0


def test_timeout_names_the_missing_processes_and_late_arrivals_get_it_too():
    r = Rendezvous()
    out = _members(r, {0: 1, 2: 1}, 4, timeout=0.2)
    for pid in (0, 2):
        assert isinstance(out[pid], DeadlineExceeded)
        assert str(out[pid]) == f"{LABEL} timed out after 0.2s waiting for process(es) [1, 3]; arrived: [0, 2]"
    with pytest.raises(DeadlineExceeded, match=r"waiting for process\(es\) \[1, 3\]") as late:
        _run(r, 1, num=4, compute=lambda c: c)
    assert late.value.process_ids == out[0].process_ids == (1, 3)  # a late arrival's error names them as well
    assert r.pending() == 0 and r.remembered_failures() == 1


def test_failures_are_forgotten_after_their_ttl():
    r = Rendezvous(failed_ttl=0.05)
    _members(r, {0: 1}, 2, timeout=0.05)
    time.sleep(0.1)
    assert r.remembered_failures() == 0
    assert _members(r, {0: 1, 1: 2}, 2) == {0: 3, 1: 3}


def test_a_member_leaving_aborts_the_others():
    r = Rendezvous()
    callbacks: list = []
    out: dict = {}

    def waiter():
        try:
            out[0] = _run(r, 0, num=3, timeout=10.0, compute=lambda c: c)
        except Exception as e:  # noqa: BLE001
            out[0] = e

    def leaver():
        try:
            out[1] = _run(r, 1, num=3, timeout=10.0, compute=lambda c: c, on_leave=callbacks.append)
        except Exception as e:  # noqa: BLE001
            out[1] = e

    threads = [threading.Thread(target=waiter), threading.Thread(target=leaver)]
    for t in threads:
        t.start()
    while not callbacks:
        time.sleep(0.005)
    started = time.monotonic()
    callbacks[0]()  # what gRPC does when process 1's call ends
    for t in threads:
        t.join(5)
    assert time.monotonic() - started < 5
    for pid in (0, 1):
        assert isinstance(out[pid], Aborted), out
        assert str(out[pid]) == (f"{LABEL} was aborted: process 1 left (its call ended or its process died) "
                                 "before every process arrived")
    assert r.pending() == 0


@pytest.mark.parametrize("case", ["num_processes", "twice", "compute"])
def test_disagreement_fails_everyone(case):
    r = Rendezvous()
    if case == "num_processes":
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault(0, _catch(lambda: _run(r, 0, compute=dict))))
        t.start()
        while r.pending() == 0:
            time.sleep(0.005)
        with pytest.raises(InvalidArgument, match=f"process 1 says num_processes=3 but process 0 said "
                                                  f"num_processes=2 for {LABEL}"):
            _run(r, 1, num=3, compute=dict)
        t.join(5)
        assert isinstance(out[0], InvalidArgument)
    elif case == "twice":
        out = _members(r, {0: 1}, 2, timeout=0.01)  # leaves a remembered timeout; use another key
        key = CollectiveKey("g", 1)
        t = threading.Thread(target=lambda: out.setdefault(5, _catch(lambda: _run(r, 0, num=3, compute=dict, key=key))))
        t.start()
        while r.pending() == 0:
            time.sleep(0.005)
        with pytest.raises(InvalidArgument, match="process 0 contributed twice") as e:
            _run(r, 0, num=3, compute=dict, key=key)
        # Two jobs started by hand on the default group look like this: the message says what to change.
        assert "give each job its own XREDUCE_GROUP" in str(e.value)
        t.join(5)
        assert isinstance(out[5], InvalidArgument)
    else:
        def compute(c):
            raise InvalidArgument("process 1 sent float32[2] but process 0 sent float32[3]")

        out = _members(r, {0: 1, 1: 2}, 2, compute=compute)
        assert all(isinstance(e, InvalidArgument) for e in out.values())
    assert r.pending() == 0


def test_fail_before_anyone_arrives_reaches_later_arrivals():
    r = Rendezvous()
    r.fail(KEY, LABEL, 2, Aborted("process 1's request was rejected"))
    with pytest.raises(Aborted, match="rejected"):
        _run(r, 0, compute=dict)
    assert r.pending() == 0


def test_remembered_failures_are_bounded():
    r = Rendezvous(max_failed=10)
    for i in range(50):
        r.fail(CollectiveKey("g", i), LABEL, 2, Aborted("x"))
    assert r.remembered_failures() == 10 and r.pending() == 0


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


def _share(devices, arrays, dests=None):
    value = Value(tuple(devices), tuple(arrays))
    return Contribution("Reduce", "SUM", 1, "hierarchical_copy", None, ((value, tuple(dests or devices)),))


def test_reduce_together_equals_one_reduction_over_the_union():
    engine = Engine(NumpyBackend(8))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(5).astype(np.float32) for _ in range(8)]
    shares = {1: _share([4, 5, 6, 7], data[4:]), 0: _share([0, 1, 2, 3], data[:4])}
    got = reduce_together(engine, shares, LABEL, Deadline(None))
    want = engine.reduce("SUM", Value(tuple(range(8)), tuple(data)), ())
    assert got[0][0].devices == (0, 1, 2, 3) and got[1][0].devices == (4, 5, 6, 7)
    assert got[1][0].arrays[0].tobytes() == want.arrays[0].tobytes()


@pytest.mark.parametrize("case, message", [
    ("shape", f"process 1 sent float32[3] but process 0 sent float32[2] for tensor 0 of {LABEL}"),
    ("devices", f"process 1 and process 0 both sent a component on CPU:1 for tensor 0 of {LABEL}"),
    ("op", f"process 1 sent op='MEAN' but process 0 sent op='SUM' for {LABEL}"),
])
def test_reduce_together_names_what_differs(case, message):
    engine = Engine(NumpyBackend(4))
    a = np.zeros(2, np.float32)
    shares = {0: _share([0, 1], [a, a])}
    if case == "shape":
        shares[1] = _share([2, 3], [np.zeros(3, np.float32)] * 2)
    elif case == "devices":
        shares[1] = _share([1, 2], [a, a])
    else:
        base = _share([2, 3], [a, a])
        shares[1] = Contribution("Reduce", "MEAN", 1, base.algorithm, None, base.pairs)
    with pytest.raises(InvalidArgument) as info:
        reduce_together(engine, shares, LABEL, Deadline(None))
    assert str(info.value).startswith(message)


def test_assign_devices_blocks_overrides_and_overlaps():
    assert assign_devices({0: (), 1: (), 2: ()}, 8, str, "j") == {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}
    assert assign_devices({0: (4, 5), 1: (0, 1)}, 8, str, "j") == {0: (4, 5), 1: (0, 1)}
    with pytest.raises(InvalidArgument, match="process 1 and process 0 both use 5 in j"):
        assign_devices({0: (4, 5), 1: (5,)}, 8, str, "j")
    with pytest.raises(InvalidArgument, match="num_processes=3 but the daemon has 2 devices"):
        assign_devices({0: (), 1: (), 2: ()}, 2, str, "j")


def test_a_crash_in_compute_still_releases_the_waiters():
    r = Rendezvous()

    def compute(c):
        raise ZeroDivisionError("a bug")

    out = _members(r, {0: 1, 1: 2}, 2, compute=compute)
    assert sorted(type(e).__name__ for e in out.values()) == ["Internal", "ZeroDivisionError"]
    assert r.pending() == 0


# --- the waiting line ---------------------------------------------------------------------------------------


def _waiting_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "xreduced.rendezvous" and "event=collective_waiting" in r.getMessage()]


def test_a_waiting_collective_is_logged_at_growing_gaps_naming_who_is_missing(caplog):
    caplog.set_level(logging.WARNING, "xreduced.rendezvous")
    r = Rendezvous(report_after=0.1)
    out = _members(r, {0: 1, 2: 1}, 4, timeout=0.5)
    assert all(isinstance(e, DeadlineExceeded) for e in out.values())
    lines = _waiting_lines(caplog)
    # Due at 0.1 s and 0.3 s (gaps double): one line each, whichever waiter is awake first writes it.
    assert len(lines) == 2, lines
    for line, due in zip(lines, (0.1, 0.3)):
        found = re.fullmatch(r'event=collective_waiting group="g" collective=0 waited_s=([\d.]+) num_processes=4 '
                             r"arrived=0,2 missing=1,3", line)
        assert found and due <= float(found[1]) < due + 0.2, line


def test_the_waiting_line_names_a_collective_by_name_and_cuts_long_lists(caplog):
    caplog.set_level(logging.WARNING, "xreduced.rendezvous")
    r = Rendezvous(report_after=0.05)
    out = _members(r, {p: 1 for p in range(12)}, 40, timeout=0.1, key=CollectiveKey('my "job"', name="join"))
    assert all(isinstance(e, DeadlineExceeded) for e in out.values())
    (line,) = _waiting_lines(caplog)
    assert 'group="my \\"job\\"" collective="join" ' in line
    assert line.endswith("num_processes=40 arrived=0,1,2,3,4,5,6,7,8,9,...+2 missing=12,13,14,15,16,17,18,19,20,21,"
                         "...+18"), line


def test_a_collective_that_completes_in_time_or_with_reports_off_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, "xreduced.rendezvous")
    assert _members(Rendezvous(report_after=5.0), {0: 1, 1: 2}, 2) == {0: 3, 1: 3}
    out = _members(Rendezvous(report_after=0), {0: 1}, 2, timeout=0.2)
    assert isinstance(out[0], DeadlineExceeded)
    assert _waiting_lines(caplog) == []


# --- each branch of a participant's way through the rendezvous ----------------------------------------------


def _in_thread(fn, name=None) -> tuple[threading.Thread, dict]:
    """Runs ``fn`` in a thread; its result or exception lands in the dict under "out"."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("out", _catch(fn)), name=name)
    thread.start()
    return thread, out


def _watched() -> tuple[Rendezvous, threading.Semaphore]:
    """A rendezvous, and a semaphore released once per participant that arrives there without completing
    (its ``arriving``)."""
    arrived = threading.Semaphore(0)
    return Rendezvous(arriving=lambda key: arrived.release()), arrived


def test_the_last_arrival_computes_once_in_its_own_thread():
    r, arrived = _watched()
    calls = []

    def compute(c):
        calls.append((dict(c), threading.current_thread().name))
        return {p: p * 100 for p in c}

    waiters = [_in_thread(lambda p=p: _run(r, p, p + 1, num=3, compute=compute)) for p in (0, 1)]
    for _ in waiters:
        assert arrived.acquire(timeout=10)
    last, out = _in_thread(lambda: _run(r, 2, 3, num=3, compute=compute), name="last")
    last.join(10)
    for thread, _ in waiters:
        thread.join(10)
    assert calls == [({0: 1, 1: 2, 2: 3}, "last")]
    assert [o["out"] for _, o in waiters] == [0, 100] and out["out"] == 200
    assert not arrived.acquire(blocking=False)  # the last arrival completed it: nobody was told it waits
    assert r.pending() == 0 and r.remembered_failures() == 0


def test_a_waiting_participant_returns_only_once_the_last_one_arrives():
    r, arrived = _watched()
    thread, out = _in_thread(lambda: _run(r, 0, 1))
    assert arrived.acquire(timeout=10)
    assert out == {} and r.pending() == 1
    assert _run(r, 1, 2) == 3
    thread.join(10)
    assert out == {"out": 3} and r.pending() == 0


def test_a_deferred_participant_returns_at_once_and_is_answered_by_the_last_arrival():
    r = Rendezvous()
    waiting = _run(r, 0, 1, defer=True)
    assert isinstance(waiting, Deferred) and not waiting.done
    assert _run(r, 1, 2) == 3
    assert (waiting.value, waiting.error) == (3, None)


def test_the_last_arrival_computes_itself_even_when_it_could_defer():
    r = Rendezvous()
    _run(r, 0, 1, defer=True)
    assert _run(r, 1, 2, defer=True) == 3


def test_a_waiter_whose_reduction_overruns_is_told_it_did_not_finish():
    r, arrived = _watched()
    computing, release = threading.Event(), threading.Event()

    def slow(c):
        computing.set()
        assert release.wait(30)
        return _total(c)

    waiter, out = _in_thread(lambda: _run(r, 0, timeout=0.05))
    assert arrived.acquire(timeout=10)
    last, last_out = _in_thread(lambda: _run(r, 1, compute=slow))
    assert computing.wait(10)
    waiter.join(30)  # its timeout, then max(timeout, 1 s) more for the reduction
    release.set()
    last.join(10)
    assert isinstance(out["out"], DeadlineExceeded)
    assert str(out["out"]) == f"{LABEL}: every process arrived but the reduction did not finish within 1s more"
    assert last_out["out"] == 2 and r.remembered_failures() == 0


def test_a_deferred_participant_whose_reduction_overruns_is_told_at_its_wake():
    r = Rendezvous()
    waiting = _run(r, 0, timeout=0.05, defer=True)
    computing, release = threading.Event(), threading.Event()

    def slow(c):
        computing.set()
        assert release.wait(30)
        return _total(c)

    last, out = _in_thread(lambda: _run(r, 1, compute=slow))
    assert computing.wait(10)
    due = waiting.wake_at()  # everyone arrived: the deadline plus max(timeout, 1 s)
    waiting.wake(due - 0.5)
    assert not waiting.done
    waiting.wake(due)
    release.set()
    last.join(10)
    assert isinstance(waiting.error, DeadlineExceeded)
    assert str(waiting.error) == f"{LABEL}: every process arrived but the reduction did not finish within 1s more"
    assert out["out"] == 2


def test_a_participant_whose_call_has_already_ended_leaves_at_once():
    r = Rendezvous()
    with pytest.raises(Aborted, match="process 0 left"):
        _run(r, 0, on_leave=lambda leave: False)  # gRPC's add_callback says False: the call is over
    with pytest.raises(Aborted, match="process 0 left") as late:  # remembered for late arrivals
        _run(r, 1)
    assert str(late.value) == (f"{LABEL} was aborted: process 0 left (its call ended or its process died) before "
                               "every process arrived")


def test_leaving_once_everyone_has_arrived_changes_nothing():
    r = Rendezvous()
    leave = []
    waiting = _run(r, 0, on_leave=leave.append, defer=True)
    assert _run(r, 1, 2) == 3
    leave[0]()  # the call ends after its collective completed
    assert waiting.value == 3 and r.remembered_failures() == 0


def test_a_deferred_participant_that_leaves_aborts_the_waiting_thread():
    r, arrived = _watched()
    leave = []
    thread, out = _in_thread(lambda: _run(r, 0, num=3))
    assert arrived.acquire(timeout=10)
    _run(r, 1, num=3, on_leave=leave.append, defer=True)
    leave[0]()
    thread.join(10)
    assert isinstance(out["out"], Aborted) and out["out"].process_ids == (1,)


def test_fail_group_reaches_threads_and_deferred_participants_but_not_the_join():
    r, arrived = _watched()
    waiting = _run(r, 0, defer=True)
    thread, out = _in_thread(lambda: _run(r, 0, key=CollectiveKey("g", 1)))
    join = _run(r, 0, key=CollectiveKey("g", name="join"), defer=True)
    other = _run(r, 0, key=CollectiveKey("h", 0), defer=True)
    for _ in range(4):
        assert arrived.acquire(timeout=10)
    error = Aborted("process 1 died", process_ids=(1,))
    r.fail_group("g", error)
    thread.join(10)
    for got in (waiting.error, out["out"]):
        assert isinstance(got, Aborted) and got.process_ids == (1,)
        assert str(got) == f"{LABEL} was aborted: process 1 died"
    assert not join.done and not other.done and r.pending() == 2
    with pytest.raises(Aborted, match="process 1 died") as late:  # remembered for late arrivals
        _run(r, 1)
    assert late.value.process_ids == (1,)


def test_a_failure_is_remembered_for_late_arrivals_until_its_group_is_forgotten():
    r = Rendezvous()
    r.fail(KEY, LABEL, 2, Aborted("process 1's request was rejected"))
    with pytest.raises(Aborted, match="rejected"):
        _run(r, 0)
    r.forget_failures("h")  # another group's: still remembered
    with pytest.raises(Aborted, match="rejected"):
        _run(r, 0)
    r.forget_failures("g")
    assert r.remembered_failures() == 0
    waiting = _run(r, 0, defer=True)  # a new collective of that key starts afresh
    assert _run(r, 1, 2) == 3 and waiting.value == 3


def test_a_failure_not_to_remember_leaves_nothing_for_late_arrivals():
    r = Rendezvous()
    with pytest.raises(DeadlineExceeded):
        _run(r, 0, timeout=0.01, remember_failure=False)
    assert r.remembered_failures() == 0 and r.pending() == 0
    waiting = _run(r, 0, defer=True, remember_failure=False)
    assert _run(r, 1, 2, remember_failure=False) == 3 and waiting.value == 3


def test_an_abandoned_collective_fails_its_waiters_and_is_remembered():
    r, arrived = _watched()
    over = threading.Event()

    def abandoned():
        if not over.is_set():
            return None
        error = Aborted("epoch 3 is over", process_ids=(2,))
        return error

    thread, out = _in_thread(lambda: _run(r, 0, timeout=30.0, abandoned=abandoned, remember_failure=False))
    assert arrived.acquire(timeout=10)
    over.set()
    thread.join(10)
    assert isinstance(out["out"], Aborted) and str(out["out"]) == "epoch 3 is over"
    assert out["out"].process_ids == (2,)
    with pytest.raises(Aborted, match="epoch 3 is over"):  # remembered, whatever the participant asked
        _run(r, 1)


def test_a_process_not_expected_here_is_refused_and_the_others_go_on():
    r = Rendezvous()
    waiting = _run(r, 2, 1, num=4, expected=frozenset({0, 2}), defer=True)
    with pytest.raises(InvalidArgument) as refused:
        _run(r, 1, num=4, expected=frozenset({0, 2}))
    assert str(refused.value) == (f"process 1 is not one of this node's processes [0, 2] for {LABEL}; each process "
                                  "must call its own node's daemon (the one it joined the group through)")
    assert not waiting.done
    assert _run(r, 0, 2, num=4, expected=frozenset({0, 2})) == 3 and waiting.value == 3


def test_a_process_not_expected_here_arriving_first_leaves_nothing_waiting():
    r = Rendezvous()
    with pytest.raises(InvalidArgument, match="process 1 is not one of this node's processes"):
        _run(r, 1, num=4, expected=frozenset({0, 2}))
    assert r.pending() == 0
    with pytest.raises(InvalidArgument, match="process 1 is not one of this node's processes"):
        _run(r, 1, num=3, expected=frozenset({0, 2}))  # not a disagreement with a collective nobody joined
    waiting = _run(r, 2, 1, num=3, expected=frozenset({0, 2}), defer=True)
    assert _run(r, 0, 2, num=3, expected=frozenset({0, 2})) == 3 and waiting.value == 3
