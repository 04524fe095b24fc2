"""Device names: every TF DeviceSpec form parses; canonical, short and keras forms."""

from __future__ import annotations

import re

import pytest
from xreduce.wire.devices import DeviceName, canonical

FORMS = [
    # (spec, device_type, index)
    ("/job:localhost/replica:0/task:0/device:GPU:1", "GPU", 1),
    ("/device:GPU:1", "GPU", 1),
    ("GPU:1", "GPU", 1),
    ("/gpu:1", "GPU", 1),
    ("gpu:1", "GPU", 1),
    ("/job:localhost/replica:0/task:0/device:CPU:0", "CPU", 0),
    ("/device:CPU:0", "CPU", 0),
    ("CPU:0", "CPU", 0),
    ("/cpu:0", "CPU", 0),
    ("cpu:0", "CPU", 0),
    ("/job:localhost/replica:0/task:0/device:gpu:7", "GPU", 7),
    ("/device:cpu:3", "CPU", 3),
    ("Gpu:2", "GPU", 2),
    ("/gPu:12", "GPU", 12),
    ("cPU:5", "CPU", 5),
    ("/job:localhost/device:GPU:4", "GPU", 4),
    (" GPU:1 ", "GPU", 1),
]


@pytest.mark.parametrize("spec, device_type, index", FORMS, ids=[f[0].strip() or "blank" for f in FORMS])
def test_parse_accepted_forms(spec, device_type, index):
    name = DeviceName.parse(spec)
    assert name == DeviceName(device_type, index)
    assert (name.device_type, name.index, name.job, name.replica, name.task) == (device_type, index, "localhost", 0, 0)
    assert name.canonical == f"/job:localhost/replica:0/task:0/device:{device_type}:{index}"
    assert name.short == f"{device_type}:{index}"
    assert name.keras == f"{device_type.lower()}:{index}"
    assert canonical(spec) == name.canonical


@pytest.mark.parametrize(
    "spec",
    ["GPU:1", "/gpu:1", "cpu:0", "/job:localhost/replica:0/task:0/device:CPU:5"],
)
def test_every_form_parses_back_to_itself(spec):
    name = DeviceName.parse(spec)
    assert DeviceName.parse(name.canonical) == name
    assert DeviceName.parse(name.short) == name
    assert DeviceName.parse(name.keras) == name


def test_other_job_replica_task_are_kept():
    name = DeviceName.parse("/job:worker/replica:2/task:3/device:GPU:1")
    assert (name.job, name.replica, name.task) == ("worker", 2, 3)
    assert name.canonical == "/job:worker/replica:2/task:3/device:GPU:1"
    assert name.short == "GPU:1"
    assert name.keras == "gpu:1"
    assert name != DeviceName.parse("GPU:1")


def test_names_sort_and_hash():
    names = [DeviceName.parse(s) for s in ("GPU:1", "CPU:2", "gpu:0", "/cpu:0")]
    assert [n.short for n in sorted(names)] == ["CPU:0", "CPU:2", "GPU:0", "GPU:1"]
    assert len({DeviceName.parse("/gpu:1"), DeviceName.parse("GPU:1")}) == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        pytest.param(
            "garbage",
            "Unknown attribute 'garbage' is encountered while parsing the device spec: 'garbage'.",
            id="garbage",
        ),
        pytest.param("", "a device name can not be empty; got ''", id="empty"),
        pytest.param("   ", "a device name can not be empty; got ''", id="blank"),
        pytest.param(
            "tpu:0",
            "Unknown attribute 'tpu:0' is encountered while parsing the device spec: 'tpu:0'.",
            id="tpu",
        ),
        pytest.param("/device:TPU:0", "device name '/device:TPU:0': unknown device type 'TPU'", id="device-tpu"),
        pytest.param("gpu", "Unknown attribute 'gpu' is encountered while parsing the device spec: 'gpu'.",
                     id="gpu-no-index"),
        pytest.param("GPU:", "Unknown attribute 'GPU:' is encountered while parsing the device spec: 'GPU:'.",
                     id="gpu-colon-no-index"),
        pytest.param("/device:GPU", "device name '/device:GPU': '' is not a non-negative integer",
                     id="device-gpu-no-index"),
        pytest.param("/job:localhost", "device name '/job:localhost' names no device type and index",
                     id="job-only"),
        pytest.param("/job:localhost/replica:0/task:0",
                     "device name '/job:localhost/replica:0/task:0' names no device type and index",
                     id="job-replica-task"),
        pytest.param("gpu:-1", "device name 'gpu:-1': '-1' is not a non-negative integer", id="negative-index"),
        pytest.param("gpu:x", "device name 'gpu:x': 'x' is not a non-negative integer", id="letter-index"),
        pytest.param("/job:localhost/replica:a/device:GPU:0",
                     "device name '/job:localhost/replica:a/device:GPU:0': 'a' is not a non-negative integer",
                     id="bad-replica"),
        pytest.param("/job:localhost/bogus:1/device:GPU:0",
                     "Unknown attribute 'bogus:1' is encountered while parsing the device spec: "
                     "'/job:localhost/bogus:1/device:GPU:0'.",
                     id="unknown-attribute"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(ValueError) as info:
        DeviceName.parse(spec)
    assert str(info.value).startswith(message), str(info.value)
    if spec.strip():
        assert repr(spec) in str(info.value), "the message repeats the spec"


@pytest.mark.parametrize(
    "spec, type_name",
    [(None, "NoneType"), (0, "int"), (1.5, "float"), (b"GPU:0", "bytes"), (["GPU:0"], "list")],
    ids=["None", "int", "float", "bytes", "list"],
)
def test_parse_rejects_non_strings(spec, type_name):
    with pytest.raises(ValueError, match=re.escape(f"got {spec!r} of type {type_name}")) as info:
        DeviceName.parse(spec)
    assert str(info.value).startswith("a device name must be a string such as 'GPU:0'")


@pytest.mark.parametrize("spec", ["/device:GPU:0/device:CPU:1", "gpu:0/cpu:1"], ids=["device-twice", "short-twice"])
def test_parse_rejects_two_device_types(spec):
    with pytest.raises(ValueError, match="Multiple device types are not allowed"):
        DeviceName.parse(spec)
