"""Network-namespace "nodes" for the tests: the harness of ``xreduce_bench.netns``, and a skip mark.

The harness lives in the bench package (installed, and used by ``xreduce bench
--nodes``); the tests take it from here.
"""

from __future__ import annotations

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
           "needs_namespaces", "parse_rate", "remaining", "sweep_leftovers"]

needs_namespaces = pytest.mark.skipif(namespaces_unavailable() is not None,
                                      reason=f"no network namespaces here: {namespaces_unavailable()}")
"""Skips a test (or, as ``pytestmark``, a module) where network namespaces cannot be made."""
