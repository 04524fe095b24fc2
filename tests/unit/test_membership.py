"""``xreduced.membership.LocalGroups`` and ``Rendezvous.fail_group``: who is in a group of one daemon, and what
a lost process fails."""

from __future__ import annotations

import threading

import pytest
from xreduced.decode import CollectiveKey
from xreduced.errors import Aborted
from xreduced.membership import LocalGroups
from xreduced.rendezvous import Meeting, Participant, Rendezvous


def make() -> tuple[LocalGroups, list]:
    failed = []
    return LocalGroups(lambda group, error: failed.append((group, str(error), error.process_ids))), failed


def test_a_session_that_ends_unleft_loses_its_process_once():
    groups, failed = make()
    g = groups.start("g", 3)
    for pid in range(3):
        groups.watch("g", g, pid, f"s{pid}")
    groups.session_ended("s2")
    groups.session_ended("s2")
    assert [(group, ids) for group, _, ids in failed] == [("g", (2,))]
    with pytest.raises(Aborted, match=r'collective 7 cannot complete: process 2 of group "g" ended without') as e:
        groups.check("g", "collective 7")
    assert e.value.process_ids == (2,)
    groups.session_ended("s1")  # a second loss: the group is lost already, nothing more fails
    assert len(failed) == 1


def test_a_process_that_left_is_not_lost_when_its_session_ends():
    groups, failed = make()
    g = groups.start("g", 2)
    groups.watch("g", g, 0, "s0")
    groups.watch("g", g, 1, "s1")
    assert groups.leave("g", 1)
    assert failed[0][1].startswith('process 1 of group "g" left the group (shutdown()) while the others')
    groups.session_ended("s1")
    assert len(failed) == 1


def test_every_process_leaving_forgets_the_group_and_fails_nothing():
    groups, failed = make()
    g = groups.start("g", 2)
    groups.watch("g", g, 0, "s0")
    groups.watch("g", g, 1, "s1")
    groups.leave("g", 0)
    failed.clear()
    groups.leave("g", 1)
    assert failed == [] and groups.groups() == 0
    groups.check("g", "collective 0")  # nothing known: nothing refused
    assert not groups.leave("g", 0)  # unknown here: the caller asks the peers (a group across nodes)


def test_a_lost_group_whose_processes_are_all_gone_is_forgotten():
    groups, _ = make()
    g = groups.start("g", 2)
    groups.watch("g", g, 0, "s0")
    groups.watch("g", g, 1, "s1")
    groups.session_ended("s1")
    groups.session_ended("s0")
    assert groups.groups() == 0


def test_a_new_join_starts_afresh_and_an_old_session_no_longer_counts():
    groups, failed = make()
    old = groups.start("g", 2)
    groups.watch("g", old, 1, "old")
    new = groups.start("g", 2)
    groups.watch("g", old, 0, "late")  # a watch of the old membership comes after the new one started
    groups.session_ended("old")
    groups.session_ended("late")
    assert new != old and failed == []
    groups.check("g", "collective 0")


def test_fail_group_fails_the_groups_waiting_collectives_but_not_its_join():
    r = Rendezvous()
    errors = {}

    def arrive(key):
        try:
            r.run(Meeting(key, f"collective {key}", 2), Participant(0, 1, 30.0), lambda c: c)
        except Aborted as e:
            errors[key] = (str(e), e.process_ids)

    keys = [CollectiveKey("g", 3), CollectiveKey("other", 3)]
    threads = [threading.Thread(target=arrive, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    while r.pending() < 2:
        pass
    error = Aborted("process 1 died", process_ids=(1,))
    r.fail_group("g", error)
    threads[0].join(5)
    assert errors == {keys[0]: ("collective seq:3 was aborted: process 1 died", (1,))}
    assert r.pending() == 1  # the other group's collective still waits
    r.fail_group("other", error)
    threads[1].join(5)
    join = threading.Thread(target=arrive, args=(CollectiveKey("g", name="join"),))
    join.start()
    while r.pending() < 1:
        pass
    r.fail_group("g", error)
    assert r.pending() == 1  # a join is a new membership's: a loss of the old one does not fail it
    r.fail(CollectiveKey("g", name="join"), "join", 2, Aborted("done"))
    join.join(5)
