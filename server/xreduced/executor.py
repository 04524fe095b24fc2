"""The executor: runs a :class:`~xreduced.planner.Plan` on a backend.

It never touches numpy or cupy arithmetic itself; every operation goes
through the backend, so the host and GPU paths run the same plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from xreduced.backends import Backend
from xreduced.errors import DeadlineExceeded
from xreduced.planner import Copy, Plan, Sum


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

    def check(self, what: str) -> None:
        """Raises :class:`DeadlineExceeded` naming ``what`` once time is up."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"timed out after {self.seconds:g} s while {what}")


def execute(
    plan: Plan,
    backend: Backend,
    inputs: Sequence[Sequence[np.ndarray]],
    mean: bool = False,
    deadline: Deadline | None = None,
) -> dict[int, list[np.ndarray]]:
    """Runs ``plan`` and returns, per destination device, one array per tensor.

    Args:
        plan: from the planner.
        backend: where the devices live.
        inputs: ``inputs[p][t]`` is tensor ``t`` of the component on
            ``plan.devices[p]``; every component has the same shapes.
        mean: divide the sum by the number of replicas (integers promoted).
        deadline: checked before every step.

    Example:
        >>> from xreduced.backends.numpy_backend import NumpyBackend
        >>> from xreduced.planner import hierarchical_copy
        >>> plan = hierarchical_copy([0, 1], [2], 4)
        >>> out = execute(plan, NumpyBackend(2), [[np.ones(2, np.float32)]] * 2)
        >>> out[1][0]
        array([2., 2.], dtype=float32)
    """
    deadline = deadline or Deadline(None)
    templates = list(inputs[0])
    flat = {
        (t, d): backend.upload(d, arr)
        for d, component in zip(plan.devices, inputs)
        for t, arr in enumerate(component)
    }
    steps_of: dict[int, list] = {}
    for step in plan.steps:
        steps_of.setdefault(step.pack, []).append(step)
    results: dict[tuple[int, int], Any] = {}
    for pack in plan.packs:
        if not pack.elements:
            continue
        deadline.check(f"reducing pack {pack.index} of {len(plan.packs)}")
        bufs = {
            (f"in@{d}", d): backend.gather(
                d, [(flat[(s.tensor, d)], s.start, s.stop) for s in pack.segments]
            )
            for d in plan.devices
        }
        for step in steps_of.get(pack.index, []):
            deadline.check(f"running pack {pack.index}")
            if isinstance(step, Copy):
                bufs[(step.buffer, step.dst)] = backend.copy(bufs[(step.buffer, step.src)], step.dst)
            elif isinstance(step, Sum):
                first, *rest = (bufs[(name, step.device)] for name in step.inputs)
                acc = backend.add(first, rest[0]) if rest else first
                for other in rest[1:]:
                    backend.add_into(acc, other)
                bufs[(step.out, step.device)] = acc
        for d in plan.destinations:
            results[(pack.index, d)] = bufs[(plan.result, d)]
    backend.synchronize()
    return {d: _unpack(plan, backend, results, d, templates, mean) for d in plan.destinations}


def _unpack(plan, backend, results, device, templates, mean) -> list[np.ndarray]:
    pieces: dict[int, list[tuple[Any, int, int]]] = {}
    for pack in plan.packs:
        if not pack.elements:
            continue
        offset = 0
        for s in pack.segments:
            size = s.stop - s.start
            pieces.setdefault(s.tensor, []).append((results[(pack.index, device)], offset, offset + size))
            offset += size
    out = []
    for t, template in enumerate(templates):
        if math.prod(template.shape) == 0:
            buf = backend.upload(device, np.empty(template.shape, template.dtype))
        else:
            buf = backend.reshape(backend.gather(device, pieces[t]), template.shape)
        if mean:
            buf = backend.divide(buf, len(plan.devices))
        out.append(np.asarray(backend.download(buf)))
    backend.synchronize()
    return out
