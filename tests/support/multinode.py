"""The multi-node tests' helpers: jobs of real training processes across node daemons, their expected values.

A job's processes are :class:`xreduce_bench.faults.NodeProcess` subprocesses (each with its node's
``XREDUCE_ADDRESS`` and the ``KERAS_DISTRIBUTION_*`` variables) on the daemons of a
:class:`xreduce_bench.faults.Cluster`. Their inputs are
:func:`xreduce_bench.faults.replica_array` of their global replica ids, so the values every
process must get are computed here from the inputs alone, with numpy:

* :func:`exact_total`: in float64 (or int64, complex128) and then cast: the only answer when the
  inputs are small integers, whatever the order of the additions;
* :func:`planned_total`: in the dtype, in the order the design fixes: each node sums its replicas
  with TF's hierarchical copy (the first half and the second half, each a left fold, then their
  sum), then the node sums are added in node order ``((node 0 + node 1) + node 2) ...`` (what two
  nodes get; with more, Gloo's ring adds the node sums in an order of its own: :func:`every_order`);
* :func:`mean_of`: MEAN divides once, by the global replica count, as TF divides.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Sequence

import numpy as np
import xreduce
from prometheus_client.parser import text_string_to_metric_families
from xreduce_bench.faults import Cluster, NodeProcess, decode, replica_array

NODE_FLAGS = ("--backend", "numpy", "--virtual-devices", "4")
"""A node daemon of these tests: 4 host devices."""
PEER_TIMEOUT = 2.0
FAST_PEERS = ("--peer-timeout", str(PEER_TIMEOUT), "--heartbeat-interval", "0.5")
"""A lost node is noticed within 2 x 2 s (the default is 5 s)."""
FAILS_WITHIN = 2 * PEER_TIMEOUT + 5.0
"""The bound on a fault's detection that the tests assert: twice the peer timeout, and slack."""
DTYPES = xreduce.SUPPORTED_DTYPES
OPENSSL = shutil.which("openssl")


# --- running a job -------------------------------------------------------------------------------------------


def finish(processes: Sequence[NodeProcess], timeout: float = 120.0) -> list[list[dict]]:
    """Every process's step events once its script has ended; the processes are closed after.

    Raises:
        TimeoutError: a process did not finish (its events and stderr are in the message).
    """
    try:
        return [p.steps(timeout) for p in processes]
    finally:
        for p in processes:
            p.close()


def run_job(cluster: Cluster, placement: Sequence[int], steps: list[dict] | Callable[[int], list[dict]],
            env: dict[str, str] | None = None, timeout: float = 120.0) -> list[list[dict]]:
    """Launches process ``p`` on node ``placement[p]`` running ``steps`` (or ``steps(p)``); every process's
    step events."""
    return finish(cluster.launch(placement, steps, env), timeout)


@dataclasses.dataclass
class Job:
    """A finished job: each process's script and its step events, by process id; steps found by ``name``."""

    scripts: list[list[dict]]
    events: list[list[dict]]

    def outcomes(self, name: str) -> list[dict]:
        """Each process's event of its step called ``name``."""
        out = []
        for script, events in zip(self.scripts, self.events):
            index = next(i for i, step in enumerate(script) if step.get("name") == name)
            out.append(next(e for e in events if e["i"] == index))
        return out

    def results(self, name: str) -> list:
        """Each process's result of step ``name``, which must have succeeded everywhere."""
        out = []
        for pid, e in enumerate(self.outcomes(name)):
            assert e["ok"], f"process {pid}: step {name!r} failed: {e['code']} {e['error']}: {e['message']}"
            out.append(e["result"])
        return out

    @property
    def inits(self) -> list[dict]:
        """Each process's ``init`` result (the first step named ``init``)."""
        return self.results("init")

    @property
    def nodes(self) -> list[list[int]]:
        """The global replicas of each node, in its plan's order (:func:`nodes_of`)."""
        return nodes_of(self.inits)

    @property
    def replicas(self) -> int:
        """The job's global replica count."""
        return sum(len(n) for n in self.nodes)


def run_named(cluster: Cluster, placement: Sequence[int], script: Callable[[int], list[dict]],
              env: dict[str, str] | None = None, timeout: float = 120.0) -> Job:
    """:func:`run_job` as a :class:`Job` (whose steps carry names)."""
    scripts = [script(p) for p in range(len(placement))]
    return Job(scripts, run_job(cluster, placement, scripts.__getitem__, env, timeout))


def results(events: Sequence[dict], where: str = "") -> list:
    """The results of a process's steps; a failed step fails the test, with the daemon's message."""
    out = []
    for e in events:
        assert e["ok"], f"{where}step {e['i']} ({e['op']}) failed: {e['code']} {e['error']}: {e['message']}"
        out.append(e["result"])
    return out


# --- expected values ------------------------------------------------------------------------------------------


def nodes_of(inits: Sequence[dict]) -> list[list[int]]:
    """The global replica ids on each node, node 0 first, in the order of the node daemon's devices
    (the order the node's plan adds them in); from every process's ``init`` result."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for info in inits:
        devices = [xreduce.DeviceName.parse(d).index for d in info["daemon_devices"]]
        by_node.setdefault(info["node_index"], []).extend(zip(devices, info["replicas"]))
    return [[r for _, r in sorted(by_node[n])] for n in sorted(by_node)]


def inputs(seed: int, tensor: int, replicas: Sequence[int], dtype: str, shape: Sequence[int],
           fill: str) -> list[np.ndarray]:
    """What each of ``replicas`` holds (:func:`xreduce_bench.faults.replica_array`)."""
    return [replica_array(seed, tensor, r, dtype, shape, fill) for r in replicas]


def exact_total(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The sum in float64 / int64 / complex128, cast to the inputs' dtype (integers wrap as numpy's do).

    Example:
        >>> exact_total([np.array([1.5], np.float16), np.array([2.0], np.float16)])
        array([3.5], dtype=float16)
    """
    dtype = arrays[0].dtype
    wide = np.complex128 if dtype.kind == "c" else np.int64 if dtype.kind in "iu" else np.float64
    return np.asarray(np.sum([a.astype(wide) for a in arrays], axis=0)).astype(dtype)


def _fold(arrays: Sequence[np.ndarray]) -> np.ndarray:
    total = arrays[0].copy()
    for a in arrays[1:]:
        total = total + a
    return total


def node_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One node's sum as TF's hierarchical copy adds ``N`` replicas: ``fold(first N // 2) + fold(rest)``.

    Example:
        >>> node_sum([np.float32(1e8), np.float32(1.0), np.float32(-1e8), np.float32(1.0)])
        np.float32(0.0)
    """
    if len(arrays) == 1:
        return arrays[0].copy()
    half = len(arrays) // 2
    return _fold(arrays[:half]) + _fold(arrays[half:])


def planned_total(node_arrays: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """The nodes' sums added in node order, every addition in the dtype."""
    return _fold([node_sum(arrays) for arrays in node_arrays])


def every_order(node_arrays: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The nodes' sums added in every order, every addition in the dtype: a sum across nodes must equal,
    element by element, one of them.

    Example:
        >>> [t.tolist() for t in every_order([[np.float16([2048])], [np.float16([1])], [np.float16([1])]])]
        [[2048.0], [2048.0], [2048.0], [2050.0], [2048.0], [2050.0]]
    """
    sums = [node_sum(arrays) for arrays in node_arrays]
    return [_fold([sums[i] for i in order]) for order in itertools.permutations(range(len(sums)))]


def mean_of(total: np.ndarray, count: int) -> np.ndarray:
    """MEAN as TF divides: integers promoted first (to float32 up to 16 bits, else float64), complex
    parts divided as floats, floats in their own dtype.

    Example:
        >>> mean_of(np.array([3], np.int16), 2), mean_of(np.array([3 + 1j], np.complex64), 2)
        (array([1.5], dtype=float32), array([1.5+0.5j], dtype=complex64))
    """
    if total.dtype.kind in "iu":
        wide = np.float32 if total.dtype.itemsize <= 2 else np.float64
        return total.astype(wide) / wide(count)
    if total.dtype.kind == "c":
        out = np.empty_like(total)
        out.real = total.real / total.real.dtype.type(count)
        out.imag = total.imag / total.imag.dtype.type(count)
        return out
    return (total / total.dtype.type(count)).astype(total.dtype)


def component_arrays(components: Sequence[dict]) -> list[np.ndarray]:
    """The arrays of a result's components (each as the process received it)."""
    return [decode(c) for c in components]


def same_bytes(arrays: Sequence[np.ndarray], want: np.ndarray) -> bool:
    """Whether every array has ``want``'s dtype, shape and bytes."""
    return all(a.dtype == want.dtype and a.shape == want.shape and a.tobytes() == want.tobytes() for a in arrays)


# --- daemons ------------------------------------------------------------------------------------------------


def status(address: str, **client_options) -> object:
    """The daemon's ``GetStatusResponse``."""
    with xreduce.Client(address, **client_options) as client:
        return client.get_status(timeout=30)


def group_status(address: str, gid: str, **client_options):
    """The daemon's ``GroupStatus`` of group ``gid`` (the daemon may hold other groups too)."""
    groups = [g for g in status(address, **client_options).groups if g.group == gid]
    assert len(groups) == 1, f"the daemon at {address} holds {len(groups)} groups named {gid!r}"
    return groups[0]


def group_metrics(daemon, gid: str) -> dict[str, float]:
    """The daemon's Prometheus samples of group ``gid`` (``--metrics-listen``): {name: value}."""
    address = re.search(r"event=metrics address=(\S+)", daemon.log()).group(1)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("group") == gid}


def without_torch(directory: pathlib.Path, how: str) -> dict[str, str]:
    """A daemon environment in which torch is missing (``how="missing"``: nothing to import) or broken
    (``"broken"``: a ``torch`` module whose import raises ImportError)."""
    directory.mkdir(parents=True, exist_ok=True)
    if how == "missing":
        (directory / "sitecustomize.py").write_text("import sys\n\nsys.modules['torch'] = None\n")
    elif how == "broken":
        (directory / "torch.py").write_text("raise ImportError('this torch does not load')\n")
    else:
        raise ValueError(f"how must be 'missing' or 'broken'; got {how!r}")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)}


def certificates(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """A CA and one node certificate it signed (127.0.0.1, for serving and as a client) with the openssl
    command: ``{"ca", "cert", "key"}``."""
    def openssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=nodes CA")
    openssl("req", *curve, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=xreduced")
    (directory / "node.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "node.pem", "-days", "2", "-extfile", "node.ext")
    return {"ca": directory / "ca.pem", "cert": directory / "node.pem", "key": directory / "node.key"}

