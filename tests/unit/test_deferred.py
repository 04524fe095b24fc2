"""Deferred replies (xreduced.deferred) and the rendezvous's participants that wait without a thread."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
from xreduced.decode import CollectiveKey
from xreduced.deferred import Deferred, then
from xreduced.errors import Aborted, DeadlineExceeded, InvalidArgument
from xreduced.rendezvous import Meeting, Participant, Rendezvous

KEY = CollectiveKey("g", 0)


def _sum(contributions):
    return {p: sum(contributions.values()) for p in contributions}


def _run(r: Rendezvous, key, label, num, pid, value, timeout, compute, on_leave=None, defer=False):
    return r.run(Meeting(key, label, num), Participant(pid, value, timeout, on_leave=on_leave, defer=defer), compute)


def test_a_deferred_resolves_once_and_runs_its_steps_in_order_where_it_resolves():
    d = Deferred()
    seen = []
    d.on_done(lambda value, error: seen.append(("first", value, threading.current_thread().name)))
    doubled = d.then(lambda v: 2 * v)
    doubled.on_done(lambda value, error: seen.append(("doubled", value, error)))

    def resolver():
        assert d.resolve(21) is True
        assert d.resolve(99) is False

    t = threading.Thread(target=resolver, name="resolver")
    t.start()
    t.join(5)
    assert seen == [("first", 21, "resolver"), ("doubled", 42, None)]
    late = []
    d.on_done(lambda value, error: late.append(value))  # resolved already: runs now
    assert late == [21]


def test_an_error_passes_through_then_and_a_raising_step_becomes_the_error():
    d = Deferred()
    skipped = d.then(lambda v: pytest.fail("a step after an error must not run"))
    settled = d.settle(lambda value, error: f"answered {type(error).__name__}")
    d.resolve(error=InvalidArgument("bad"))
    assert isinstance(skipped.error, InvalidArgument) and skipped.value is None
    assert settled.value == "answered InvalidArgument" and settled.error is None
    broken = Deferred()
    failing = broken.then(lambda v: 1 / v)
    broken.resolve(0)
    assert isinstance(failing.error, ZeroDivisionError)
    assert then(3, lambda v: v + 1) == 4 and isinstance(then(Deferred(), lambda v: v), Deferred)


def test_wake_goes_to_the_source_of_a_chain_and_stops_once_resolved():
    woken = []
    source = Deferred(wake_at=lambda: 12.5, wake=woken.append)
    last = source.then(lambda v: v).settle(lambda v, e: v)
    assert last.wake_at() == 12.5
    last.wake(13.0)
    assert woken == [13.0]
    source.resolve(1)
    assert last.wake_at() == math.inf
    last.wake(14.0)
    assert woken == [13.0]


def test_a_deferred_participant_gets_its_share_from_the_last_arrival_s_thread():
    r = Rendezvous()
    waiting = _run(r, KEY, "c0", 2, 0, 1, 5.0, _sum, defer=True)
    assert isinstance(waiting, Deferred) and not waiting.done
    assert r.pending() == 1
    got = []
    waiting.on_done(lambda value, error: got.append((value, error, threading.current_thread().name)))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(1, _run(r, KEY, "c0", 2, 1, 2, 5.0, _sum)), name="last")
    t.start()
    t.join(5)
    assert out == {1: 3} and got == [(3, None, "last")] and r.pending() == 0


def test_a_deferred_participant_times_out_when_woken_at_its_deadline_naming_who_is_missing():
    r = Rendezvous()
    waiting = _run(r, KEY, "collective 0", 3, 0, 1, 0.2, _sum, defer=True)
    _run(r, KEY, "collective 0", 3, 2, 1, 5.0, _sum, defer=True)
    start = time.monotonic()
    assert start < waiting.wake_at() <= start + 0.2
    waiting.wake(waiting.wake_at() - 0.1)  # early: nothing happens
    assert not waiting.done
    waiting.wake(waiting.wake_at())
    assert isinstance(waiting.error, DeadlineExceeded)
    assert "timed out after 0.2s waiting for process(es) [1]" in str(waiting.error)
    with pytest.raises(DeadlineExceeded, match=r"waiting for process\(es\) \[1\]"):  # a late arrival: the same
        _run(r, KEY, "collective 0", 3, 1, 1, 5.0, _sum)


def test_a_participant_that_leaves_aborts_the_deferred_ones_and_a_failed_compute_reaches_them():
    r = Rendezvous()
    waiting = _run(r, KEY, "c0", 3, 0, 1, 5.0, _sum, defer=True)
    leave = []
    _run(r, KEY, "c0", 3, 1, 1, 5.0, _sum, on_leave=leave.append, defer=True)
    leave[0]()  # process 1's call ended
    assert isinstance(waiting.error, Aborted) and "process 1 left" in str(waiting.error)

    other = CollectiveKey("g", 1)
    waiting = _run(r, other, "c1", 2, 0, 1, 5.0, _sum, defer=True)

    def refuse(_):
        raise InvalidArgument("process 1 sent float32[2] but process 0 sent float32[3]")

    with pytest.raises(InvalidArgument):
        _run(r, other, "c1", 2, 1, 1, 5.0, refuse)
    assert isinstance(waiting.error, InvalidArgument) and "float32[2]" in str(waiting.error)


def test_a_deferred_wait_is_reported_when_its_report_is_due(caplog):
    r = Rendezvous(report_after=0.05)
    waiting = _run(r, KEY, "c0", 2, 0, 1, 5.0, _sum, defer=True)
    due = waiting.wake_at()
    assert due < time.monotonic() + 1.0  # the report, before the deadline
    with caplog.at_level(logging.WARNING, logger="xreduced.rendezvous"):
        waiting.wake(due)
    assert "event=collective_waiting" in caplog.text and "missing=1" in caplog.text
    assert waiting.wake_at() > due and not waiting.done
