"""The ``xreduce`` command: tools around the daemon.

``xreduce plan`` prints the plan the daemon would run, step by step (it runs
``xreduced plan``: the planner is the daemon's);
``xreduce status`` shows a running daemon's devices, limits, counters, memory guards and groups across nodes;
``xreduce bench`` sweeps a collective over sizes, nccl-tests style, against peers.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from xreduce.wire.addresses import check_address
from xreduce.wire.contract import DEFAULT_ADDRESS, METHOD_PREFIX

_PLAN = ("import sys; from xreduced.cli import main; "
         "sys.exit(main(['plan', *sys.argv[1:]], plan_prog='xreduce plan'))")
"""``xreduced plan``, its usage and messages naming ``xreduce plan``: the command the user ran."""


def _plan(argv: Sequence[str]) -> int:
    """``xreduce plan ARGS``: runs ``xreduced plan ARGS`` with this interpreter; returns its exit status."""
    return subprocess.run([sys.executable, "-c", _PLAN, *argv]).returncode


def human_bytes(n: float) -> str:
    """A byte count for people, in binary units.

    Example:
        >>> human_bytes(0), human_bytes(351), human_bytes(1536), human_bytes(1 << 30)
        ('0 B', '351 B', '1.5 KiB', '1 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """An uptime for people.

    Example:
        >>> human_seconds(4.2), human_seconds(134), human_seconds(3725), human_seconds(180000)
        ('4.2s', '2m 14s', '1h 02m', '2d 02h')
    """
    s = int(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _short(name: str) -> str:
    """``CPU:0`` of a canonical device name (the name itself if it has no device part)."""
    return name.rsplit("device:", 1)[-1]


def describe_groups(groups) -> list[str]:
    """``xreduce status``'s lines for the ``GroupStatus`` list of a ``GetStatusResponse``; none without groups.

    Example:
        >>> from xreduce.v1 import xreduce_pb2 as pb
        >>> node = lambda i, host, pid: pb.ClusterNode(index=i, address=host, backend="numpy", processes=[
        ...     pb.ProcessDevices(process_id=pid, devices=["/job:worker/replica:0/task:0/device:CPU:0"])])
        >>> group = pb.GroupStatus(
        ...     group="default@10.0.0.1:1234", epoch=2, state="failed", num_processes=2, node_index=0,
        ...     nodes=[node(0, "10.0.0.1", 0), node(1, "10.0.0.2", 1)], engine="gloo", coordinator=True,
        ...     cross_node_collectives=12, cross_node_bytes=3 << 20, cross_node_seconds=0.25,
        ...     lost=[pb.LostPeer(node_index=1, address="10.0.0.2", process_ids=[1], reason="no heartbeat for 5.0 s")],
        ...     reason="node 1 (10.0.0.2) was lost")
        >>> for line in describe_groups([group]):
        ...     print(line)
        groups across nodes (1)
          default@10.0.0.1:1234  epoch 2  failed
            processes    2 on 2 nodes, this daemon is node 0 (the coordinator)
            engine       gloo
            node 0       10.0.0.1  numpy  process 0 [CPU:0]
            node 1       10.0.0.2  numpy  process 1 [CPU:0]
            cross-node   12 collectives, 3 MiB, 0.25s in the engine
            lost         node 1 at 10.0.0.2, processes [1]: no heartbeat for 5.0 s
            reason       node 1 (10.0.0.2) was lost
        >>> describe_groups([])
        []
    """
    if not groups:
        return []
    lines = [f"groups across nodes ({len(groups)})"]
    for g in groups:
        role = " (the coordinator)" if g.coordinator else ""
        lines += [
            f"  {g.group}  epoch {g.epoch}  {g.state}",
            f"    processes    {g.num_processes} on {len(g.nodes)} nodes, this daemon is node {g.node_index}{role}",
            f"    engine       {g.engine or 'none'}",
        ]
        for n in g.nodes:
            procs = ", ".join(f"{p.process_id} [{', '.join(_short(d) for d in p.devices)}]" for p in n.processes)
            word = "process" if len(n.processes) == 1 else "processes"
            lines.append(f"    {f'node {n.index}':<12} {n.address}  {n.backend}  {word} {procs}".rstrip())
        lines.append(f"    cross-node   {g.cross_node_collectives} collectives, {human_bytes(g.cross_node_bytes)}, "
                     f"{g.cross_node_seconds:.3g}s in the engine")
        for lost in g.lost:
            lines.append(f"    lost         node {lost.node_index} at {lost.address}, processes "
                         f"{list(lost.process_ids)}: {lost.reason}")
        if g.reason:
            lines.append(f"    reason       {g.reason}")
    return lines


def _big_tensors() -> str:
    """This SDK's bound on a job's memory for big tensors (docs/operations.md, "Memory")."""
    from xreduce import _chunks

    per_process = _chunks.PROCESS_OVERHEAD_BYTES
    return (f"chunks of {human_bytes(_chunks.chunk_bytes())}; a job's memory <= 2·P·S + P·{human_bytes(per_process)}"
            f" + {human_bytes(_chunks.DAEMON_OVERHEAD_BYTES)} (P·S with out=)")


def describe_status(status, address: str) -> str:
    """``xreduce status``'s text for a ``GetStatusResponse``."""
    security = ", ".join(
        (["mutual TLS" if status.mutual_tls else "TLS"] if status.tls else ["plaintext"])
        + ["bearer token" if status.token_auth else "no token"])
    lim = status.limits
    lines = [
        f"xreduced {status.version} at {address}, up {human_seconds(status.uptime_seconds)}",
        f"  backend     {status.backend}",
        f"  security    {security}",
        "  local lane  " + (f"{status.local_lane}, {status.local_lane_connections} connection(s), "
                            f"{status.local_lane_calls} call(s)" if status.local_lane else "off"),
        "",
        f"devices ({len(status.devices)})",
    ]
    width = max((len(d.short_name) for d in status.devices), default=0)
    for d in status.devices:
        lines.append(f"  {d.short_name:<{width}}  {human_bytes(d.memory_bytes):>9}  {d.physical_device}")
    lines += [
        "",
        "limits",
        f"  max request bytes    {human_bytes(lim.max_request_bytes)} ({lim.max_request_bytes})",
        f"  max in-flight bytes  {human_bytes(lim.max_inflight_bytes)} ({lim.max_inflight_bytes})",
        "  max mapped bytes     " + (f"{human_bytes(lim.max_mapped_bytes)} ({lim.max_mapped_bytes})"
                                     if lim.max_mapped_bytes else "none"),
        f"  max collectives      {lim.max_collectives}",
        f"  max message bytes    {human_bytes(lim.max_message_bytes)} ({lim.max_message_bytes})",
        f"  collective timeout   {lim.collective_timeout_seconds:g}s",
        f"  workers              {lim.workers}",
        f"  big tensors          {_big_tensors()}",
        "",
        "now",
        f"  in-flight bytes      {human_bytes(status.inflight_bytes)} ({status.inflight_bytes})",
        f"  mapped bytes         {human_bytes(status.mapped_bytes)} ({status.mapped_bytes})",
        f"  collectives waiting  {status.collectives_waiting}",
        f"  oom_score_adj        {status.oom_score_adj}",
        "",
    ]
    groups = describe_groups(status.groups)
    lines += [*groups, ""] if groups else []
    if not status.methods:
        lines.append("calls: none yet")
        return "\n".join(lines)
    rows = []
    for m in status.methods:
        codes = sorted(m.calls_by_code.items(), key=lambda kv: (kv[0] != "OK", kv[0]))
        rows.append((m.method.removeprefix(METHOD_PREFIX).lstrip("/"), str(sum(m.calls_by_code.values())),
                     ", ".join(f"{code} {n}" for code, n in codes), human_bytes(m.bytes_in),
                     human_bytes(m.bytes_out)))
    header = ("calls", "total", "by status", "bytes in", "bytes out")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for i, r in enumerate([header, *rows]):
        indent = "" if i == 0 else "  "
        lines.append(f"{indent + r[0]:<{widths[0] + 2}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  "
                     f"{r[3]:>{widths[3]}}  {r[4]:>{widths[4]}}".rstrip())
    return "\n".join(lines)


CONNECT_TIMEOUT = 2.0
"""Seconds ``xreduce status`` waits for a host that does not answer to take its connection
(``--connect-timeout``); a refused connection fails at once."""

_ONE_TRY = 0.5
"""Seconds of the one call that says why the daemon refused the connection."""


def _connect(client, seconds: float) -> str:
    """How the daemon at ``client.address`` takes a connection (TLS handshake included): ``"ready"``;
    ``"failed"`` as soon as the first attempt fails (refused, no such socket, closed by a TLS daemon);
    ``"silent"`` after ``seconds`` of a host that does not answer."""
    import threading

    import grpc

    settled = threading.Event()
    states: list[grpc.ChannelConnectivity] = []

    def watch(now: grpc.ChannelConnectivity) -> None:
        if now in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            states.append(now)
            settled.set()

    channel = client._get_channel()
    channel.subscribe(watch, try_to_connect=True)
    try:
        settled.wait(seconds)
    finally:
        channel.unsubscribe(watch)
    if not states:
        return "silent"
    return "ready" if states[0] == grpc.ChannelConnectivity.READY else "failed"


def _status(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from xreduce._client import Client
    from xreduce._errors import UnavailableError, XReduceError

    try:
        client = Client(args.address, timeout=args.timeout)
        address = client.address
    except ValueError as e:  # malformed XREDUCE_ADDRESS, or TLS settings
        print(f"xreduce status: {e}", file=sys.stderr)
        return 2
    nobody = (f"xreduce status: no daemon answers at {address} ({{}}); start one there (xreduced --listen "
              f"{address}), or check --address and XREDUCE_ADDRESS")
    with client:
        connection = _connect(client, args.connect_timeout)
        if connection == "silent":
            print(nobody.format(f"no connection within {args.connect_timeout:g}s"), file=sys.stderr)
            return 1
        try:
            # Refused: one short call, whose error says why (a TLS mismatch has its own hint).
            status = client.get_status(timeout=args.timeout if connection == "ready" else _ONE_TRY)
        except (XReduceError, ValueError) as e:
            if connection == "failed" and isinstance(e, UnavailableError) and not e.tls_mismatch:
                print(nobody.format(str(e).removeprefix(f"xreduce daemon at {address} is unavailable: ")),
                      file=sys.stderr)
                return 1
            code = getattr(e, "code", None)
            what = f" ({code.name})" if code is not None else ""
            print(f"xreduce status: cannot get the status of the daemon at {address}{what}: {e}", file=sys.stderr)
            return 1
    if args.json:
        # The proto's own field names (snake_case), as grpcurl prints the same message.
        print(json_format.MessageToJson(status, always_print_fields_with_no_presence=True,
                                        preserving_proto_field_name=True))
    else:
        print(describe_status(status, address))
    return 0


def _bench(argv: list[str]) -> int:
    try:
        from xreduce_bench import command
    except ModuleNotFoundError as e:
        if e.name != "xreduce_bench":
            raise
        print("xreduce bench: the xreduce_bench package is not installed; it comes with xreduce from a checkout "
              "that has bench/ (pip install '.[bench]' there)",
              file=sys.stderr)
        return 2
    return command.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xreduce`` command.

    A reader that stops reading (``xreduce status | head -2``) ends the
    command quietly, with the status of a process killed by SIGPIPE.

    Example (shell):
        $ xreduce plan --devices 8 --num-packs 2 --bytes 1MiB
        $ xreduce status --address 127.0.0.1:50551 --json
        $ xreduce bench --embedded --processes 4 --max-bytes 64MiB --peers --echo
    """
    try:
        status = _command(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, not at exit: a reader that went away shows up inside the try
        return status
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """Quiets stdout after its reader went away; returns the status of a process killed by SIGPIPE.

    Python ignores SIGPIPE, so a write to a closed pipe raises ``BrokenPipeError``
    where a C tool would end silently; the interpreter would raise it once more
    when it flushes stdout at exit, unless stdout points at ``/dev/null``.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _command(argv: Sequence[str]) -> int:
    if list(argv[:1]) == ["plan"]:  # every argument after it is xreduced plan's
        return _plan(argv[1:])
    p = argparse.ArgumentParser(prog="xreduce", description="xreduce tools")
    sub = p.add_subparsers(dest="command", required=True)
    # Listed for --help only: main hands `plan` and its arguments to `xreduced plan` before parsing.
    sub.add_parser("plan", help="print the reduction plan the daemon would run for a value, step by step, and exit "
                   "(runs `xreduced plan`; see `xreduce plan --help`)", add_help=False)
    status = sub.add_parser(
        "status", help="show a running daemon's devices, limits, counters and groups across nodes",
        description="Shows a running daemon's devices, limits, counters and groups across nodes (its "
        "GetStatus). The daemon is "
        f"--address, else XREDUCE_ADDRESS, else {DEFAULT_ADDRESS}; the token comes from XREDUCE_TOKEN and TLS "
        "from the XREDUCE_TLS_* variables, as for the SDK. Exits 1 when the daemon cannot be reached (a refused "
        "connection at once, a host that does not answer after --connect-timeout), 2 for a malformed address.")
    status.add_argument("--address", default=None, help="host:port or unix:PATH of the daemon")
    status.add_argument("--json", action="store_true", help="print the GetStatusResponse as JSON")
    status.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT,
                        help="seconds to wait for a host that does not answer to take the connection (a refused "
                        f"one fails at once; default {CONNECT_TIMEOUT:g})")
    status.add_argument("--timeout", type=float, default=10.0,
                        help="seconds the daemon has to answer, once connected (default 10)")
    # `xreduce bench` lives in the xreduce_bench package: its options are parsed there, and the SDK
    # imports it only when the command runs.
    sub.add_parser("bench", add_help=False,
                   help="sweep a collective over sizes, nccl-tests style, against gloo and MPI")
    args, rest = p.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    for name in ("timeout", "connect_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}")
    if args.address is not None:
        try:
            check_address(args.address, "--address")
        except ValueError as e:
            p.error(str(e))
    return _status(args)


if __name__ == "__main__":
    raise SystemExit(main())
