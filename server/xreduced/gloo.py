"""The engine that carries bytes between nodes: Gloo, through ``torch.distributed``.

One :class:`GlooEngine` per group and epoch: a ``ProcessGroupGloo`` whose ranks
are the group's node daemons (rank = node index). Its rendezvous goes through
the coordinator's store (the ``Peers.Store*`` RPCs, :class:`PeerStore`), so the
only port a group adds besides the coordinator's are Gloo's own connections,
bound to the node's ``--node-address``. Every operation is bounded by a
timeout; torch is imported only when a group spans nodes.

The engine moves bytes only: node sums travel as ``uint8`` buffers and each node
adds them itself in node order (:mod:`xreduced.peers`), so every dtype crosses
and the order of additions does not depend on Gloo's algorithm.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
from collections.abc import Callable

import numpy as np

INSTALL_HINT = "pip install 'xreduce[cluster]' (torch, whose torch.distributed carries Gloo) on every node"


SUMMABLE = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8",
                                          "bool", "complex64", "complex128"))
"""The dtypes Gloo's all-reduce adds (bfloat16 too, see :func:`summable`); others cross as bytes."""


def summable(dtype: np.dtype) -> bool:
    """Whether Gloo's all-reduce adds ``dtype``.

    Example:
        >>> summable(np.dtype("float32")), summable(np.dtype("uint16"))
        (True, False)
    """
    return np.dtype(dtype) in SUMMABLE or np.dtype(dtype).name == "bfloat16"


def unavailable_reason() -> str | None:
    """Why this daemon cannot drive Gloo, or None when it can.

    Example:
        >>> unavailable_reason() in (None, "torch is not installed: " + INSTALL_HINT)
        True
    """
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed: " + INSTALL_HINT
    return _import_error()


@functools.cache
def _import_error() -> str | None:
    """Imports torch.distributed once (seconds, so only when a group needs it); why it failed, or None."""
    try:
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 -- a broken install can raise anything: it means no engine
        return f"torch cannot be imported ({type(e).__name__}: {e}): " + INSTALL_HINT
    if not dist.is_available():
        return "this torch has no torch.distributed: " + INSTALL_HINT
    return None


class EngineError(RuntimeError):
    """An engine operation failed: a peer reset, a timeout, a refused connection."""


def _store_class():
    import torch.distributed as dist

    class PeerStore(dist.Store):
        """A ``torch.distributed`` store over the coordinator's ``Peers.Store*`` RPCs.

        Gloo sets each rank's address and reads the others'; ``get`` waits, bounded.
        """

        def __init__(self, set_: Callable[[str, bytes], None], get: Callable[[str, float], bytes],
                     add: Callable[[str, int], int], timeout: float):
            super().__init__()
            self._set, self._get, self._add = set_, get, add
            self._timeout = timeout

        def set(self, key, value):
            self._set(key, value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key):
            return self._get(key, self._timeout)

        def add(self, key, amount):
            return self._add(key, int(amount))

        def wait(self, keys, timeout=None):
            seconds = self._timeout if timeout is None else timeout.total_seconds()
            for key in keys:
                self._get(key, seconds)

        def check(self, keys):
            try:
                for key in keys:
                    self._get(key, 0.0)
            except EngineError:
                return False
            return True

        def set_timeout(self, timeout):
            self._timeout = timeout.total_seconds()

    return PeerStore


class GlooEngine:
    """Gloo among a group's node daemons for one epoch.

    Args:
        store: ``(set, get, add)``: the coordinator's store for this group and
            epoch; ``get(key, timeout)`` raises :class:`EngineError` when the
            key is not set in time.
        rank: this node's index; size: the number of nodes.
        address: the interface Gloo binds to and the others connect to.
        timeout: the bound on connecting and on each operation's waits.

    Raises:
        EngineError: the ranks did not all connect within ``timeout``.

    Example:
        >>> import threading
        >>> table = {}
        >>> def get(key, timeout):
        ...     for _ in range(int(timeout * 100) + 1):
        ...         if key in table: return table[key]
        ...         threading.Event().wait(0.01)
        ...     raise EngineError(key)
        >>> def add(key, n):
        ...     table[key] = str(int(table.get(key, b"0")) + n).encode(); return int(table[key])
        >>> store = (table.__setitem__, get, add)
        >>> engines = [None, None]
        >>> def make(rank): engines[rank] = GlooEngine(store, rank, 2, "127.0.0.1", 10.0)
        >>> threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> out = {}
        >>> def gather(rank): out[rank] = engines[rank].all_gather(np.frombuffer(bytes([rank] * 3), np.uint8), 5.0)
        >>> threads = [threading.Thread(target=gather, args=(r,)) for r in (0, 1)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> [part.tolist() for part in out[1]]
        [[0, 0, 0], [1, 1, 1]]
        >>> for e in engines: e.close()
        >>> engines[0].all_gather(np.zeros(3, np.uint8), 5.0)  # its epoch ended: no call on a torn-down group
        Traceback (most recent call last):
        ...
        xreduced.gloo.EngineError: the engine is closed: the group's epoch ended
    """

    name = "gloo"

    def __init__(self, store: tuple[Callable, Callable, Callable], rank: int, size: int, address: str,
                 timeout: float):
        import torch._C._distributed_c10d as c10d
        import torch.distributed as dist

        self._c10d = c10d
        self.rank, self.size = rank, size
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = datetime.timedelta(seconds=timeout)
        options._threads = 2
        try:
            self._group = dist.ProcessGroupGloo(_store_class()(*store, timeout), rank, size, options)
        except RuntimeError as e:
            raise EngineError(f"Gloo could not connect the {size} nodes from {address}: {_short(e)}") from None

    def all_gather(self, buffer: np.ndarray, timeout: float) -> list[np.ndarray]:
        """Every node's ``buffer`` (``uint8``, the same size on every node), node 0's first.

        Raises:
            EngineError: a peer failed or did not answer within ``timeout``.
        """
        import torch

        source = torch.from_numpy(np.array(buffer, np.uint8, copy=not buffer.flags.writeable))
        parts = [torch.empty(source.shape, dtype=torch.uint8) for _ in range(self.size)]
        options = self._c10d.AllgatherOptions()
        options.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        self._wait(self._live().allgather([parts], [source], options))
        return [p.numpy() for p in parts]

    def all_reduce(self, buffer: np.ndarray, timeout: float) -> np.ndarray:
        """The sum over every node of ``buffer`` (a flat array of a :func:`summable` dtype), in place.

        Raises:
            EngineError: a peer failed or did not answer within ``timeout``.
        """
        self.finish(self.all_reduce_start(buffer, timeout))
        return buffer

    def all_reduce_start(self, buffer: np.ndarray, timeout: float):
        """Starts :meth:`all_reduce` of ``buffer`` (contiguous, left alone until :meth:`finish`); Gloo's
        threads carry it while the caller goes on. Operations run in the order they are started."""
        import torch

        if buffer.dtype.name == "bfloat16":
            tensor = torch.from_numpy(buffer.view(np.uint16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(buffer)
        options = self._c10d.AllreduceOptions()
        options.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        try:
            return self._live().allreduce([tensor], options)
        except RuntimeError as e:
            raise EngineError(_short(e)) from None

    def finish(self, work) -> None:
        """Waits for an operation :meth:`all_reduce_start` started.

        Raises:
            EngineError: a peer failed or did not answer within the operation's timeout.
        """
        self._wait(work)

    def broadcast(self, buffer: np.ndarray, root: int, timeout: float) -> np.ndarray:
        """``buffer`` of node ``root`` into every node's ``buffer`` (``uint8``, written in place).

        Raises:
            EngineError: a peer failed or did not answer within ``timeout``.
        """
        import torch

        options = self._c10d.BroadcastOptions()
        options.rootRank = root
        options.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        target = buffer if buffer.flags.writeable else buffer.copy()  # the root only sends, but torch wants it writable
        self._wait(self._live().broadcast([torch.from_numpy(target)], options))
        return target

    def _live(self):
        """The process group; after :meth:`close` (the epoch ended meanwhile) an :class:`EngineError`, never a
        call on a torn-down group."""
        group = getattr(self, "_group", None)
        if group is None:
            raise EngineError("the engine is closed: the group's epoch ended")
        return group

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise EngineError(_short(e)) from None

    def close(self) -> None:
        """Aborts what is in flight and lets the connections go. Idempotent."""
        group, self._group = getattr(self, "_group", None), None
        if group is None:
            return
        try:
            group.abort()
        except (RuntimeError, AttributeError):  # older torch: no abort; the connections go with the object
            pass


def _short(error: BaseException) -> str:
    """Gloo's message, first line (torch appends C++ frames)."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
