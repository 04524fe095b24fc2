"""Distributed values: ``PerReplica`` (one value per device) and ``Mirrored``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xreduce._arrays import HostArray
from xreduce._job_devices import DaemonName
from xreduce._sparse import HostSlices, host
from xreduce.wire.devices import canonical


class DistributedValues:
    """Values spread over devices: ``values[i]`` lives on ``devices[i]``.

    Args:
        values: one array (or tensor-like) per device, or one
            :class:`~xreduce.distribute.IndexedSlices` per device.
        devices: device names in any form the SDK gives out (see
            :mod:`xreduce._job_devices`: ``cpu:4``, ``/job:worker/replica:0/task:1/device:CPU:0``,
            any DeviceSpec spelling); when omitted they come from the arrays
            that carry a device (CuPy, CUDA torch/JAX: the GPU of this node
            they are on), else they are this process's first ``len(values)``
            devices, resolved when first needed.

    Raises:
        ValueError: no values, ``devices`` of another length, or (without
            ``devices``) a value that is not an array, a tensor or a number.

    Example:
        >>> import numpy as np
        >>> v = PerReplica([np.zeros(2), np.ones(2)], devices=["cpu:0", "/cpu:1"])
        >>> v.devices[1]
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """

    def __init__(self, values: Sequence[Any], devices: Sequence[str] | None = None):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ValueError(
                f"{type(self).__name__} takes a list of values, one per device; got {type(values).__name__}"
            )
        self._values = tuple(values)
        if not self._values:
            raise ValueError(f"{type(self).__name__} needs at least one value; got []")
        self._hosts: tuple[HostArray | HostSlices, ...] | None = None
        if devices is not None:
            if isinstance(devices, str) or len(devices) != len(self._values):
                raise ValueError(
                    f"{type(self).__name__}: {len(self._values)} values but devices={list(devices)!r}"
                    if not isinstance(devices, str) else
                    f"{type(self).__name__}: devices must be a list of names; got {devices!r}"
                )
            self._devices: tuple[str, ...] | None = tuple(canonical(d) for d in devices)
        else:
            found = [getattr(h, "device", None) for h in self.hosts()]
            self._devices = tuple(DaemonName(canonical(d)) for d in found) if all(found) else None
        if self._devices is not None and len(set(self._devices)) != len(self._devices):
            raise ValueError(
                f"{type(self).__name__}: each device may hold one value; got devices="
                f"{list(devices) if devices is not None else list(self._devices)!r}"
            )

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-device values, as given."""
        return self._values

    @property
    def devices(self) -> tuple[str, ...]:
        """Canonical device names, one per value (as given: a task-qualified name stays one).

        Raises:
            ValueError: the value was made without ``devices`` and has not been
                reduced yet: its devices are the daemon's first ones, known once
                a cross-device op (which knows its daemon) has used it.

        Example:
            >>> import numpy as np
            >>> PerReplica([np.zeros(2)]).devices
            Traceback (most recent call last):
            ...
            ValueError: PerReplica was made without devices: they are the daemon's first 1, ...
        """
        if self._devices is None:
            raise ValueError(
                f"{type(self).__name__} was made without devices: they are the daemon's first {len(self._values)}, "
                "known once a CrossDeviceOps has used the value; give devices= to name them"
            )
        return self._devices

    def _resolve_devices(self, names: Sequence[str]) -> tuple[str, ...]:
        if self._devices is None:
            if len(names) < len(self._values):
                raise ValueError(
                    f"{len(self._values)} values but the daemon has only {len(names)} devices"
                )
            self._devices = tuple(names[: len(self._values)])
        return self._devices

    def hosts(self) -> tuple[HostArray | HostSlices, ...]:
        """The values converted to host arrays (cached); an ``IndexedSlices`` to a ``HostSlices``.

        Raises:
            ValueError: a value is not an array, a tensor or a number; the
                message names it (``values[i]``) and says why.
        """
        if self._hosts is None:
            self._hosts = tuple(self._host(i, v) for i, v in enumerate(self._values))
        return self._hosts

    def _host(self, i: int, value: Any) -> HostArray | HostSlices:
        try:
            return host(value)
        except ValueError as e:
            hint = " (device names go in devices=)" if isinstance(value, str) else ""
            raise ValueError(f"{type(self).__name__}: values[{i}] must be an array, a tensor or a number, one per "
                             f"device{hint}; {e}") from None

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        devices = self._devices or ("<daemon's first devices>",)
        body = ",\n  ".join(f"{d}: {v!r}" for d, v in zip(devices, self._values))
        return f"{type(self).__name__}:{{\n  {body}\n}}"


class PerReplica(DistributedValues):
    """A value with possibly different contents on each device (TF's PerReplica).

    Example:
        >>> import numpy as np
        >>> PerReplica([np.array(1.0), np.array(2.0)], devices=["GPU:0", "GPU:1"]).devices[0]
        '/job:localhost/replica:0/task:0/device:GPU:0'
    """


class Mirrored(DistributedValues):
    """A value with identical contents on every device (TF's Mirrored).

    Example:
        >>> import numpy as np
        >>> m = Mirrored([np.array([3.0]), np.array([3.0])], devices=["CPU:0", "CPU:1"])
        >>> len(m), m.values[1]
        (2, array([3.]))
    """
