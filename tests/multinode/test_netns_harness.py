"""The "nodes" harness itself: namespaces on a bridge, traffic between them, cut links, shaping, teardown.

Every test makes real namespaces and veth pairs (root only: skipped with the
reason elsewhere) and talks between nodes over real TCP sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from netns import NETNS_ENV, Nodes, needs_namespaces, remaining, sweep_leftovers

PORT = 7000

ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        conn.sendall(conn.recv(64))
"""

CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        conn.sendall(b"hello from " + sys.argv[4].encode())
        print("echo:", conn.recv(64).decode())
except OSError as e:
    print(type(e).__name__, e.errno)
"""


def echo_server(node) -> subprocess.Popen:
    proc = node.popen([sys.executable, "-c", ECHO_SERVER, node.address, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "listening\n"
    return proc


def connect(node, address: str, timeout: float = 5.0) -> str:
    """What a TCP client in ``node`` gets from ``address``'s echo: ``echo: ...`` or the error's name."""
    done = node.run([sys.executable, "-c", CLIENT, address, str(PORT), str(timeout), node.address],
                    capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@needs_namespaces
def test_two_nodes_reach_each_other_over_tcp():
    with Nodes(2) as nodes:
        assert [(n.index, n.address, n.interface) for n in nodes] == [(1, "10.0.0.1", "eth0"), (2, "10.0.0.2", "eth0")]
        echo_server(nodes[2])
        assert connect(nodes[1], "10.0.0.2") == "echo: hello from 10.0.0.1"
        echo_server(nodes[1])
        assert connect(nodes[2], "10.0.0.1") == "echo: hello from 10.0.0.2"


@needs_namespaces
def test_nodes_are_apart_from_this_namespace_and_each_other():
    with Nodes(2) as nodes:
        shown = nodes[1].run(["ip", "-br", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        assert sorted(line.split()[2] for line in shown.splitlines()) == ["10.0.0.1/24", "127.0.0.1/8"]
        # a server on node 2's loopback is not node 1's
        proc = nodes[2].popen([sys.executable, "-c", ECHO_SERVER, "127.0.0.1", str(PORT)], stdout=subprocess.PIPE,
                              text=True)
        assert proc.stdout.readline() == "listening\n"
        assert connect(nodes[1], "127.0.0.1") == "ConnectionRefusedError 111"


@needs_namespaces
def test_inside_a_node_every_node_has_a_name_both_ways():
    with Nodes(2) as nodes:
        code = "import socket; print(socket.gethostbyname('node2'), socket.gethostbyaddr('10.0.0.1')[0])"
        done = nodes[1].run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert done.stdout == "10.0.0.2 node1\n"


@needs_namespaces
def test_a_cut_link_drops_packets_silently_and_restore_brings_it_back():
    with Nodes(2) as nodes:
        echo_server(nodes[2])
        assert connect(nodes[1], "10.0.0.2") == "echo: hello from 10.0.0.1"
        nodes.cut(nodes[2])
        # no refusal, no reset: the SYN is lost, so the connect times out
        assert connect(nodes[1], "10.0.0.2", timeout=2.0) == "TimeoutError None"
        assert connect(nodes[2], "10.0.0.1", timeout=2.0).startswith(("TimeoutError", "OSError"))
        nodes.restore(nodes[2])
        assert connect(nodes[1], "10.0.0.2") == "echo: hello from 10.0.0.1"


@needs_namespaces
def test_shaping_puts_tbf_on_both_ends_of_every_link():
    with Nodes(2, shape="100mbit") as nodes:
        assert nodes.rate == 100e6
        for node in nodes:
            for where, device in ((node.namespace, "eth0"), (nodes.switch, node.port)):
                shown = subprocess.run(["tc", "-n", where, "qdisc", "show", "dev", device], capture_output=True,
                                       text=True, check=True).stdout
                assert " tbf " in shown and "rate 100Mbit" in shown, shown
        echo_server(nodes[2])
        assert connect(nodes[1], "10.0.0.2") == "echo: hello from 10.0.0.1"


@needs_namespaces
def test_the_python_script_runs_this_interpreter_in_the_node_its_environment_names():
    with Nodes(2) as nodes:
        code = "import socket, sys; socket.socket().bind(('10.0.0.2', 0)); print(sys.executable)"
        done = subprocess.run([nodes.python, "-c", code], env={**os.environ, **nodes[2].env()}, capture_output=True,
                              text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, sys.executable + "\n"), done.stderr
        done = subprocess.run([nodes.python, "-c", code], env={**os.environ, **nodes[1].env()}, capture_output=True,
                              text=True, timeout=60)
        assert "Cannot assign requested address" in done.stderr
        assert nodes[1].env() == {NETNS_ENV: nodes[1].namespace}


@needs_namespaces
def test_teardown_stops_the_processes_and_removes_every_namespace_and_interface():
    with Nodes(3, shape="1gbit") as nodes:
        token = nodes.token
        # the switch, three nodes and their hosts files; the veths are inside the namespaces
        assert len(remaining(token)) == 7
        server = echo_server(nodes[2])
        sleeper = nodes[3].popen(["sleep", "600"])
        python = nodes.python
    assert remaining(token) == []
    assert server.poll() is not None and sleeper.poll() is not None
    assert not os.path.exists(python)
    nodes.close()  # a second close has nothing left to do


@needs_namespaces
def test_teardown_also_runs_when_the_block_fails():
    with pytest.raises(RuntimeError, match="the test failed"), Nodes(2) as nodes:
        token = nodes.token
        nodes[1].popen(["sleep", "600"])
        raise RuntimeError("the test failed")
    assert remaining(token) == []


KILLED_RUN = """
import os, signal, subprocess
from xreduce_bench.netns import Nodes
nodes = Nodes(2, shape="1gbit").start()
sleeper = nodes[1].popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(nodes.token, sleeper.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@needs_namespaces
def test_a_sweep_removes_what_a_killed_run_left_and_keeps_a_live_run():
    with Nodes(1) as live:
        killed = subprocess.run([sys.executable, "-c", KILLED_RUN], capture_output=True, text=True, timeout=60)
        assert killed.returncode == -9, killed.stderr
        token, pid = killed.stdout.split()
        left = remaining(token)
        assert len(left) == 5 and running(int(pid))
        assert sorted(sweep_leftovers()) == sorted(left)
        assert remaining(token) == [] and not running(int(pid))
        assert len(remaining(live.token)) == 3


def test_bad_arguments_name_the_argument_and_the_value():
    with pytest.raises(ValueError, match=r"count must be an integer in \[1, 253\]; got 0"):
        Nodes(0)
    with pytest.raises(ValueError, match="shape must be a tc rate such as 1gbit, 100mbit or 125mbps; got '1 gig'"):
        Nodes(2, shape="1 gig")
    with pytest.raises(ValueError, match="subnet must be three octets such as 10.0.0; got '10.0.300'"):
        Nodes(2, subnet="10.0.300")
