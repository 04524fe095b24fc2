"""Groups across nodes compute what the design says, in every dtype: real node daemons on loopback and
real training processes (subprocesses, each with its node's ``XREDUCE_ADDRESS`` and the
``KERAS_DISTRIBUTION_*`` variables).

Every expected value is computed here from the inputs (:mod:`multinode`): with small integers the
exact sum, whatever the order; with random floats the order the design fixes (each node's plan, then
node order), and every process, on every device, must hold the same bytes.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from multinode import (
    DTYPES,
    Job,
    component_arrays,
    every_order,
    exact_total,
    inputs,
    mean_of,
    planned_total,
    run_named,
    same_bytes,
)
from xreduce_bench.faults import Cluster, replica_array

OPS = ("SUM", "MEAN")
SHAPE = [2, 3]
BATCHES = {
    0: [("float16", [3]), ("int32", [2, 2]), ("complex128", [4]), ("uint8", [1]), ("bfloat16", [2, 1, 2])],
    1: [("float32", [5]), ("float32", [2, 2]), ("float32", [1]), ("float32", [7])],
    2: [("float64", [5]), ("float64", [3, 1]), ("float64", [9]), ("float64", [1])],
}
"""Batches by num_packs: without packing the dtypes may mix; packed, one dtype."""
EDGES = [("float32", []), ("int64", []), ("float32", [0]), ("complex64", [2, 0])]
"""Scalars and empty tensors: their shapes must survive the trip across nodes."""
RANDOM = [("float16", [64]), ("bfloat16", [64]), ("float32", [257]), ("float64", [33]), ("complex64", [16])]
JOBS = {
    "2-nodes-2+1-wire": ([0, 0, 1], [0, 1, 2], "wire"),
    "3-nodes-1+4+1-shm": ([0, 1, 2, 1, 1, 1], [0, 2, 4], "shm"),
}
"""Job: (the node of each process, the broadcasts' source processes, the SDK's transport: tensors in the
messages, or in shared memory with the results written into the processes' output regions). In the
second, processes 1, 3, 4 and 5 share node 1 (one device each) and node 2 hosts process 2: nodes go by
lowest process id."""


def script(sources: list[int]) -> list[dict]:
    steps = [{"op": "init", "name": "init"}]
    for i, dtype in enumerate(DTYPES):
        for op in OPS:
            steps.append({"op": "reduce", "name": f"reduce-{dtype}-{op}", "call": "reduce", "reduce_op": op,
                          "seed": i, "tensors": [{"dtype": dtype, "shape": SHAPE}]})
    for packs, tensors in BATCHES.items():
        for op in OPS:
            steps.append({"op": "reduce", "name": f"batch-{packs}-{op}", "num_packs": packs, "reduce_op": op,
                          "seed": 100 + packs, "tensors": [{"dtype": d, "shape": s} for d, s in tensors]})
    for op in OPS:
        steps.append({"op": "reduce", "name": f"random-{op}", "num_packs": 0, "reduce_op": op, "seed": 200,
                      "fill": "random", "tensors": [{"dtype": d, "shape": s} for d, s in RANDOM]})
    for source in sources:
        steps.append({"op": "broadcast", "name": f"broadcast-{source}", "source": source, "dtype": "float32",
                      "shape": [3], "fill": "random", "seed": 300})
    for op in OPS:
        steps.append({"op": "strategy", "name": f"strategy-{op}", "reduce_op": op})
    for op in OPS:  # last: whatever happens to them, the steps above are not affected
        steps.append({"op": "reduce", "name": f"edges-{op}", "num_packs": 0, "reduce_op": op, "seed": 400,
                      "tensors": [{"dtype": d, "shape": s} for d, s in EDGES]})
    steps.append({"op": "broadcast", "name": "broadcast-scalar", "source": sources[-1], "dtype": "float64",
                  "shape": [], "seed": 500})
    steps.append({"op": "data_parallel", "name": "data_parallel"})
    return steps


@pytest.fixture(scope="module")
def jobs(three_nodes) -> dict[str, Job]:
    """Each job of :data:`JOBS`, run once for the module's tests (a job of two nodes on nodes 0 and 1)."""
    out = {}
    for name, (placement, sources, transport) in JOBS.items():
        three_nodes.new_job()
        out[name] = run_named(three_nodes, placement, lambda p, s=sources: script(s),
                              env={"XREDUCE_TRANSPORT": transport})
    return out


def _check_everywhere(job: Job, name: str, want: list[np.ndarray], one: bool = False) -> None:
    """Every process got ``want[t]``'s bytes on each of its devices, for every tensor ``t`` (``one``: the
    step has one result, a broadcast's)."""
    for pid, (result, info) in enumerate(zip(job.results(name), job.inits)):
        result = [result] if one else result
        assert len(result) == len(want), f"process {pid}: {len(result)} results for {len(want)} tensors"
        for t, (components, expected) in enumerate(zip(result, want)):
            assert [c["device"] for c in components] == info["worker_devices"], (pid, t)
            got = component_arrays(components)
            assert same_bytes(got, expected), (f"process {pid}, tensor {t}: got {got[0].dtype} {got[0].shape} "
                                               f"{got[0]!r}, want {expected.dtype} {expected.shape} {expected!r}")


def _expected(job: Job, step: dict) -> list[np.ndarray]:
    want = []
    for t, spec in enumerate(step["tensors"]):
        arrays = inputs(step["seed"], t, range(job.replicas), spec["dtype"], spec["shape"], step.get("fill", "int"))
        total = exact_total(arrays)
        want.append(mean_of(total, job.replicas) if step["reduce_op"] == "MEAN" else total)
    return want


def _step(job: Job, name: str) -> dict:
    return next(s for s in job.scripts[0] if s.get("name") == name)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("job_name", JOBS)
def test_reduce_every_dtype_equals_the_sum_over_every_node(jobs, job_name, dtype, op):
    job = jobs[job_name]
    _check_everywhere(job, f"reduce-{dtype}-{op}", _expected(job, _step(job, f"reduce-{dtype}-{op}")))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("num_packs", sorted(BATCHES))
@pytest.mark.parametrize("job_name", JOBS)
def test_batch_reduce_with_num_packs(jobs, job_name, num_packs, op):
    job = jobs[job_name]
    name = f"batch-{num_packs}-{op}"
    _check_everywhere(job, name, _expected(job, _step(job, name)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("job_name", JOBS)
def test_random_floats_are_the_same_bytes_in_every_process_in_node_order(jobs, job_name, op):
    job = jobs[job_name]
    step = _step(job, f"random-{op}")
    outcomes = job.results(f"random-{op}")
    for t, (dtype, shape) in enumerate(RANDOM):
        got = [a for result in outcomes for a in component_arrays(result[t])]
        assert len({a.tobytes() for a in got}) == 1, f"{dtype}: the processes got different bytes"
        by_node = [inputs(step["seed"], t, node, dtype, shape, "random") for node in job.nodes]
        if len(by_node) == 2:  # node 0 + node 1, each node's sum by its plan
            want = planned_total(by_node)
            want = mean_of(want, job.replicas) if op == "MEAN" else want
            assert same_bytes(got, want), f"{dtype}: {got[0]!r} != {want!r} (each node's plan, then node order)"
        else:  # Gloo's ring adds the node sums in an order of its own, the same on every node
            totals = [mean_of(t, job.replicas) if op == "MEAN" else t for t in every_order(by_node)]
            assert np.all(np.any([got[0] == t for t in totals], axis=0)), (
                f"{dtype}: {got[0]!r} is not, element by element, the node sums added in some order")
        exact = np.sum([a.astype(np.complex128) for node in by_node for a in node], axis=0)
        exact = exact / job.replicas if op == "MEAN" else exact
        scale = np.abs(exact).max() + 10
        rtol = 8 * job.replicas * float(np.finfo(np.float32).eps if dtype == "complex64" else
                                        np.finfo(np.float64).eps if dtype == "float64" else
                                        np.finfo(np.float32).eps if dtype == "float32" else 2.0 ** -7)
        assert np.max(np.abs(got[0].astype(np.complex128) - exact)) <= rtol * scale, dtype


@pytest.mark.parametrize("job_name", JOBS)
def test_broadcast_from_a_process_of_another_node(jobs, job_name):
    job = jobs[job_name]
    for source in JOBS[job_name][1]:
        want = replica_array(300, 0, source, "float32", [3], "random")
        _check_everywhere(job, f"broadcast-{source}", [want], one=True)
    nodes = {info["node_index"] for info in job.inits}
    sources = {job.inits[s]["node_index"] for s in JOBS[job_name][1]}
    assert sources == nodes, "some node's process was never the source"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("job_name", JOBS)
def test_mirrored_strategy_run_and_reduce_across_nodes(jobs, job_name, op):
    job = jobs[job_name]
    n = job.replicas
    want = np.array([n * (n + 1) / 2, n * n]) / (n if op == "MEAN" else 1)
    for pid, (result, info) in enumerate(zip(job.results(f"strategy-{op}"), job.inits)):
        assert result["num_replicas_in_sync"] == n
        assert result["made"] == [[r + 1.0, n] for r in info["replicas"]], pid
        (component,) = result["reduced"]
        assert same_bytes(component_arrays([component]), want), (pid, component)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("job_name", JOBS)
def test_scalars_and_empty_tensors_keep_their_shapes_across_nodes(jobs, job_name, op):
    job = jobs[job_name]
    _check_everywhere(job, f"edges-{op}", _expected(job, _step(job, f"edges-{op}")))


@pytest.mark.parametrize("job_name", JOBS)
def test_a_scalar_broadcast_keeps_its_shape_across_nodes(jobs, job_name):
    job = jobs[job_name]
    source = _step(job, "broadcast-scalar")["source"]
    _check_everywhere(job, "broadcast-scalar", [replica_array(500, 0, source, "float64", [], "int")], one=True)


@pytest.mark.parametrize("job_name", JOBS)
def test_every_process_lists_the_devices_of_every_node(jobs, job_name):
    job = jobs[job_name]
    everything = [f"cpu:{r}" for r in range(job.replicas)]
    placement = JOBS[job_name][0]
    for pid, info in enumerate(job.inits):
        assert info["list_devices"] == info["devices"] == everything, pid
        assert info["local_devices"] == [f"cpu:{r}" for r in info["replicas"]], pid
        assert (info["node_index"], info["num_nodes"], info["engine"]) == (placement[pid], max(placement) + 1, "gloo")
    assert len({(i["group"], i["epoch"]) for i in job.inits}) == 1


@pytest.mark.parametrize("job_name", JOBS)
def test_data_parallel_all_reduces_gradients_across_nodes(jobs, job_name):
    job = jobs[job_name]
    n = job.replicas
    for pid, result in enumerate(job.results("data_parallel")):
        assert result["mesh"] == [f"cpu:{r}" for r in range(n)]
        assert same_bytes(component_arrays(result["reduced"]), np.array([(n + 1) / 2])), pid


# --- a group of one node through a coordinator keeps TF's numbers ----------------------------------------------

CONFORMANCE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
CASES = [c for c in json.loads((CONFORMANCE / "cases.json").read_text())["cases"]
         if c["call"] in ("reduce", "batch_reduce") and c["num_devices"] == 8
         and all(v["devices"] == list(range(8)) for v in c["values"])
         and all(d == "same" for d in (c["destinations"] if c["call"] == "batch_reduce" else [c["destinations"]]))]
"""Every all-reduce vector over 8 devices: two processes of 4 devices each reproduce it."""


def _conformance_script(pid: int) -> list[dict]:
    mine = slice(4 * pid, 4 * pid + 4)
    steps = [{"op": "init", "name": "init"}]
    for case in CASES:
        steps.append({"op": "given", "name": case["id"], "call": case["call"], "reduce_op": case["reduce_op"],
                      "num_packs": case["num_packs"], "npz": str(CONFORMANCE / "arrays.npz"),
                      "values": [{"keys": v["keys"][mine], "devices": [f"CPU:{d}" for d in v["devices"][mine]]}
                                 for v in case["values"]]})
    return steps


@pytest.fixture(scope="module")
def one_node_job(start_module_daemon) -> Job:
    cluster = Cluster(1, ["--backend", "numpy", "--virtual-devices", "8"], start=start_module_daemon)
    return run_named(cluster, [0, 0], _conformance_script)


def test_a_group_of_one_node_through_a_coordinator(one_node_job):
    inits = one_node_job.inits
    assert [(i["num_nodes"], i["node_index"], i["engine"]) for i in inits] == [(1, 0, "")] * 2
    assert inits[0]["epoch"] == inits[1]["epoch"] >= 1 and inits[0]["group"] == inits[1]["group"]
    assert [i["local_devices"] for i in inits] == [[f"cpu:{d}" for d in range(4)], [f"cpu:{d}" for d in range(4, 8)]]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_a_group_of_one_node_reproduces_the_conformance_vectors(one_node_job, case):
    arrays = np.load(CONFORMANCE / "arrays.npz")
    for pid, result in enumerate(one_node_job.results(case["id"])):
        assert len(result) == len(case["expected"])
        for components, want in zip(result, case["expected"]):
            keys = want["keys"][4 * pid:4 * pid + 4]
            for component, key in zip(components, keys, strict=True):
                assert same_bytes(component_arrays([component]), arrays[key]), (pid, key)
