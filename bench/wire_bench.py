"""Large payloads over the wire: ReduceStream against BatchReduce and a raw gRPC echo, in one run.

Three paths move the same payload of ``--bytes`` N over the same transport
(a unix socket, or loopback TCP with ``--tcp``), each client channel with the
SDK's options (``xreduce._client.CHANNEL_OPTIONS``):

* ``echo``: a raw grpcio unary echo of N bytes (a generic bytes handler in a
  server process of its own, with the daemon's message limits): the floor for
  moving N bytes there and back with grpcio;
* ``BatchReduce``: the daemon's BatchReduce of 8 replicas x N/8 float32 (N
  bytes of request), all-reduce SUM, from numpy arrays (encoded as the SDK
  does) to numpy arrays (every result component decoded);
* ``ReduceStream``: the same reduction through the SDK's
  ``stream_batch_reduce``, once per ``--chunk-bytes``.

Each path runs once untimed, then ``--repeat`` rounds of one timed run of each
path in turn, so a change in the machine's load touches every path alike; the
table shows the median seconds and the ratio to the echo. Every streamed result is checked
bit-exactly against BatchReduce's. The daemons are real ``xreduced``
processes (numpy backend, 8 host devices), one per path, so each reports its
own peak RSS (VmHWM).

``--stream-only`` times ReduceStream alone, for payloads no unary call can
carry (over gRPC's 2 GiB message limit). ``--crossover`` instead times BatchReduce and ReduceStream over a ladder of
sizes and prints the smallest size from which streaming wins: what
``xreduce._streaming.STREAM_THRESHOLD_BYTES`` should be.

Usage:
    .venv/bin/python bench/wire_bench.py [--bytes 64MiB] [--repeat 5] [--tcp]
        [--chunk-bytes 1MiB [2MiB ...]] [--channel-option grpc.KEY=INT ...] [--stream-only] [--crossover]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import numpy as np
from xreduce import _client
from xreduce._client import Client
from xreduce._streaming import stream_batch_reduce
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.framing import DEFAULT_CHUNK_BYTES, streamed_tensor
from xreduce_bench.daemon import DaemonProcess
from xreduced.cli import parse_bytes

REPLICAS = 8
"""Replicas of the payload (and the daemons' host devices); ``--replicas`` changes it."""
ECHO_METHOD = "/bench.Echo/Echo"
SERVER_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
"""The daemon's default message limits (--max-message-bytes 1 GiB)."""



def parse_option(text: str) -> tuple[str, int]:
    """``'grpc.KEY=123'`` -> ``('grpc.KEY', 123)``.

    Example:
        >>> parse_option("grpc.http2.bdp_probe=0")
        ('grpc.http2.bdp_probe', 0)
    """
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("grpc.") or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"not a channel option: {text!r} (try grpc.http2.bdp_probe=0)")
    return key, int(value)


def mib(n: float) -> str:
    return f"{n / (1 << 20):.4g}"


def serve_echo(address: str) -> None:
    """Runs the echo server until stdin closes (the bench's child process)."""
    server = grpc.server(futures.ThreadPoolExecutor(4), options=SERVER_OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),))
    port = server.add_insecure_port(address)
    server.start()
    print(f"listening {port}", flush=True)
    sys.stdin.read()
    server.stop(0)


class EchoProcess:
    """The echo server in a child process; ``address`` is where it listens."""

    def __init__(self, address: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-echo", address], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening"):
            self.stop()
            raise RuntimeError(f"the echo server did not start: {line!r}")
        port = line.split()[1]
        self.address = address if address.startswith("unix:") else f"127.0.0.1:{port}"

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def replicas(nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.random(nbytes // REPLICAS // 4, dtype=np.float32) for _ in range(REPLICAS)]


def batch_reduce(client: Client, arrays: list[np.ndarray]) -> list[np.ndarray]:
    request = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=pb.DistributedValue(
        components=[pb.Component(device=f"CPU:{i}", tensor=codec.encode(a)) for i, a in enumerate(arrays)]))])
    reply = client.batch_reduce(request)
    return [codec.decode(c.tensor) for c in reply.results[0].result.components]


def stream_reduce(client: Client, arrays: list[np.ndarray], chunk_bytes: int) -> list[np.ndarray]:
    header = pb.BatchReduceRequest(reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=pb.DistributedValue(
        components=[pb.Component(device=f"CPU:{i}", tensor=streamed_tensor(a)) for i, a in enumerate(arrays)]))])
    [(_, results)] = stream_batch_reduce(client, header, [arrays], chunk_bytes=chunk_bytes)
    return [a for _, a in results]


def timed(fn, repeat: int) -> tuple[float, object]:
    out = fn()  # untimed: connections, caches, the daemon's first allocation
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def start_daemon(address: str) -> DaemonProcess:
    return DaemonProcess(["--listen", address, "--backend", "numpy", "--virtual-devices", str(REPLICAS)])


def interleaved(paths: dict[str, object], repeat: int) -> tuple[dict[str, float], dict[str, object]]:
    """Runs every path once untimed, then ``repeat`` rounds of one timed run of each in turn
    (so a change in the machine's load touches every path alike); the medians and last outputs."""
    outputs = {name: fn() for name, fn in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def compare(args, tmp: str) -> int:
    n = args.bytes
    addr = (lambda name: f"unix:{tmp}/{name}.sock") if not args.tcp else (lambda name: "127.0.0.1:0")
    arrays = replicas(n)
    with contextlib.ExitStack() as stack:
        paths, servers, sizes = {}, {}, {}
        if not args.stream_only:
            payload = b"".join(a.tobytes() for a in arrays)
            echo = EchoProcess(addr("echo"))
            stack.callback(echo.stop)
            channel = stack.enter_context(grpc.insecure_channel(echo.address,
                                                                options=list(_client.CHANNEL_OPTIONS)))
            paths["echo (raw grpcio unary)"] = functools.partial(channel.unary_unary(ECHO_METHOD), payload,
                                                                 timeout=600)
            servers["echo (raw grpcio unary)"], sizes["echo (raw grpcio unary)"] = echo.proc.pid, n
            daemon = start_daemon(addr("batch"))
            stack.callback(daemon.terminate)
            client = stack.enter_context(Client(daemon.address))
            paths["BatchReduce"] = functools.partial(batch_reduce, client, arrays)
            servers["BatchReduce"], sizes["BatchReduce"] = daemon.proc.pid, n
        for chunk in args.chunk_bytes:
            name = f"ReduceStream, {mib(chunk)} MiB chunks"
            daemon = start_daemon(addr(f"stream{chunk}"))
            stack.callback(daemon.terminate)
            client = stack.enter_context(Client(daemon.address))
            paths[name] = functools.partial(stream_reduce, client, arrays, chunk)
            servers[name], sizes[name] = daemon.proc.pid, n // REPLICAS
        medians, outputs = interleaved(paths, args.repeat)
        rss = {name: peak_rss_mib(pid) for name, pid in servers.items()}
    wrong = 0
    if not args.stream_only:
        assert outputs["echo (raw grpcio unary)"] == payload
        expected = outputs["BatchReduce"]
        for name in paths:
            if name.startswith("ReduceStream"):
                wrong += sum(int(np.count_nonzero(g.view(np.uint32) != e.view(np.uint32)))
                             for g, e in zip(outputs[name], expected))
    transport = "loopback TCP" if args.tcp else "unix socket"
    print(f"{mib(n)} MiB payload ({REPLICAS} replicas x {mib(n // REPLICAS)} MiB float32, SUM all-reduce) over a "
          f"{transport}; median of {args.repeat} interleaved runs after one warm-up")
    if args.channel_option:
        print("extra channel options: " + ", ".join(f"{k}={v}" for k, v in args.channel_option))
    print(f"{'path':<32}{'sent(MiB)':>10}{'recv(MiB)':>10}{'median(s)':>11}{'vs echo':>9}{'server peak RSS(MiB)':>22}")
    echo_s = None if args.stream_only else medians["echo (raw grpcio unary)"]
    for name, seconds in medians.items():
        ratio = "-" if echo_s is None else f"{seconds / echo_s:.2f}"
        print(f"{name:<32}{mib(n):>10}{mib(sizes[name]):>10}{seconds:>11.3f}{ratio:>9}{rss[name]:>22.0f}")
    if not args.stream_only:
        print(f"#wrong (streamed results that differ bit-wise from BatchReduce's): {wrong}")
    return 1 if wrong else 0


def crossover(args, tmp: str) -> int:
    address = f"unix:{tmp}/d.sock" if not args.tcp else "127.0.0.1:0"
    daemon = start_daemon(address)
    chunk = args.chunk_bytes[0]
    first_win = None
    print(f"{'size':>10}{'BatchReduce(s)':>16}{'ReduceStream(s)':>17}{'stream/batch':>14}")
    try:
        with Client(daemon.address) as client:
            size = 64 << 10
            while size <= args.bytes:
                arrays = replicas(size)
                batch_s, _ = timed(functools.partial(batch_reduce, client, arrays), args.repeat)
                stream_s, _ = timed(functools.partial(stream_reduce, client, arrays, chunk), args.repeat)
                print(f"{mib(size) + ' MiB':>10}{batch_s:>16.4f}{stream_s:>17.4f}{stream_s / batch_s:>14.2f}")
                if stream_s < batch_s and first_win is None:
                    first_win = size
                elif stream_s >= batch_s:
                    first_win = None
                size *= 2
    finally:
        daemon.terminate()
    print(f"streaming wins from {mib(first_win)} MiB on" if first_win else "streaming never won at every larger size")
    return 0


def main(argv: list[str] | None = None) -> int:
    global REPLICAS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=parse_bytes, default=64 << 20, help="payload N; default 64MiB")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per path; default 5")
    p.add_argument("--replicas", type=int, default=REPLICAS, help=f"replicas (>= 2); default {REPLICAS}")
    p.add_argument("--tcp", action="store_true", help="loopback TCP instead of a unix socket")
    p.add_argument("--chunk-bytes", type=parse_bytes, nargs="+", default=[DEFAULT_CHUNK_BYTES],
                   help=f"ReduceStream chunk sizes to time; default {DEFAULT_CHUNK_BYTES}")
    p.add_argument("--channel-option", type=parse_option, action="append", default=[],
                   help="an extra integer option of every client channel, e.g. grpc.http2.bdp_probe=0")
    p.add_argument("--crossover", action="store_true", help="find the size from which streaming wins")
    p.add_argument("--stream-only", action="store_true",
                   help="time ReduceStream alone (payloads over gRPC's 2 GiB message limit)")
    p.add_argument("--serve-echo", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    REPLICAS = args.replicas
    if args.serve_echo:
        serve_echo(args.serve_echo)
        return 0
    # The SDK's client reads CHANNEL_OPTIONS when it opens its channel: extra options reach every path.
    _client.CHANNEL_OPTIONS = (*_client.CHANNEL_OPTIONS, *args.channel_option)
    with tempfile.TemporaryDirectory(prefix="wire-bench-") as tmp:
        os.chmod(tmp, 0o700)
        return crossover(args, tmp) if args.crossover else compare(args, tmp)


if __name__ == "__main__":
    sys.exit(main())
