"""The SDK's stall warning (``xreduce._stall``), with a fake daemon: its delay, its words, its timing."""

from __future__ import annotations

import re
import threading
import time

import pytest
from xreduce import _stall
from xreduce.v1 import xreduce_pb2 as pb

SPEC = pb.CollectiveSpec(group="train", num_processes=2, process_id=0, sequence=3)


class FakeDaemon:
    """Answers ``GetStatus`` with ``waiting`` collectives, or raises ``error``."""

    address = "127.0.0.1:50551"

    def __init__(self, waiting: int = 1, error: Exception | None = None):
        self.waiting, self.error, self.calls = waiting, error, 0

    def get_status(self, timeout=None):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return pb.GetStatusResponse(collectives_waiting=self.waiting,
                                    limits=pb.Limits(collective_timeout_seconds=60.0))


@pytest.mark.parametrize("raw, want", [(None, 10.0), ("", 10.0), ("0.25", 0.25), (" 3 ", 3.0), ("0", None)])
def test_the_delay_comes_from_the_variable_and_0_turns_it_off(raw, want):
    environ = {} if raw is None else {"XREDUCE_STALL_WARNING_SECONDS": raw}
    assert _stall.warning_seconds(environ) == want


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "soon"])
def test_a_bad_delay_names_the_variable_and_the_value(raw):
    with pytest.raises(ValueError, match=f"XREDUCE_STALL_WARNING_SECONDS must be a number of seconds >= 0 "
                                         rf"\(0: no warnings\); got '{raw}'"):
        _stall.warning_seconds({"XREDUCE_STALL_WARNING_SECONDS": raw})


def test_the_warning_names_the_collective_this_process_and_the_one_it_waits_for():
    text = _stall.message(SPEC, 10.04, _stall.daemon_report(FakeDaemon(waiting=1)))
    assert text == (
        'collective 3 in group "train" has not completed after 10 s (this is process 0 of 2; it waits for '
        "process 1). The daemon at 127.0.0.1:50551 has 1 collective(s) waiting (--collective-timeout 60 s); its "
        "log names who is missing (event=collective_waiting). Is process 1 running, with the same XREDUCE_GROUP? "
        "(XREDUCE_STALL_WARNING_SECONDS=0 turns this warning off.)")


def test_with_more_processes_it_names_those_it_may_wait_for():
    spec = pb.CollectiveSpec(group="g", num_processes=14, process_id=2, name="join")
    text = _stall.message(spec, 0.31, "The daemon says nothing.")
    assert text.startswith('collective "join" in group "g" has not completed after 0.3 s (this is process 2 of 14; '
                           "it waits for some of processes [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, ...]). The daemon says "
                           "nothing. Are they all running, with the same XREDUCE_GROUP?"), text


@pytest.mark.parametrize("daemon, want", [
    (FakeDaemon(waiting=0), "The daemon at 127.0.0.1:50551 has no collective waiting for processes: all may have "
                            "arrived and the reduction itself is slow."),
    (FakeDaemon(error=TimeoutError("no answer")),
     "The daemon at 127.0.0.1:50551 did not answer GetStatus (TimeoutError: no answer)."),
], ids=["none-waiting", "no-answer"])
def test_what_the_daemon_reports(daemon, want):
    assert _stall.daemon_report(daemon) == want


def _watcher(seen: list[str]) -> _stall.Watcher:
    return _stall.Watcher(emit=seen.append, report=lambda source: f"[{source.get_status().collectives_waiting}]")


def test_a_wait_is_warned_at_growing_gaps_until_the_call_ends():
    seen: list[str] = []
    daemon = FakeDaemon()
    with _watcher(seen).watching(SPEC, daemon, 0.1):
        time.sleep(0.45)  # due at 0.1 s, then 0.3 s (the gap doubles), then 0.7 s
    time.sleep(0.4)
    waited = [float(re.search(r"after ([\d.]+) s", t)[1]) for t in seen]
    assert len(waited) == 2 and 0.1 <= waited[0] < 0.2 and 0.3 <= waited[1] < 0.4, seen
    assert daemon.calls == 2


def test_calls_that_complete_in_time_are_never_warned_nor_asked_about():
    seen: list[str] = []
    daemon = FakeDaemon()
    watcher = _watcher(seen)
    for _ in range(200):
        with watcher.watching(SPEC, daemon, 0.05):
            pass
    time.sleep(0.15)
    assert seen == [] and daemon.calls == 0


def test_several_waits_are_warned_each_by_one_thread():
    seen: list[str] = []
    watcher = _watcher(seen)
    specs = [pb.CollectiveSpec(group=f"g{i}", num_processes=2, process_id=1) for i in range(3)]

    def wait(spec, seconds):
        with watcher.watching(spec, FakeDaemon(), 0.1):
            time.sleep(seconds)

    threads = [threading.Thread(target=wait, args=(spec, 0.05 + 0.1 * i)) for i, spec in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(t.split(" has")[0] for t in seen) == ['collective 0 in group "g1"', 'collective 0 in group "g2"']
    assert sum(t.name == "xreduce-stall-watcher" for t in threading.enumerate()) >= 1


@pytest.mark.parametrize("spec, raw", [
    (None, "1"), (pb.CollectiveSpec(group="g", num_processes=1), "1"), (SPEC, "0"),
], ids=["no-collective", "one-process", "turned-off"])
def test_watch_does_nothing_without_a_collective_of_several_processes_or_when_turned_off(monkeypatch, spec, raw):
    monkeypatch.setenv("XREDUCE_STALL_WARNING_SECONDS", raw)
    daemon = FakeDaemon()
    with _stall.watch(daemon, spec):
        pass
    assert type(_stall.watch(daemon, spec)).__name__ == "nullcontext"


def test_a_join_across_nodes_is_named_as_the_daemons_name_its_group_and_says_where_it_waits():
    """The join waits at the coordinator, not in the daemon's rendezvous: the daemon's count of waiting
    collectives (none) would wrongly suggest a slow reduction."""
    seen: list[str] = []
    daemon = FakeDaemon(waiting=0)
    spec = pb.CollectiveSpec(group="default", num_processes=2, process_id=0, name="join")
    with _stall.Watcher(emit=seen.append).watching(spec, daemon, 0.05, coordinator="127.0.0.1:50570"):
        time.sleep(0.2)
    assert seen, "no warning"
    assert seen[0].startswith('collective "join" in group "default@127.0.0.1:50570" has not completed'), seen[0]
    assert "coordinator, 127.0.0.1:50570" in seen[0] and "reduction itself is slow" not in seen[0], seen[0]
    assert daemon.calls == 0
