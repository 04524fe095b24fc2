"""``xreduce.distribution``: Keras' distribution_lib tests, ported, against real daemons.

The Keras tests that apply (DeviceMesh, TensorLayout, Distribution.scope,
DataParallel, initialize's precedence) run here against an embedded daemon or
the ``xreduced`` subprocess, never a mock; so do the xreduce additions
(``distribute_batch``, ``all_reduce_gradients``) and the example script. Those
that need no daemon at all are in tests/unit/test_distribution_layouts.py.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import xreduce
from keras_env import CPU8, ENV, canonical_names, clean  # noqa: F401 (clean: an autouse fixture)
from xreduce import distribution as dist
from xreduce._runtime import set_process_group
from xreduce.distribute import HierarchicalCopyAllReduce, Mirrored, MirroredStrategy, PerReplica, ReduceOp

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "keras_utils.py"


@pytest.fixture
def embedded():
    """An in-process daemon with 4 host devices; the SDK talks to it by default."""
    with xreduce.serve_embedded(virtual_devices=4) as address:
        yield address


class Peers:
    """The other processes of a multi-process job, as DistributionState threads joining the same daemon
    with the same ``job_addresses`` (whose first names the coordinator: it must be free or the daemon's)."""

    def __init__(self, address: str, count: int, me: int, job_addresses: str | list[str] = ()):
        self.states = {p: dist.DistributionState(address=address) for p in range(count) if p != me}
        self.threads = [
            threading.Thread(target=state.initialize, kwargs={"job_addresses": job_addresses,
                                                              "num_processes": count, "process_id": p})
            for p, state in self.states.items()
        ]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for t in self.threads:
            t.join(30)
        joined = all(state.is_initialized for state in self.states.values())
        for state in self.states.values():
            state.shutdown()
        assert exc[0] is not None or joined, "a peer did not join"


def free_address() -> str:
    """A loopback ``host:port`` nothing listens on now: a coordinator's address for one test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def coordinator() -> str:
    """The job's first address: process 0's daemon serves the coordinator there."""
    return free_address()


@pytest.fixture
def dead(monkeypatch):
    """An address nothing listens on, made the SDK's default: any daemon call fails."""
    address = free_address()
    monkeypatch.setenv("XREDUCE_ADDRESS", address)
    return address


# --- list_devices --------------------------------------------------------------------------------------------


def test_list_devices_in_keras_form(embedded):
    assert dist.list_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert dist.get_device_count() == 4


@pytest.mark.parametrize("device_type", ["cpu", "CPU", "Cpu", " cpu "])
def test_list_devices_type_is_case_insensitive(embedded, device_type):
    assert dist.list_devices(device_type) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert dist.get_device_count(device_type) == 4


@pytest.mark.parametrize("device_type", ["gpu", "GPU", "tpu", "cuda"])
def test_list_devices_absent_or_unknown_type_names_the_types_present(embedded, device_type):
    message = f"device_type {device_type!r} is not served by the xreduce daemon at {embedded}; " \
              "device types present: 'cpu' (4 devices)"
    with pytest.raises(ValueError, match=re.escape(message)):
        dist.list_devices(device_type)
    with pytest.raises(ValueError, match=re.escape(message)):
        dist.get_device_count(device_type)


def test_list_devices_rejects_a_non_string_type(embedded):
    message = "device_type must be a string such as 'gpu' or 'cpu'; got 0 of type int"
    with pytest.raises(ValueError, match=re.escape(message)):
        dist.list_devices(0)


def test_list_devices_of_the_real_daemon(daemon, monkeypatch):
    monkeypatch.setenv("XREDUCE_ADDRESS", daemon.address)
    assert dist.list_devices() == CPU8
    assert dist.get_device_count("cpu") == 8


def test_list_devices_unreachable_daemon_names_the_address(dead):
    with pytest.raises(xreduce.UnavailableError, match=re.escape(dead)):
        dist.list_devices()


def _gpu_reason():
    from xreduced.backends import cupy_backend

    return cupy_backend.unavailable_reason()


@pytest.mark.gpu
def test_list_devices_prefers_gpus():
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(f"GPU backend unavailable: {reason}")
    with xreduce.serve_embedded(virtual_devices=2, backend="cupy"):
        devices = dist.list_devices()
        assert devices == [f"gpu:{i}" for i in range(len(devices))] and devices
        assert dist.list_devices("GPU") == devices
        with pytest.raises(ValueError, match="device types present: 'gpu'"):
            dist.list_devices("cpu")


# --- initialize ----------------------------------------------------------------------------------------------


def test_initialize_with_explicit_params(embedded, coordinator):
    addresses = f"{coordinator},10.0.0.2:2345"  # both processes use the one daemon, which serves the coordinator
    with Peers(embedded, 2, me=1, job_addresses=addresses):
        info = dist.initialize(addresses, 2, 1)
    assert (info.process_id, info.num_processes) == (1, 2)
    assert info.job_addresses == (coordinator, "10.0.0.2:2345")
    assert info.coordinator_address == coordinator and info.is_multi_process
    assert info.daemon_address == embedded
    assert info.devices == ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    assert info.local_devices == ("cpu:2", "cpu:3") and info.group == f"default@{coordinator}"
    assert (info.num_nodes, info.node_index, info.is_multi_node) == (1, 0, False) and info.epoch >= 1
    assert dist.list_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert dist.process_info() is info and dist.is_initialized()
    assert (dist.process_id(), dist.num_processes()) == (1, 2)


def test_initialize_with_env_vars(embedded, coordinator, monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", f"{coordinator},10.0.0.2:2345")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    with Peers(embedded, 2, me=1, job_addresses=[coordinator, "10.0.0.2:2345"]):
        info = dist.initialize()
    assert (info.job_addresses, info.num_processes, info.process_id) == ((coordinator, "10.0.0.2:2345"), 2, 1)
    assert info.group == f"default@{coordinator}"


def test_initialize_reads_the_environment_only_for_arguments_that_are_none(embedded, monkeypatch):
    first, second = free_address(), free_address()
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", f"{first},b:2,c:3")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "3")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "2")
    with Peers(embedded, 3, me=0, job_addresses=f"{first},b:2,c:3"):
        info = dist.initialize(process_id=0)  # 0 is given, not None: the environment's 2 is not used
    assert (info.job_addresses, info.num_processes, info.process_id) == ((first, "b:2", "c:3"), 3, 0)
    dist.shutdown()
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    with Peers(embedded, 2, me=1, job_addresses=f"{second},y:2"):
        info = dist.initialize(job_addresses=f"{second},y:2", num_processes=2)  # the environment's 3: not read
    assert (info.job_addresses, info.num_processes, info.process_id) == ((second, "y:2"), 2, 1)
    assert info.group == f"default@{second}"


def test_initialize_argument_beats_an_environment_that_would_fail(embedded, monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "not-a-number")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "9")
    with Peers(embedded, 4, me=3):
        info = dist.initialize(num_processes=4, process_id=3)
    assert (info.num_processes, info.process_id, info.job_addresses) == (4, 3, ())


def test_initialize_with_nones_is_one_process(embedded):
    info = dist.initialize()
    assert (info.process_id, info.num_processes, info.job_addresses) == (0, 1, ())
    assert info.coordinator_address is None and not info.is_multi_process


def test_initialize_num_processes_defaults_to_the_address_count(embedded, coordinator):
    addresses = [coordinator, "b:2", "c:3"]
    with Peers(embedded, 3, me=2, job_addresses=addresses):
        info = dist.initialize(addresses, process_id=2)
    assert (info.num_processes, info.process_id) == (3, 2)


def test_initialize_one_address_is_the_coordinator(embedded, coordinator):
    with Peers(embedded, 2, me=1, job_addresses=coordinator):
        info = dist.initialize(coordinator, num_processes=2, process_id=1)
    assert info.coordinator_address == coordinator and info.num_processes == 2
    assert info.group == f"default@{coordinator}"


def test_empty_environment_variables_count_as_unset(embedded, monkeypatch):
    for name in ENV:
        monkeypatch.setenv(name, "")
    info = dist.initialize()
    assert (info.process_id, info.num_processes) == (0, 1)


def test_second_initialize_is_a_runtime_error(embedded):
    with Peers(embedded, 2, me=0):
        first = dist.initialize(num_processes=2, process_id=0)
    with pytest.raises(RuntimeError, match=re.escape(
            "xreduce.distribution.initialize() should only be called once; this process is already "
            "process_id=0 of num_processes=2")):
        dist.initialize(num_processes=2, process_id=1)
    assert dist.process_info() is first
    dist.shutdown()
    dist.shutdown()  # idempotent
    assert not dist.is_initialized() and (dist.process_id(), dist.num_processes()) == (0, 1)
    with Peers(embedded, 2, me=1):
        assert dist.initialize(num_processes=2, process_id=1).process_id == 1


@pytest.mark.parametrize("pid, count", [(5, 2), (2, 2), (-1, 2), (1, 1)])
def test_process_id_out_of_range(dead, pid, count):
    # Validation comes before the daemon check: the dead address is never called.
    message = f"process_id must be in [0, num_processes); got process_id={pid}, num_processes={count}"
    with pytest.raises(ValueError) as info:
        dist.initialize(num_processes=count, process_id=pid)
    assert str(info.value) == message
    assert not dist.is_initialized()


def test_process_id_out_of_range_from_the_environment_says_so(dead, monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "5")
    with pytest.raises(ValueError) as info:
        dist.initialize()
    assert str(info.value) == (
        "process_id must be in [0, num_processes); got process_id=5, num_processes=2 "
        "(process_id from KERAS_DISTRIBUTION_PROCESS_ID, num_processes from KERAS_DISTRIBUTION_NUM_PROCESSES)"
    )


def test_address_count_must_match_num_processes(dead, monkeypatch):
    keras_message = ("The provided job_addresses ['10.0.0.1:1234', '10.0.0.2:2345'] has 2 jobs, "
                     "but num_processes is 3")
    with pytest.raises(ValueError) as info:
        dist.initialize("10.0.0.1:1234,10.0.0.2:2345", 3, 0)
    assert str(info.value) == keras_message
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "10.0.0.1:1234,10.0.0.2:2345")
    with pytest.raises(ValueError, match=re.escape(keras_message + " (job_addresses from "
                                                   "KERAS_DISTRIBUTION_JOB_ADDRESSES)")):
        dist.initialize(num_processes=3, process_id=0)


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        ({"num_processes": 2}, {}, "process_id is required when num_processes=2; pass process_id= or set "
                                   "KERAS_DISTRIBUTION_PROCESS_ID"),
        ({"num_processes": 0, "process_id": 0}, {}, "num_processes must be >= 1; got num_processes=0"),
        ({"num_processes": "2", "process_id": 0}, {}, "num_processes must be an integer; got '2' of type str"),
        ({"num_processes": True, "process_id": 0}, {}, "num_processes must be an integer; got True of type bool"),
        ({"num_processes": 2, "process_id": 0.0}, {}, "process_id must be an integer; got 0.0 of type float"),
        ({}, {"KERAS_DISTRIBUTION_NUM_PROCESSES": "two"},
         "KERAS_DISTRIBUTION_NUM_PROCESSES must be an integer; got 'two'"),
        ({"num_processes": 2}, {"KERAS_DISTRIBUTION_PROCESS_ID": "first"},
         "KERAS_DISTRIBUTION_PROCESS_ID must be an integer; got 'first'"),
        ({"job_addresses": "a:1,,b:2"}, {}, "job_addresses has an empty address; got 'a:1,,b:2'"),
        ({"job_addresses": 7}, {}, "job_addresses must be a comma-separated string or a list of strings; got 7"),
    ],
    ids=["no-process-id", "zero-processes", "string-argument", "bool", "float", "env-not-int", "env-pid-not-int",
         "empty-address", "address-type"],
)
def test_initialize_rejects_bad_settings(dead, monkeypatch, kwargs, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        dist.initialize(**kwargs)
    assert str(info.value).startswith(message), str(info.value)
    assert not dist.is_initialized()


@pytest.mark.slow
def test_initialize_unreachable_daemon_names_the_address(dead):
    with pytest.raises(xreduce.UnavailableError, match=re.escape(f"xreduce daemon at {dead} is unavailable")):
        dist.initialize()
    assert not dist.is_initialized()
    state = dist.DistributionState(address=dead)
    with pytest.raises(xreduce.UnavailableError, match=re.escape(dead)):
        state.initialize(num_processes=2, process_id=1)
    assert state.info is None


def test_fresh_states_stand_in_for_processes(daemon, coordinator):
    """Two states in two threads, each its own process of a two-process job, against the real daemon."""
    states = [dist.DistributionState(address=daemon.address) for _ in range(2)]
    infos: dict[int, dist.ProcessInfo] = {}

    def run(i):
        infos[i] = states[i].initialize(f"{coordinator},h1:1", process_id=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [infos[i].process_id for i in range(2)] == [0, 1]
    assert all(infos[i].num_processes == 2 and infos[i].daemon_address == daemon.address for i in range(2))
    assert infos[0].devices == tuple(CPU8)
    assert [s.process_id() for s in states] == [0, 1]
    assert not dist.is_initialized(), "the default instance is untouched"
    for s in states:
        s.shutdown()
    assert [s.is_initialized for s in states] == [False, False]


# --- groups across nodes: one daemon per node, on loopback --------------------------------------------------

NODE_FLAGS = ("--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "4")
"""A node daemon of these tests: 4 host devices."""
FAST_PEERS = ("--peer-timeout", "3", "--heartbeat-interval", "0.5")
"""A lost node is noticed within 6 s, not the default 10 s."""


@pytest.fixture(scope="module")
def nodes(start_module_daemon):
    """Two node daemons (node A, node B) for the module's groups; each group has its own coordinator."""
    return [start_module_daemon(*NODE_FLAGS).address for _ in range(2)]


@contextlib.contextmanager
def job(daemons: Sequence[str], job_addresses: str | list[str]) -> Iterator[list[dist.DistributionState]]:
    """Process ``p`` of ``len(daemons)`` initializes against ``daemons[p]``, all at once (threads standing in
    for processes); each group is installed for its daemon, so ops and strategies on it are collectives.
    Every process shuts down after the block."""
    states = [dist.DistributionState(address=a) for a in daemons]
    failures: dict[int, BaseException] = {}

    def join(pid: int) -> None:
        try:
            states[pid].initialize(job_addresses, len(states), pid)
        except Exception as e:  # noqa: BLE001 - reported by the caller's assertion
            failures[pid] = e

    threads = [threading.Thread(target=join, args=(p,)) for p in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert not failures, failures
        assert all(s.is_initialized for s in states), "a process did not join"
        installed = {s.info.daemon_address for s in states}
        for s in states if len(installed) == len(states) else ():  # one process per daemon: the runtime's key
            set_process_group(s.info.daemon_address, s.group)
        yield states
    finally:
        for s in states:
            if s.info is not None:
                set_process_group(s.info.daemon_address, None)
            s.shutdown()


def each_process(fn, daemons: Sequence[str]) -> list:
    """``fn(address)`` in one thread per daemon at once (every process of a collective); their results."""
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = fn(daemons[i])
        except Exception as e:  # noqa: BLE001 - returned, for the caller to check
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(daemons))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(results) == len(daemons), "a process did not return"
    return [results[i] for i in range(len(daemons))]


def test_a_group_across_two_nodes_has_one_global_device_list(nodes, coordinator, monkeypatch):
    a, b = nodes
    addresses = f"{coordinator},127.0.0.1:2345"
    monkeypatch.setenv("XREDUCE_ADDRESS", b)  # this process is process 1, on node B; process 0 is on node A
    process_0 = dist.DistributionState(address=a)
    thread = threading.Thread(target=process_0.initialize, args=(addresses, 2, 0))
    thread.start()
    try:
        info = dist.initialize(addresses, 2, 1)
        thread.join(90)
        peer = process_0.info
        assert peer is not None, "process 0 did not join"
        assert info.devices == peer.devices == tuple(f"cpu:{i}" for i in range(8))
        assert (peer.local_devices, info.local_devices) == (("cpu:0", "cpu:1", "cpu:2", "cpu:3"),
                                                            ("cpu:4", "cpu:5", "cpu:6", "cpu:7"))
        assert dist.list_devices() == [f"cpu:{i}" for i in range(8)] and dist.get_device_count("cpu") == 8
        assert (peer.node_index, info.node_index, info.num_nodes, info.is_multi_node) == (0, 1, 2, True)
        assert info.group == peer.group == f"default@{coordinator}"
        assert info.epoch == peer.epoch >= 1 and info.engine == peer.engine == "gloo"
        assert (peer.daemon_address, info.daemon_address) == (a, b)
    finally:
        thread.join(90)
        process_0.shutdown()


def test_nodes_follow_process_0_then_each_nodes_lowest_process(nodes, coordinator):
    a, b = nodes
    with job([b, a, b], coordinator) as states:  # processes 0 and 2 on node B, process 1 on node A
        infos = [s.info for s in states]
        offsets = [s.group.replica_offset for s in states]
    assert [i.node_index for i in infos] == [0, 1, 0]
    assert [i.local_devices for i in infos] == [("cpu:0", "cpu:1"), ("cpu:2", "cpu:3", "cpu:4", "cpu:5"),
                                                ("cpu:6", "cpu:7")]
    assert offsets == [0, 2, 6]
    assert len({i.epoch for i in infos}) == 1 and all(i.num_nodes == 2 for i in infos)


def test_mirrored_strategy_reduces_across_nodes_with_global_replica_ids(nodes, coordinator):
    def step(address):
        strategy = MirroredStrategy(address=address)
        ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.array([ctx.replica_id_in_sync_group + 1.0, ctx.num_replicas_in_sync]))
        total = strategy.reduce(ReduceOp.SUM, ids, axis=None)
        mean = strategy.reduce(ReduceOp.MEAN, ids, axis=None)
        return [v.tolist() for v in ids.values], total.tolist(), mean.tolist()

    with job(nodes, coordinator):
        (ids0, sum0, mean0), (ids1, sum1, mean1) = each_process(step, nodes)
    assert ids0 == [[1.0, 8], [2.0, 8], [3.0, 8], [4.0, 8]] and ids1 == [[5.0, 8], [6.0, 8], [7.0, 8], [8.0, 8]]
    assert sum0 == sum1 == [36.0, 64.0]  # 1 + ... + 8 over both nodes; 8 replicas say 8
    assert mean0 == mean1 == [4.5, 8.0]  # divided once by the global replica count


def test_reinitializing_forms_a_new_epoch_and_the_old_one_is_refused(nodes, coordinator):
    with job(nodes, coordinator) as states:
        first = [s.info.epoch for s in states]
        old = [s.group for s in states]
    with job(nodes, coordinator) as states:
        second = [s.info.epoch for s in states]
        group = states[0].info.group
        for address, stale in zip(nodes, old):
            set_process_group(address, stale)  # collectives of the epoch before: both processes at once
        def reduce(address: str):
            value = PerReplica([np.ones(2)] * 4)  # on this process's devices
            return HierarchicalCopyAllReduce(address=address).reduce(ReduceOp.SUM, value, value)

        outcomes = each_process(reduce, nodes)
    assert first[0] == first[1] and second[0] == second[1] > first[0]
    assert group == f"default@{coordinator}", "a new epoch, the same group"
    for outcome in outcomes:
        assert isinstance(outcome, xreduce.XReduceError), outcome
        assert f"epoch {first[0]}" in str(outcome), outcome


def test_an_unreachable_coordinator_fails_initialize_with_the_daemons_message(start_daemon):
    node = start_daemon(*NODE_FLAGS, "--collective-timeout", "2").address
    nobody = free_address()
    state = dist.DistributionState(address=node)
    with pytest.raises(xreduce.XReduceError) as raised:
        state.initialize(f"{nobody},127.0.0.1:2345", 2, 1)
    assert nobody in str(raised.value), str(raised.value)
    assert state.info is None and state.group is None


@pytest.mark.parametrize("process_id", [0, 1], ids=["process-0", "process-1"])
def test_a_typo_in_the_coordinators_host_is_named_as_such(start_daemon, process_id):
    node = start_daemon(*NODE_FLAGS, "--collective-timeout", "2").address
    typo = "127.0.0.l:1234"  # an "l" for the "1"
    state = dist.DistributionState(address=node)
    with pytest.raises(xreduce.InvalidArgumentError) as raised:
        state.initialize(f"{typo},127.0.0.1:2345", 2, process_id)
    message = str(raised.value)
    assert message.startswith(f"coordinator: cannot resolve the host of job_addresses[0] {typo!r}: "), message
    assert "--node-address" not in message, message
    assert state.info is None and state.group is None


def _status(address: str, *flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "xreduce._cli", "status", "--address", address, *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _group_lines(status: str, group: str) -> list[str]:
    """The lines of ``xreduce status`` about ``group``: its heading and the lines indented under it."""
    lines = status.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {group}  "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return lines[start:end]


def test_status_shows_the_group_on_every_node(nodes, coordinator):
    def step(address):
        return MirroredStrategy(address=address).reduce(ReduceOp.SUM, PerReplica([np.ones(3)] * 4), axis=None)

    with job(nodes, coordinator) as states:
        each_process(step, nodes)
        epoch = states[0].info.epoch
        texts = [_status(address) for address in nodes]
        as_json = json.loads(_status(nodes[1], "--json"))
    for index, text in enumerate(texts):
        assert re.search(r"^groups across nodes \(\d+\)$", text, re.M), text  # the module's other groups too
        section = _group_lines(text, f"default@{coordinator}")
        assert section[0] == f"  default@{coordinator}  epoch {epoch}  active"
        coordinator_role = " (the coordinator)" if index == 0 else ""
        assert section[1] == f"    processes    2 on 2 nodes, this daemon is node {index}{coordinator_role}"
        assert section[2] == "    engine       gloo"
        assert re.fullmatch(r"    node 0       127\.0\.0\.1\S*  numpy  process 0 \[CPU:0, CPU:1, CPU:2, CPU:3\]",
                            section[3]), section
        assert re.fullmatch(r"    node 1       127\.0\.0\.1\S*  numpy  process 1 \[CPU:0, CPU:1, CPU:2, CPU:3\]",
                            section[4]), section
        assert re.fullmatch(r"    cross-node   [1-9]\d* collectives, [1-9].*, .*s in the engine", section[5]), section
    groups = [g for g in as_json["groups"] if g["group"] == f"default@{coordinator}"]
    assert [(g["epoch"], g["state"], g["node_index"], g["coordinator"]) for g in groups] == [(str(epoch), "active",
                                                                                               1, False)]
    # Every process has shut down: the job ended cleanly, which the README's status (run after its job) shows.
    after = _group_lines(_status(nodes[1]), f"default@{coordinator}")
    assert after[0] == f"  default@{coordinator}  epoch {epoch}  left", after
    assert re.fullmatch(r"    reason       .*every process of node \d .* left the group", after[-1]), after
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    shown = re.search(r"^  default@127\.0\.0\.1:50570  epoch 1  (\w+)$", readme, re.M)
    assert shown and shown[1] == "left", "the README's status after its job ended shows another state"


def test_a_lost_node_fails_the_epoch_and_a_new_one_forms(start_daemon, coordinator):
    a = start_daemon(*NODE_FLAGS, *FAST_PEERS)
    b = start_daemon(*NODE_FLAGS, *FAST_PEERS)
    with job([a.address, b.address], coordinator) as states:
        epoch = states[0].info.epoch
        b.terminate(signal.SIGKILL)
        with pytest.raises((xreduce.AbortedError, xreduce.UnavailableError)) as raised:
            MirroredStrategy(address=a.address).reduce(ReduceOp.SUM, PerReplica([np.ones(2)] * 4), axis=None)
        status = _status(a.address)
    assert "node 1" in str(raised.value), str(raised.value)
    assert f"  default@{coordinator}  epoch {epoch}  failed" in status, status
    assert re.search(r"    lost         node 1 at 127\.0\.0\.1\S*, processes \[1\]: .+", status), status
    replacement = start_daemon(*NODE_FLAGS, *FAST_PEERS).address
    with job([a.address, replacement], coordinator) as states:
        assert states[0].info.epoch > epoch and states[1].info.node_index == 1
        totals = each_process(lambda address: MirroredStrategy(address=address).reduce(
            ReduceOp.SUM, PerReplica([np.ones(2)] * 4), axis=None), [a.address, replacement])
    assert [t.tolist() for t in totals] == [[8.0, 8.0], [8.0, 8.0]]


# --- DeviceMesh ----------------------------------------------------------------------------------------------


def test_constructing_with_devices_needs_no_daemon(dead):
    mesh = dist.DeviceMesh((4, 2), ["batch", "model"], CPU8)
    layout = dist.TensorLayout(("batch", None), mesh)
    dp = dist.DataParallel(devices=CPU8)
    assert dp.get_data_layout((16, 3)).axes == ("batch", None)
    assert dist.DataParallel(device_mesh=dist.DeviceMesh((8,), ["data"], CPU8)).batch_dim_name == "data"
    lazy = dist.DataParallel()  # devices from list_devices(), not asked for yet
    assert lazy.batch_dim_name == "batch" and "every device of list_devices()" in repr(lazy)
    assert dist.DeviceMesh((4,), ["batch"]).shape == (4,)
    x = dp.distribute_batch(np.arange(16.0))
    assert layout.device_mesh is mesh and len(x) == 8
    with pytest.raises(xreduce.UnavailableError, match=re.escape(dead)):
        _ = lazy.device_mesh


def test_mesh_default_devices_come_from_list_devices_when_first_read(dead):
    mesh = dist.DeviceMesh((2, 2), ["batch", "model"])  # the dead daemon is never asked
    too_big = dist.DeviceMesh((8,), ["batch"])
    with xreduce.serve_embedded(virtual_devices=4):
        assert mesh.devices.tolist() == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]
        with pytest.raises(ValueError, match=re.escape(
                "Shape does not match the number of devices. Received: shape=(8,) (8 devices); "
                "devices.shape=(4,) (4 devices) from list_devices()")):
            _ = too_big.devices
    assert mesh.devices[1, 1] == "cpu:3", "resolved once, then kept"


# --- DataParallel --------------------------------------------------------------------------------------------


def test_create_with_list_devices(embedded):
    d = dist.DataParallel()
    assert d.device_mesh.devices.tolist() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert d.device_mesh.axis_names == ["batch"] and d.batch_dim_name == "batch"
    assert repr(d) == ("<DataParallel device_mesh=<DeviceMesh shape=(4,), axis_names=['batch']>, "
                       "batch_dim_name='batch'>")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"devices": []}, "devices can not be empty; got [] (pass devices=None for every device of list_devices())"),
        ({"devices": [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]},
         "devices must be a flat list of device names; got an array of shape (2, 2)"),
        ({"device_mesh": "mesh"},
         "Expect `mesh` to be an instance of `DeviceMesh`. Received: mesh='mesh' (of type <class 'str'>)"),
        ({"device_mesh": dist.DeviceMesh((1,), ["b"], ["cpu:0"]), "devices": ["cpu:0"]},
         "DataParallel takes device_mesh or devices, not both; got device_mesh=<DeviceMesh shape=(1,), "
         "axis_names=['b']>, devices=['cpu:0']"),
        ({"devices": ["cpu:0"], "cross_device_ops": "hierarchical"},
         "cross_device_ops must be a CrossDeviceOps; got str"),
    ],
    ids=["empty-devices", "2d-devices", "not-a-mesh", "both", "bad-ops"],
)
def test_data_parallel_rejects(dead, kwargs, message):
    with pytest.raises(ValueError) as info:
        dist.DataParallel(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


# --- all_reduce_gradients ------------------------------------------------------------------------------------


def _per_replica(arrays, devices=None):
    return PerReplica(list(arrays), devices=devices)


def test_all_reduce_gradients_mean_equals_numpy_mean(embedded):
    dp = dist.DataParallel()
    rng = np.random.default_rng(7)
    whole = rng.integers(-50, 50, size=(4, 3, 5)).astype(np.float64)  # exact in any summation order
    out = dp.all_reduce_gradients(_per_replica(whole))
    assert isinstance(out, Mirrored) and out.devices == canonical_names(dist.list_devices())
    for copy in out.values:
        np.testing.assert_array_equal(copy, whole.mean(axis=0))
    noisy = rng.normal(size=(4, 7)).astype(np.float32)
    out = dp.all_reduce_gradients(_per_replica(noisy), ReduceOp.MEAN)
    for copy in out.values:
        assert copy.dtype == np.float32
        np.testing.assert_allclose(copy, noisy.mean(axis=0), rtol=1e-6, atol=1e-7)


def test_all_reduce_gradients_list_sum_and_mixed_dtypes(embedded):
    dp = dist.DataParallel()
    kernel = np.arange(4 * 6, dtype=np.float32).reshape(4, 2, 3)
    bias = np.arange(4, dtype=np.float64).reshape(4, 1)
    counts = np.arange(4, dtype=np.int32).reshape(4, 1) * 10
    outs = dp.all_reduce_gradients([_per_replica(kernel), _per_replica(bias), _per_replica(counts)], "sum")
    assert isinstance(outs, list) and len(outs) == 3
    for out, whole in zip(outs, (kernel, bias, counts)):
        assert isinstance(out, Mirrored) and len(out) == 4
        for copy in out.values:
            assert copy.dtype == whole.dtype
            np.testing.assert_array_equal(copy, whole.sum(axis=0))
    assert dp.all_reduce_gradients([]) == []


def test_all_reduce_gradients_of_distributed_batches(embedded):
    dp = dist.DataParallel()
    x = dp.distribute_batch(np.arange(24.0).reshape(8, 3))
    means = PerReplica([v.mean(axis=0) for v in x.values], devices=x.devices)
    out = dp.all_reduce_gradients(means)
    np.testing.assert_array_equal(out.values[2], np.arange(24.0).reshape(8, 3).mean(axis=0))


def test_values_without_devices_go_to_the_distribution_devices(embedded):
    dp = dist.DataParallel(devices=["cpu:3", "cpu:1"])
    out = dp.all_reduce_gradients(_per_replica([np.array([1.0]), np.array([3.0])]))
    assert out.devices == canonical_names(["cpu:3", "cpu:1"])
    assert [v.tolist() for v in out.values] == [[2.0], [2.0]]


def test_one_device_gives_an_array(embedded):
    out = dist.DataParallel(devices=["cpu:2"]).all_reduce_gradients(_per_replica([np.array([1.0, 2.0])]))
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "grads, op, error, message",
    [
        ("grads", "mean", ValueError, "all_reduce_gradients takes a PerReplica or a list of them; got str"),
        ([np.zeros(2)], "mean", ValueError, "per_replica_grads[0] must be a PerReplica; got ndarray"),
        (PerReplica([np.zeros(1)] * 3), "mean", ValueError,
         "per_replica_grads has 3 values but the distribution has 2 devices ['cpu:0', 'cpu:1']"),
        ([PerReplica([np.zeros(1)] * 2), PerReplica([np.zeros(1)])], "mean", ValueError,
         "per_replica_grads[1] has 1 values but the distribution has 2 devices ['cpu:0', 'cpu:1']"),
        (PerReplica([np.zeros(1)] * 2), "max", ValueError, "`reduce_op` must be Reduce.SUM or Reduce.MEAN; got 'max'"),
    ],
    ids=["not-a-list", "array", "too-many", "too-few", "max"],
)
def test_all_reduce_gradients_rejects(dead, grads, op, error, message):
    with pytest.raises(error) as info:
        dist.DataParallel(devices=["cpu:0", "cpu:1"]).all_reduce_gradients(grads, op)
    assert str(info.value) == message


def test_all_reduce_gradients_on_the_real_daemon(daemon):
    ops = HierarchicalCopyAllReduce(num_packs=2, address=daemon.address)
    dp = dist.DataParallel(devices=CPU8, cross_device_ops=ops)
    assert dp.cross_device_ops is ops
    whole = np.arange(8 * 10, dtype=np.float64).reshape(8, 10)
    out = dp.all_reduce_gradients([_per_replica(whole), _per_replica(whole * 2)])
    for copy in out[0].values:
        np.testing.assert_array_equal(copy, whole.mean(axis=0))
    np.testing.assert_array_equal(out[1].values[7], (whole * 2).mean(axis=0))


def test_daemon_errors_reach_the_caller(embedded):
    dp = dist.DataParallel(devices=["cpu:0", "cpu:9"])
    with pytest.raises(xreduce.NotFoundError, match="CPU:9"):
        dp.all_reduce_gradients(_per_replica([np.zeros(1), np.zeros(1)]))


# --- the public surface and the example ----------------------------------------------------------------------


def _example_env(**extra):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ENV and k != "XREDUCE_ADDRESS"}
    env.update(extra)
    return env


def test_example_runs_embedded():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--embedded"], capture_output=True, text=True,
                          timeout=60, env=_example_env())
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "list_devices(): ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']" in out
    assert "get_device_count(): 4" in out
    assert "initialize(): process_id=0 num_processes=1" in out
    assert "global batch of 30 rows -> rows per device [8, 8, 7, 7]" in out
    steps = re.findall(r"step (\d+): loss\s+([\d.]+) .*\|all-reduce - numpy mean\| ([\d.e+-]+)", out)
    assert [int(s[0]) for s in steps] == list(range(1, 9))
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0] / 100, losses
    assert all(float(s[2]) < 1e-12 for s in steps), steps
    learned = re.search(r"learned w=\[([^\]]*)\] b=(\S+)", out)
    assert learned, out
    np.testing.assert_allclose([float(v) for v in learned.group(1).split()], [2.0, -3.0, 0.5], atol=0.1)
    assert abs(float(learned.group(2)) - 1.0) < 0.1
    assert "distribution() after the scope: None" in out


@pytest.mark.slow
def test_example_without_a_daemon_says_where_it_looked(dead):
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                          env=_example_env(XREDUCE_ADDRESS=dead))
    assert proc.returncode == 1
    assert f"xreduce daemon at {dead} is unavailable" in proc.stderr and "--embedded" in proc.stderr
