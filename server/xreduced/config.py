"""Daemon configuration: each setting resolves argument -> environment -> default.

Every flag ``--some-flag`` has the environment twin ``XREDUCE_SOME_FLAG``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence

DEFAULT_ADDRESS = "127.0.0.1:50551"
"""Where the daemon listens, and the SDK looks, when nothing else is said."""

_MAX_GRPC_MESSAGE = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved daemon settings.

    Example:
        >>> Config().listen
        '127.0.0.1:50551'
    """

    listen: str = DEFAULT_ADDRESS
    backend: str = "auto"
    virtual_devices: int | None = None
    """Logical devices; None means 8 host devices, or one per GPU with cupy."""
    max_message_bytes: int = 1 << 30
    log_level: str = "INFO"
    grace_seconds: float = 10.0
    workers: int = 64
    collective_timeout: float = 300.0
    """Seconds a process waits for the others of its collective, unless its request says less."""


_FLAGS = {
    # flag: (type, help)
    "listen": (str, f"host:port or unix:PATH (port 0 picks a free port); default {DEFAULT_ADDRESS}"),
    "backend": (str, "auto, numpy or cupy; auto picks cupy when it sees a GPU; default auto"),
    "virtual_devices": (int, "logical devices: host devices (default 8), or spread over the GPUs"),
    "max_message_bytes": (int, "largest gRPC message sent or received; default 1073741824 (1 GiB)"),
    "log_level": (str, "DEBUG, INFO, WARNING or ERROR; default INFO"),
    "grace_seconds": (float, "on SIGTERM/SIGINT, how long in-flight calls may finish; default 10"),
    "workers": (int, "threads serving calls (each waiting collective holds one); default 64"),
    "collective_timeout": (float, "seconds a multi-process collective waits for every process; default 300"),
}


def env_name(field: str) -> str:
    """The environment twin of a setting.

    Example:
        >>> env_name("max_message_bytes")
        'XREDUCE_MAX_MESSAGE_BYTES'
    """
    return "XREDUCE_" + field.upper()


def flag_name(field: str) -> str:
    """The command-line flag of a setting, e.g. ``--max-message-bytes``."""
    return "--" + field.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    """The ``xreduced`` argument parser (every default is None: unset)."""
    p = argparse.ArgumentParser(
        prog="xreduced",
        description="The xreduce daemon: cross-device reduction (TF's hierarchical copy "
        "all-reduce) served over gRPC. Every flag has an XREDUCE_* environment twin.",
    )
    for field, (_, help_text) in _FLAGS.items():
        p.add_argument(flag_name(field), dest=field, default=None, metavar=field.upper(),
                       help=f"{help_text} [env {env_name(field)}]")
    return p


def resolve(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Resolves the configuration: argument beats environment beats default.

    Raises:
        ValueError: a setting is malformed; the message names the flag or the
            environment variable the value came from, and the value received.

    Example:
        >>> resolve(["--virtual-devices", "4"], {"XREDUCE_VIRTUAL_DEVICES": "2"}).virtual_devices
        4
    """
    environ = os.environ if environ is None else environ
    args = parser().parse_args(list(argv or []))
    values = {}
    for field, (kind, _) in _FLAGS.items():
        raw = getattr(args, field)
        source = flag_name(field)
        if raw is None and environ.get(env_name(field)):
            raw, source = environ[env_name(field)], env_name(field)
        if raw is None:
            continue
        try:
            values[field] = kind(raw)
        except ValueError:
            raise ValueError(f"{source} must be {kind.__name__}; got {raw!r}") from None
        values[field] = _check(field, values[field], source)
    return Config(**values)


def _check(field: str, value, source: str):
    if field == "backend":
        if value.lower() not in ("auto", "numpy", "cupy"):
            raise ValueError(f"{source} must be auto, numpy or cupy; got {value!r}")
        value = value.lower()
    elif field == "log_level":
        if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"{source} must be DEBUG, INFO, WARNING or ERROR; got {value!r}")
        value = value.upper()
    elif field == "virtual_devices" and value < 1:
        raise ValueError(f"{source} must be >= 1; got {value}")
    elif field == "max_message_bytes" and not 1 <= value <= _MAX_GRPC_MESSAGE:
        raise ValueError(f"{source} must be in [1, {_MAX_GRPC_MESSAGE}] (gRPC's limit); got {value}")
    elif field == "grace_seconds" and not 0 <= value <= 3600:  # also refuses nan and inf
        raise ValueError(f"{source} must be a number of seconds in [0, 3600]; got {value}")
    elif field == "collective_timeout" and not 0 < value <= 86400:
        raise ValueError(f"{source} must be a number of seconds in (0, 86400]; got {value}")
    elif field == "workers" and value < 1:
        raise ValueError(f"{source} must be >= 1; got {value}")
    elif field == "listen" and not value:
        raise ValueError(f"{source} must be host:port or unix:PATH; got {value!r}")
    return value
