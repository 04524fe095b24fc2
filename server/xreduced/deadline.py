"""Deadlines: a point in monotonic time after which work stops (a call's, a collective's, a peer's)."""

from __future__ import annotations

import time
from collections.abc import Callable

from xreduced.errors import DeadlineExceeded


class Deadline:
    """A point in monotonic time after which work stops.

    Example:
        >>> Deadline(None).remaining() is None
        True
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left, or None when unbounded."""
        return None if self._at is None else self._at - time.monotonic()

    def check(self, what: str | Callable[[], str]) -> None:
        """Raises :class:`DeadlineExceeded` naming ``what`` (or what ``what()`` says: a message made only
        when time is up) once time is up.

        Example:
            >>> Deadline(0.0).check(lambda: "summing")
            Traceback (most recent call last):
            ...
            xreduced.errors.DeadlineExceeded: timed out after 0 s while summing
        """
        if self._at is not None and time.monotonic() >= self._at:
            doing = what if isinstance(what, str) else what()
            raise DeadlineExceeded(f"timed out after {self.seconds:g} s while {doing}")
