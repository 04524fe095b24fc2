"""Groups across nodes on one host: node daemons, scripted training processes, a daemon's footprint.

``bench/fault_trials.py`` and the multi-node tests (``tests/multinode``) run the same parts:

* :class:`Cluster`: one ``xreduced`` per node on loopback (port 0), a coordinator address for the
  job, and a node's daemon restarted on its own port after a fault;
* :class:`NodeProcess`: one training process, ``python -m xreduce_bench.faults SCRIPT``, with
  ``XREDUCE_ADDRESS`` set to its node's daemon and the three ``KERAS_DISTRIBUTION_*`` variables set;
  it runs the steps of its script (see :class:`Worker`) and prints one JSON object per line;
* :func:`footprint`: a process's threads, open descriptors and resident memory, from ``/proc``.

The data of global replica ``r`` is :func:`replica_array` of ``r``, the same in every process, so
whoever launches the processes computes every expected value from the inputs alone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xreduce_bench.daemon import DaemonProcess
from xreduce_bench.sweep import numpy_dtype

ENV_JOB = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID")
CLEARED = ("XREDUCE_ADDRESS", "XREDUCE_GROUP", "XREDUCE_LOCAL_DEVICES", "XREDUCE_TOKEN", "XREDUCE_TLS_CA",
           "XREDUCE_TLS_CLIENT_CERT", "XREDUCE_TLS_CLIENT_KEY", "XREDUCE_TLS_SERVER_NAME", *ENV_JOB)
"""The SDK's settings a launched process never inherits from the launcher (it gets its own)."""


# --- the data ------------------------------------------------------------------------------------------------


def replica_array(seed: int, tensor: int, replica: int, dtype: str, shape: Sequence[int],
                  fill: str = "int") -> np.ndarray:
    """What global replica ``replica`` holds for tensor ``tensor``: the same in every process.

    Args:
        fill: ``"int"``: small integers (-8..8, 0..8 unsigned; complex parts too), whose sums are
            exact in every dtype, in any order, over up to 8 replicas; ``"random"``: normal floats
            times 10 (integers -1000..1000); ``"index"``: ``replica + 1`` everywhere, cheap for
            large tensors.

    Example:
        >>> replica_array(1, 0, 2, "int8", [3], "index").tolist()
        [3, 3, 3]
        >>> a = replica_array(1, 0, 2, "bfloat16", [4])
        >>> a.dtype.name, bool(np.all(a.astype(np.float64) == np.round(a.astype(np.float64))))
        ('bfloat16', True)
    """
    dt = numpy_dtype(dtype)
    shape = tuple(shape)
    if fill == "index":
        return np.full(shape, replica + 1, dt)
    rng = np.random.default_rng([seed, tensor, replica])
    if fill == "int":
        low = 0 if dt.kind == "u" else -8
        parts = [rng.integers(low, 9, size=shape) for _ in range(2 if dt.kind == "c" else 1)]
    elif fill == "random":
        if dt.kind in "iu":
            low = 0 if dt.kind == "u" else -1000
            parts = [rng.integers(low, 1000, size=shape)]
        else:
            parts = [rng.standard_normal(size=shape) * 10 for _ in range(2 if dt.kind == "c" else 1)]
    else:
        raise ValueError(f"fill must be 'int', 'random' or 'index'; got {fill!r}")
    if dt.kind == "c":
        return (parts[0] + 1j * parts[1]).astype(dt)
    return parts[0].astype(dt)


def encode(array: np.ndarray, digest_only: bool = False) -> dict:
    """An array as JSON: dtype, shape, the SHA-256 of its bytes and (unless ``digest_only``) the bytes.

    Example:
        >>> e = encode(np.arange(2, dtype=np.int16))
        >>> e["dtype"], e["shape"], e["hex"], len(e["sha256"])
        ('int16', [2], '00000100', 64)
        >>> decode(e).tolist()
        [0, 1]
    """
    a = np.asarray(array)  # (np.ascontiguousarray would make a scalar an array of one element)
    out = {"dtype": a.dtype.name, "shape": list(a.shape), "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
    if not digest_only:
        out["hex"] = a.tobytes().hex()
    return out


def decode(d: dict) -> np.ndarray:
    """The array :func:`encode` wrote (with its bytes).

    Example:
        >>> decode({"dtype": "bfloat16", "shape": [], "hex": "803f"}).item()
        1.0
    """
    return np.frombuffer(bytes.fromhex(d["hex"]), dtype=numpy_dtype(d["dtype"])).reshape(d["shape"])


# --- one training process ------------------------------------------------------------------------------------


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _components(value, devices: Sequence[str], digest_only: bool) -> list[dict]:
    """A result's arrays with their devices: a Mirrored's, or one plain array on ``devices[0]``."""
    from xreduce.distribute import DistributedValues

    if isinstance(value, DistributedValues):
        return [{"device": d, **encode(v, digest_only)} for d, v in zip(value.devices, value.values)]
    return [{"device": devices[0], **encode(value, digest_only)}]


class Worker:
    """The steps a :class:`NodeProcess` runs, one method per ``op``; each returns JSON-able data.

    Steps (``op`` and its fields):

    * ``init``: ``xreduce.distribution.initialize()`` from the environment; returns the
      :class:`~xreduce.distribution.ProcessInfo` fields, ``list_devices()``, ``worker_devices`` (the job's
      names of this process's devices) and ``daemon_devices`` (the same devices as its daemon names them);
    * ``shutdown``: ``xreduce.distribution.shutdown()``;
    * ``barrier``: waits for a line on stdin (the launcher says go);
    * ``reduce``: ``HierarchicalCopyAllReduce(num_packs).reduce`` (``call: "reduce"``) or
      ``batch_reduce`` of ``tensors`` (``[{"dtype", "shape"}]``) filled by :func:`replica_array`
      (``seed``, ``fill``) for this process's global replicas; ``digest`` leaves the bytes out;
    * ``given``: the same with the arrays given (``npz`` file, ``values``: per tensor the keys of
      this process's components, ``devices`` theirs), as the conformance vectors are;
    * ``broadcast``: process ``source`` sends :func:`replica_array` of replica ``source`` to every
      process's local devices (source 0 through the SDK, another through ``Broadcast`` itself);
    * ``strategy``: ``MirroredStrategy.run`` makes ``[replica_id + 1, num_replicas]`` on each
      replica and ``strategy.reduce(reduce_op)`` combines them;
    * ``data_parallel``: ``DataParallel().all_reduce_gradients`` of ``[replica_id + 1]`` per replica;
    * ``local``: a single-process reduce over the daemon's devices, outside any group;
    * ``names``: reductions with this process's devices named in each form the SDK gives out, and with
      another process's device (see :meth:`Worker.names`).
    """

    def __init__(self):
        self.i = 0

    def _replicas(self) -> list[int]:
        """This process's global replica ids: its devices' places in the job's device list."""
        from xreduce import distribution

        info = distribution.process_info()
        if info is None:
            raise RuntimeError("this step needs a group: run an init step first")
        return [info.devices.index(d) for d in info.local_devices]

    def _local(self) -> list[str]:
        """This process's devices, the job's names (``worker_devices``), which its calls name and results carry."""
        from xreduce.distribute import MirroredStrategy

        return list(MirroredStrategy().extended.worker_devices)

    def calling(self, op: str) -> None:
        """Says that the step's daemon call starts now (``t`` is ``time.monotonic()``, system-wide)."""
        _emit({"event": "calling", "i": self.i, "op": op, "t": time.monotonic()})

    def init(self, step: dict) -> dict:
        from xreduce import distribution
        from xreduce._keras_devices import current_group

        info = distribution.initialize()
        group = current_group()
        return {"process_id": info.process_id, "epoch": info.epoch, "group": info.group,
                "node_index": info.node_index, "num_nodes": info.num_nodes, "engine": info.engine,
                "devices": list(info.devices), "local_devices": list(info.local_devices),
                "list_devices": distribution.list_devices(), "replicas": self._replicas(),
                "worker_devices": self._local(),
                "daemon_devices": list(group.local_devices) if group is not None else self._local()}

    def shutdown(self, step: dict) -> None:
        from xreduce import distribution

        distribution.shutdown()

    def barrier(self, step: dict) -> str:
        return sys.stdin.readline().strip()

    def reduce(self, step: dict) -> list[list[dict]]:
        from xreduce.distribute import PerReplica

        local = self._local()
        devices = [step["bad_device"], *local[1:]] if "bad_device" in step else local  # a bad request
        values = [PerReplica([replica_array(step.get("seed", 0), t, r, spec["dtype"], spec["shape"],
                                            step.get("fill", "int")) for r in self._replicas()], devices=devices)
                  for t, spec in enumerate(step["tensors"])]
        return self._reduce(step, values, local)

    def given(self, step: dict) -> list[list[dict]]:
        from xreduce.distribute import PerReplica

        arrays = np.load(step["npz"])
        values = [PerReplica([arrays[k] for k in v["keys"]], devices=v["devices"]) for v in step["values"]]
        return self._reduce(step, values, self._local())

    def _reduce(self, step: dict, values: list, local: list[str]) -> list[list[dict]]:
        from xreduce.distribute import CommunicationOptions, HierarchicalCopyAllReduce

        ops = HierarchicalCopyAllReduce(num_packs=step.get("num_packs", 1))
        options = CommunicationOptions(timeout_seconds=step["timeout"]) if step.get("timeout") else None
        op = step.get("reduce_op", "SUM")
        self.calling("reduce")
        try:
            if step.get("call", "batch_reduce") == "reduce":
                outs = [ops.reduce(op, values[0], values[0], options=options)]
            else:
                outs = ops.batch_reduce(op, [(v, v) for v in values], options=options)
        finally:
            ops.close()
        return [_components(out, local, step.get("digest", False)) for out in outs]

    def broadcast(self, step: dict) -> list[dict]:
        from xreduce import Client, distribution
        from xreduce._runtime import process_group
        from xreduce.distribute import HierarchicalCopyAllReduce
        from xreduce.v1 import xreduce_pb2 as pb
        from xreduce.wire import codec

        local = self._local()
        source = step.get("source", 0)
        tensor = replica_array(step.get("seed", 0), 0, source, step["dtype"], step["shape"], step.get("fill", "int"))
        mine = tensor if distribution.process_id() == source else None
        if source == 0:
            ops = HierarchicalCopyAllReduce()
            self.calling("broadcast")
            try:
                return _components(ops.broadcast(mine, local), local, False)
            finally:
                ops.close()
        # The SDK's broadcast sends from process 0; the RPC takes any source process, in the group's
        # next collective (the SDK's runtime numbers them), and the devices as the daemon names them.
        group = process_group()
        spec = group.next_spec()
        request = pb.BroadcastRequest(destinations=group.local_devices, collective=spec, source_process=source)
        if mine is not None:
            request.tensor.CopyFrom(codec.encode(mine))
            request.source_device = group.local_devices[0]
        with Client() as client:
            self.calling("broadcast")
            reply = client.broadcast(request)
        named = dict(zip(group.local_devices, local))
        return [{"device": named.get(c.device, c.device), **encode(codec.decode(c.tensor))}
                for c in reply.result.components]

    def local(self, step: dict) -> list[dict]:
        """A single-process reduce of ``[i + 1] * 3`` on each device ``i`` of the daemon (no group)."""
        from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica

        ops = HierarchicalCopyAllReduce()
        try:
            names = ops.client.device_names()
            value = PerReplica([np.full(3, i + 1.0, np.float32) for i in range(len(names))], devices=names)
            self.calling("local")
            return _components(ops.reduce("SUM", value, value), names, False)
        finally:
            ops.close()

    def strategy(self, step: dict) -> dict:
        from xreduce.distribute import MirroredStrategy, get_replica_context

        s = MirroredStrategy()

        def replica_fn():
            ctx = get_replica_context()
            return np.array([ctx.replica_id_in_sync_group + 1.0, ctx.num_replicas_in_sync])

        per_replica = s.run(replica_fn)
        devices = list(s.extended.worker_devices)
        self.calling("strategy")
        out = s.reduce(step.get("reduce_op", "SUM"), per_replica, axis=None)
        values = per_replica.values if len(devices) > 1 else (per_replica,)
        return {"num_replicas_in_sync": s.num_replicas_in_sync, "made": [v.tolist() for v in values],
                "reduced": _components(out, devices, False)}

    def data_parallel(self, step: dict) -> dict:
        from xreduce import distribution
        from xreduce.distribute import PerReplica

        dp = distribution.DataParallel()
        devices = dp.device_mesh.devices.ravel().tolist()
        grads = PerReplica([np.array([r + 1.0]) for r in self._replicas()])
        self.calling("data_parallel")
        out = dp.all_reduce_gradients(grads, step.get("reduce_op", "mean"))
        return {"mesh": devices, "reduced": _components(out, devices, False)}

    def names(self, step: dict) -> dict[str, dict]:
        """Reduces this process's replicas (``[replica + 1.0]`` each) with its devices named in every form
        the SDK gives out, one collective per check, and names another process's device; per check, the
        outcome (``ok``, the result's ``devices`` and ``values``, or ``error`` and ``message``)."""
        from xreduce import distribution
        from xreduce.distribute import (
            DistributedValues,
            HierarchicalCopyAllReduce,
            MirroredStrategy,
            PerReplica,
            ReductionToOneDevice,
        )
        from xreduce.wire.devices import DeviceName

        info = distribution.process_info()
        local = list(info.local_devices)
        forms = {
            "local_devices": local,
            "list_devices": [d for d in distribution.list_devices() if d in local],
            "canonical": [DeviceName.parse(d).canonical for d in local],
            "worker_devices": list(MirroredStrategy().extended.worker_devices),
            "distribute_batch": list(distribution.DataParallel().distribute_batch(np.zeros((len(local), 1))).devices),
            "task": [f"/job:worker/replica:0/task:{info.process_id}/device:CPU:{i}" for i in range(len(local))],
        }
        other = (info.process_id + 1) % info.num_processes
        theirs = info.devices[info.devices.index(local[0]) + len(local)] if other else info.devices[0]
        ops = HierarchicalCopyAllReduce()
        to_one = ReductionToOneDevice(reduce_to_device=info.devices[0])

        def value(names: list[str]) -> PerReplica:
            return PerReplica([np.array([r + 1.0]) for r in self._replicas()], devices=names)

        checks: dict[str, Callable[[], Any]] = {
            **{form: (lambda n=names: ops.reduce("SUM", value(n), value(n))) for form, names in forms.items()},
            "to_task": lambda: ops.batch_reduce("SUM", [(value(local), forms["task"])])[0],
            "reduce_to_device": lambda: to_one.reduce("SUM", value(forms["task"]), forms["worker_devices"]),
            "broadcast": lambda: ops.broadcast(np.array([7.0]) if info.process_id == 0 else None, forms["task"]),
            "other": lambda: ops.reduce("SUM", value([f"/job:worker/replica:0/task:{other}/device:CPU:0"]
                                                     + local[1:]), local),
            "other_keras": lambda: ops.reduce("SUM", value(local), [theirs]),
        }
        out = {}
        try:
            for name, check in checks.items():
                try:
                    result = check()
                except Exception as e:
                    out[name] = {"ok": False, "error": type(e).__name__, "message": str(e)}
                    continue
                values = result.values if isinstance(result, DistributedValues) else (result,)
                devices = result.devices if isinstance(result, DistributedValues) else ()
                out[name] = {"ok": True, "devices": list(devices), "values": [np.asarray(v).tolist() for v in values]}
        finally:
            ops.close()
            to_one.close()
        return out

    def run(self, steps: list[dict]) -> None:
        """Runs ``steps`` in order, each reported as an event; a failed step stops the script if it says
        ``stop_on_error``."""
        for i, step in enumerate(steps):
            self.i = i
            op = step["op"]
            try:
                result = getattr(self, op)(step)
            except Exception as e:  # every failure is reported, with its status code
                code = getattr(e, "code", None)
                _emit({"event": "step", "i": i, "op": op, "ok": False, "t": time.monotonic(),
                       "error": type(e).__name__, "code": getattr(code, "name", None), "message": str(e),
                       "traceback": traceback.format_exc(limit=4)})
                if step.get("stop_on_error"):
                    break
            else:
                _emit({"event": "step", "i": i, "op": op, "ok": True, "t": time.monotonic(), "result": result})
        _emit({"event": "done"})


# --- the launching side --------------------------------------------------------------------------------------


def free_address(host: str = "127.0.0.1") -> str:
    """A ``host:port`` nothing listens on now (the coordinator's address of a job).

    Example:
        >>> free_address().startswith("127.0.0.1:")
        True
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


class NodeProcess:
    """A running training process of a job across nodes; its JSON events are collected by a thread.

    Args:
        daemon: its node's daemon (``XREDUCE_ADDRESS``).
        job_addresses: ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (the first is the coordinator's).
        num_processes, process_id: its place in the job.
        steps: its script (see :class:`Worker`).
        env: more environment (e.g. ``XREDUCE_TOKEN``); the launcher's own SDK settings are not inherited.
        prefix: what runs the interpreter (e.g. ``ip netns exec NODE``), or nothing.
    """

    def __init__(self, daemon: str, job_addresses: str, num_processes: int, process_id: int, steps: list[dict],
                 env: dict[str, str] | None = None, prefix: Sequence[str] = ()):
        full = {k: v for k, v in os.environ.items() if k not in CLEARED}
        full.update(PYTHONUNBUFFERED="1", XREDUCE_ADDRESS=daemon, KERAS_DISTRIBUTION_JOB_ADDRESSES=job_addresses,
                    KERAS_DISTRIBUTION_NUM_PROCESSES=str(num_processes),
                    KERAS_DISTRIBUTION_PROCESS_ID=str(process_id))
        full.update(env or {})
        self.process_id = process_id
        self.daemon = daemon
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "xreduce_bench.faults", json.dumps(steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full)
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line}
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 60.0) -> dict:
        """The first event for which ``predicate`` holds, waiting at most ``timeout`` s.

        Raises:
            TimeoutError: none came (the message holds the events and the end of stderr).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((e for e in self.events if predicate(e)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise TimeoutError(f"process {self.process_id}: no such event within {timeout}s; events "
                                       f"{self.events}; stderr {''.join(self.stderr)[-3000:]}")
                self._cond.wait(left)

    def step(self, i: int, timeout: float = 60.0) -> dict:
        """Step ``i``'s event (``ok``, ``result`` or ``error``/``code``/``message``, ``t``)."""
        return self.wait_for(lambda e: e.get("event") == "step" and e["i"] == i, timeout)

    def calling(self, i: int, timeout: float = 60.0) -> dict:
        """The event that step ``i``'s daemon call starts."""
        return self.wait_for(lambda e: e.get("event") == "calling" and e["i"] == i, timeout)

    def go(self) -> None:
        """Lets a ``barrier`` step pass."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def steps(self, timeout: float = 60.0) -> list[dict]:
        """Waits for the script to end; every step's event, in order."""
        self.wait_for(lambda e: e.get("event") == "done", timeout)
        with self._cond:
            return [e for e in self.events if e.get("event") == "step"]

    def signal(self, sig: int = signal.SIGKILL) -> float:
        """Sends ``sig``; returns when (``time.monotonic()``)."""
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return t

    def close(self) -> None:
        """Kills the process if it still runs; waits for it (bounded)."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                f.close()


class Cluster:
    """Node daemons on loopback for groups across nodes, and the coordinator's address of a job.

    Args:
        nodes: how many node daemons.
        flags: every daemon's flags besides ``--listen`` (e.g. ``--virtual-devices 4``).
        start: starts a daemon from its flags (``start(*flags, env=...)`` returns a
            :class:`~xreduce_bench.daemon.DaemonProcess`); default: a ``DaemonProcess`` this object stops
            in :meth:`close`. Tests pass their daemon factory, which stops what it started.
        env: each daemon's extra environment, by node (e.g. a PYTHONPATH), or None.

    Example:
        >>> with Cluster(1, ["--backend", "numpy", "--virtual-devices", "2"]) as c:
        ...     (process,) = c.launch([0], [{"op": "local"}])  # one process on node 0, no group
        ...     (event,) = process.steps()
        ...     process.close()
        >>> event["ok"], [decode(component).tolist() for component in event["result"]]
        (True, [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]])
    """

    def __init__(self, nodes: int, flags: Sequence[str], start: Callable[..., DaemonProcess] | None = None,
                 env: Sequence[dict[str, str] | None] | None = None):
        self.flags = list(flags)
        self._start = start
        self._env = list(env) if env is not None else [None] * nodes
        self._own: list[DaemonProcess] = []
        self.daemons: list[DaemonProcess] = []
        try:
            with concurrent.futures.ThreadPoolExecutor(nodes) as pool:  # each takes seconds to start
                for future in [pool.submit(self._launch, i, "127.0.0.1:0") for i in range(nodes)]:
                    self.daemons.append(future.result())
        except BaseException:
            self.close()
            raise
        self.coordinator = free_address()

    def _launch(self, index: int, listen: str) -> DaemonProcess:
        flags = ["--listen", listen, *self.flags]
        if self._start is not None:
            return self._start(*flags, env=self._env[index])
        proc = DaemonProcess(flags, env=self._env[index])
        self._own.append(proc)
        return proc

    def address(self, node: int) -> str:
        """Node ``node``'s daemon address."""
        return self.daemons[node].address

    def new_job(self) -> str:
        """A fresh coordinator address (a job of its own on the same daemons); returns it."""
        self.coordinator = free_address()
        return self.coordinator

    def launch(self, placement: Sequence[int], steps: list[dict] | Callable[[int], list[dict]],
               env: dict[str, str] | None = None, coordinator: str | None = None) -> list[NodeProcess]:
        """Process ``p`` on node ``placement[p]``, all at once, each running ``steps`` (or ``steps(p)``).
        The job's coordinator is ``coordinator``, else :attr:`coordinator`."""
        return [NodeProcess(self.address(node), coordinator or self.coordinator, len(placement), p,
                            steps(p) if callable(steps) else steps, env) for p, node in enumerate(placement)]

    def restart(self, node: int, timeout: float = 30.0) -> DaemonProcess:
        """Starts node ``node``'s daemon again on its address (the old one must be gone: killed, or
        stopped and then killed here)."""
        old = self.daemons[node]
        if old.proc.poll() is None:
            old.proc.send_signal(signal.SIGKILL)
            old.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while True:  # the port may stay taken a moment after the kill
            try:
                self.daemons[node] = self._launch(node, old.address)
                return self.daemons[node]
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        """Stops the daemons this object started itself (SIGCONT first: one may be stopped)."""
        for proc in reversed(self._own):
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.terminate(signal.SIGKILL, timeout=10)
        self._own.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InNode:
    """An ``xreduced`` started inside a network-namespace node (``node.popen``); ``address`` is where it
    listens in there. Its log is collected by a thread, as :class:`~xreduce_bench.daemon.DaemonProcess` does.

    Raises:
        RuntimeError: it did not serve within ``timeout`` seconds (the message holds its log).
    """

    def __init__(self, node, flags: Sequence[str], timeout: float = 60.0):
        self.proc = node.popen([sys.executable, "-m", "xreduced", *flags], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self.address: str | None = None
        serving = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                if self.address is None and "event=serving address=" in line:
                    self.address = line.split("event=serving address=", 1)[1].split()[0]
                    serving.set()
            serving.set()

        threading.Thread(target=drain, daemon=True).start()
        if not serving.wait(timeout) or self.address is None:
            self.proc.kill()
            raise RuntimeError(f"xreduced in {node} did not serve within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return "".join(self.lines)


class NamespaceCluster:
    """Node daemons in the network-namespace nodes of :class:`xreduce_bench.netns.Nodes` (started): node
    ``k`` of a job is ``nodes[k + 1]``, its daemon on the namespace's loopback with its engine on the
    node's address, the coordinator on node 0's address. The same interface as :class:`Cluster` for
    jobs (no restart: a fault here is a link, cut and restored).
    """

    DAEMON_PORT = 50551

    def __init__(self, nodes, flags: Sequence[str]):
        self.nodes = nodes
        self.flags = list(flags)
        self.daemons = [InNode(node, ["--listen", f"127.0.0.1:{self.DAEMON_PORT}", "--node-address", node.address,
                                      *self.flags]) for node in nodes]
        self._port = self.DAEMON_PORT
        self.coordinator = self.new_job()

    def address(self, node: int) -> str:
        """Node ``node``'s daemon address, as its processes reach it (inside the node)."""
        return self.daemons[node].address

    def new_job(self) -> str:
        """A fresh coordinator address on node 0 (a port of its own per job); returns it."""
        self._port += 1
        self.coordinator = f"{self.nodes[1].address}:{self._port}"
        return self.coordinator

    def launch(self, placement: Sequence[int], steps: list[dict] | Callable[[int], list[dict]],
               env: dict[str, str] | None = None, coordinator: str | None = None) -> list[NodeProcess]:
        """As :meth:`Cluster.launch`, each process inside its node."""
        return [NodeProcess(self.address(node), coordinator or self.coordinator, len(placement), p,
                            steps(p) if callable(steps) else steps, env, prefix=self.nodes[node + 1].command([]))
                for p, node in enumerate(placement)]


def footprint(pid: int) -> dict[str, float]:
    """Threads, open file descriptors and resident memory (MiB) of process ``pid``, from ``/proc``.

    Example:
        >>> sorted(footprint(os.getpid()))
        ['fds', 'rss_mib', 'threads']
    """
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    return {"threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024}


def main(argv: list[str]) -> int:
    """``python -m xreduce_bench.faults STEPS_JSON``: one training process (see :class:`Worker`)."""
    steps = json.loads(argv[1])
    import xreduce.distribute  # noqa: F401 (imported before "ready": steps start at once)
    import xreduce.distribution  # noqa: F401

    _emit({"event": "ready", "pid": os.getpid()})
    Worker().run(steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
