"""What the daemon has done: counters per method and status code, reduction
timings, and the Prometheus metrics that show them.

The Prometheus metrics live in each daemon's own registry (several daemons
can run in one process); ``--metrics-listen`` serves them over HTTP:

* ``xreduce_calls_total{method,code}``: finished calls per method and status code
  (errors are the codes other than ``OK``);
* ``xreduce_bytes_in_total{method}``, ``xreduce_bytes_out_total{method}``:
  serialized request and reply bytes;
* ``xreduce_reduction_seconds{method}`` (histogram): how long the reduction of a
  successful Reduce, BatchReduce or Broadcast took, from decoded request to
  result (a multi-process collective counts once, when every process is in);
* ``xreduce_algbw_bytes_per_second{method}`` (histogram): algorithm bandwidth
  of those reductions, one replica's bytes divided by the reduction seconds
  (as nccl-tests' algbw);
* ``xreduce_inflight_bytes`` (gauge): the estimated working sets of the calls being served
  (:func:`xreduced.admission.working_set`);
* ``xreduce_collectives_waiting`` (gauge);
* ``xreduce_mapped_bytes`` (gauge): the clients' shared memory the daemon maps now, and
  ``xreduce_mapped_bytes_limit`` (gauge) its budget, ``--max-mapped-bytes`` (+Inf: none);
  ``xreduce_oom_score_adj`` (gauge): the daemon process's ``oom_score_adj`` (:mod:`xreduced.oom`);
* ``xreduce_limit_rejections_total{limit}``: calls refused by each limit;
* ``xreduce_local_lane_connections`` (gauge), ``xreduce_local_lane_calls_total``: the local lane
  (:mod:`xreduced.lane`); ``xreduce_local_lane_express_calls_total``: those of its calls its express
  lane answered, and ``xreduce_local_lane_express_held`` (gauge): calls held there now for the rest of their
  collectives (:mod:`xreduced.express`); ``xreduce_local_lane_repeat_calls_total``: those it served as kept
  repeats (:mod:`xreduced.repeated`);
* groups across nodes, per ``group``: ``xreduce_group_info{group,engine,state,coordinator}`` (1),
  ``xreduce_group_epoch``, ``xreduce_group_nodes``,
  ``xreduce_group_failed`` (1 once the epoch has lost a peer or a process), ``xreduce_group_lost_peers``,
  and ``xreduce_cross_node_collectives_total``, ``xreduce_cross_node_bytes_total`` (sent and received
  through the engine), ``xreduce_cross_node_seconds_total``.

The call pipeline (:mod:`xreduced.pipeline`) records every call here.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

import prometheus_client

from xreduced.oom import MappedBytes, score_adj

REDUCTION_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                             1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ALGBW_BUCKETS = (1e4, 1e5, 1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11, 2.5e11,
                 5e11, 1e12)
"""Bytes per second, 10 kB/s to 1 TB/s."""


class _CallsCollector:
    """The calls and bytes per method, read from :class:`Stats`' own counters when scraped (a call then
    costs one dictionary update, not three Prometheus children)."""

    def __init__(self, snapshot: Callable[[], dict[str, dict]]):
        self._snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        calls = CounterMetricFamily("xreduce_calls", "Finished calls per method and status code.",
                                    labels=["method", "code"])
        into = CounterMetricFamily("xreduce_bytes_in", "Serialized request bytes per method.", labels=["method"])
        out = CounterMetricFamily("xreduce_bytes_out", "Serialized reply bytes per method.", labels=["method"])
        for method, m in self._snapshot().items():  # in the order they first came, as Prometheus' own counters
            for code, n in m["calls_by_code"].items():
                calls.add_metric([method, code], float(n))
            into.add_metric([method], float(m["bytes_in"]))
            out.add_metric([method], float(m["bytes_out"]))
        yield from (calls, into, out)


class _LaneCollector:
    """The local lane's connections and calls, read when scraped."""

    def __init__(self, counts: Callable[[], tuple[int, int]], express: Callable[[], tuple[int, int]],
                 repeats: Callable[[], int]):
        self._counts = counts
        self._express = express
        self._repeats = repeats

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        connections, calls = self._counts()
        yield GaugeMetricFamily("xreduce_local_lane_connections", "Connections open on the local lane.",
                                value=float(connections))
        yield CounterMetricFamily("xreduce_local_lane_calls", "Calls served over the local lane.",
                                  value=float(calls))
        answered, held = self._express()
        yield CounterMetricFamily("xreduce_local_lane_express_calls",
                                  "Calls of the local lane its express lane answered (of known request shapes).",
                                  value=float(answered))
        yield GaugeMetricFamily("xreduce_local_lane_express_held",
                                "Calls held in the express lane now, for the rest of their collectives.",
                                value=float(held))
        yield CounterMetricFamily("xreduce_local_lane_repeat_calls",
                                  "Calls of the local lane served as kept repeats (a request sent before, byte for "
                                  "byte, its tensors in shared memory).", value=float(self._repeats()))


class _GroupCollector:
    """Prometheus metrics of the groups across nodes, read when scraped."""

    def __init__(self, groups: Callable[[], list]):
        self._groups = groups

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {
            "epoch": GaugeMetricFamily("xreduce_group_epoch", "The group's membership epoch.", labels=["group"]),
            "nodes": GaugeMetricFamily("xreduce_group_nodes", "Nodes in the group's epoch.", labels=["group"]),
            "failed": GaugeMetricFamily("xreduce_group_failed", "1 once the epoch has lost a peer or a process.",
                                        labels=["group"]),
            "lost": GaugeMetricFamily("xreduce_group_lost_peers", "Peers the epoch lost.", labels=["group"]),
            "collectives": CounterMetricFamily("xreduce_cross_node_collectives", "Collectives that crossed nodes.",
                                               labels=["group"]),
            "bytes": CounterMetricFamily("xreduce_cross_node_bytes", "Bytes this node sent and received through "
                                         "the engine.", labels=["group"]),
            "seconds": CounterMetricFamily("xreduce_cross_node_seconds", "Seconds spent crossing nodes.",
                                           labels=["group"]),
        }
        info = GaugeMetricFamily("xreduce_group_info", "1 per group: its engine and whether its epoch stands.",
                                 labels=["group", "engine", "state", "coordinator"])
        for g in self._groups():
            info.add_metric([g.group, g.engine or "none", g.state, "true" if g.coordinator else "false"], 1)
            values = {"epoch": float(g.epoch), "nodes": len(g.nodes), "failed": int(g.state == "failed"),
                      "lost": len(g.lost), "collectives": g.cross_node_collectives, "bytes": g.cross_node_bytes,
                      "seconds": g.cross_node_seconds}
            for key, family in families.items():
                family.add_metric([g.group], values[key])
        yield info
        yield from families.values()


class Stats:
    """Counters since the daemon started and its Prometheus registry; thread-safe.

    Args:
        inflight: the in-flight bytes now (the ``xreduce_inflight_bytes`` gauge).
        collectives_waiting: the collectives waiting for participants now.
        mapped: the shared memory mapped and its budget (``value`` and ``limit``, None: none).

    Example:
        >>> s = Stats()
        >>> s.record("/x.Y/Z", "OK", 10, 20, 0.001)
        >>> s.snapshot()["/x.Y/Z"]["calls_by_code"]
        {'OK': 1}
        >>> s.registry.get_sample_value("xreduce_calls_total", {"method": "/x.Y/Z", "code": "OK"})
        1.0
    """

    def __init__(self, inflight: Callable[[], int] = lambda: 0, collectives_waiting: Callable[[], int] = lambda: 0,
                 mapped: MappedBytes | None = None):
        mapped = MappedBytes(None) if mapped is None else mapped
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._methods: dict[str, dict] = collections.defaultdict(
            lambda: {"calls_by_code": collections.Counter(), "bytes_in": 0, "bytes_out": 0})
        self._children: dict = {}
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(_CallsCollector(self.snapshot))
        self._seconds = prometheus_client.Histogram(
            "xreduce_reduction_seconds", "Seconds a successful Reduce, BatchReduce or Broadcast took to reduce.",
            ["method"], buckets=REDUCTION_SECONDS_BUCKETS, registry=r)
        self._algbw = prometheus_client.Histogram(
            "xreduce_algbw_bytes_per_second", "Algorithm bandwidth of a reduction: one replica's bytes "
            "divided by its seconds.", ["method"], buckets=ALGBW_BUCKETS, registry=r)
        self._rejections = prometheus_client.Counter(
            "xreduce_limit_rejections", "Calls refused by a limit.", ["limit"], registry=r)
        prometheus_client.Gauge("xreduce_inflight_bytes", "Estimated working sets of the calls being served now.",
                                registry=r).set_function(inflight)
        prometheus_client.Gauge("xreduce_collectives_waiting", "Multi-process collectives waiting for "
                                "participants now.", registry=r).set_function(collectives_waiting)
        prometheus_client.Gauge("xreduce_mapped_bytes", "Bytes of the clients' shared memory the daemon maps now.",
                                registry=r).set_function(lambda: mapped.value)
        prometheus_client.Gauge("xreduce_mapped_bytes_limit", "The budget of the shared memory the daemon maps "
                                "(--max-mapped-bytes); +Inf: none.", registry=r).set_function(
            lambda: math.inf if mapped.limit is None else mapped.limit)
        prometheus_client.Gauge("xreduce_oom_score_adj", "The daemon process's oom_score_adj.",
                                registry=r).set_function(lambda: score_adj() or 0)

    def watch_groups(self, groups: Callable[[], list]) -> None:
        """Exports the groups across nodes that ``groups()`` returns (``GroupStatus`` messages) when scraped.

        Example:
            >>> from xreduce.v1 import xreduce_pb2 as pb
            >>> s = Stats()
            >>> s.watch_groups(lambda: [pb.GroupStatus(group="g@h:1", epoch=3, cross_node_bytes=64)])
            >>> s.registry.get_sample_value("xreduce_group_epoch", {"group": "g@h:1"})
            3.0
        """
        self.registry.register(_GroupCollector(groups))

    def watch_lane(self, counts: Callable[[], tuple[int, int]],
                   express: Callable[[], tuple[int, int]] = lambda: (0, 0),
                   repeats: Callable[[], int] = lambda: 0) -> None:
        """Exports the local lane's (connections, calls) that ``counts()`` returns, its express lane's (calls
        answered, calls held now) that ``express()`` returns, and the calls it served as kept repeats
        (``repeats()``), when scraped.

        Example:
            >>> s = Stats()
            >>> s.watch_lane(lambda: (2, 40), lambda: (38, 1), lambda: 1)
            >>> [s.registry.get_sample_value(f"xreduce_local_lane_{n}_total") for n in ("calls", "express_calls",
            ...                                                                           "repeat_calls")]
            [40.0, 38.0, 1.0]
        """
        self.registry.register(_LaneCollector(counts, express, repeats))

    def record(self, method: str, code: str, bytes_in: int, bytes_out: int, seconds: float) -> None:
        """Counts one finished call.

        Example:
            >>> s = Stats()
            >>> s.record("/x.Y/Z", "NOT_FOUND", 10, 0, 0.001)
            >>> s.registry.get_sample_value("xreduce_calls_total", {"method": "/x.Y/Z", "code": "NOT_FOUND"})
            1.0
        """
        with self._lock:
            m = self._methods[method]
            m["calls_by_code"][code] += 1
            m["bytes_in"] += bytes_in
            m["bytes_out"] += bytes_out

    def observe_reduction(self, method: str, seconds: float, replica_bytes: int) -> None:
        """Counts one finished reduction of ``replica_bytes`` per replica.

        Example:
            >>> s = Stats()
            >>> s.observe_reduction("/x.Y/Reduce", 0.5, 1000)  # 1000 bytes in 0.5 s: 2000 B/s
            >>> s.registry.get_sample_value("xreduce_algbw_bytes_per_second_sum", {"method": "/x.Y/Reduce"})
            2000.0
        """
        with self._lock:
            children = self._children.get(method)
            if children is None:  # prometheus_client's labels() is slow: a method's children are looked up once
                children = self._children[method] = (self._seconds.labels(method), self._algbw.labels(method))
        timing, algbw = children
        timing.observe(seconds)
        if seconds > 0 and replica_bytes > 0:
            algbw.observe(replica_bytes / seconds)

    def rejected(self, limit: str) -> None:
        """Counts one call refused by ``limit`` (e.g. ``max_inflight_bytes``).

        Example:
            >>> s = Stats()
            >>> s.rejected("max_collectives")
            >>> s.registry.get_sample_value("xreduce_limit_rejections_total", {"limit": "max_collectives"})
            1.0
        """
        self._rejections.labels(limit).inc()

    def snapshot(self) -> dict[str, dict]:
        """A copy of the counters, per method.

        Example:
            >>> s = Stats()
            >>> s.record("/x.Y/Z", "OK", 10, 20, 0.001)
            >>> s.snapshot()
            {'/x.Y/Z': {'calls_by_code': {'OK': 1}, 'bytes_in': 10, 'bytes_out': 20}}
        """
        with self._lock:
            return {k: {"calls_by_code": dict(v["calls_by_code"]), "bytes_in": v["bytes_in"],
                        "bytes_out": v["bytes_out"]} for k, v in self._methods.items()}


class MetricsServer:
    """Serves a registry's metrics in Prometheus' text format over HTTP at ``/metrics`` (any path works).

    Args:
        listen: ``host:port``; port 0 picks a free one (``address`` names it).

    Raises:
        RuntimeError: ``listen`` is malformed or cannot be bound.

    Example:
        >>> m = MetricsServer("127.0.0.1:0", Stats().registry)
        >>> m.address.startswith("127.0.0.1:")
        True
        >>> m.stop()
    """

    def __init__(self, listen: str, registry: prometheus_client.CollectorRegistry):
        host, _, port_text = listen.rpartition(":")
        host = host.strip("[]")
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise RuntimeError(f"--metrics-listen {listen!r}: must be host:port (port 0 picks a free port)")
        try:
            self._httpd, self._thread = prometheus_client.start_http_server(
                int(port_text), host or "0.0.0.0", registry=registry)
        except OSError as e:
            raise RuntimeError(f"--metrics-listen {listen!r}: cannot listen ({e.strerror or e})") from None
        port = self._httpd.server_address[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"

    def stop(self) -> None:
        """Stops serving and closes the socket.

        Example:
            See the class example, which ends with it.
        """
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
