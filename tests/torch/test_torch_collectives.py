"""Every collective and reduce op of the "xreduce" backend through ``torch.distributed``'s public API.

One job per size (``torch_worker.py collectives``: 2 ranks run every case, 4 ranks a subset) runs each case on
the xreduce group and on a Gloo group of the same ranks, and each rank prints both results and the exact one.
The data are small whole numbers, whose sums, products and means are exact in every dtype and order, so
every result must be the exact one bit for bit, and Gloo's (where Gloo takes the case: it averages floating
types only). Copies (broadcast, the gathers) carry -0.0, NaNs with payloads (a signalling one too), infinities
and subnormals, which must arrive bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch_ranks import COLLECTIVE_TIMEOUT, WORKER, Ranks

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def suites(daemon, tmp_path_factory):
    """``suites(world_size)``: {case: [each rank's result]} of the job of that size (run once, when first asked)."""
    done: dict[int, dict[str, list[dict]]] = {}

    def suite(world_size: int) -> dict[str, list[dict]]:
        if world_size not in done:
            logs = tmp_path_factory.mktemp(f"collectives{world_size}")
            args = ["collectives", "--suite", "all" if world_size == 2 else "four"]
            with Ranks(WORKER, args, world_size, daemon.address, logs) as job:
                events = job.finish(JOB_TIMEOUT)
            names = events[0][0]["names"]
            results = {name: [] for name in names}
            for rank in events:
                assert rank[0] == events[0][0] and rank[-1] == {"event": "done"}
                for e in rank[1:-1]:
                    results[e["case"]].append(e)
            assert all(len(r) == world_size for r in results.values())
            done[world_size] = results
        return done[world_size]

    return suite


def words(result: dict) -> list[str]:
    """A result's elements' bit patterns in hexadecimal (``7fc12345``: a float32 quiet NaN with a payload)."""
    data = bytes.fromhex(result["bits"])
    width = torch.tensor([], dtype=getattr(torch, result["dtype"])).element_size()
    return [f"{int.from_bytes(data[i:i + width], sys.byteorder):0{2 * width}x}" for i in range(0, len(data), width)]


def mismatches(results: dict[str, list[dict]], prefix: str) -> list[str]:
    """Each case named ``prefix...`` whose xreduce result differs from the exact one or from Gloo's, in any rank."""
    cases = [name for name in results if name.startswith(prefix)]
    assert cases, f"no case {prefix}..."
    bad = []
    for name in cases:
        for rank, r in enumerate(results[name]):
            ours = r["xreduce"]
            for other in ("expected", "gloo"):
                theirs = r.get(other)
                if theirs is None or "unsupported" in theirs:
                    continue
                if isinstance(ours, list):  # objects
                    if ours != theirs:
                        bad.append(f"{name}, rank {rank}: {ours} != {other} {theirs}")
                elif ours["bits"] != theirs["bits"]:
                    differ = [(i, a, b) for i, (a, b) in enumerate(zip(words(ours), words(theirs))) if a != b]
                    bad.append(f"{name}, rank {rank}: {ours['values']} != {other} {theirs['values']}; the elements "
                               f"that differ (index, ours, {other}'s), in hexadecimal: {differ}")
    return bad


def failed_checks(results: dict[str, list[dict]], name: str) -> list[str]:
    return [f"{name}, rank {rank}: {check}" for rank, r in enumerate(results[name])
            for check, ok in r["checks"].items() if ok is not True]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_every_op_and_dtype_is_exact_and_gloos(suites, world_size):
    """SUM, AVG (an integer mean truncated, as Gloo's sum divided), MIN, MAX, PRODUCT; float32, float64,
    float16, bfloat16, int64, uint8 (4 ranks: float32, bfloat16, int64); and, on 2 ranks, random floats
    summed as Gloo sums them."""
    bad = mismatches(suites(world_size), "all_reduce/")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_copies_the_roots_bits(suites, world_size):
    """From rank 0 and 1 (4 ranks: 1 and 3), every dtype: -0.0, NaN payloads, sNaN, inf and subnormals kept."""
    bad = mismatches(suites(world_size), "broadcast/")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("collective", ["all_gather/", "all_gather_into_tensor/", "all_gather_object"])
def test_gathers_copy_every_ranks_bits(suites, world_size, collective):
    bad = mismatches(suites(world_size), collective)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("collective", ["gather/", "scatter/", "gather_object", "scatter_object_list"])
def test_gather_and_scatter_move_every_bit_to_and_from_the_root(suites, world_size, collective):
    """To and from rank 0 and 1 (4 ranks: 3), every dtype; the objects to rank 1 and from rank 0. A rank that is
    not the root keeps its input as it was."""
    bad = mismatches(suites(world_size), collective)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("collective", ["all_to_all_single/", "all_to_all/"])
def test_all_to_all_gives_each_rank_the_parts_sent_to_it(suites, world_size, collective):
    """Equal parts, uneven split sizes, the special bit patterns; and the list form with uneven parts (Gloo's
    takes equal sizes only: checked against the exact result)."""
    bad = mismatches(suites(world_size), collective)
    assert not bad, "\n".join(bad)


def test_an_all_to_all_whose_split_sizes_disagree_is_refused_by_every_rank(suites):
    """Every rank learns every rank's split sizes first, so all refuse the call alike (no rank waits for a data
    exchange the others never start) and the group goes on: the cases after it pass."""
    for r in suites(2)["refused/all_to_all"]:
        assert r["error"] is not None and r["error"]["type"] == "ValueError", r
        assert r["error"]["message"] == ("all_to_all: rank 0 sends 1 element(s) to rank 1, which expects 2 from it "
                                         "(its output split sizes)"), r


def test_send_is_refused_naming_it(suites):
    for r in suites(2)["refused/send"]:
        assert r["error"] is not None and r["error"]["type"] == "NotImplementedError", r
        assert r["error"]["message"].startswith("the xreduce backend has no send: it reduces; use the gloo or nccl "
                                                "backend for send"), r


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("collective", ["reduce_scatter/", "reduce_scatter_tensor/"])
def test_reduce_scatter_gives_each_rank_its_part(suites, world_size, collective):
    """SUM, AVG, MAX of float32 and int64 (4 ranks: SUM of float32); Gloo does not average int64."""
    bad = mismatches(suites(world_size), collective)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
def test_barrier_returns_once_every_rank_entered(suites, world_size):
    """Rank 0 enters first; the last rank enters once rank 0 is entering; rank 0's barrier returns after that."""
    assert not failed_checks(suites(world_size), "barrier")


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_op_returns_before_the_collective_is_done(suites, world_size):
    """Rank 0's ``all_reduce(async_op=True)`` returns while the others have not entered (they wait for rank 0 to
    look at its work): not completed then; ``wait()`` True, then completed and successful, and
    ``get_future().value()`` holds the reduced tensor itself."""
    assert not failed_checks(suites(world_size), "async_op")


def test_many_collectives_in_flight_each_get_their_result(suites):
    """Six ``all_reduce`` and an ``all_gather`` with ``async_op=True``, waited for in reverse order."""
    assert not failed_checks(suites(2), "async_many")


def test_views_that_are_not_contiguous_are_reduced_in_place(suites):
    """A transposed tensor summed; every other column of one MAX-reduced, the rest of it untouched; every other
    row broadcast into; a column gathered."""
    bad = mismatches(suites(2), "noncontiguous/")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_bitwise_ops_are_refused_naming_the_op(suites, op):
    for r in suites(2)[f"refused/{op}"]:
        assert r["error"]["type"] == "ValueError", r
        assert f"cannot reduce with ReduceOp.{op}; it takes SUM, AVG" in r["error"]["message"]


def test_a_bool_tensor_is_refused_naming_its_dtype(suites):
    for r in suites(2)["refused/bool"]:
        assert r["error"]["type"] == "ValueError", r
        assert r["error"]["message"].startswith("tensors[0]: the xreduce backend cannot reduce a tensor of dtype "
                                                "torch.bool (device cpu)")


def test_init_process_group_timeout_bounds_a_collective(ranks):
    """``init_process_group(timeout=3 s)``; rank 0 alone enters an ``all_reduce``: it fails with torch's
    ``DistBackendError`` carrying the daemon's message, after the 3 s (the daemon's own collective timeout
    is 60 s, and the job must end in 45)."""
    events = ranks(2, "timeout", "--timeout", "3").finish(COLLECTIVE_TIMEOUT * 0.75)
    error = next(e for e in events[0] if e["event"] in ("error", "no error"))
    print(f"\nrank 0's lone all_reduce failed after {error.get('seconds', float('nan')):.2f} s")
    assert error["event"] == "error", error
    assert error["type"] == "DistBackendError", error
    assert error["message"].startswith('collective 1 in group "torch-'), error
    assert "timed out after 3s waiting for process(es) [1]; arrived: [0]" in error["message"]
