"""Collectives that run while the caller goes on: one worker thread per group, a ``Work`` per call.

``torch.distributed`` calls a group's collectives from the thread that trains (DDP: from its autograd
hooks, once per gradient bucket). Each call is queued to the group's worker thread and answered at once
with a :class:`Work` whose future completes when the daemon has answered: the backward pass goes on while
the daemon reduces. The worker runs the calls in the order they were made, which is the order every rank
makes them, so the k-th collective of every rank meets the others' k-th.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _Work
from torch.futures import Future

from xreduce.torch._tensors import torch_error


class Work(_Work):
    """One collective of the xreduce backend: ``wait()`` blocks until it is done (raising its error),
    ``get_future()`` completes with its output tensors, as PyTorch documents ``Work``.

    Example:
        >>> f = Future(); w = Work(f); f.set_result([torch.ones(1)])
        >>> w.wait(), w.is_completed(), w.result()
        (True, True, [tensor([1.])])

        A failed collective: ``wait()`` raises its error; ``get_future()`` fails as a C++ future fails, as DDP's
        reducer needs it to (it raises that in ``backward()``):

        >>> f = Future(); w = Work(f); f.set_exception(dist.DistBackendError("process 1 ended"))
        >>> w.is_completed(), w.is_success()
        (True, False)
        >>> w.wait()
        Traceback (most recent call last):
        ...
        torch.distributed.DistBackendError: process 1 ended
        >>> w.get_future().wait()
        Traceback (most recent call last):
        ...
        RuntimeError: Got the following error when running the callback: DistBackendError: process 1 ended...
    """

    def __init__(self, future: Future):
        super().__init__()
        self._future = future
        # What C++ sees: DDP's reducer reads get_future()'s value as tensors, and Future.set_exception only
        # stores the exception as a value (it is raised in Python alone), which the reducer then takes for an
        # empty list of tensors and crashes. A callback that raises completes its chained future with a C++
        # error, which the reducer raises in backward(): a RuntimeError naming the DistBackendError.
        self._chained = future.then(lambda f: f.value())
        self._done = threading.Event()
        self._chained.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Blocks until the collective is done; raises its error (a ``DistBackendError``, ...).

        Raises:
            torch.distributed.DistBackendError: ``timeout`` passed first (the collective goes on).
        """
        if timeout is not None and timeout.total_seconds() > 0 and not self._done.wait(timeout.total_seconds()):
            raise dist.DistBackendError(f"xreduce: the collective was not done within {timeout.total_seconds()} s")
        self._future.wait()  # raises the collective's own error (a DistBackendError, ...)
        self._chained.wait()
        return True

    def get_future(self) -> Future:
        """The future of the output tensors (what DDP chains its bucket's work on); a failed collective's
        raises a ``RuntimeError`` whose message names its error (``DistBackendError: ...``)."""
        return self._chained

    def is_completed(self) -> bool:
        """Whether the collective is done (successfully or not)."""
        return self._chained.done()

    def is_success(self) -> bool:
        """Whether the collective is done without an error."""
        if not self._chained.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        """The output tensors (waits)."""
        return self._future.wait()

    def synchronize(self) -> None:
        """Nothing to do: results are in place once the future completes."""


class Runner:
    """The group's worker thread: runs queued collectives in order, each completing its future.

    Example:
        >>> r = Runner("g")
        >>> w = r.submit(lambda: [torch.ones(1) * 2])
        >>> w.wait(), w.get_future().value()
        (True, [tensor([2.])])
        >>> r.close()
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"xreduce-torch-{name}", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Work:
        """Queues ``call`` (it returns the output tensors); its :class:`Work` comes back at once."""
        future: Future = Future()
        self._queue.put((call, future))
        return Work(future)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, future = item
            try:
                result = call()
            except BaseException as e:  # noqa: BLE001 - every error goes to the caller's future
                future.set_exception(torch_error(e))
            else:
                future.set_result(result)

    def close(self) -> None:
        """Stops the thread once the calls queued before have run."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
