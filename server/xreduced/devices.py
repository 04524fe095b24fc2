"""The daemon's device table: names, lookup and the ListDevices view."""

from __future__ import annotations

from xreduce.wire.devices import DeviceName

from xreduced.backends import DeviceInfo
from xreduced.errors import InvalidArgument, NotFound


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

    def __len__(self) -> int:
        return len(self.infos)

    def name(self, index: int) -> DeviceName:
        """The parsed name of device ``index``."""
        info = self.infos[index]
        return DeviceName(info.device_type, info.index)

    def resolve(self, spec: str, field: str) -> int:
        """Returns the index of the device ``spec`` names.

        Raises:
            InvalidArgument: ``spec`` is not a device name.
            NotFound: no such device here; the message lists the daemon's devices.
        """
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
        return self._index[key]

    def listing(self) -> str:
        """The devices' short names, e.g. ``CPU:0, CPU:1``."""
        return ", ".join(self.name(i).short for i in range(len(self.infos)))
