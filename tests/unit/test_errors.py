"""The daemon's errors carry their data as declared fields, and a copy keeps them (a late arrival's error, each
thread's own raise of one collective's failure)."""

from __future__ import annotations

import pytest
from xreduced.admission import LimitExceeded
from xreduced.decode import CollectiveKey
from xreduced.errors import Aborted, DeadlineExceeded, InvalidArgument
from xreduced.rendezvous import Meeting, Participant, Rendezvous


def test_a_copy_keeps_the_class_and_every_field_without_the_traceback():
    try:
        raise LimitExceeded("3 collectives are over --max-collectives 2", "max_collectives")
    except LimitExceeded as e:
        raised = e
    assert raised.__traceback__ is not None
    copy = raised.copy("collective 4: 3 collectives are over --max-collectives 2")
    assert type(copy) is LimitExceeded and copy.limit == "max_collectives" and copy.process_ids == ()
    assert str(copy) == "collective 4: 3 collectives are over --max-collectives 2"
    assert copy.__traceback__ is None and copy.code == raised.code
    assert str(raised.copy()) == str(raised)


@pytest.mark.parametrize("kind", [Aborted, DeadlineExceeded, InvalidArgument])
def test_process_ids_are_a_tuple_of_what_was_given(kind):
    assert kind("x", process_ids=[3, 1]).process_ids == (3, 1)
    assert kind("x").process_ids == ()


def test_a_remembered_failure_keeps_its_fields_for_each_late_arrival():
    r = Rendezvous()
    key = CollectiveKey("g", 0)
    r.fail(key, key.label, 3, LimitExceeded("over --max-collectives 1", "max_collectives"))
    raised = []
    for pid in (0, 1):
        with pytest.raises(LimitExceeded, match="over --max-collectives 1") as late:
            r.run(Meeting(key, key.label, 3), Participant(pid, 1, 5.0), dict)
        assert late.value.limit == "max_collectives"
        raised.append(late.value)
    assert raised[0] is not raised[1]  # each its own copy
