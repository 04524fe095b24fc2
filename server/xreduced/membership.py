"""The membership of groups on one daemon: each process tied to its session, so that a dead one is noticed at once.

A process joins a group of this daemon (``JoinGroup`` without a coordinator)
naming a session it holds open (``OpenSession``; the SDK's ``initialize`` opens
one for the group). If that session ends before the process leaves
(``LeaveGroup``), the process has died (killed, crashed, or stopped past its
own teardown): the group's waiting collectives fail now for every process, and
so do its next ones, with ``ABORTED`` naming the process, instead of waiting for
it until the collective timeout. A process that leaves while others still use
the group fails them the same way: it will never contribute again. The next
join of the group's name starts a new membership. Groups across nodes have the
same rule in :mod:`xreduced.peers`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable

from xreduced.errors import Aborted

log = logging.getLogger("xreduced.membership")


@dataclasses.dataclass
class _Membership:
    generation: int
    num_processes: int
    sessions: dict[int, str] = dataclasses.field(default_factory=dict)
    left: set[int] = dataclasses.field(default_factory=set)
    lost: Aborted | None = None
    """Why the group cannot go on (a process died or left), once it cannot."""


class LocalGroups:
    """Who is in each group of this daemon, and whether the group still stands; thread-safe.

    Args:
        fail_waiting: ``fail_waiting(group, error)`` fails every collective of ``group`` waiting now
            (:meth:`xreduced.rendezvous.Rendezvous.fail_group`).

    Example:
        >>> failed = []
        >>> groups = LocalGroups(lambda group, error: failed.append((group, str(error))))
        >>> generation = groups.start("train", 2)
        >>> groups.watch("train", generation, 0, "s0"); groups.watch("train", generation, 1, "s1")
        >>> groups.session_ended("s1")
        >>> print(failed[0][1])  # doctest: +ELLIPSIS
        process 1 of group "train" ended without leaving the group (its session with the daemon closed: ...);
        every process must shutdown() and initialize() again
        >>> groups.check("train", "collective 4 in group \\"train\\"")
        Traceback (most recent call last):
        ...
        xreduced.errors.Aborted: collective 4 in group "train" cannot complete: process 1 of group "train" ended ...
    """

    def __init__(self, fail_waiting: Callable[[str, Aborted], None]):
        self._fail_waiting = fail_waiting
        self._lock = threading.Lock()
        self._groups: dict[str, _Membership] = {}
        self._generations = 0
        self._watched: dict[str, set[tuple[str, int, int]]] = {}

    def start(self, group: str, num_processes: int) -> int:
        """A join of ``group`` completed: a new membership (what happened to the last one no longer
        applies). Returns its generation, which :meth:`watch` names."""
        with self._lock:
            self._generations += 1
            self._groups[group] = _Membership(self._generations, num_processes)
            return self._generations

    def watch(self, group: str, generation: int, process_id: int, session: str) -> None:
        """Process ``process_id`` joined membership ``generation`` of ``group`` through ``session``."""
        with self._lock:
            m = self._groups.get(group)
            if m is None or m.generation != generation:
                return
            m.sessions[process_id] = session
            self._watched.setdefault(session, set()).add((group, generation, process_id))

    def leave(self, group: str, process_id: int) -> bool:
        """Process ``process_id`` is done with ``group``. Returns whether the group was known here.

        Once every process has left, the membership is forgotten; before that, the others' collectives
        fail: this process will not contribute again."""
        with self._lock:
            m = self._groups.get(group)
            if m is None:
                return False
            m.left.add(process_id)
            for session in [s for pid, s in m.sessions.items() if pid == process_id]:
                self._unwatch(session, group, m.generation, process_id)
            if len(m.left) >= m.num_processes:
                del self._groups[group]
                return True
            error = self._lose(group, m, f'process {process_id} of group "{group}" left the group (shutdown()) '
                                         "while the others still use it", process_id)
        if error is not None:
            self._fail_waiting(group, error)
        return True

    def session_ended(self, session: str) -> None:
        """A session's stream ended: each process that joined through it and has not left ends its group."""
        with self._lock:
            lost = []
            for group, generation, pid in sorted(self._watched.pop(session, ())):
                m = self._groups.get(group)
                if m is None or m.generation != generation or pid in m.left:
                    continue
                error = self._lose(group, m, f'process {pid} of group "{group}" ended without leaving the group '
                                             "(its session with the daemon closed: it was killed, crashed or exited "
                                             "without shutdown())", pid)
                if error is not None:
                    lost.append((group, pid, error))
                m.left.add(pid)  # gone for good: a membership whose processes are all gone is forgotten
                if len(m.left) >= m.num_processes:
                    del self._groups[group]
        for group, pid, error in lost:
            log.warning("event=process_gone group=%s process=%d", json.dumps(group), pid)
            self._fail_waiting(group, error)

    def check(self, group: str, label: str) -> None:
        """Raises ``Aborted`` when ``group`` has lost a process: collective ``label`` cannot complete."""
        with self._lock:
            m = self._groups.get(group)
            error = m.lost if m is not None else None
        if error is not None:
            raise Aborted(f"{label} cannot complete: {error}", process_ids=error.process_ids)

    def groups(self) -> int:
        """Memberships kept now."""
        with self._lock:
            return len(self._groups)

    def _lose(self, group: str, m: _Membership, why: str, process_id: int) -> Aborted | None:
        """With the lock held: the group cannot go on; the error for its waiting collectives (None if it
        was already lost)."""
        if m.lost is not None:
            return None
        m.lost = Aborted(f"{why}; every process must shutdown() and initialize() again", process_ids=(process_id,))
        return m.lost

    def _unwatch(self, session: str, group: str, generation: int, process_id: int) -> None:
        entries = self._watched.get(session)
        if entries is not None:
            entries.discard((group, generation, process_id))
            if not entries:
                del self._watched[session]
