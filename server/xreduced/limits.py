"""The daemon's limits: request size, in-flight bytes, collectives waiting.

A call over a limit is refused at once with ``RESOURCE_EXHAUSTED`` and a
message that names the figures and the flag; nothing blocks waiting for room,
and the daemon goes on serving.

What each limit counts:

* ``--max-request-bytes``: the request's serialized size, the bytes it arrived
  as, checked before the request is even parsed.
* ``--max-inflight-bytes``: the sum of the serialized sizes of the requests
  being served now (a collective's participant counts while it waits for the
  others). It does not bound the daemon's memory yet: a call's working set is
  about 12x its request and is counted only while its handler runs, and glibc
  keeps freed memory in per-thread arenas (README, "Faults and load").
* ``--max-collectives``: multi-process collectives (and joins) that have a
  participant in the daemon now. A call that would open one more is refused;
  a call joining one already open is always let in (refusing it would only
  make the others time out).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Hashable, Iterator

import grpc

from xreduced.config import Config
from xreduced.errors import ServiceError


class LimitExceeded(ServiceError):
    """A call over one of the daemon's limits; ``limit`` names the setting."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, limit: str = ""):
        super().__init__(message)
        self.limit = limit


@dataclasses.dataclass(frozen=True)
class Limits:
    """The configured limits; None means unbounded.

    Example:
        >>> Limits.from_config(Config(max_collectives=4)).max_collectives
        4
    """

    max_request_bytes: int | None = None
    max_inflight_bytes: int | None = None
    max_collectives: int | None = None

    @classmethod
    def from_config(cls, config: Config) -> Limits:
        return cls(config.max_request_bytes, config.max_inflight_bytes, config.max_collectives)

    def check_request(self, size: int, method: str) -> None:
        """Refuses a request whose serialized size is over ``--max-request-bytes``.

        Example:
            >>> Limits(max_request_bytes=100).check_request(150, "/x.Y/Z")
            Traceback (most recent call last):
            ...
            xreduced.limits.LimitExceeded: /x.Y/Z: request of 150 bytes is over --max-request-bytes 100
        """
        limit = self.max_request_bytes
        if limit is not None and size > limit:
            raise LimitExceeded(f"{method}: request of {size} bytes is over --max-request-bytes {limit}",
                                "max_request_bytes")


class InflightBytes:
    """Bytes of the requests being served; reserving past the limit fails at once.

    Example:
        >>> b = InflightBytes(100)
        >>> b.reserve(60)
        >>> b.reserve(50)
        Traceback (most recent call last):
        ...
        xreduced.limits.LimitExceeded: request of 50 bytes would bring in-flight bytes to 110,
        over --max-inflight-bytes 100 (60 in flight now)
        >>> b.release(60); b.value
        0
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def reserve(self, n: int) -> None:
        """Adds ``n`` bytes, or raises LimitExceeded (and adds nothing)."""
        with self._lock:
            total = self._value + n
            if self.limit is not None and total > self.limit:
                raise LimitExceeded(
                    f"request of {n} bytes would bring in-flight bytes to {total}, over --max-inflight-bytes "
                    f"{self.limit} ({self._value} in flight now)", "max_inflight_bytes")
            self._value = total

    def release(self, n: int) -> None:
        with self._lock:
            self._value -= n

    @contextlib.contextmanager
    def held(self, n: int) -> Iterator[None]:
        """Reserves ``n`` bytes for the block; releases them however it ends."""
        self.reserve(n)
        try:
            yield
        finally:
            self.release(n)


class CollectiveSlots:
    """Collectives with a participant in the daemon now, at most ``limit`` of them.

    Example:
        >>> slots = CollectiveSlots(1)
        >>> with slots.held("a", "collective 0"), slots.held("a", "collective 0"):
        ...     slots.open()
        1
        >>> with slots.held("a", "collective 0"), slots.held("b", "collective 1"):
        ...     pass
        Traceback (most recent call last):
        ...
        xreduced.limits.LimitExceeded: collective 1 would be the 2nd collective waiting at once,
        over --max-collectives 1
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._lock = threading.Lock()
        self._participants: collections.Counter[Hashable] = collections.Counter()

    def open(self) -> int:
        """Collectives with a participant in the daemon now."""
        with self._lock:
            return len(self._participants)

    def enter(self, key: Hashable, label: str) -> None:
        """One more participant of collective ``key`` (named ``label`` in messages).

        Raises:
            LimitExceeded: ``key`` is not open yet and ``limit`` collectives are.
        """
        with self._lock:
            n = len(self._participants)
            if key not in self._participants and self.limit is not None and n >= self.limit:
                raise LimitExceeded(f"{label} would be the {_ordinal(n + 1)} collective waiting at once, over "
                                    f"--max-collectives {self.limit}", "max_collectives")
            self._participants[key] += 1

    def leave(self, key: Hashable) -> None:
        """One participant of ``key`` fewer."""
        with self._lock:
            self._participants[key] -= 1
            if not self._participants[key]:
                del self._participants[key]

    @contextlib.contextmanager
    def held(self, key: Hashable, label: str) -> Iterator[None]:
        """One participant of collective ``key`` for the block; see :meth:`enter`."""
        self.enter(key, label)
        try:
            yield
        finally:
            self.leave(key)


def _ordinal(n: int) -> str:
    """Example:
    >>> [_ordinal(i) for i in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)]
    ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '22nd', '101st']
    """
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
