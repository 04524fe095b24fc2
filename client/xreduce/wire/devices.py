"""Device names in TensorFlow's DeviceSpec forms.

Every form of DESIGN.md §5 is accepted: ``/job:localhost/replica:0/task:0/device:GPU:1``,
``/device:GPU:1``, ``GPU:1``, ``/gpu:1`` and ``gpu:1`` (likewise CPU), with the
device type in any case.
"""

from __future__ import annotations

import dataclasses
import functools

DEVICE_TYPES = ("CPU", "GPU")


@dataclasses.dataclass(frozen=True, order=True)
class DeviceName:
    """A parsed device name.

    Example:
        >>> DeviceName.parse("/gpu:1").canonical
        '/job:localhost/replica:0/task:0/device:GPU:1'
        >>> DeviceName.parse("cpu:3").short
        'CPU:3'
    """

    device_type: str
    index: int
    job: str = "localhost"
    replica: int = 0
    task: int = 0

    @property
    def canonical(self) -> str:
        """The full name, ``/job:J/replica:R/task:T/device:TYPE:I``."""
        return (
            f"/job:{self.job}/replica:{self.replica}/task:{self.task}"
            f"/device:{self.device_type}:{self.index}"
        )

    @property
    def short(self) -> str:
        """``TYPE:I``, e.g. ``GPU:0``."""
        return f"{self.device_type}:{self.index}"

    @property
    def keras(self) -> str:
        """The keras.distribution form, ``gpu:0``."""
        return f"{self.device_type.lower()}:{self.index}"

    @classmethod
    def parse(cls, spec: str) -> DeviceName:
        """Parses any accepted form of a device name.

        Raises:
            ValueError: ``spec`` is not a string, is empty, or is not a device name;
                the message repeats it.
        """
        if cls is DeviceName and isinstance(spec, str):
            return _parse_cached(spec)  # a batch names the same few devices for every tensor
        return cls._parse(spec)

    @classmethod
    def _parse(cls, spec: str) -> DeviceName:
        if not isinstance(spec, str):
            raise ValueError(
                f"a device name must be a string such as 'GPU:0'; got {spec!r} "
                f"of type {type(spec).__name__}"
            )
        if not spec.strip():
            raise ValueError("a device name can not be empty; got ''")
        fields: dict[str, object] = {}
        parts = [p for p in spec.strip().split("/") if p]
        for part in parts:
            key, _, rest = part.partition(":")
            low = key.lower()
            if low in ("job", "replica", "task") and rest:
                fields[low] = rest if low == "job" else _int(rest, spec)
            elif (low == "device" or low.upper() in DEVICE_TYPES) and rest:
                if "device_type" in fields:
                    raise ValueError(
                        f"Multiple device types are not allowed while parsing the device spec: {spec!r}."
                    )
                fields.update(_type_index(rest if low == "device" else part, spec))
            else:
                raise ValueError(
                    f"Unknown attribute {part!r} is encountered while parsing the "
                    f"device spec: {spec!r}."
                )
        if "device_type" not in fields:
            raise ValueError(
                f"device name {spec!r} names no device type and index; "
                "expected a form such as 'GPU:0' or '/job:localhost/replica:0/"
                "task:0/device:GPU:0'"
            )
        return cls(**fields)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def _parse_cached(spec: str) -> DeviceName:
    """:meth:`DeviceName.parse` of a string, remembered (names are immutable; errors are not remembered)."""
    return DeviceName._parse(spec)


def _int(text: str, spec: str) -> int:
    if not text.isdigit():
        raise ValueError(f"device name {spec!r}: {text!r} is not a non-negative integer")
    return int(text)


def _type_index(text: str, spec: str) -> dict[str, object]:
    kind, _, index = text.partition(":")
    if kind.upper() not in DEVICE_TYPES:
        raise ValueError(
            f"device name {spec!r}: unknown device type {kind!r}; expected one of "
            f"{', '.join(DEVICE_TYPES)}"
        )
    return {"device_type": kind.upper(), "index": _int(index, spec)}


def canonical(spec: str) -> str:
    """Returns the canonical form of a device name.

    Example:
        >>> canonical("gpu:0")
        '/job:localhost/replica:0/task:0/device:GPU:0'
    """
    return DeviceName.parse(spec).canonical
