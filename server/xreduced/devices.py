"""The daemon's device table: names, lookup and the ListDevices view."""

from __future__ import annotations

from xreduce.wire.devices import DeviceName

from xreduced.backends import DeviceInfo
from xreduced.errors import InvalidArgument, NotFound

MAX_SPELLINGS = 4096
"""Device names remembered once resolved (callers use a few spellings each; the bound keeps memory fixed)."""


class DeviceTable:
    """Resolves device names in any DeviceSpec form to device indices.

    Example:
        >>> from xreduced.backends import DeviceInfo
        >>> t = DeviceTable([DeviceInfo("CPU", i, 0, "host") for i in range(2)])
        >>> t.resolve("/cpu:1", "destinations[0]")
        1
    """

    def __init__(self, infos: list[DeviceInfo]):
        self.infos = infos
        self._index = {(i.device_type, i.index): n for n, i in enumerate(infos)}
        self._names = [DeviceName(i.device_type, i.index) for i in infos]
        self._canonical = [n.canonical for n in self._names]
        self._resolved: dict[str, int] = {}  # names already resolved, in the spellings callers use

    def canonical(self, index: int) -> str:
        """Device ``index``'s canonical name, e.g. ``/job:localhost/replica:0/task:0/device:CPU:1``.

        Example:
            >>> from xreduced.backends import DeviceInfo
            >>> DeviceTable([DeviceInfo("CPU", 0, 0, "host")]).canonical(0)
            '/job:localhost/replica:0/task:0/device:CPU:0'
        """
        return self._canonical[index]

    def __len__(self) -> int:
        return len(self.infos)

    def name(self, index: int) -> DeviceName:
        """The parsed name of device ``index``."""
        return self._names[index]

    def resolve(self, spec: str, field: str) -> int:
        """Returns the index of the device ``spec`` names.

        Raises:
            InvalidArgument: ``spec`` is not a device name.
            NotFound: no such device here; the message lists the daemon's devices.
        """
        found = self._resolved.get(spec)
        if found is not None:
            return found
        try:
            name = DeviceName.parse(spec)
        except ValueError as e:
            raise InvalidArgument(f"{field}: {e}") from None
        key = (name.device_type, name.index)
        if name.job != "localhost" or name.replica != 0 or name.task != 0 or key not in self._index:
            raise NotFound(
                f"{field}: no device {spec!r} on this daemon; its devices are "
                f"{self.listing()}"
            )
        found = self._index[key]
        if len(self._resolved) < MAX_SPELLINGS:
            self._resolved[spec] = found
        return found

    def listing(self) -> str:
        """The devices' short names, e.g. ``CPU:0, CPU:1``."""
        return ", ".join(self.name(i).short for i in range(len(self.infos)))
