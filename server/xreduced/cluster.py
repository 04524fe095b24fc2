"""One epoch of a group across nodes, as a node daemon takes part in it.

A :class:`ClusterGroup` holds the epoch's membership (from the coordinator), its
engines (Gloo; and NCCL for node sums in GPU memory when every node drives it),
the heartbeats and the attendance stream that tell this node when the epoch
ends, and the lane in which the group's collectives enter the engines one after
another, in sequence order. Whatever breaks that lockstep (a process that
left, a timeout, a lost node, an engine error) ends the epoch: every
participant fails with ABORTED or UNAVAILABLE naming who was lost.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from xreduce.v1 import xreduce_pb2 as pb

from xreduced import gloo
from xreduced.deadline import Deadline
from xreduced.errors import Aborted, DeadlineExceeded, ServiceError, Unavailable

if TYPE_CHECKING:
    from xreduced.nccl_engine import NcclEngine

log = logging.getLogger("xreduced.cluster")


@dataclasses.dataclass
class _Stats:
    collectives: int = 0
    bytes: int = 0
    seconds: float = 0.0


class ClusterGroup:
    """One epoch of a group across nodes, as this node daemon takes part in it.

    Args:
        gid: the group's id (``name@coordinator``); epoch: the membership's epoch.
        node_index: this node in ``nodes``; nodes: node 0 first.
        engine: the engine among the nodes (Gloo), or None for a group on one node.
        device_engine: the engine for node sums in GPU memory (NCCL, :mod:`xreduced.nccl_engine`), or None.
        beat: sends one heartbeat; returns the coordinator's :class:`pb.EpochState`.
        report: ends the epoch at the coordinator: ``report(reason, process_ids, left)``.
        attend: opens the attendance stream (``Peers.Attend``): the epoch's end arrives on it at once.
    """

    def __init__(self, gid: str, num_processes: int, epoch: int, node_index: int, nodes: list[pb.ClusterNode],  # noqa: PLR0913
                 engine: gloo.GlooEngine | None, coordinator: str, beat: Callable[[], pb.EpochState],
                 report: Callable[[str, list[int]], None], peer_timeout: float, heartbeat_interval: float,
                 hosted: bool, attend: Callable[[], Any] | None = None, device_engine: NcclEngine | None = None):
        self.gid, self.num_processes, self.epoch = gid, num_processes, epoch
        self.node_index, self.nodes = node_index, nodes
        self.engine = engine
        self.device_engine = device_engine
        self.coordinator = coordinator
        self.hosted = hosted
        self.local = frozenset(p.process_id for p in nodes[node_index].processes)
        self.node_of = {p.process_id: n.index for n in nodes for p in n.processes}
        self.peer_timeout, self.heartbeat_interval = peer_timeout, heartbeat_interval
        self.stats = _Stats()
        self.lost: list[pb.LostPeer] = []
        self.reason = ""
        self.failed = threading.Event()
        self.coordinator_lost = False
        """The epoch ended because the coordinator stopped answering (its collectives fail UNAVAILABLE here)."""
        self.left: set[int] = set()
        """This node's processes that have left the group (LeaveGroup)."""
        self._beat, self._report = beat, report
        self._lock = threading.Condition()
        self._reported: threading.Event | None = None
        """Set once this node's report of the epoch's end is through (when it made one): :meth:`close` waits
        for it, so the coordinator hears the report before the attendance stream closes (which it would take
        for this node's loss)."""
        self._next = 0  # the next sequence number to enter the engine
        self._claimed: set[int] = set()  # sequences a refusal of this node will enter (see claim)
        self._lane = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xreduced-engine")
        self._closed = threading.Event()
        self._heart = threading.Thread(target=self._heartbeats, name="xreduced-heartbeat", daemon=True)
        self._heart.start()
        self._stream = attend() if attend is not None and len(nodes) > 1 else None
        if self._stream is not None:
            threading.Thread(target=self._attend, name="xreduced-attend", daemon=True).start()

    def connect(self, engine: gloo.GlooEngine, device_engine: NcclEngine | None = None) -> None:
        """Takes the epoch's engines, connected; a failure since closes them at once."""
        self.engine, self.device_engine = engine, device_engine
        if self.failed.is_set():
            self._close_engines()
            raise self.error()

    @property
    def engine_name(self) -> str:
        """``gloo``, ``gloo+nccl`` (node sums in GPU memory cross on NCCL), or empty on one node."""
        names = [e.name for e in (self.engine, self.device_engine) if e is not None]
        return "+".join(names)

    def _close_engines(self) -> None:
        for e in (self.device_engine, self.engine):
            if e is not None:
                e.close()

    @property
    def spans_nodes(self) -> bool:
        """Whether the group has more than one node."""
        return len(self.nodes) > 1

    def describe(self, index: int) -> str:
        """``node 1 (10.0.0.2, processes [1])``."""
        node = self.nodes[index]
        return f"node {index} ({node.address}, processes {[p.process_id for p in node.processes]})"

    # --- failure ---------------------------------------------------------------------------------------------

    def fail(self, reason: str, lost: list[pb.LostPeer] = (), report: bool = False,
             process_ids: list[int] = (), coordinator: bool = False, left: bool = False) -> None:
        """Ends this epoch here (and, with ``report``, at the coordinator, so every node learns); ``coordinator``:
        because the coordinator stopped answering; ``left``: because every process of a node left the group,
        a job's end (logged at INFO, not as a failure)."""
        with self._lock:
            if self.failed.is_set():
                return
            self.reason, self.lost = reason, list(lost)
            self.coordinator_lost = coordinator
            self.failed.set()
            if report:
                self._reported = threading.Event()
            self._lock.notify_all()
        if left:
            log.info("event=group_ended group=%s epoch=%d reason=%r", self.gid, self.epoch, reason)
        else:
            log.warning("event=group_failed group=%s epoch=%d reason=%r", self.gid, self.epoch, reason)
        self._close_engines()  # lets their connections go (a call waiting on a peer ends by its timeout, or aborts)
        self._lane.shutdown(wait=False, cancel_futures=True)  # its thread ends once a call in it does
        if report:
            with contextlib.suppress(Exception):  # the coordinator may be what was lost
                self._report(reason, list(process_ids), left)
            self._reported.set()

    def error(self) -> ServiceError:
        """The error every collective of this failed epoch gets."""
        again = "; call xreduce.distribution.shutdown() and initialize() again on every process for a new epoch"
        text = f'group "{self.gid}" epoch {self.epoch} is over: {self.reason}{again}'
        return Unavailable(text) if self.coordinator_lost and not self.hosted else Aborted(text)

    def abandoned(self) -> ServiceError | None:
        """The epoch's error once it has failed (the rendezvous asks while this node's processes wait), else None."""
        return self.error() if self.failed.is_set() else None

    def check(self, epoch: int, label: str) -> None:
        """Refuses a collective of another epoch, or of this epoch once it has failed."""
        if epoch != self.epoch:
            raise Aborted(f"{label} names epoch {epoch} but the group is at epoch {self.epoch}; initialize again")
        if self.failed.is_set():
            raise self.error()

    def _heartbeats(self) -> None:
        last_ok = time.monotonic()
        while not self._closed.wait(self.heartbeat_interval) and not self.failed.is_set():
            try:
                state = self._beat()
            except grpc.RpcError as e:
                silent = time.monotonic() - last_ok
                if silent > self.peer_timeout:
                    self.fail(f"the coordinator at {self.coordinator}, {self.describe(0)}, did not answer "
                              f"for {silent:.1f} s ({e.code().name})",
                              [pb.LostPeer(node_index=0, address=self.nodes[0].address,
                                           process_ids=[p.process_id for p in self.nodes[0].processes],
                                           reason=f"no answer for {silent:.1f} s")], coordinator=True)
                continue
            last_ok = time.monotonic()
            if not state.ok:
                self.fail(state.reason or f"epoch {self.epoch} is over", list(state.lost), left=state.left)

    def _attend(self) -> None:
        try:
            for reply in self._stream:
                if not reply.state.ok:
                    self.fail(reply.state.reason or f"epoch {self.epoch} is over", list(reply.state.lost),
                              left=reply.state.left)
                    return
        except grpc.RpcError:
            pass  # closed here, or the coordinator is gone: the heartbeats tell which, within the peer timeout

    def close(self) -> None:
        """Stops the heartbeats, the attendance stream and the engine; waits only for a report of the epoch's
        end in flight (another thread's :meth:`fail`), which its own timeout bounds."""
        self._closed.set()
        with self._lock:
            reported = self._reported
        if reported is not None:
            reported.wait(self.peer_timeout)  # the report ends by its own timeout first
        if self._stream is not None:
            self._stream.cancel()
        self._close_engines()
        self._lane.shutdown(wait=False, cancel_futures=True)

    # --- the engine, in sequence order -----------------------------------------------------------------------

    def entered(self, sequence: int | None) -> bool:
        """Whether collective ``sequence`` has entered the engine, or a refusal of it will (:meth:`claim`): the
        nodes stay in step."""
        with self._lock:
            return sequence is not None and (self._next > sequence or sequence in self._claimed)

    def claim(self, sequence: int | None) -> bool:
        """Takes collective ``sequence`` for a refusal by this node (a process's request was rejected before
        the rendezvous); False when it has entered the engine or was claimed before (nothing to do)."""
        with self._lock:
            if sequence is None or self._next > sequence or sequence in self._claimed:
                return False
            self._claimed.add(sequence)
            return True

    def exchange(self, sequence: int, mine: np.ndarray, work: Callable, deadline: Deadline, label: str):
        """All-gathers the headers, then runs ``work(engine, headers, timeout)`` (which moves the bytes, on
        ``engine`` and on :attr:`device_engine` if any, and returns ``(result, bytes moved)``); collective
        ``sequence`` enters the engines after ``sequence - 1``.

        Returns:
            (headers, result): every node's header, node 0's first, and what ``work`` returned.

        Raises:
            Aborted / Unavailable: the epoch failed meanwhile (naming who was lost).
            DeadlineExceeded: ``deadline`` passed first; the epoch is over.
        """
        with self._lock:
            while self._next < sequence and not self.failed.is_set():
                left = deadline.remaining()
                if left is not None and left <= 0:
                    break
                self._lock.wait(min(left, 1.0) if left is not None else 1.0)
            if self.failed.is_set():
                raise self.error()
            if self._next != sequence:
                self.fail(f"{label} found collective {self._next} still before it after its deadline", report=True)
                raise self.error()
            self._next += 1
            self._claimed.discard(sequence)
            self._lock.notify_all()
            future = self._lane.submit(self._run, mine, work, deadline)
        start = time.perf_counter()
        while True:
            try:
                headers, result, moved = future.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                left = deadline.remaining()
                if self.failed.is_set():
                    raise self.error() from None
                if left is not None and left <= 0:
                    self.fail(f"{label} did not cross the nodes within its deadline", report=True)
                    raise DeadlineExceeded(f"{label} timed out in the exchange between nodes; "
                                           f"{self.error()}") from None
            except gloo.EngineError as e:
                raise self._engine_failed(label, e) from None
            except ServiceError as e:  # e.g. the deadline, in the node's work: the others would wait for this node
                self.fail(f"{label} failed on {self.describe(self.node_index)}: {e}", report=True)
                raise
            except Exception:  # a bug: the others must not wait for this node
                log.exception("event=exchange_error group=%s", self.gid)
                self.fail(f"{label} failed on {self.describe(self.node_index)} (a daemon error; see its log)",
                          report=True)
                raise self.error() from None
        with self._lock:
            self.stats.collectives += 1
            self.stats.bytes += moved + headers[0].nbytes * len(headers)
            self.stats.seconds += time.perf_counter() - start
        return headers, result

    def _run(self, mine: np.ndarray, work: Callable, deadline: Deadline):
        headers = self.engine.all_gather(mine.view(np.uint8), self._timeout(deadline))
        headers = [h.view(np.int64) for h in headers]
        result, moved = work(self.engine, headers, self._timeout(deadline))
        return headers, result, moved

    def _timeout(self, deadline: Deadline) -> float:
        left = deadline.remaining()
        return max(left, 0.001) if left is not None else 3600.0

    def _engine_failed(self, label: str, e: gloo.EngineError) -> ServiceError:
        """An engine error: wait (bounded) for the coordinator to say who was lost, then end the epoch."""
        self.failed.wait(self.peer_timeout + 2 * self.heartbeat_interval)
        if not self.failed.is_set():
            self.fail(f"the engine failed on {self.describe(self.node_index)} during {label}: {e}", report=True)
        return self.error()
