"""examples/torch_ddp.py under torchrun (1 and 2 ranks, ``--hook``, ``--keras``) and as a plain script (1 rank).

Each run's loss falls and rank 0 says that every rank ended with the same weights (the example gathers their
checksums); runs that must train the same weights (one rank with or without torchrun; two ranks over xreduce or
over Gloo with xreduce's hook) print the same checksum.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from children import child_env

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch_ddp.py"
STEPS = 12
RUN_TIMEOUT = 90.0
LOSS = re.compile(r"^step +(\d+) +loss (\S+)$", re.M)
SAME = re.compile(r"^OK: (\d+) rank\(s\) end with the same weights, sha256 ([0-9a-f]{16})$", re.M)


@pytest.fixture(scope="module")
def example(daemon):
    """``example(nproc, *flags)``: (banner, losses, (ranks, checksum)) of a run (once per arguments); ``nproc``
    None runs ``python examples/torch_ddp.py``, a number ``torchrun --standalone`` (which picks its own port)."""
    runs: dict[tuple, tuple[str, list[float], tuple[int, str]]] = {}

    def run(nproc: int | None, *flags: str) -> tuple[str, list[float], tuple[int, str]]:
        if (nproc, *flags) not in runs:
            launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                                 str(nproc)]
            result = subprocess.run([sys.executable, *launcher, str(EXAMPLE), "--steps", str(STEPS), *flags],
                                    capture_output=True, text=True, timeout=RUN_TIMEOUT,
                                    env=dict(child_env(), XREDUCE_ADDRESS=daemon.address))
            assert result.returncode == 0, result.stdout + result.stderr[-4000:]
            banner = next(line for line in result.stdout.splitlines() if line.startswith("backend "))
            losses = [float(loss) for _, loss in LOSS.findall(result.stdout)]
            (ranks, checksum), = SAME.findall(result.stdout)
            runs[(nproc, *flags)] = banner, losses, (int(ranks), checksum)
        return runs[(nproc, *flags)]

    return run


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_trains_and_every_rank_ends_with_the_same_weights(example, nproc):
    banner, losses, (ranks, _) = example(nproc)
    assert banner == f"backend xreduce, {nproc} rank(s)"
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # steps 0, 10 and 11
    assert ranks == nproc


def test_plain_python_is_one_rank_as_under_torchrun(example):
    banner, losses, same = example(None)
    assert banner == "backend xreduce, 1 rank(s)"
    assert losses[-1] < losses[0]
    assert same == example(1)[2]


def test_hook_trains_the_weights_of_the_xreduce_backend(example):
    """``--hook``: Gloo the default group, DDP's gradients through ``xreduce.torch.allreduce_hook``; on two
    ranks the sums are the same bit for bit, so are the weights."""
    banner, losses, same = example(2, "--hook")
    assert banner == "backend gloo + xreduce hook, 2 rank(s)"
    assert losses[-1] < losses[0]
    assert same == example(2)[2]


def test_a_keras_model_trains_under_ddp_to_the_weights_of_gloo(example):
    """``--keras``: the MLP built with Keras 3 on its torch backend (a Keras model is a ``torch.nn.Module``), DDP
    over ``xreduce`` on two ranks: every rank ends with the weights DDP over Gloo trains, bit for bit."""
    banner, losses, same = example(2, "--keras")
    assert banner == "backend xreduce, 2 rank(s), a Keras model"
    assert losses[-1] < losses[0]
    gloo_banner, _, gloos = example(2, "--keras", "--backend", "gloo")
    assert gloo_banner == "backend gloo, 2 rank(s), a Keras model"
    assert same == gloos and same != example(2)[2]  # not the torch.nn MLP's weights
