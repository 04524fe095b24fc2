"""DDP over the "xreduce" backend against DDP over Gloo: the same MLP, data and seeds, in real processes.

Each job (``torch_worker.py ddp``) trains the MLP three times, from the same initial weights on the same
batches: with DDP over an xreduce group, over a Gloo group of the same ranks, and over that Gloo group with
``xreduce.torch.allreduce_hook`` sending the gradients through the xreduce group. Two ranks add in the only
order there is (``a + b`` is ``b + a``), so the weights are the same bit for bit. Four ranks are summed by the
daemon as ``(g0 + g1) + (g2 + g3)`` and by Gloo's ring in another order: the weights differ by rounding only
(:data:`FOUR_RANKS_BOUND`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 10
JOB_TIMEOUT = 90.0

FOUR_RANKS_BOUND = 1e-6
"""The largest difference between a weight trained over xreduce and over Gloo on four ranks, after
:data:`STEPS` steps of SGD (momentum 0.9, lr 0.01) of the worker's MLP (32-64-64-1), whose weights stay
below 0.4 in size: about 33 float32 ulps there. Seen: 3.0e-8 (one ulp), the sums' rounding carried through
10 steps."""


def train(ranks, tmp_path, world_size: int, default: str) -> dict[str, list[torch.Tensor]]:
    """Each variant's final weights (rank 0's), after checking that every rank ends with the same."""
    out = tmp_path / f"weights-{world_size}-{default}.pt"
    job = ranks(world_size, "ddp", "--default", default, "--steps", str(STEPS), "--out", str(out))
    events = job.finish(JOB_TIMEOUT)
    trained = [{e["variant"]: e for e in rank if e.get("event") == "trained"} for rank in events]
    assert sorted(trained[0]) == ["gloo", "hook", "xreduce"], events[0]
    for variant in trained[0]:
        assert len({t[variant]["digest"] for t in trained}) == 1, f"the ranks' {variant} weights differ"
    return torch.load(out)


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_two_ranks_train_to_gloos_weights_bit_for_bit(ranks, tmp_path):
    """xreduce the default group: DDP over it, and Gloo's DDP with the hook on it, end where Gloo's does."""
    weights = train(ranks, tmp_path, 2, "xreduce")
    assert identical(weights["xreduce"], weights["gloo"]), max_diff(weights["xreduce"], weights["gloo"])
    assert identical(weights["hook"], weights["gloo"]), max_diff(weights["hook"], weights["gloo"])


def test_the_hook_on_a_gloo_default_group_matches_gloo_bit_for_bit(ranks, tmp_path):
    """Gloo the default group, ``ddp.register_comm_hook(dist.new_group(backend="xreduce"), allreduce_hook)``:
    the documented way to keep Gloo and send only DDP's gradients through the daemon."""
    weights = train(ranks, tmp_path, 2, "gloo")
    assert identical(weights["hook"], weights["gloo"]), max_diff(weights["hook"], weights["gloo"])
    assert identical(weights["xreduce"], weights["gloo"]), max_diff(weights["xreduce"], weights["gloo"])


def test_four_ranks_differ_from_gloo_by_the_order_of_additions_only(ranks, tmp_path):
    weights = train(ranks, tmp_path, 4, "xreduce")
    assert identical(weights["hook"], weights["xreduce"])  # both are the daemon's sums
    diff = max_diff(weights["xreduce"], weights["gloo"])
    print(f"\nfour ranks, {STEPS} steps: max |xreduce - gloo| = {diff:.3g}")
    assert diff <= FOUR_RANKS_BOUND
