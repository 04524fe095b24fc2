"""The coordinator of groups across nodes, in-process: membership, epochs, heartbeats, the engine's store."""

import threading
import time

import pytest
from xreduce.v1 import xreduce_pb2 as pb
from xreduced.coordinator import MAX_STORE_VALUE, Coordinator
from xreduced.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument


def node(node_id, address="127.0.0.1", devices=4, engines=("gloo",)):
    return pb.NodeIdentity(node_id=node_id, address=address, devices=[f"CPU:{i}" for i in range(devices)],
                           backend="numpy", engines=list(engines))


def register_all(c, registrations, timeout=5.0):
    """Registers (process_id, node, devices) concurrently; returns each process's reply or error."""
    out = {}
    count = len(registrations)

    def one(pid, identity, devices):
        try:
            out[pid] = c.register(pb.RegisterRequest(group="job", num_processes=count, process_id=pid,
                                                     node=identity, devices=devices), timeout)
        except Exception as e:  # noqa: BLE001 -- the test looks at what each process got
            out[pid] = e

    threads = [threading.Thread(target=one, args=r) for r in registrations]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture
def coordinator():
    c = Coordinator(lambda name: f"{name}@here:1", peer_timeout=0.6, heartbeat_interval=0.1)
    yield c
    c.close()


def test_nodes_are_ordered_by_their_lowest_process_and_devices_split_per_node(coordinator):
    b, a = node("b"), node("a", address="10.0.0.1")
    replies = register_all(coordinator, [(0, a, []), (1, b, []), (2, a, []), (3, b, ["CPU:3"])])
    r = replies[0]
    assert all(x.epoch == 1 and x.group == "job@here:1" and x.engine == "gloo" for x in replies.values())
    assert [n.node_id for n in r.nodes] == ["a", "b"] and r.nodes[0].address == "10.0.0.1"
    per_node = [[(p.process_id, list(p.devices)) for p in n.processes] for n in r.nodes]
    assert per_node == [[(0, ["CPU:0", "CPU:1"]), (2, ["CPU:2", "CPU:3"])], [(1, ["CPU:0", "CPU:1"]), (3, ["CPU:3"])]]


def test_one_node_needs_no_engine_and_a_second_registration_forms_a_new_epoch(coordinator):
    first = register_all(coordinator, [(0, node("a"), []), (1, node("a"), [])])
    assert first[0].engine == "" and first[0].epoch == 1
    second = register_all(coordinator, [(0, node("a"), []), (1, node("a"), [])])
    assert second[1].epoch == 2
    state = coordinator.heartbeat("job@here:1", 1, "a")
    assert not state.ok and state.epoch == 2 and "epoch 1 is over: the group is at epoch 2" in state.reason


def test_a_node_without_the_engine_is_refused_naming_what_to_install(coordinator):
    replies = register_all(coordinator, [(0, node("a"), []), (1, node("b", "10.0.0.2", engines=()), [])])
    for reply in replies.values():
        assert isinstance(reply, FailedPrecondition)
        assert "node(s) [1] (10.0.0.2) cannot drive Gloo" in str(reply) and "xreduce[cluster]" in str(reply)


@pytest.mark.parametrize("engines, chosen", [
    ((("gloo", "nccl"), ("gloo", "nccl")), "gloo+nccl"),
    ((("gloo", "nccl"), ("gloo",)), "gloo"),
    ((("gloo",), ("gloo", "nccl")), "gloo"),
    ((("gloo",), ("gloo",)), "gloo"),
])
def test_nccl_joins_gloo_only_when_every_node_drives_it(coordinator, engines, chosen):
    a, b = node("a", engines=engines[0]), node("b", "10.0.0.2", engines=engines[1])
    replies = register_all(coordinator, [(0, a, []), (1, b, []), (2, a, [])])
    assert [r.engine for r in replies.values()] == [chosen] * 3


def test_nccl_without_gloo_is_refused_as_gloo_is_missing(coordinator):
    replies = register_all(coordinator, [(0, node("a", engines=("gloo", "nccl")), []),
                                         (1, node("b", "10.0.0.2", engines=("nccl",)), [])])
    assert all(isinstance(r, FailedPrecondition) and "cannot drive Gloo" in str(r) for r in replies.values())


def test_one_node_has_no_engine_even_with_nccl(coordinator):
    replies = register_all(coordinator, [(0, node("a", engines=("gloo", "nccl")), [])])
    assert replies[0].engine == ""


def test_missing_processes_are_named_after_the_timeout(coordinator):
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"waiting for process\(es\) \[1, 2\] to register") as e:
        coordinator.register(pb.RegisterRequest(group="job", num_processes=3, process_id=0, node=node("a")), 0.3)
    assert e.value.process_ids == (1, 2)
    assert time.monotonic() - start < 5  # bounded by the timeout given, not forever


@pytest.mark.parametrize("change, message", [
    ({"process_id": 0}, "process 0 registered twice"),
    ({"num_processes": 3}, "process 1 says 3 but the processes registering for group 'job@here:1' said 2"),
])
def test_conflicting_registrations_are_refused(coordinator, change, message):
    waiting = threading.Thread(target=lambda: pytest.raises(DeadlineExceeded, coordinator.register, pb.RegisterRequest(
        group="job", num_processes=2, process_id=0, node=node("a")), 0.5))
    waiting.start()
    time.sleep(0.1)
    fields = {"group": "job", "num_processes": 2, "process_id": 1, "node": node("b")} | change
    with pytest.raises(InvalidArgument, match=message):
        coordinator.register(pb.RegisterRequest(**fields), 0.5)
    waiting.join()


def test_a_device_the_node_lacks_is_refused(coordinator):
    replies = register_all(coordinator, [(0, node("a", devices=2), ["CPU:5"])])
    assert isinstance(replies[0], InvalidArgument) and "asked for 'CPU:5'" in str(replies[0])


def test_a_silent_node_ends_the_epoch_and_is_named(coordinator):
    register_all(coordinator, [(0, node("a"), []), (1, node("b", "10.0.0.2"), [])])
    coordinator.heartbeat("job@here:1", 1, "b")  # node 1 beats once, then falls silent
    deadline = time.monotonic() + 10
    state = coordinator.heartbeat("job@here:1", 1, "a")
    while state.ok and time.monotonic() < deadline:
        time.sleep(0.05)
        state = coordinator.heartbeat("job@here:1", 1, "a")  # node 0 keeps beating
    assert not state.ok
    assert "lost node 1 (10.0.0.2, processes [1])" in state.reason
    assert [(p.node_index, list(p.process_ids)) for p in state.lost] == [(1, [1])]


def test_a_node_that_never_beats_is_lost_too(coordinator):
    """Nodes beat from the moment the epoch forms (before their engines connect): one stopped then is lost."""
    register_all(coordinator, [(0, node("a"), []), (1, node("b", "10.0.0.2"), [])])
    deadline = time.monotonic() + 10
    state = coordinator.heartbeat("job@here:1", 1, "a")
    while state.ok and time.monotonic() < deadline:
        time.sleep(0.05)
        state = coordinator.heartbeat("job@here:1", 1, "a")
    assert not state.ok and [p.node_index for p in state.lost] == [1]


def test_a_closed_attendance_stream_ends_the_epoch_at_once(coordinator):
    register_all(coordinator, [(0, node("a"), []), (1, node("b", "10.0.0.2"), [])])
    coordinator.left("job@here:1", 1, "b")
    state = coordinator.heartbeat("job@here:1", 1, "a")
    assert not state.ok and "lost node 1 (10.0.0.2, processes [1]): its daemon's connection" in state.reason


def test_a_report_ends_the_epoch_naming_the_reporter_and_the_process(coordinator):
    register_all(coordinator, [(0, node("a"), []), (1, node("b"), [])])
    state = coordinator.report_failure("job@here:1", 1, "b", "process 1 left", [1])
    assert not state.ok and state.reason == "node 1 (127.0.0.1) reported: process 1 left"
    assert list(state.lost[0].process_ids) == [1]


def test_the_store_waits_bounded_and_goes_with_its_epoch(coordinator):
    register_all(coordinator, [(0, node("a"), []), (1, node("b"), [])])
    threading.Timer(0.1, coordinator.store_set, ("job@here:1", 1, "rank1", b"addr")).start()
    assert coordinator.store_get("job@here:1", 1, "rank1", 5.0) == b"addr"
    assert coordinator.store_add("job@here:1", 1, "n", 2) == 2 and coordinator.store_add("job@here:1", 1, "n", 3) == 5
    with pytest.raises(DeadlineExceeded, match="'nothing' of epoch 1 was not set within 0.1s"):
        coordinator.store_get("job@here:1", 1, "nothing", 0.1)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_STORE_VALUE} bytes"):
        coordinator.store_set("job@here:1", 1, "big", b"x" * (MAX_STORE_VALUE + 1))
    with pytest.raises(Aborted, match="epoch 7 is over: the group is at epoch 1"):
        coordinator.store_get("job@here:1", 7, "rank1", 0.1)
    coordinator.report_failure("job@here:1", 1, "a", "bye", [])
    with pytest.raises(Aborted, match="reported: bye"):
        coordinator.store_get("job@here:1", 1, "rank1", 0.1)


def test_a_restarted_coordinator_numbers_its_epoch_above_any_a_node_has_seen(coordinator):
    out = {}

    def one(pid, last):
        out[pid] = coordinator.register(pb.RegisterRequest(group="job", num_processes=2, process_id=pid,
                                                           node=node(f"n{pid}"), last_epoch=last), 5.0)

    threads = [threading.Thread(target=one, args=(0, 0)), threading.Thread(target=one, args=(1, 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0].epoch == out[1].epoch == 6


def test_a_coordinator_stopped_with_grace_still_tells_an_open_stream_how_the_epoch_ended():
    """A daemon stops its coordinator as soon as no epoch stands there (its last process was killed): the other
    nodes' attendance streams still carry the end and its reason, instead of a closed connection that they
    would take for the coordinator's loss after the peer timeout."""
    import grpc
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduced.config import Config
    from xreduced.coordinator import CoordinatorServer

    c = Coordinator(lambda name: f"{name}@here:1", peer_timeout=5.0, heartbeat_interval=1.0)
    server = CoordinatorServer("127.0.0.1:0", c, Config())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        register_all(c, [(0, node("a"), []), (1, node("b"), [])])
        stream = pb_grpc.PeersStub(channel).Attend(pb.AttendRequest(group="job@here:1", epoch=1, node_id="b"),
                                                   timeout=10)
        assert next(stream).state.ok
        with c._lock:  # the stream's thread wakes only once the server is stopping
            c.report_failure("job@here:1", 1, "a", "process 0 on node 0 ended without leaving the group", [0])
            server.stop(grace=c.heartbeat_interval)
        last = next(stream).state
        assert not last.ok and "process 0 on node 0 ended" in last.reason, last
    finally:
        server.stop()
        channel.close()


def test_a_registration_whose_call_ended_is_withdrawn_and_the_process_registers_again(coordinator):
    """Process 0's Register call ends (its process died while it joined): it gets Aborted, and a restarted
    process 0 registers (not "registered twice") and forms the epoch with process 1."""
    ended = []
    got = {}

    def first():
        try:
            coordinator.register(pb.RegisterRequest(group="job", num_processes=2, process_id=0, node=node("a")),
                                 10.0, lambda callback: ended.append(callback) or True)
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            got["first"] = e

    thread = threading.Thread(target=first)
    thread.start()
    while not ended:
        time.sleep(0.01)
    ended[0]()  # the call ends: gRPC runs the callbacks registered on it
    thread.join(10)
    assert isinstance(got["first"], Aborted) and "ended before the epoch formed" in str(got["first"])
    replies = register_all(coordinator, [(0, node("a"), []), (1, node("b"), [])])
    assert [r.epoch for r in replies.values()] == [1, 1], replies


def test_a_job_that_ends_cleanly_is_no_failure(coordinator):
    register_all(coordinator, [(0, node("a"), []), (1, node("b"), [])])
    state = coordinator.report_failure("job@here:1", 1, "b", "every process of node 1 left the group", [], left=True)
    assert not state.ok and state.left and not state.lost
