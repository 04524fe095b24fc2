"""The SDK around the collectives: addresses, errors, the strategy, serve_embedded."""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
import xreduce
from children import child_env
from xreduce import distribute
from xreduce.distribute import (
    HierarchicalCopyAllReduce,
    Mirrored,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_daemon_is_unavailable_naming_the_address():
    dead = f"127.0.0.1:{_free_port()}"
    ops = HierarchicalCopyAllReduce(address=dead)
    v = PerReplica([np.zeros(1), np.zeros(1)], devices=["CPU:0", "CPU:1"])
    with pytest.raises(xreduce.UnavailableError, match=dead) as info:
        ops.reduce("sum", v, v)
    assert isinstance(info.value, xreduce.XReduceError)
    assert info.value.code.name == "UNAVAILABLE"


def test_address_precedence(monkeypatch):
    monkeypatch.delenv("XREDUCE_ADDRESS", raising=False)
    assert xreduce.resolve_address() == xreduce.DEFAULT_ADDRESS == "127.0.0.1:50551"
    monkeypatch.setenv("XREDUCE_ADDRESS", "unix:/tmp/from-env.sock")
    assert xreduce.resolve_address() == "unix:/tmp/from-env.sock"
    assert xreduce.resolve_address("127.0.0.1:1") == "127.0.0.1:1"
    with xreduce.serve_embedded(virtual_devices=2) as address:
        assert address.startswith("unix:")
        assert xreduce.resolve_address() == address
        assert xreduce.resolve_address("127.0.0.1:1") == "127.0.0.1:1"
    assert xreduce.resolve_address() == "unix:/tmp/from-env.sock"


def test_daemon_errors_keep_their_status(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    with pytest.raises(xreduce.NotFoundError, match="CPU:9"):
        ops.reduce("sum", PerReplica([np.zeros(1), np.zeros(1)], devices=["CPU:0", "CPU:9"]), "CPU:0")
    with pytest.raises(xreduce.InvalidArgumentError, match=r"float32\[3\] but components\[0\] is float32\[2\]"):
        ops.reduce("sum", PerReplica([np.zeros(2, np.float32), np.zeros(3, np.float32)],
                                     devices=["CPU:0", "CPU:1"]), "CPU:0")
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
        ops.reduce("mean", PerReplica([np.zeros(2), np.zeros(3)], devices=["CPU:0", "CPU:1"]), "CPU:1")


def test_per_replica_without_devices_takes_the_daemons_first(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([np.array([1.0]), np.array([2.0]), np.array([3.0])])
    out = ops.reduce("sum", v, v)
    assert list(out.devices) == [xreduce.canonical(f"CPU:{i}") for i in range(3)]
    assert list(v.devices) == list(out.devices)


def test_results_are_writable_numpy_arrays(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([np.ones(3), np.ones(3)], devices=["CPU:0", "CPU:1"])
    out = ops.reduce("sum", v, v)
    out.values[0][0] = 7.0  # a caller may update results in place
    assert out.values[1][0] == 2.0


def test_mirrored_strategy_run_reduce_and_values_from_function(daemon):
    strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce(address=daemon.address))
    assert strategy.num_replicas_in_sync == 8
    with strategy.scope():
        assert distribute.get_strategy() is strategy and distribute.has_strategy()
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.float32))

        def step(x):
            ctx = distribute.get_replica_context()
            return x * 2, {"id": np.int32(ctx.replica_id_in_sync_group)}

        doubled, info = strategy.run(step, args=(values,))
    assert not distribute.has_strategy() and distribute.get_replica_context().num_replicas_in_sync == 1
    assert isinstance(doubled, PerReplica) and isinstance(info["id"], PerReplica)
    np.testing.assert_array_equal(strategy.reduce("sum", doubled, axis=None), np.full(2, 56.0, np.float32))
    np.testing.assert_array_equal(strategy.reduce("mean", doubled, axis=None), np.full(2, 7.0, np.float32))
    np.testing.assert_array_equal(strategy.reduce(ReduceOp.SUM, doubled, axis=0), np.float32(112.0))
    np.testing.assert_array_equal(strategy.reduce("mean", info["id"], axis=None), np.float64(3.5))
    mirrored = strategy.extended.reduce_to("sum", doubled, doubled)
    assert isinstance(mirrored, Mirrored) and len(mirrored.values) == 8
    pair = strategy.extended.batch_reduce_to("mean", [(doubled, "CPU:3"), (doubled, doubled)])
    np.testing.assert_array_equal(pair[0], np.full(2, 7.0, np.float32))
    assert strategy.reduce("mean", np.float32(4.0)) == 4.0
    with pytest.raises(ValueError, match="cannot be reduced"):
        strategy.reduce("sum", np.float32(4.0))


@pytest.mark.parametrize("devices", [["CPU:99"], ["CPU:0", "gpu:3"]], ids=["one", "two"])
def test_mirrored_strategy_checks_its_devices_on_first_use(daemon, devices):
    strategy = MirroredStrategy(devices=devices, address=daemon.address)  # constructing asks nothing
    assert strategy.num_replicas_in_sync == len(devices)
    listing = ", ".join(f"CPU:{i}" for i in range(8))
    message = (f"MirroredStrategy(devices={devices!r}): no device {devices[-1]!r} on the daemon at "
               f"{daemon.address}; its devices are {listing}")
    value = PerReplica([np.ones(2)] * len(devices), devices=devices)
    for use in (lambda: strategy.run(lambda: np.ones(2)),
                lambda: strategy.reduce("sum", value, axis=None),
                lambda: strategy.reduce("sum", np.ones(2)),
                lambda: strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2)),
                lambda: strategy.extended.reduce_to("sum", value, devices[0]),
                lambda: strategy.extended.batch_reduce_to("sum", [(value, devices[0])])):
        with pytest.raises(xreduce.NotFoundError) as e:
            use()
        assert str(e.value) == message
        assert e.value.code.name == "NOT_FOUND"


def test_serve_embedded_serves_and_stops():
    with xreduce.serve_embedded(virtual_devices=3) as address:
        strategy = MirroredStrategy()
        assert strategy.num_replicas_in_sync == 3
        v = PerReplica([np.int64(1), np.int64(2), np.int64(3)])
        assert HierarchicalCopyAllReduce().reduce("sum", v, "CPU:2") == 6
    with pytest.raises(xreduce.UnavailableError):
        HierarchicalCopyAllReduce(address=address).reduce("sum", v, "CPU:2")


def test_leaving_serve_embedded_ends_the_sessions_before_the_daemon_stops():
    """A call through shared memory opens a session (a stream the daemon holds open). Leaving the block ends it
    first: the daemon then stops with no call to cancel, and gRPC has nothing to log on stderr (it logged ``Got
    goaway ... Cancelling all calls`` when the daemon cut the stream)."""
    script = (
        "import numpy as np, xreduce\n"
        "from xreduce import _runtime\n"
        "from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica\n"
        "with xreduce.serve_embedded(virtual_devices=2) as address:\n"
        "    v = PerReplica([np.ones(1 << 16, np.float32)] * 2, devices=['CPU:0', 'CPU:1'])\n"
        "    assert float(HierarchicalCopyAllReduce().reduce('sum', v, 'CPU:0')[0]) == 2.0\n"
        "    assert any(key[0] == address for key in _runtime.default()._sessions)\n"
        "assert not any(key[0] == address for key in _runtime.default()._sessions)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    assert "goaway" not in done.stderr.lower(), done.stderr


def test_python_scalars_follow_tf_conversion(daemon):
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    out = ops.reduce("sum", PerReplica([1.5, 2.5], devices=["CPU:0", "CPU:1"]), "CPU:0")
    assert out.dtype == np.float32 and out == 4.0
    out = ops.reduce("sum", PerReplica([1, 2], devices=["CPU:0", "CPU:1"]), "CPU:0")
    assert out.dtype == np.int32
    with pytest.raises(ValueError, match="bool"):
        ops.reduce("sum", PerReplica([True, False], devices=["CPU:0", "CPU:1"]), "CPU:0")


def test_bfloat16_through_ml_dtypes(daemon):
    import ml_dtypes

    ops = HierarchicalCopyAllReduce(address=daemon.address)
    x = [np.array([1.5, 3.0], ml_dtypes.bfloat16), np.array([0.25, -1.0], ml_dtypes.bfloat16)]
    out = ops.reduce("mean", PerReplica(x, devices=["CPU:0", "CPU:1"]), "CPU:0")
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), [0.875, 1.0])


def test_torch_tensors_come_back_as_torch(daemon):
    torch = pytest.importorskip("torch", reason="torch is not installed; interop is optional")
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], devices=["CPU:0", "CPU:1"])
    out = ops.reduce("sum", v, v)
    assert all(isinstance(t, torch.Tensor) for t in out.values)
    assert out.values[0].tolist() == [4.0, 6.0]
    bf = PerReplica([torch.tensor([1.5], dtype=torch.bfloat16)] * 2, devices=["CPU:0", "CPU:1"])
    assert ops.reduce("sum", bf, "CPU:0").dtype == torch.bfloat16


def test_jax_arrays_come_back_as_jax(daemon):
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed; interop is optional")
    import jax

    ops = HierarchicalCopyAllReduce(address=daemon.address)
    v = PerReplica([jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])], devices=["CPU:0", "CPU:1"])
    out = ops.reduce("sum", v, "CPU:1")
    assert isinstance(out, jax.Array) and out.tolist() == [4.0, 6.0]


def test_an_array_is_a_destination_as_a_tf_tensor_is(daemon):
    """TF takes a tensor as destinations (its device); a host array's device is the first one."""
    ops = HierarchicalCopyAllReduce(address=daemon.address)
    grad = np.array([1.5, 2.5], np.float32)
    out = ops.batch_reduce("sum", [(grad, grad)])[0]
    np.testing.assert_array_equal(out, grad)
    v = PerReplica([np.ones(2), np.ones(2)], devices=["CPU:0", "CPU:1"])
    np.testing.assert_array_equal(ops.reduce("sum", v, np.zeros(1)), [2.0, 2.0])
    with pytest.raises(ValueError, match="destinations must be one of"):
        ops.reduce("sum", v, 0)
