"""Keras ``model.fit`` through the daemon against TF's own all-reduce, in fresh TensorFlow processes.

Each run is ``python -m xreduce_bench.keras_job`` (a real Keras 3 ``fit`` on logical CPUs, SGD with
momentum, 20 steps) with TF's own ``HierarchicalCopyAllReduce`` or ``ReductionToOneDevice``, or with
``xreduce.tensorflow``'s against a real daemon; the weights are compared bit for bit, or within the
bound the order of additions allows where TF adds in another order.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from children import child_env
from tf_env import QUIET
from xreduce.tensorflow._bridge import XLA_MESSAGE

JOB_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8")


def fit(daemon, tmp_path, strategy: str, replicas: int, *flags: str, **environ: str) -> tuple[dict, list[np.ndarray]]:
    """One job's fit event and weights (``environ``: more of the job's environment)."""
    out = tmp_path / f"{strategy}-{replicas}-{abs(hash(flags))}-{abs(hash(tuple(environ.items())))}.npz"
    env = dict(child_env(), XREDUCE_ADDRESS=daemon.address, **QUIET, **environ)
    proc = subprocess.run([sys.executable, "-m", "xreduce_bench.keras_job", "--strategy", strategy, "--replicas",
                           str(replicas), "--out", str(out), *flags], env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = events[-1] if events else {"event": "none", "stderr": proc.stderr[-3000:]}
    if last["event"] != "fit":
        return last, []
    with np.load(out) as weights:
        return last, [weights[k] for k in weights.files]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [w.shape for w in a] == [w.shape for w in b]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize("model", ["mlp", "mlp1m", "embedding"])
def test_two_replicas_train_to_tfs_weights_bit_for_bit(daemon, tmp_path, model):
    """One process, two logical CPUs: TF's HierarchicalCopyAllReduce, xreduce's in TF's MirroredStrategy and
    xreduce's MirroredStrategy give the same weights after 20 steps (and a partial last batch); the
    embedding's gradients are IndexedSlices, concatenated as TF concatenates them. The first xreduce job's
    steps take xreduce's TF kernel (xreduce.tensorflow._kernel; the 1 M MLP's 8.6 MB call in phases, its results
    over the inputs), the second's (the kernel off) the tf.numpy_function bridge with a prepared batch in Python."""
    flags = ("--model", model, "--extra-rows", "37")
    tf_fit, tf_weights = fit(daemon, tmp_path, "tf-hcar", 2, *flags)
    for strategy, kernel in (("xreduce-ops", "1"), ("xreduce", "0")):
        event, weights = fit(daemon, tmp_path, strategy, 2, *flags, XREDUCE_TF_KERNEL=kernel)
        assert event["event"] == "fit", event
        assert event["history"] == tf_fit["history"] and event["replicas"] == 2
        assert bitwise(weights, tf_weights)
        if model != "embedding":  # every step's all-reduce a prepared batch (xreduce._prepared); sparse ones are not
            calls = event["kernel_calls"] if kernel == "1" else event["prepared_calls"]
            assert calls >= 21, event
        if kernel == "0":
            assert event["kernel_calls"] == 0, event


def test_four_replicas_match_tf_once_grappler_keeps_its_order(daemon, tmp_path):
    """At four replicas Grappler's arithmetic optimizer reorders TF's own sum tree inside tf.function; with it
    off, TF adds in the hierarchical copy's order and the weights are the same bit for bit. With it on
    (TF's default) they differ only by that order."""
    off = ("--no-arithmetic-optimization",)
    _, tf_off = fit(daemon, tmp_path, "tf-hcar", 4, *off)
    _, x_off = fit(daemon, tmp_path, "xreduce-ops", 4, *off)
    assert bitwise(x_off, tf_off)
    _, tf_on = fit(daemon, tmp_path, "tf-hcar", 4)
    _, x_on = fit(daemon, tmp_path, "xreduce-ops", 4)
    assert bitwise(x_on, x_off)  # the daemon's order does not depend on Grappler
    assert 0 < max_diff(x_on, tf_on) < 1e-5


def test_three_replicas_tf_drops_a_replica_xreduce_does_not(daemon, tmp_path):
    """TF's HierarchicalCopyAllReduce over an odd device count leaves the last device out of the sum (bug (a)):
    its weights are far from ReductionToOneDevice's; xreduce's add every replica, in another order than
    ReductionToOneDevice's left fold."""
    flags = ("--batch", "66")
    _, dropped = fit(daemon, tmp_path, "tf-hcar", 3, *flags)
    _, folded = fit(daemon, tmp_path, "tf-rtod", 3, *flags)
    _, ours = fit(daemon, tmp_path, "xreduce-ops", 3, *flags)
    assert max_diff(dropped, folded) > 1e-3
    assert max_diff(ours, folded) < 1e-5


def test_jit_compile_is_refused_with_what_to_do(daemon, tmp_path):
    event, _ = fit(daemon, tmp_path, "xreduce-ops", 2, "--jit-compile", "--steps", "2")
    assert event["event"] == "error" and event["type"] == "ValueError"
    assert event["message"].endswith(XLA_MESSAGE)
