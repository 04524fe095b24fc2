"""How the daemon keeps clear of the kernel's OOM killer: a budget on the clients' shared memory it maps,
and its own ``oom_score_adj``.

Every page of a client's shared memory the daemon maps counts in its RSS (regions are mapped populated,
:func:`xreduced.regions.open_shm`), so a daemon that serves several training processes looks like the
largest process of the node, and the OOM killer, which picks by RSS plus ``oom_score_adj``, picks it
first: every process of every job on the node then loses its daemon. Two guards:

* :class:`MappedBytes`, ``--max-mapped-bytes``: the ``byte_size`` of every host shared-memory region the
  daemon maps, over all sessions (the ``OpenSession`` probe too, while it reads it), added up; a region
  that would go over is refused with ``RESOURCE_EXHAUSTED`` before anything is opened, and a region's
  bytes come back when it is unmapped (unregistered, its session ended, or the last call using it ended).
  CUDA IPC regions are GPU memory and do not count. The default is half the node's memory
  (:func:`default_max_mapped_bytes`).
* :func:`set_score_adj`, ``--oom-score-adj`` (-900): the ``xreduced`` command sets its own score at
  start, so that the kernel picks a training process before it. Lowering it needs ``CAP_SYS_RESOURCE``;
  without it the daemon logs one warning that says what to do, and serves anyway. An embedded daemon
  (:func:`xreduce.serve_embedded`) leaves its process's score alone: it is the training process's.

docs/operations.md, "Memory: the daemon's budget and the OOM killer", is the operator's side.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Iterable

from xreduced.admission import LimitExceeded
from xreduced.config import Config

log = logging.getLogger("xreduced")

MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
SCORE_ADJ = "/proc/self/oom_score_adj"

SCORE_ADJ_RANGE = (-1000, 1000)
"""The kernel's range for ``oom_score_adj``."""


def binary_bytes(n: int) -> str:
    """A byte count in binary units, three significant digits, for the budget's messages.

    Example:
        >>> binary_bytes(1 << 30), binary_bytes(9 << 30), binary_bytes(3 << 29), binary_bytes(512)
        ('1 GiB', '9 GiB', '1.5 GiB', '512 B')
    """
    size, unit = 1, "B"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if n < size * 1024:
            break
        size, unit = size * 1024, name
    return f"{n / size:.3g} {unit}"


def _figure(n: int) -> str:
    return f"{n} bytes ({binary_bytes(n)})"


class MappedBytes:
    """The shared memory the daemon maps, in bytes, within ``limit`` (None: no budget); thread-safe.

    Example:
        >>> budget = MappedBytes(8 << 30)
        >>> budget.reserve(8 << 30, "region 'a'")
        >>> budget.reserve(1 << 30, "region 'xrs-123-ab'")
        Traceback (most recent call last):
        ...
        xreduced.admission.LimitExceeded: max-mapped-bytes: region 'xrs-123-ab' of 1073741824 bytes (1 GiB) would
        bring the shared memory this daemon maps to 9663676416 bytes (9 GiB), over its budget of 8589934592 bytes
        (8 GiB) (--max-mapped-bytes / XREDUCE_MAX_MAPPED_BYTES)
        >>> budget.release(8 << 30); budget.value
        0
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self._lock = threading.Lock()
        self._value = 0

    @classmethod
    def from_config(cls, config: Config) -> MappedBytes:
        """The budget ``config`` sets, or the node's default (:func:`node_max_mapped_bytes`) when it sets none.

        Example:
            >>> MappedBytes.from_config(Config(max_mapped_bytes=1 << 30)).limit
            1073741824
        """
        if config.max_mapped_bytes is not None:
            return cls(config.max_mapped_bytes)
        return cls(node_max_mapped_bytes())

    @property
    def value(self) -> int:
        """The bytes mapped now.

        Example:
            >>> budget = MappedBytes(None)
            >>> budget.reserve(100, "region 'a'"); budget.value
            100
        """
        return self._value

    def reserve(self, n: int, what: str) -> None:
        """Counts ``n`` bytes about to be mapped (``what``: which, for the message); call it before mapping them.

        Raises:
            LimitExceeded: they would bring the total over the budget; nothing is counted then.
        """
        with self._lock:
            total = self._value + n
            if self.limit is not None and total > self.limit:
                raise LimitExceeded(
                    f"max-mapped-bytes: {what} of {_figure(n)} would bring the shared memory this daemon maps to "
                    f"{_figure(total)}, over its budget of {_figure(self.limit)} (--max-mapped-bytes / "
                    "XREDUCE_MAX_MAPPED_BYTES)", "max_mapped_bytes")
            self._value = total

    def release(self, n: int) -> None:
        """Gives back ``n`` bytes reserved before, once they are unmapped."""
        with self._lock:
            self._value -= n


def default_max_mapped_bytes(meminfo: str, cgroup_limits: Iterable[str] = ()) -> int | None:
    """Half of the node's memory: the smaller of ``MemTotal`` in ``meminfo`` (``/proc/meminfo``'s text) and
    the cgroup memory limits among ``cgroup_limits`` (the texts of ``memory.max`` or
    ``memory.limit_in_bytes`` files; ``max``, or cgroup v1's near-2**63 "no limit", limits nothing).

    Returns:
        The bytes, or None when neither says how much memory there is (no budget).

    Example:
        >>> meminfo = "MemTotal:       32768000 kB\\nMemFree:        1000 kB\\n"
        >>> default_max_mapped_bytes(meminfo)
        16777216000
        >>> default_max_mapped_bytes(meminfo, ["max\\n", "8589934592\\n"])
        4294967296
        >>> default_max_mapped_bytes(meminfo, ["9223372036854771712"]) == default_max_mapped_bytes(meminfo)
        True
    """
    sizes = []
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", meminfo, re.MULTILINE)
    if m:
        sizes.append(int(m.group(1)) * 1024)
    for text in cgroup_limits:
        text = text.strip()
        if text.isdigit():
            sizes.append(int(text))
    return min(sizes) // 2 if sizes else None


def cgroup_limit_files(proc_cgroup: str, root: str = CGROUP_ROOT) -> list[str]:
    """The files that may hold the memory limits of a process whose ``/proc/self/cgroup`` says
    ``proc_cgroup``: cgroup v2's ``memory.max`` and v1's ``memory.limit_in_bytes``, of its cgroup and each
    one above it (a parent's limit bounds its children too; in a container without its own cgroup
    namespace its cgroup is the mount's root). Those that do not exist are to be skipped.

    Example:
        >>> for path in cgroup_limit_files("0::/kubepods/pod1/c1\\n", "/cg"):
        ...     print(path)
        /cg/kubepods/pod1/c1/memory.max
        /cg/kubepods/pod1/memory.max
        /cg/kubepods/memory.max
        /cg/memory.max
        >>> cgroup_limit_files("4:memory:/docker/ab\\n1:cpu:/docker/ab\\n", "/cg")[:2]
        ['/cg/memory/docker/ab/memory.limit_in_bytes', '/cg/memory/docker/memory.limit_in_bytes']
    """
    files = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            files.append(os.path.join(base, *parts[:depth], name))
    return files


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def node_max_mapped_bytes() -> int | None:
    """:func:`default_max_mapped_bytes` of this node, read from ``/proc`` and the cgroup files.

    Example:
        >>> node_max_mapped_bytes() is None or node_max_mapped_bytes() > 0
        True
    """
    limits = [_read(path) for path in cgroup_limit_files(_read(PROC_CGROUP) or "")]
    return default_max_mapped_bytes(_read(MEMINFO) or "", [t for t in limits if t is not None])


def score_adj(path: str = SCORE_ADJ) -> int | None:
    """This process's ``oom_score_adj`` in effect, or None where it cannot be read.

    Example:
        >>> score_adj() is None or -1000 <= score_adj() <= 1000
        True
    """
    text = _read(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def set_score_adj(value: int, path: str = SCORE_ADJ) -> int | None:
    """Sets this process's ``oom_score_adj`` to ``value`` (unless it is already); when the kernel refuses,
    logs one warning that says what to do instead. Call it only in the daemon's own process.

    Returns:
        The score in effect afterwards (None where it cannot be read).

    Example (a file standing in for ``/proc/self/oom_score_adj``):
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w+") as f:
        ...     _ = f.write("0\\n"); f.flush()
        ...     set_score_adj(-900, f.name)
        -900
    """
    if score_adj(path) == value:
        return value
    try:
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except OSError as e:
        now = score_adj(path)
        if e.errno in (errno.EACCES, errno.EPERM):
            log.warning(
                "event=oom_score_adj_refused wanted=%d in_effect=%s error=%r: lowering oom_score_adj needs "
                "CAP_SYS_RESOURCE, so the OOM killer may pick this daemon before a training process. Run it with "
                "that capability (or as root), or have its runtime set the score: docker run --oom-score-adj %d, "
                "compose oom_score_adj: %d, systemd OOMScoreAdjust=%d, on Kubernetes a Guaranteed-QoS pod or "
                "priorityClassName: system-node-critical (-997: set --oom-score-adj -997 to keep it); "
                "--oom-score-adj / XREDUCE_OOM_SCORE_ADJ. Serving anyway",
                value, now, e.strerror, value, value, value)
        else:
            log.warning("event=oom_score_adj_failed wanted=%d in_effect=%s error=%r: cannot set %s; serving anyway",
                        value, now, e.strerror, path)
        return now
    return score_adj(path)
