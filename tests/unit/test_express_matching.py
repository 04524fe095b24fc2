"""The express lane's matching (xreduced.express.Express), in-process: what it takes, holds, completes and hands
over to the full path. The daemon's tests (tests/integration/test_express.py) run it over real sockets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduced.decode import CollectiveKey
from xreduced.express import Express
from xreduced.lane import classify
from xreduced.prepared import shape_of


@dataclasses.dataclass
class Incoming:
    size: int
    message: object


def incoming(pid: int, sequence: int = 1, n: int = 2, x: float = 1.0, name: str = "", group: str = "g") -> Incoming:
    value = pb.DistributedValue(components=[pb.Component(device=f"CPU:{pid}", tensor=codec.encode(np.float32([x])))])
    message = pb.BatchReduceRequest(pairs=[pb.ReducePair(value=value)], collective=pb.CollectiveSpec(
        group=group, num_processes=n, process_id=pid, sequence=sequence, name=name))
    return Incoming(message.ByteSize(), message)


class Harness:
    """An Express whose service and pipeline are recorders: which shapes are known, what was reduced, which
    calls began and how they ended."""

    def __init__(self, known=True, busy=False, admits=True, fails=False, hold=0.5):
        self.reduced, self.began, self.ended, self.woken = [], [], [], 0
        self.fails = fails

        def begin(method, message, size, shape, collective):
            if not admits:
                return None
            call = {"method": method, "pid": message.collective.process_id}
            self.began.append(call)
            return call

        def reduce(kind, label, requests):
            self.reduced.append((kind, label, sorted(requests)))
            if self.fails:
                raise ValueError("bad bytes")
            return {pid: f"reply {pid}".encode() for pid in requests}

        self.express = Express(known=lambda shape: "prepared" if known else None, reduce=reduce,
                               busy=lambda key, group: busy, begin=begin,
                               end=self.end, hold=hold, wake=self.wake)
        self.ended_locked = []  # whether the express lane held its lock when each call ended

    def end(self, call, out):
        self.ended.append((call["pid"], out))
        self.ended_locked.append(self.express._lock.locked())

    def wake(self):
        self.woken += 1

    def offer(self, connection, pid, now=0.0, timeout=None, **kw):
        """As the lane offers a call: only one ``classify`` names for the express lane, under its shape."""
        call = incoming(pid, **kw)
        path = classify("BatchReduce", call, lambda slices: 0)
        if not path.express or path.shape is None:
            return None
        return self.express.offer(connection, "BatchReduce", call, timeout, now, path.shape)


def pids(arrivals):
    return [a.process_id for a in arrivals]


def test_a_collective_is_held_until_complete_then_reduced_once_and_each_call_ends_counted():
    h = Harness()
    assert h.offer("c0", 0) == ([], []) and (h.express.held(), h.express.collectives()) == (1, 1)
    replies, handed = h.offer("c1", 1)
    assert handed == [] and (h.express.held(), h.express.collectives()) == (0, 0)
    assert h.reduced == [("BatchReduce", 'collective 1 in group "g"', [0, 1])]
    assert [(a.process_id, data) for a, data in replies] == [(0, b"reply 0"), (1, b"reply 1")]
    assert [c["method"] for c in h.began] == ["/xreduce.v1.CrossDeviceOps/BatchReduce"] * 2
    for arrival, data in replies:
        h.express.answered(arrival, len(data))
    assert h.ended == [(0, 7), (1, 7)]


def test_named_collectives_and_sequences_are_matched_apart():
    h = Harness()
    assert h.offer("c0", 0, sequence=1) == ([], [])
    assert h.offer("c1", 1, sequence=2) == ([], [])
    assert h.offer("c2", 1, name="step") == ([], []) and h.express.held() == 3
    replies, _ = h.offer("c3", 0, name="step")
    assert h.reduced == [("BatchReduce", 'collective "step" in group "g"', [0, 1])] and len(replies) == 2


@pytest.mark.parametrize("harness, kw", [
    (dict(known=False), {}),  # a shape not validated before
    (dict(busy=True), {}),  # the rendezvous knows the collective, or the group spans nodes
    (dict(admits=False), {}),  # draining, or over the in-flight budget or --max-collectives
    ({}, dict(n=1)),  # one process: nothing to match
    ({}, dict(sequence=-1)),  # the full path names the bad field
])
def test_what_is_not_the_plain_case_is_not_taken_and_nothing_is_begun(harness, kw):
    h = Harness(**harness)
    assert h.offer("c0", 0, **kw) is None
    assert h.express.held() == 0 and h.began == [] and h.ended == []


def test_a_process_arriving_twice_hands_both_calls_over_uncounted():
    h = Harness()
    h.offer("c0", 0)
    replies, handed = h.offer("c1", 0)
    assert replies == [] and pids(handed) == [0, 0] and h.express.held() == 0
    assert h.ended == [(0, None), (0, None)] and all(a.call is None for a in handed)


def test_processes_calling_different_methods_are_handed_over_unreduced():
    h = Harness()
    h.offer("c0", 0)
    message = incoming(1).message
    reduce = pb.ReduceRequest(value=message.pairs[0].value, collective=message.collective)
    call = Incoming(reduce.ByteSize(), reduce)
    replies, handed = h.express.offer("c1", "Reduce", call, None, 0.0, classify("Reduce", call, lambda s: 0).shape)
    assert replies == [] and pids(handed) == [0, 1] and h.reduced == []


def test_processes_disagreeing_on_their_number_are_handed_over_unreduced():
    h = Harness()
    h.offer("c0", 0, n=3)
    replies, handed = h.offer("c1", 1, n=2)  # it would complete a collective of 2: the full path refuses it
    assert replies == [] and pids(handed) == [0, 1] and h.reduced == []


def test_a_reduction_that_raises_hands_every_call_over():
    h = Harness(fails=True)
    h.offer("c0", 0)
    replies, handed = h.offer("c1", 1)
    assert replies == [] and pids(handed) == [0, 1]
    assert h.ended == [(0, None), (1, None)]


def test_a_participant_by_the_full_path_claims_the_held_calls_and_wakes_the_lane():
    h = Harness()
    h.offer("c0", 0)
    h.express.claim(CollectiveKey("g", 2))  # another collective: nothing held for it
    assert h.woken == 0 and h.express.held() == 1
    h.express.claim(CollectiveKey("g", 1))
    assert h.woken == 1 and h.express.held() == 0
    assert pids(h.express.handed_over()) == [0] and h.express.handed_over() == []


def test_a_failed_group_hands_over_every_collective_held_of_it_and_wakes_the_lane():
    h = Harness()
    h.offer("c0", 0, sequence=1)
    h.offer("c2", 0, sequence=2, n=3)
    h.offer("h0", 0, group="other")
    h.express.claim_group("nobody")  # a group with nothing held: nothing happens
    assert h.woken == 0 and h.express.held() == 3
    h.express.claim_group("g")
    assert h.woken == 1 and (h.express.held(), h.express.collectives()) == (1, 1)
    assert sorted(a.key.sequence for a in h.express.handed_over()) == [1, 2]
    assert h.ended == [(0, None), (0, None)]  # their calls are the full path's now
    assert h.reduced == []


def test_a_caller_hanging_up_hands_its_collective_over_with_its_own_call():
    h = Harness()
    h.offer("c0", 0, n=3)
    h.offer("c1", 1, n=3)
    h.offer("other", 0, sequence=2)
    handed = h.express.hung_up("c1")
    assert pids(handed) == [0, 1] and h.express.held() == 1
    assert h.express.hung_up("c1") == [] and h.express.hung_up("nobody") == []


def test_a_collective_not_complete_within_the_hold_or_a_timeout_is_handed_over_then():
    h = Harness(hold=0.5)
    h.offer("c0", 0, now=10.0)
    h.offer("c1", 0, now=10.1, sequence=2, timeout=0.2)
    assert h.express.wake_at() == pytest.approx(10.3)
    assert h.express.due(10.29) == []
    assert [a.key for a in h.express.due(10.3)] == [CollectiveKey("g", 2)]
    assert h.express.wake_at() == pytest.approx(10.5)
    handed = h.express.due(10.5)
    assert pids(handed) == [0] and handed[0].remaining(10.5) is None
    assert h.express.wake_at() == float("inf")


def test_shapes_match_across_sequences_and_values_so_later_collectives_are_known():
    a, b = incoming(0, sequence=1, x=1.0), incoming(0, sequence=7, x=5.0)
    assert shape_of(a.message, a.size) == shape_of(b.message, b.size)


def test_calls_are_handed_over_with_the_express_lanes_lock_released():
    """The pipeline ends a handed call under locks of its own (the admission's, its idle condition): the express
    lane never calls it holding its lock (the review's point 6), in each way a call is handed over."""
    h = Harness()
    h.offer("c0", 0, sequence=1)
    h.offer("c1", 0, sequence=1)  # twice
    h.offer("c0", 0, sequence=2, n=3)
    h.offer("c1", 1, sequence=2, n=2)  # disagreeing on their number
    for sequence, ends in ((3, "claim"), (4, "group"), (5, "hung up"), (6, "due")):
        h.offer(f"c{sequence}", 0, sequence=sequence, group=ends)
    h.express.claim(CollectiveKey("claim", 3))
    h.express.claim_group("group")
    h.express.hung_up("c5")
    h.express.due(100.0)
    assert len(h.ended) == 8 and h.express.held() == 0
    assert h.ended_locked == [False] * 8
