"""Every conformance case and error entry through the SDK against a real daemon.

This is what a training process sees: ``xreduce.distribute`` objects, numpy
arrays in and out, TF's return types (a plain array for one destination
device, a ``Mirrored`` otherwise) and TF's client-side errors.
"""

from __future__ import annotations

import ast
import json
import pathlib

import numpy as np
import pytest
import xreduce
from xreduce.distribute import HierarchicalCopyAllReduce, Mirrored, PerReplica

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
DOC = json.loads((HERE / "cases.json").read_text())
ARRAYS = np.load(HERE / "arrays.npz")
ERRORS = [e for e in DOC["errors"] if e["error"]["match"] != "not_applicable"]
TYPES = {"ValueError": ValueError, "TypeError": TypeError}


@pytest.fixture(scope="module", params=["shm", "wire"])
def ops_for(daemon, request):
    """Every case runs over both transports: shared memory and bytes on the wire."""
    made = {}

    def get(num_packs):
        if num_packs not in made:
            made[num_packs] = HierarchicalCopyAllReduce(num_packs=num_packs, address=daemon.address,
                                                        transport=request.param)
        return made[num_packs]

    yield get
    for ops in made.values():
        ops.close()


def _per_replica(entry) -> PerReplica:
    return PerReplica([ARRAYS[k] for k in entry["keys"]], devices=[f"CPU:{d}" for d in entry["devices"]])


def _dest(spec, value):
    return value if spec == "same" else [f"CPU:{d}" for d in spec]


def _op(case):
    return case["reduce_op"] or ast.literal_eval(case["reduce_op_python"])


def _check(got, want):
    if len(want["devices"]) == 1:
        assert isinstance(got, np.ndarray), f"one destination device gives a plain array, got {type(got)}"
        arrays, devices = [got], None
    else:
        assert isinstance(got, Mirrored), f"several destination devices give a Mirrored, got {type(got)}"
        arrays, devices = list(got.values), list(got.devices)
        assert devices == [xreduce.canonical(f"CPU:{d}") for d in want["devices"]]
    for arr, key in zip(arrays, want["keys"]):
        expected = ARRAYS[key]
        assert arr.dtype == expected.dtype and arr.shape == expected.shape
        assert arr.tobytes() == expected.tobytes(), f"{arr!r} != {expected!r}"


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["id"] for c in DOC["cases"]])
def test_case(ops_for, case):
    ops = ops_for(case["num_packs"])
    if case["call"] == "broadcast":
        v = case["values"][0]
        tensor = v["python_value"] if "python_value" in v else ARRAYS[v["key"]]
        dest = [f"CPU:{d}" for d in case["destinations"]]
        results = [ops.broadcast(tensor, dest[0] if len(dest) == 1 else dest)]
    elif case["call"] == "reduce":
        value = _per_replica(case["values"][0])
        results = [ops.reduce(_op(case), value, _dest(case["destinations"], value))]
    else:
        values = [_per_replica(v) for v in case["values"]]
        pairs = [(v, _dest(d, v)) for v, d in zip(values, case["destinations"])]
        results = ops.batch_reduce(_op(case), pairs)
    assert len(results) == len(case["expected"])
    for got, want in zip(results, case["expected"]):
        _check(got, want)


@pytest.mark.parametrize("entry", ERRORS, ids=[e["id"] for e in ERRORS])
def test_error(daemon, entry):
    err = entry["error"]
    if entry["call"] == "constructor":
        call = lambda: HierarchicalCopyAllReduce(num_packs=entry["num_packs"], address=daemon.address)  # noqa: E731
    else:
        ops = HierarchicalCopyAllReduce(num_packs=entry["num_packs"], address=daemon.address)
        v = entry["values"][0]
        if entry["call"] == "broadcast":
            tensor = ARRAYS[v["key"]]
            call = lambda: ops.broadcast(tensor, ast.literal_eval(entry["destinations_python"]))  # noqa: E731
        else:
            v0 = _per_replica(v)
            op = _op(entry)
            if "destinations_python" in entry:
                call = lambda: ops.reduce(op, v0, ast.literal_eval(entry["destinations_python"]))  # noqa: E731
            elif "pairs_python" in entry:
                pairs = eval(entry["pairs_python"], {"v0": v0, "t0": v0.values[0]})  # noqa: S307
                call = lambda: ops.batch_reduce(op, pairs)  # noqa: E731
            else:
                call = lambda: getattr(ops, entry["call"])(op, v0, v0) if entry["call"] == "reduce" \
                    else ops.batch_reduce(op, [(v0, v0)])  # noqa: E731
    expected = TYPES.get(err["type"], Exception) if err["match"] != "any" else Exception
    with pytest.raises(expected) as info:
        call()
    if err["match"] == "exact":
        assert str(info.value) == err["message"]
    if err["match"] == "any":
        # What TF accepted or crashed on, the daemon rejects by name.
        assert isinstance(info.value, xreduce.InvalidArgumentError), repr(info.value)
        assert "replicas must agree in dtype and shape" in str(info.value)


def test_not_applicable_entries_are_accepted(daemon):
    """TF rejects a list or tuple of device strings as destinations; xreduce takes them."""
    entries = [e for e in DOC["errors"] if e["error"]["match"] == "not_applicable"]
    assert entries
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    for entry in entries:
        v = entry["values"][0]
        if entry["call"] == "broadcast":
            out = ops.broadcast(ARRAYS[v["key"]], ast.literal_eval(entry["destinations_python"]))
            assert np.array_equal(out, ARRAYS[v["key"]])
        elif entry["call"] == "reduce":
            out = ops.reduce("sum", _per_replica(v), ast.literal_eval(entry["destinations_python"]))
            assert np.array_equal(out, ARRAYS[v["keys"][0]] + ARRAYS[v["keys"][1]])
        else:
            v0 = _per_replica(v)
            (out,) = ops.batch_reduce("sum", eval(entry["pairs_python"], {"v0": v0}))  # noqa: S307
            assert list(out.devices) == [xreduce.canonical("CPU:0"), xreduce.canonical("CPU:1")]
