"""One node's side of an epoch across nodes (``xreduced.cluster.ClusterGroup``), in-process: how its end is
reported and how it closes."""

import threading
import time

from xreduce.v1 import xreduce_pb2 as pb
from xreduced.cluster import ClusterGroup


class Stream:
    """The attendance stream's client side: it ends when cancelled, and records when that was."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.events: list[str] = []

    def __iter__(self):
        self.cancelled.wait(10)
        return iter(())

    def cancel(self):
        self.events.append("stream cancelled")
        self.cancelled.set()


def group(report, stream):
    nodes = [pb.ClusterNode(index=i, node_id=f"n{i}", address=f"10.0.0.{i + 1}",
                            processes=[pb.ProcessDevices(process_id=i, devices=["CPU:0"])]) for i in range(2)]
    return ClusterGroup("job@10.0.0.1:1", 2, 1, 1, nodes, None, "10.0.0.1:1", lambda: pb.EpochState(ok=True),
                        report, peer_timeout=5.0, heartbeat_interval=1.0, hosted=False, attend=lambda: stream)


def test_close_waits_for_a_report_in_flight_so_the_coordinator_hears_it_before_the_stream_closes():
    """Two threads end the epoch at once (a killed process's session, and its collective): the one that
    closes must not cancel the attendance stream while the other still reports, or the coordinator takes
    the closed stream for this node's loss and names the wrong cause."""
    stream, reporting = Stream(), threading.Event()

    def report(reason, process_ids, left=False):
        reporting.set()
        time.sleep(0.3)
        stream.events.append(f"reported {process_ids}")

    g = group(report, stream)
    failing = threading.Thread(target=g.fail, args=("process 1 ended",), kwargs={"report": True, "process_ids": [1]})
    failing.start()
    assert reporting.wait(5)
    g.fail("the same loss, seen by another thread", report=True)  # already failed: returns at once
    g.close()
    failing.join(5)
    assert stream.events == ["reported [1]", "stream cancelled"]
    assert g.reason == "process 1 ended"


def test_close_waits_no_longer_than_the_report_which_may_fail():
    stream = Stream()

    def report(reason, process_ids, left=False):
        raise ConnectionError("the coordinator is gone")

    g = group(report, stream)
    g.fail("lost the coordinator", report=True)
    g.close()
    assert stream.events == ["stream cancelled"]


def test_close_without_a_report_cancels_the_stream_at_once():
    stream = Stream()
    g = group(lambda *_: None, stream)
    g.close()
    assert stream.events == ["stream cancelled"]
