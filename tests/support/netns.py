"""Network-namespace "nodes" for the tests: the harness of ``xreduce_bench.netns``, and a skip mark.

The harness lives in the bench package (installed, and used by ``xreduce bench
--nodes``); the tests take it from here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from xreduce_bench.netns import (
    INTERFACE,
    NETNS_ENV,
    PREFIX,
    Node,
    Nodes,
    NodesError,
    namespaces_unavailable,
    parse_rate,
    remaining,
    sweep_leftovers,
)

__all__ = ["INTERFACE", "NETNS_ENV", "PREFIX", "Node", "Nodes", "NodesError", "namespaces_unavailable",
           "needs_namespaces", "parse_rate", "remaining", "start_node_daemons", "sweep_leftovers"]

needs_namespaces = pytest.mark.skipif(namespaces_unavailable() is not None,
                                      reason=f"no network namespaces here: {namespaces_unavailable()}")
"""Skips a test (or, as ``pytestmark``, a module) where network namespaces cannot be made."""


def start_node_daemons(nodes: Nodes, virtual_devices: int, peer_timeout: float) -> None:
    """One daemon per node, serving on the node's own loopback at ``127.0.0.1:50551``, its engine on the node's
    address, a lost node noticed within twice ``peer_timeout``; returns once each serves."""
    for node in nodes:
        daemon = node.popen([sys.executable, "-m", "xreduced", "--listen", "127.0.0.1:50551", "--virtual-devices",
                             str(virtual_devices), "--node-address", node.address, "--peer-timeout",
                             str(peer_timeout), "--heartbeat-interval", "0.5"], stderr=subprocess.PIPE, text=True)
        for line in daemon.stderr:
            if "event=serving" in line:
                break
        else:
            pytest.fail(f"the daemon of {node} did not start")
        daemon.stderr.close()  # its later log lines are not read: do not let them fill a pipe
