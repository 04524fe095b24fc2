"""``xreduce.distribution`` without a daemon: Keras' distribution_lib tests, ported, that need none.

DeviceMesh, TensorLayout, Distribution.scope, DataParallel's layouts and
``distribute_batch`` on explicit devices; what reaches a daemon is in
tests/integration/test_distribution.py.
"""

from __future__ import annotations

import collections
import re
import threading

import numpy as np
import pytest
from keras_env import CPU8, canonical_names, clean  # noqa: F401 (clean: an autouse fixture)
from xreduce import distribution as dist
from xreduce.distribute import PerReplica

# --- DeviceMesh ----------------------------------------------------------------------------------------------



def test_mesh_creation():
    shape, axis_names = (4, 2), ["batch", "model"]
    mesh = dist.DeviceMesh(shape, axis_names, CPU8)
    assert mesh.shape == shape
    assert mesh.axis_names == axis_names
    assert mesh.devices.shape == shape
    assert mesh.devices[1, 0] == "cpu:2" and mesh.devices.tolist()[3] == ["cpu:6", "cpu:7"]
    assert repr(mesh) == "<DeviceMesh shape=(4, 2), axis_names=['batch', 'model']>"


def test_mesh_input_validation():
    devices = [f"cpu:{i}" for i in range(4)]
    with pytest.raises(ValueError, match="Shape and axis_names cannot be empty"):
        dist.DeviceMesh((4,), "", devices)
    with pytest.raises(ValueError, match="Shape and axis_names should have same size"):
        dist.DeviceMesh((4, 2), ["batch"], devices)
    with pytest.raises(ValueError, match="Shape does not match the number of devices") as info:
        dist.DeviceMesh((4, 2), ["batch", "model"], devices)
    assert "shape=(4, 2) (8 devices)" in str(info.value) and "devices.shape=(4,) (4 devices)" in str(info.value)


@pytest.mark.parametrize(
    "shape, axis_names, message",
    [
        ((), ["batch"], "Shape and axis_names cannot be empty. Received: shape=(), axis_names=['batch']"),
        ((4, 0), ["a", "b"], "shape must be positive integers such as (8,) or (4, 2); got shape=(4, 0)"),
        ((-4,), ["a"], "shape must be positive integers such as (8,) or (4, 2); got shape=(-4,)"),
        (("4",), ["a"], "shape must be positive integers such as (8,) or (4, 2); got shape=('4',)"),
        ((4,), "batch", "axis_names must be a list of non-empty strings, one per axis; got 'batch'"),
        ((2, 2), ["a", "a"], "axis_names must be distinct; got ['a', 'a']"),
        ((2, 2), ["a", None], "axis_names must be a list of non-empty strings, one per axis; got ['a', None]"),
    ],
    ids=["empty-shape", "zero-dim", "negative-dim", "string-dim", "string-axis-names", "repeated-axis", "none-axis"],
)
def test_mesh_rejects_bad_shapes_and_axis_names(shape, axis_names, message):
    with pytest.raises(ValueError) as info:
        dist.DeviceMesh(shape, axis_names, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert str(info.value) == message


def test_mesh_takes_every_device_spec_form():
    forms = ["gpu:0", "/gpu:1", "GPU:2", "/device:GPU:3", "/job:localhost/replica:0/task:0/device:GPU:4", "Gpu:5"]
    mesh = dist.DeviceMesh(6, ["batch"], forms)
    assert mesh.shape == (6,)
    assert mesh.devices.tolist() == [f"gpu:{i}" for i in range(6)]
    other = dist.DeviceMesh((1,), ["batch"], ["/job:worker/replica:0/task:1/device:GPU:0"])
    assert other.devices.tolist() == ["/job:worker/replica:0/task:1/device:GPU:0"]


@pytest.mark.parametrize(
    "devices, message",
    [
        (["cpu:0", "/cpu:0"], "devices names ['cpu:0'] more than once"),
        (["cpu:0", "tpu:0"], "Unknown attribute 'tpu:0' is encountered while parsing the device spec: 'tpu:0'."),
        (["cpu:0", 1], "a device name must be a string such as 'GPU:0'; got 1 of type int"),
        ("cpu:0", "devices must be a list of device names; got the string 'cpu:0'"),
        ([], "devices can not be empty; got [] (pass devices=None for every device of list_devices())"),
    ],
    ids=["repeated", "tpu", "not-a-string", "a-string", "empty"],
)
def test_mesh_rejects_bad_devices(devices, message):
    with pytest.raises(ValueError) as info:
        dist.DeviceMesh((2,), ["batch"], devices)
    assert str(info.value).startswith(message), str(info.value)


def test_mesh_devices_are_read_only():
    mesh = dist.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="read-only"):
        mesh.devices[0] = "cpu:7"


# --- TensorLayout --------------------------------------------------------------------------------------------



@pytest.fixture
def mesh42():
    return dist.DeviceMesh((4, 2), ["data", "model"], CPU8)


def test_tensor_layout_creation(mesh42):
    axes = ("data", None)
    layout = dist.TensorLayout(axes, mesh42)
    assert layout.device_mesh is mesh42
    assert layout.axes == axes
    assert dist.TensorLayout(["data", "model"]).axes == ("data", "model")


def test_tensor_layout_validation(mesh42):
    with pytest.raises(ValueError, match="Invalid axis names for Layout") as info:
        dist.TensorLayout(("data", "unknown", None), mesh42)
    assert str(info.value) == "Invalid axis names for Layout. Valid axis names: ['data', 'model'], Got ['unknown']"


def test_lazy_device_mesh_injection(mesh42):
    layout = dist.TensorLayout(("data", None), None)
    assert layout.device_mesh is None and layout.axes == ("data", None)
    layout.device_mesh = mesh42
    assert layout.device_mesh is mesh42 and layout.axes == ("data", None)
    with pytest.raises(ValueError, match="Cannot override device mesh value. Existing value is <DeviceMesh"):
        layout.device_mesh = mesh42


def test_lazy_device_mesh_validation(mesh42):
    layout = dist.TensorLayout(("data", "unknown", None), None)
    assert layout.device_mesh is None and layout.axes == ("data", "unknown", None)
    with pytest.raises(ValueError, match="Invalid axis names for Layout"):
        layout.device_mesh = mesh42
    assert layout.device_mesh is None, "a rejected mesh is not kept"


@pytest.mark.parametrize(
    "axes, mesh, message",
    [
        ("data", None, "axes must be a tuple of mesh axis names or None, one per dimension; got 'data'"),
        (("data", 0), None, "axes must be mesh axis names (strings) or None; got axes=('data', 0)"),
        (("data", "data"), None, "axes can map a mesh axis to one dimension only; got axes=('data', 'data')"),
        (("data",), "mesh", "device_mesh must be a DeviceMesh; got 'mesh' of type str"),
    ],
    ids=["string", "int-axis", "repeated", "not-a-mesh"],
)
def test_tensor_layout_rejects(axes, mesh, message):
    with pytest.raises(ValueError) as info:
        dist.TensorLayout(axes, mesh)
    assert str(info.value) == message


# --- Distribution --------------------------------------------------------------------------------------------



def test_distribution_init_with_device_mesh(mesh42):
    d = dist.Distribution(mesh42)
    assert d.device_mesh is mesh42
    assert repr(d) == "<Distribution device_mesh=<DeviceMesh shape=(4, 2), axis_names=['data', 'model']>>"
    with pytest.raises(ValueError, match="device_mesh must be a DeviceMesh; got None of type NoneType"):
        dist.Distribution(None)


def test_scope(mesh42):
    distribution_1 = dist.Distribution(mesh42)
    distribution_2 = dist.Distribution(mesh42)
    assert dist.distribution() is None
    with distribution_1.scope():
        assert dist.distribution() is distribution_1
        with distribution_2.scope() as inner:
            assert inner is distribution_2 and dist.distribution() is distribution_2
        assert dist.distribution() is distribution_1
    assert dist.distribution() is None


def test_scope_restores_a_set_distribution_even_after_an_error(mesh42):
    outer, inner = dist.Distribution(mesh42), dist.DataParallel(devices=CPU8)
    dist.set_distribution(outer)
    with pytest.raises(KeyError), inner.scope():
        assert dist.distribution() is inner
        raise KeyError("boom")
    assert dist.distribution() is outer


def test_set_distribution_takes_a_distribution_or_none(mesh42):
    message = "set_distribution takes a Distribution or None; got 'dp' of type str"
    with pytest.raises(ValueError, match=re.escape(message)):
        dist.set_distribution("dp")
    d = dist.Distribution(mesh42)
    dist.set_distribution(d)
    assert dist.distribution() is d
    dist.set_distribution(None)
    assert dist.distribution() is None


def test_distribution_is_per_thread_as_in_keras(mesh42):
    dist.set_distribution(dist.Distribution(mesh42))
    seen = []
    t = threading.Thread(target=lambda: seen.append(dist.distribution()))
    t.start()
    t.join(10)
    assert seen == [None]


def test_base_distribution_defines_no_layouts(mesh42):
    d = dist.Distribution(mesh42)
    for call in (lambda: d.get_data_layout((4, 2)), lambda: d.get_variable_layout(np.zeros(2)),
                 lambda: d.get_tensor_layout("x"), lambda: d.distribute_dataset([1, 2])):
        with pytest.raises(NotImplementedError, match="Distribution defines no"):
            call()


@pytest.mark.parametrize("auto_shard_dataset", [True, False])
def test_distribute_dataset_with_one_process_is_the_dataset(auto_shard_dataset):
    """Keras' DataParallelDistributionTest.test_distribute_dataset: one process gets the dataset itself."""
    dataset = [np.arange(8).reshape(4, 2)]
    dp = dist.DataParallel(devices=CPU8, auto_shard_dataset=auto_shard_dataset)
    assert dp.auto_shard_dataset is auto_shard_dataset
    assert dp.distribute_dataset(dataset) is dataset


def test_auto_shard_dataset_must_be_a_bool():
    with pytest.raises(ValueError, match="auto_shard_dataset must be True or False; got 'yes'"):
        dist.DataParallel(devices=CPU8, auto_shard_dataset="yes")


# --- DataParallel --------------------------------------------------------------------------------------------



@pytest.fixture
def mesh8():
    return dist.DeviceMesh((8,), ["data"], CPU8)


def test_create_with_device_mesh(mesh8):
    d = dist.DataParallel(device_mesh=mesh8)
    assert d.device_mesh is mesh8
    assert len(d.device_mesh.devices) == 8
    assert d.device_mesh.axis_names == ["data"]
    assert d.batch_dim_name == "data"


def test_create_with_devices():
    d = dist.DataParallel(devices=CPU8)
    assert len(d.device_mesh.devices) == 8
    assert d.device_mesh.axis_names == ["batch"]
    assert d.batch_dim_name == "batch"


def test_two_dimensional_mesh_warns_and_splits_along_the_first_axis():
    mesh = dist.DeviceMesh((2, 2), ["batch", "model"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    with pytest.warns(UserWarning, match=re.escape(
            "Expect the input mesh to be 1D, but received mesh.devices.ndim=2. The first axis ('batch') will be "
            "used for data-parallel sharding.")):
        d = dist.DataParallel(device_mesh=mesh)
    assert d.batch_dim_name == "batch"
    x = d.distribute_batch(np.arange(4))
    assert [v.tolist() for v in x.values] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert x.devices == canonical_names(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])


def test_get_data_layout(mesh8):
    d = dist.DataParallel(device_mesh=mesh8)
    layout = d.get_data_layout(np.arange(16).reshape((4, 2, 2)).shape)
    assert layout.device_mesh is mesh8
    assert layout.axes == ("data", None, None)
    with pytest.raises(ValueError, match=re.escape("data_shape needs a batch dimension; got data_shape=()")):
        d.get_data_layout(())


def test_get_variable_layout(mesh8):
    d = dist.DataParallel(device_mesh=mesh8)
    layout = d.get_variable_layout(np.array([1, 2, 3]))
    assert layout.device_mesh is mesh8 and layout.axes == (None,)
    with pytest.raises(ValueError, match="variable must have a shape; got list"):
        d.get_variable_layout([1, 2, 3])


def test_get_tensor_layout(mesh8):
    assert dist.DataParallel(device_mesh=mesh8).get_tensor_layout("path/to/tensor") is None


# --- distribute_batch ----------------------------------------------------------------------------------------



@pytest.mark.parametrize("rows, n", [(10, 4), (8, 4), (4, 4), (7, 3), (9, 1)])
def test_distribute_batch_splits_as_numpy_array_split(rows, n):
    devices = [f"cpu:{i}" for i in range(n)]
    batch = np.arange(rows * 3).reshape(rows, 3)
    x = dist.DataParallel(devices=devices).distribute_batch(batch)
    assert isinstance(x, PerReplica) and x.devices == canonical_names(devices)
    expected = np.array_split(batch, n)
    assert [v.shape for v in x.values] == [e.shape for e in expected]
    for got, want in zip(x.values, expected):
        np.testing.assert_array_equal(got, want)


def test_distribute_batch_keeps_the_structure():
    Batch = collections.namedtuple("Batch", "x y")
    dp = dist.DataParallel(devices=["cpu:0", "cpu:1"])
    x, y = np.arange(12.0).reshape(6, 2), np.arange(6)
    pair = dp.distribute_batch((x, y))
    assert isinstance(pair, tuple) and [v.tolist() for v in pair[1].values] == [[0, 1, 2], [3, 4, 5]]
    named = dp.distribute_batch(Batch(x, y))
    assert isinstance(named, Batch) and named.x.values[1].tolist() == [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
    nested = dp.distribute_batch({"features": [x], "label": y})
    assert set(nested) == {"features", "label"} and isinstance(nested["features"][0], PerReplica)


def test_distribute_batch_needs_as_many_rows_as_devices():
    with pytest.raises(ValueError) as info:
        dist.DataParallel(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"]).distribute_batch(np.zeros((3, 2)))
    assert str(info.value) == ("distribute_batch: a batch of 3 rows can not be split across 4 data-parallel "
                               "replicas (mesh axis 'batch' of size 4); give at least 4 rows")


@pytest.mark.parametrize(
    "batch, message",
    [
        ((np.zeros((4, 2)), np.zeros(5)),
         "distribute_batch: every array of the batch must have the same number of rows; "
         "batch[0] has 4, batch[1] has 5"),
        (np.float64(3.0),
         "distribute_batch: batch must be an array with a batch (first) dimension; got float64 of shape ()"),
        ({"x": 1.5}, "distribute_batch: batch['x'] must be an array with a batch (first) dimension; got float 1.5"),
        ((), "distribute_batch: the batch holds no arrays; got ()"),
    ],
    ids=["rows-differ", "0-d", "python-scalar", "empty"],
)
def test_distribute_batch_rejects(batch, message):
    with pytest.raises(ValueError) as info:
        dist.DataParallel(devices=["cpu:0", "cpu:1"]).distribute_batch(batch)
    assert str(info.value) == message


# --- the public surface and the example ----------------------------------------------------------------------



@pytest.mark.parametrize("name", [n for n in dist.__all__ if n != "DEFAULT_BATCH_DIM_NAME"])
def test_every_public_name_has_an_example(name):
    doc = getattr(dist, name).__doc__ or ""
    assert ">>> " in doc, f"{name} has no runnable example"
