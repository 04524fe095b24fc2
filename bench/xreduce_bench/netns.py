"""Several "nodes" on one machine: network namespaces joined by a bridge, as hosts on one switch.

:class:`Nodes` makes ``count`` namespaces, node k at ``10.0.0.k/24`` on its
interface ``eth0``, each wired by a veth pair to a bridge that lives in a
namespace of its own (the switch). Every link can be shaped with ``tc tbf``
in both directions (the node's egress and the switch port's egress: tbf
shapes egress only), and cut: :meth:`Nodes.cut` takes the switch-side port
down, so the node's packets are dropped silently, the hard case of a
partition (a node whose own link is down fails fast instead).

What runs inside a node is started with :meth:`Node.popen`/:meth:`Node.run`
(``ip netns exec``), or, for ``multiprocessing``, with :attr:`Nodes.python`
as the spawn executable and :meth:`Node.env` in the child's environment.
There, node k is also called ``nodek``: ``ip netns exec`` mounts the node's
``/etc/netns/NAME/hosts`` over ``/etc/hosts``, so names resolve both ways
without a DNS server (torch's store looks its peers up).

Names: interface names are global until they move into a namespace and at
most 15 characters, so every run draws a token; its namespaces are named
``xrn-<pid>-<token>-sw`` and ``xrn-<pid>-<token>-n<k>`` and its veth ends
``xrn<token>a<k>``/``xrn<token>b<k>`` until they move. :func:`sweep_leftovers`
removes what a run whose process is gone left behind (a killed test), and
every :class:`Nodes` calls it before it starts.

Needs root and iproute2's ``ip`` (and ``tc`` to shape); tests call
:func:`namespaces_unavailable` to skip with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

PREFIX = "xrn"
"""What every namespace and interface a run makes starts with (:func:`sweep_leftovers` looks for it)."""
NETNS_ENV = "XREDUCE_NETNS"
"""The variable that tells :attr:`Nodes.python` which namespace to run the interpreter in."""
INTERFACE = "eth0"
"""Every node's interface to the switch, inside its namespace."""
MAX_NODES = 253
ETC_NETNS = "/etc/netns"
"""Where ``ip netns exec`` finds the files it mounts over ``/etc`` inside a namespace."""

_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-(sw|n\d+)$")
_VETH = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})[ab]\d+$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_COMMAND_TIMEOUT = 30.0
"""Seconds one ``ip``/``tc`` command may take."""


class NodesError(RuntimeError):
    """Making, changing or removing the nodes failed; the message names the command and its output.

    Example:
        >>> str(NodesError("ip netns add x: File exists"))
        'ip netns add x: File exists'
    """


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate (``1gbit``, ``100mbit``, ``125mbps``: decimal units as tc reads them).

    Raises:
        ValueError: naming ``shape`` and the value, when it is no rate tc reads this way.

    Example:
        >>> parse_rate("1gbit"), parse_rate("125mbps"), parse_rate("2.5Gbit")
        (1000000000.0, 1000000000.0, 2500000000.0)
        >>> parse_rate("fast")
        Traceback (most recent call last):
        ...
        ValueError: shape must be a tc rate such as 1gbit, 100mbit or 125mbps; got 'fast'
    """
    m = _RATE.match(rate.strip()) if isinstance(rate, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"shape must be a tc rate such as 1gbit, 100mbit or 125mbps; got {rate!r}")
    return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]


@functools.lru_cache(maxsize=1)
def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (checked once, by making one).

    Example:
        >>> reason = namespaces_unavailable()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"making network namespaces needs root; running as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not on PATH"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-n0"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run(["ip", "netns", "delete", probe], check=False)
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NodesError(f"`{shlex.join(argv)}` did not finish within {_COMMAND_TIMEOUT:g}s") from None
    if check and done.returncode != 0:
        raise NodesError(f"`{shlex.join(argv)}` failed (status {done.returncode}): {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    """The names ``ip netns list`` shows (each line is ``NAME`` or ``NAME (id: N)``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _root_links() -> list[str]:
    """The interfaces of this namespace (``ip -o link`` writes a veth as ``NAME@PEER``)."""
    lines = _run(["ip", "-o", "link", "show"]).stdout.splitlines()
    return [line.split(": ")[1].split("@")[0] for line in lines if ": " in line]


def _kill_inside(namespace: str) -> None:
    """SIGKILLs every process still in ``namespace`` (all of them started by the run that made it)."""
    pids = _run(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remaining(token: str) -> list[str]:
    """The namespaces and interfaces of the run with ``token`` that still exist (after its close: none).

    Example:
        >>> remaining("000000")
        []
    """
    if namespaces_unavailable() is not None:
        return []
    names = [n for n in _namespaces() if (m := _NAMESPACE.match(n)) and m.group(2) == token]
    names += [os.path.join(ETC_NETNS, n) for n in _etc_dirs() if _NAMESPACE.match(n).group(2) == token]
    return names + [n for n in _root_links() if (m := _VETH.match(n)) and m.group(1) == token]


def _etc_dirs() -> list[str]:
    try:
        return sorted(n for n in os.listdir(ETC_NETNS) if _NAMESPACE.match(n))
    except FileNotFoundError:
        return []


def sweep_leftovers() -> list[str]:
    """Removes the namespaces and interfaces of runs whose process has exited; returns their names.

    A run is recognised by :data:`PREFIX` and the process id in its names;
    the namespaces of a live process (another run going on now) are left alone.

    Example:
        >>> isinstance(sweep_leftovers(), list)
        True
    """
    if namespaces_unavailable() is not None:
        return []
    removed, live_tokens = [], set()
    for name in _namespaces():
        m = _NAMESPACE.match(name)
        if m is None:
            continue
        if _alive(int(m.group(1))):
            live_tokens.add(m.group(2))
            continue
        _kill_inside(name)
        if _run(["ip", "netns", "delete", name], check=False).returncode == 0:
            removed.append(name)
    for name in _etc_dirs():
        if not _alive(int(_NAMESPACE.match(name).group(1))):
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
            removed.append(os.path.join(ETC_NETNS, name))
    for link in _root_links():
        m = _VETH.match(link)
        if m and m.group(1) not in live_tokens and _run(["ip", "link", "delete", link], check=False).returncode == 0:
            removed.append(link)
    return removed


class Node:
    """One node: a network namespace with ``address`` on its :data:`INTERFACE`.

    Made by :class:`Nodes`; ``index`` counts from 1 (node k is ``10.0.0.k``).

    Example:
        >>> Node(1, "xrn-1-abcdef-n1", "10.0.0.1", "p1", []).command(["hostname", "-I"])
        ['ip', 'netns', 'exec', 'xrn-1-abcdef-n1', 'hostname', '-I']
    """

    def __init__(self, index: int, namespace: str, address: str, port: str, started: list[subprocess.Popen]):
        self.index, self.namespace, self.address = index, namespace, address
        self.interface = INTERFACE
        self.port = port
        """The switch-side end of this node's link (in the switch's namespace)."""
        self._started = started

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.namespace!r}, {self.address!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs inside this node."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def env(self) -> dict[str, str]:
        """What a child started with :attr:`Nodes.python` needs in its environment to run in this node."""
        return {NETNS_ENV: self.namespace}

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside this node; the nodes' teardown stops it if it still runs."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self._started.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside this node, bounded by ``timeout`` seconds."""
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)


class Nodes:
    """``count`` nodes on one switch; a context manager that removes everything it made on exit.

    Args:
        count: how many nodes (1 to 253).
        shape: a ``tc`` rate (``1gbit``) for every link, in both directions; None: unshaped.
        subnet: the first three octets of the nodes' /24 (node k is ``SUBNET.k``).

    Raises:
        ValueError: naming the argument and the value.
        NodesError: when a command fails (the nodes made so far are removed).

    Example (as root; elsewhere it prints what it would):
        >>> if namespaces_unavailable() is None:
        ...     with Nodes(2) as nodes:
        ...         shown = nodes[2].run(["ip", "-br", "-4", "addr", "show", "eth0"], capture_output=True, text=True)
        ...     print(shown.stdout.split()[2])
        ... else:
        ...     print("10.0.0.2/24")
        10.0.0.2/24
    """

    def __init__(self, count: int, shape: str | None = None, subnet: str = "10.0.0"):
        if not isinstance(count, int) or not 1 <= count <= MAX_NODES:
            raise ValueError(f"count must be an integer in [1, {MAX_NODES}]; got {count!r}")
        self._rate = None if shape is None else parse_rate(shape)
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or any(
                int(o) > 255 for o in subnet.split(".")):
            raise ValueError(f"subnet must be three octets such as 10.0.0; got {subnet!r}")
        self.count, self.shape, self.subnet = count, shape, subnet
        self.token = secrets.token_hex(3)
        self.switch = f"{PREFIX}-{os.getpid()}-{self.token}-sw"
        self.nodes: list[Node] = []
        self._started: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._tmp: str | None = None
        self.python = ""
        """A script that runs this interpreter inside the namespace named by :data:`NETNS_ENV`."""

    def __getitem__(self, index: int) -> Node:
        """Node ``index``, counting from 1 as the addresses do."""
        if not 1 <= index <= len(self.nodes):
            raise IndexError(f"node index must be in [1, {len(self.nodes)}]; got {index}")
        return self.nodes[index - 1]

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def rate(self) -> float | None:
        """Every link's rate in bits per second, or None when unshaped."""
        return self._rate

    def start(self) -> Nodes:
        """Makes the switch and the nodes; on failure removes what it made and raises NodesError."""
        reason = namespaces_unavailable()
        if reason is not None:
            raise NodesError(f"cannot make network namespaces: {reason}")
        if self.shape is not None and shutil.which("tc") is None:
            raise NodesError(f"shape={self.shape!r} needs the tc command (iproute2), which is not on PATH")
        sweep_leftovers()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix=f"{PREFIX}-{self.token}-")
        self.python = os.path.join(self._tmp, "python-in-node")
        with open(self.python, "w") as f:
            f.write(f'#!/bin/sh\nexec ip netns exec "${NETNS_ENV}" {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(self.python, stat.S_IRWXU)
        names = [self.switch] + [f"{PREFIX}-{os.getpid()}-{self.token}-n{k}" for k in range(1, self.count + 1)]
        for name in names:  # every namespace first: a sweep tells a live run's veths by them
            _run(["ip", "netns", "add", name])
            self._made.append(name)
        # IPv4-mapped lines too: torch's store listens on IPv6 and looks its clients up in that form
        hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(
            f"{self.subnet}.{k}\tnode{k}\n::ffff:{self.subnet}.{k}\tnode{k}\n" for k in range(1, self.count + 1))
        for name in names[1:]:
            os.makedirs(os.path.join(ETC_NETNS, name))
            with open(os.path.join(ETC_NETNS, name, "hosts"), "w") as f:
                f.write(hosts)
        sw = self.switch
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for k, namespace in enumerate(names[1:], start=1):
            node_end, switch_end = f"{PREFIX}{self.token}a{k}", f"{PREFIX}{self.token}b{k}"
            port = f"p{k}"
            _run(["ip", "link", "add", node_end, "type", "veth", "peer", "name", switch_end])
            _run(["ip", "link", "set", node_end, "netns", namespace, "name", INTERFACE])
            _run(["ip", "link", "set", switch_end, "netns", sw, "name", port])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            address = f"{self.subnet}.{k}"
            _run(["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE])
            _run(["ip", "-n", namespace, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
            if self.shape is not None:
                for where, device in ((namespace, INTERFACE), (sw, port)):
                    _run(["tc", "-n", where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", self.shape,
                          "burst", str(self._burst()), "latency", "50ms"])
            self.nodes.append(Node(k, namespace, address, port, self._started))

    def _burst(self) -> int:
        """tbf's bucket in bytes: 2 ms at the rate, at least 256 KiB (what a 1gbit link needed here)."""
        return max(256 << 10, int(self._rate / 8 / 500))

    def cut(self, node: Node) -> None:
        """Takes ``node``'s switch port down: its packets, both ways, are dropped silently."""
        _run(["ip", "-n", self.switch, "link", "set", node.port, "down"])

    def restore(self, node: Node) -> None:
        """Brings ``node``'s switch port back up (the bridge forwards at once: no STP)."""
        _run(["ip", "-n", self.switch, "link", "set", node.port, "up"])

    def close(self, grace: float = 5.0) -> None:
        """Removes everything this run made; safe to call twice.

        Order: processes started with :meth:`Node.popen` get SIGTERM and
        ``grace`` seconds, then SIGKILL; whatever else still runs inside a
        node (their children) is SIGKILLed, since a namespace lives on while
        a process is in it; then the namespaces go (deleting a namespace
        deletes the veth ends in it, and their peers with them), and their
        files under :data:`ETC_NETNS`.

        Raises:
            NodesError: naming what could not be removed.
        """
        for proc in self._started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._started:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._started.clear()
        failed = []
        for name in reversed(self._made):
            _kill_inside(name)
            done = _run(["ip", "netns", "delete", name], check=False)
            if done.returncode != 0:
                failed.append(f"{name}: {done.stderr.strip()}")
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        self._made.clear()
        self.nodes.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if failed:
            raise NodesError(f"could not remove the namespaces {'; '.join(failed)}")

    def __enter__(self) -> Nodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
