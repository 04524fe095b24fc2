"""Sparse values (``IndexedSlices``) reduced across real processes, and across nodes on a real Gloo engine.

Expected values are derived from TensorFlow's source (the one-process semantics they build on are checked
against TF 2.21 itself in tests/tensorflow/test_tf_oracle.py): TF's
``CollectiveAllReduce`` concatenates every replica's values and indices in global device order (process 0's
replicas first), as ``cross_device_ops_test.py``'s ``testAllReduceSparse`` and
``testAllReduceSparseVariableLength`` expect with 2 processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from children import child_env
from xreduce.wire.sparse import Slices
from xreduced.across import gather_across

WORKER = r"""
import json, sys
import numpy as np
import xreduce
from xreduce import distribute, distribution

process_id = int(sys.argv[1])
distribution.initialize(num_processes=2, process_id=process_id)
ops = distribute.HierarchicalCopyAllReduce()
devices = distribution.list_devices()[2 * process_id:2 * process_id + 2]
rows = {0: ([[1.0], [2.0]], [0, 1]), 1: ([[3.0], [4.0]], [1, 2]), 2: ([[5.0], [6.0]], [7, 8]),
        3: ([[7.0], [8.0]], [3, 2])}
replicas = [2 * process_id, 2 * process_id + 1]
sparse = distribute.PerReplica([distribute.IndexedSlices(np.array(rows[r][0], np.float32), np.array(rows[r][1]),
                                                         [10, 1]) for r in replicas], devices=devices)
dense = distribute.PerReplica([np.float32(r + 1) for r in replicas], devices=devices)
# TF's testAllReduceSparseVariableLength: one row on process 0, three on process 1 (one replica each).
variable = distribute.PerReplica([distribute.IndexedSlices(
    np.array([[1.0]] if process_id == 0 else [[2.0], [3.0], [4.0]], np.float32),
    np.array([0] if process_id == 0 else [0, 1, 2], np.int32 if process_id == 0 else np.int64), [10, 1])],
    devices=devices[:1])
out = {}
for op in ("SUM", "MEAN"):
    got = ops.batch_reduce(op, [(sparse, sparse), (dense, dense)])
    out[op] = [[np.asarray(s.values).tolist(), np.asarray(s.indices).tolist(), list(s.dense_shape)]
               for s in got[0].values] + [[float(a) for a in got[1].values]]
got = ops.reduce("SUM", variable, devices[0])
indices = np.asarray(got.indices)
out["variable"] = [np.asarray(got.values).tolist(), indices.tolist(), str(indices.dtype)]
print(json.dumps(out))
distribution.shutdown()
"""


def test_two_processes_concatenate_in_global_device_order(start_daemon, tmp_path):
    daemon = start_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4")
    env = dict(child_env(), XREDUCE_ADDRESS=daemon.address, XREDUCE_GROUP="sparse-processes")
    env.pop("XREDUCE_LOCAL_DEVICES", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    values = [[1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [7.0], [8.0]]
    indices = [0, 1, 1, 2, 7, 8, 3, 2]  # TF's testAllReduceSparse, 4 replicas
    for out in outs:
        assert out["SUM"] == [[values, indices, [10, 1]]] * 2 + [[10.0, 10.0]]
        assert out["MEAN"] == [[[[v[0] / 4] for v in values], indices, [10, 1]]] * 2 + [[2.5, 2.5]]
    assert outs[0]["variable"] == [[[1.0], [2.0], [3.0], [4.0]], [0, 0, 1, 2], "int64"]


def test_gather_across_nodes_on_gloo():
    """Three nodes' concatenations all-gathered on a real Gloo engine: node order, padded payloads of
    different lengths, int32 kept only when every node's indices are int32."""
    pytest.importorskip("torch")
    from xreduced.gloo import EngineError, GlooEngine

    table: dict[str, bytes] = {}
    lock = threading.Condition()

    def get(key, timeout):
        with lock:
            if not lock.wait_for(lambda: key in table, timeout):
                raise EngineError(f"no key {key}")
            return table[key]

    def set_(key, value):
        with lock:
            table[key] = value
            lock.notify_all()

    def add(key, n):
        with lock:
            table[key] = str(int(table.get(key, b"0")) + n).encode()
            lock.notify_all()
            return int(table[key])

    size = 3
    engines: list = [None] * size
    parts = {0: [Slices(np.array([[1.0, 2.0]], np.float32), np.array([4], np.int32), (5, 2)),
                 Slices(np.arange(3, dtype=np.int16).reshape(3, 1), np.array([0, 1, 2], np.int32), (3, 1))],
             1: [Slices(np.zeros((0, 2), np.float32), np.zeros(0, np.int32), (5, 2)),
                 Slices(np.array([[7]], np.int16), np.array([2], np.int32), (3, 1))],
             2: [Slices(np.array([[3.0, 4.0], [5.0, 6.0]], np.float32), np.array([0, 0], np.int64), (5, 2)),
                 Slices(np.array([[9], [8]], np.int16), np.array([1, 1], np.int32), (3, 1))]}
    results: dict[int, list] = {}

    def node(rank):
        engines[rank] = GlooEngine((set_, get, add), rank, size, "127.0.0.1", 30.0)
        results[rank] = gather_across(engines[rank], parts[rank], 30.0)[0]

    threads = [threading.Thread(target=node, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in engines:
        if e is not None:
            e.close()
    assert sorted(results) == [0, 1, 2]
    for rank in range(size):
        first, second = results[rank]
        assert first.values.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]] and first.values.dtype == np.float32
        assert first.indices.tolist() == [4, 0, 0] and first.indices.dtype == np.int64 and first.dense_shape == (5, 2)
        assert second.values.reshape(-1).tolist() == [0, 1, 2, 7, 9, 8] and second.values.dtype == np.int16
        assert second.indices.tolist() == [0, 1, 2, 2, 1, 1] and second.indices.dtype == np.int32
