"""Deferred replies: a call's answer that another thread delivers.

A local-lane call that joins a collective before the other processes arrive
does not wait in its own thread: the rendezvous keeps a :class:`Deferred`
for it, and the arrival that completes the collective (or the failure that
ends it) resolves it, in that thread. The service and the call pipeline chain
their remaining steps with :meth:`Deferred.settle` (encode the result,
serialize the reply, end the call), and the lane sends the reply frame from
the last link.

While a deferred call waits, the lane asks the rendezvous again when it wants
(:meth:`Deferred.wake_at`): to log a long wait, or to fail the collective at
the call's deadline (:meth:`Deferred.wake`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("xreduced.deferred")


class Deferred:
    """A value (or an error) that arrives later, once; steps chained to it run where it arrives.

    Example:
        >>> d = Deferred()
        >>> reply = d.settle(lambda value, error: f"sum {value}")
        >>> seen = []
        >>> reply.on_done(lambda value, error: seen.append(value))
        >>> d.resolve(6), d.resolve(7), d.done, seen
        (True, False, True, ['sum 6'])
    """

    def __init__(self, source: Deferred | None = None, *, wake_at: Callable[[], float] | None = None,
                 wake: Callable[[float], None] | None = None):
        """A new deferred; ``source``: the deferred of a chain's first step (:meth:`settle` passes it).

        Args:
            wake_at: when the waiting side should call :meth:`wake` (``time.monotonic()``), as the source (who
                resolves it, e.g. the rendezvous) says.
            wake: the source's turn at that time: it logs a long wait, or fails at the deadline.
        """
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Any, BaseException | None], None]] = []
        self._source = source if source is not None else self
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self._wake_at, self._wake = wake_at, wake

    def resolve(self, value: Any = None, error: BaseException | None = None) -> bool:
        """Delivers ``value`` (or ``error``) and runs the chained steps, in this thread; False if it was
        resolved already (the first one wins)."""
        with self._lock:
            if self.done:
                return False
            self.done, self.value, self.error = True, value, error
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(value, error)
            except Exception:  # a step must not stop the others; each settles its own errors
                log.exception("event=deferred_callback_failed")
        return True

    def on_done(self, callback: Callable[[Any, BaseException | None], None]) -> None:
        """Runs ``callback(value, error)`` once resolved: now, if it is."""
        with self._lock:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self.value, self.error)

    def settle(self, step: Callable[[Any, BaseException | None], Any]) -> Deferred:
        """A deferred resolved with ``step(value, error)``'s result, or the exception it raises."""
        out = Deferred(self._source)

        def run(value, error):
            try:
                result = step(value, error)
            except Exception as e:  # noqa: BLE001 -- the next step (the lane) answers it
                out.resolve(error=e)
            else:
                out.resolve(result)

        self.on_done(run)
        return out

    def then(self, step: Callable[[Any], Any]) -> Deferred:
        """A deferred resolved with ``step(value)``; an error passes through without calling ``step``.

        Example:
            >>> d = Deferred(); doubled = d.then(lambda v: 2 * v)
            >>> d.resolve(error=ValueError("no")); type(doubled.error).__name__
            True
            'ValueError'
        """
        def run(value, error):
            if error is not None:
                raise error
            return step(value)

        return self.settle(run)

    def wake_at(self) -> float:
        """When (``time.monotonic()``) the waiting side should call :meth:`wake`; inf: never."""
        hook = self._source._wake_at
        return hook() if hook is not None and not self.done else math.inf

    def wake(self, now: float) -> None:
        """The waiting side's turn: the source logs a long wait, or fails at the deadline."""
        hook = self._source._wake
        if hook is not None and not self.done:
            hook(now)


def then(value: Any, step: Callable[[Any], Any]) -> Any:
    """``step(value)``, or, for a :class:`Deferred`, a deferred of it.

    Example:
        >>> then(3, lambda v: v + 1)
        4
    """
    return value.then(step) if isinstance(value, Deferred) else step(value)
