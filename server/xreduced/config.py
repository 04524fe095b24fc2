"""Daemon configuration: each setting resolves argument -> environment -> default.

Every flag ``--some-flag`` has the environment twin ``XREDUCE_SOME_FLAG``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

from xreduce.wire.addresses import check_address, check_host
from xreduce.wire.contract import DEFAULT_ADDRESS

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
    collective_timeout: float = 60.0
    """Seconds a process waits for the others of its collective, unless its request says otherwise: a
    minute, what a person at a terminal waits for a partner that never started (docs/operations.md)."""
    stall_warning_seconds: float = 10.0
    """Seconds a collective waits before the daemon logs who is missing (``event=collective_waiting``);
    0: never. The SDK reads the same variable for its own warning."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """With it, clients must present a certificate signed by this CA (mutual TLS)."""
    auth_token_file: str | None = None
    """A file holding the bearer token every call must carry."""
    auth_health: bool = False
    """Whether health and reflection need the token too."""
    socket_group: str | None = None
    """A unix socket is created mode 0600; with a group it is 0660 and owned by that group."""
    max_request_bytes: int = 1 << 30
    max_inflight_bytes: int = 4 << 30
    max_collectives: int = 1024
    max_mapped_bytes: int | None = None
    """Bytes of the clients' shared memory the daemon maps at once, over every session (:mod:`xreduced.oom`);
    None: half the node's memory, the smaller of MemTotal and the cgroup's limit."""
    oom_score_adj: int = -900
    """The ``oom_score_adj`` the ``xreduced`` command sets for its process at start, so that the kernel's OOM
    killer picks a training process first (an embedded daemon leaves its process's own)."""
    metrics_listen: str | None = None
    """host:port for Prometheus metrics; None: no metrics endpoint."""
    node_address: str | None = None
    """Where the other nodes of a group reach this node's engines; Gloo binds only to it, NCCL only to its
    interface. None: this machine's address on the route to the group's coordinator."""
    peer_timeout: float = 5.0
    """Seconds a node of a group may be silent (no heartbeat, no engine progress) before it is lost; a lost
    node fails every collective of its group within twice this."""
    heartbeat_interval: float = 1.0
    """Seconds between a node daemon's heartbeats to the coordinator of each group it is in."""
    local_lane: bool = True
    """Whether processes on this host may send small collectives over the local lane (a unix socket beside
    gRPC, :mod:`xreduced.lane`) instead of gRPC calls."""
    lane_express_hold: float = 0.5
    """Seconds a local-lane call of a request shape validated before may wait in the express lane (its thread
    matches and reduces such small collectives itself, :mod:`xreduced.express`) for the rest of its collective
    before the full call path takes it; 0: no express lane."""


_FLAGS = {
    # flag: (type, help)
    "listen": (str, f"host:port (port 0..65535; 0 picks a free port) or unix:PATH; default {DEFAULT_ADDRESS}"),
    "backend": (str, "auto, numpy or cupy; auto picks cupy when it sees a GPU; default auto"),
    "virtual_devices": (int, "logical devices: host devices (default 8), or spread over the GPUs"),
    "max_message_bytes": (int, "largest gRPC message sent or received; default 1073741824 (1 GiB)"),
    "log_level": (str, "DEBUG, INFO, WARNING or ERROR; default INFO"),
    "grace_seconds": (float, "on SIGTERM/SIGINT, how long in-flight calls may finish; default 10"),
    "workers": (int, "threads serving calls (each waiting collective holds one); default 64"),
    "collective_timeout": (float, "seconds a multi-process collective waits for every process; default 60"),
    "stall_warning_seconds": (float, "seconds a collective waits before the log names who is missing "
                              "(event=collective_waiting), then at gaps growing to 30 s; 0: never; default 10"),
    "tls_cert": (str, "PEM certificate chain: serve TLS (with --tls-key)"),
    "tls_key": (str, "PEM private key of --tls-cert"),
    "tls_client_ca": (str, "PEM CA bundle: require client certificates signed by it (mutual TLS)"),
    "auth_token_file": (str, "file holding the bearer token every call must carry (authorization: Bearer ...)"),
    "auth_health": ("bool", "true: health and reflection need the token too; default false"),
    "socket_group": (str, "unix socket: grant this group access (mode 0660) instead of 0600"),
    "max_request_bytes": (int, "largest request accepted, in bytes; default 1073741824 (1 GiB)"),
    "max_inflight_bytes": (int, "bytes of requests being served at once, at most; default 4294967296 (4 GiB)"),
    "max_collectives": (int, "multi-process collectives waiting at once, at most; default 1024"),
    "max_mapped_bytes": ("bytes", "bytes of the clients' shared memory mapped at once (host regions of every "
                         "session; a region over it is refused), e.g. 8GiB; default: half the node's memory, "
                         "the smaller of MemTotal and the cgroup's memory limit"),
    "oom_score_adj": (int, "the daemon's own oom_score_adj, -1000..1000, set at start (lowering it needs "
                      "CAP_SYS_RESOURCE; without it a warning, and the daemon serves anyway); default -900"),
    "metrics_listen": (str, "host:port to serve Prometheus metrics on; default off"),
    "node_address": (str, "groups across nodes: this node's address (an IP address or a host name, no port) as "
                     "the other nodes reach it; the engines bind only to it (Gloo) or its interface (NCCL); "
                     "default: the address on the route to the coordinator"),
    "peer_timeout": (float, "groups across nodes: seconds a silent node is lost after; collectives fail "
                     "within twice this; default 5"),
    "heartbeat_interval": (float, "groups across nodes: seconds between heartbeats to the coordinator; "
                           "default 1"),
    "local_lane": ("bool", "true: processes on this host send small Reduce/BatchReduce/Broadcast calls over a "
                   "unix socket beside gRPC (the local lane), served the same way; default true"),
    "lane_express_hold": (float, "seconds a local-lane call of a request shape validated before waits in the "
                          "express lane (matched and reduced by the lane's thread, skipping the full call path) for "
                          "the rest of its collective before the full path takes it; 0: no express lane; default 0.5"),
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
        usage="%(prog)s [-h] [--FLAG VALUE ...]\n       %(prog)s plan [-h] [OPTIONS]",
        description="The xreduce daemon: cross-device reduction (TF's hierarchical copy "
        "all-reduce) served over gRPC. Every flag has an XREDUCE_* environment twin.",
        epilog="Without a command the daemon serves until SIGINT or SIGTERM. `xreduced plan --help`: the plan's "
        "options.",
    )
    # Listed for --help only: xreduced.cli.main hands `plan` and its arguments to the planner before parsing.
    commands = p.add_subparsers(dest="command", title="commands", metavar="{plan}")
    commands.add_parser("plan", add_help=False, help=PLAN_HELP)
    for field, (_, help_text) in _FLAGS.items():
        p.add_argument(flag_name(field), dest=field, default=None, metavar=field.upper(),
                       help=f"{help_text} [env {env_name(field)}]")
    return p


PLAN_HELP = "print the reduction plan the daemon would run for a value, step by step, and exit"
"""What ``xreduced plan`` does, in the commands' help (``xreduced --help``, ``xreduce --help``)."""


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
    p = parser()
    args = p.parse_args(list(argv or []))
    if args.command is not None:
        p.error(f"{args.command} goes first, before any flag: xreduced {args.command} [OPTIONS]")
    values = {}
    for field, (kind, _) in _FLAGS.items():
        raw = getattr(args, field)
        source = flag_name(field)
        if raw is None and environ.get(env_name(field)):
            raw, source = environ[env_name(field)], env_name(field)
        if raw is None:
            continue
        if kind == "bool":
            if raw.lower() not in _BOOLS:
                raise ValueError(f"{source} must be true or false; got {raw!r}")
            values[field] = _BOOLS[raw.lower()]
            continue
        if kind == "bytes":
            try:
                values[field] = _check(field, parse_bytes(raw), source)
            except argparse.ArgumentTypeError:
                raise ValueError(f"{source} must be a size in bytes (examples: 8589934592, 8GiB, 512MiB); "
                                 f"got {raw!r}") from None
            continue
        try:
            values[field] = kind(raw)
        except ValueError:
            raise ValueError(f"{source} must be {kind.__name__}; got {raw!r}") from None
        values[field] = _check(field, values[field], source)
    return Config(**values)


def check(config: Config) -> Config:
    """Checks settings that only make sense together.

    Raises:
        ValueError: naming the flags.

    Example:
        >>> check(Config(tls_cert="server.pem"))
        Traceback (most recent call last):
        ...
        ValueError: --tls-cert and --tls-key go together; got only --tls-cert
    """
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together; got only "
                         + ("--tls-cert" if config.tls_cert else "--tls-key"))
    if config.tls_client_ca and not config.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    if config.heartbeat_interval >= config.peer_timeout:
        raise ValueError(f"--heartbeat-interval ({config.heartbeat_interval}) must be shorter than --peer-timeout "
                         f"({config.peer_timeout}): a node would be lost between two heartbeats")
    return config


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parses a size such as ``1MiB``, ``4096`` or ``2 GB``.

    Raises:
        argparse.ArgumentTypeError: not a size; the message repeats it.

    Example:
        >>> parse_bytes("1MiB"), parse_bytes("4KiB")
        (1048576, 4096)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64KiB, 1MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


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
    elif field in ("peer_timeout", "heartbeat_interval") and not 0 < value <= 3600:
        raise ValueError(f"{source} must be a number of seconds in (0, 3600]; got {value}")
    elif field == "lane_express_hold" and not 0 <= value <= 60:
        raise ValueError(f"{source} must be a number of seconds in [0, 60] (0: no express lane); got {value}")
    elif field == "stall_warning_seconds" and not 0 <= value <= 86400:
        raise ValueError(f"{source} must be a number of seconds in [0, 86400] (0: never); got {value}")
    elif field in ("max_request_bytes", "max_inflight_bytes", "max_collectives", "max_mapped_bytes") and value < 1:
        raise ValueError(f"{source} must be >= 1; got {value}")
    elif field in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "socket_group",
                   "metrics_listen", "node_address") and not value:
        raise ValueError(f"{source} must not be empty; got {value!r}")
    elif field == "oom_score_adj" and not -1000 <= value <= 1000:
        raise ValueError(f"{source} must be an integer in [-1000, 1000] (the kernel's range for oom_score_adj); "
                         f"got {value}")
    elif field == "workers" and value < 1:
        raise ValueError(f"{source} must be >= 1; got {value}")
    elif field == "listen":
        check_address(value, source, listen=True)
    elif field == "node_address":
        check_host(value, source)
    return value
