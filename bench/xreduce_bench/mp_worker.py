"""One process of a multi-process xreduce job, scripted by the test that launches it.

Usage::

    python -m xreduce_bench.mp_worker '{"num_processes": 2, "process_id": 0, "steps": [...]}'

The daemon is ``XREDUCE_ADDRESS``; ``XREDUCE_GROUP`` and ``XREDUCE_LOCAL_DEVICES``
work as in any process (a step may override them). The worker prints one JSON
object per line on stdout, flushed:

* ``{"event": "ready", "pid": ...}`` once imported;
* ``{"event": "calling", "i": ..., "op": ..., "t": ...}`` just before a step's daemon call;
* ``{"event": "step", "i": ..., "op": ..., "ok": true, "result": ..., "t": ...}`` or
  ``{"event": "step", ..., "ok": false, "error": "AbortedError", "message": ..., "t": ...}``;
* ``{"event": "done"}`` at the end.

``t`` is ``time.monotonic()`` (system-wide on Linux, so comparable across
processes). A failed step does not stop the script unless it says ``"stop_on_error"``.

Steps (``op`` and its fields; ``seed`` and friends define the data, see :func:`make_array`):

* ``barrier``: wait for one line on stdin (the test says go);
* ``sleep``: ``seconds``;
* ``init``: ``xreduce.distribution.initialize``; optional ``group`` and ``local_devices``
  override the environment;
* ``shutdown``: ``xreduce.distribution.shutdown``;
* ``list_devices``: the keras-style global device list;
* ``reduce``: all-reduce of one tensor (``dtype``, ``shape``, ``reduce_op``, ``num_packs``,
  ``seed``, optional ``timeout``, optional ``nbytes`` for a large float32 tensor);
* ``batch_reduce``: ``tensors`` = [{``dtype``, ``shape``}], ``reduce_op``, ``num_packs``, ``seed``;
* ``prepared``: the same through a prepared batch (``xreduce._prepared``), kept under ``name``, called once
  per seed of ``seeds``;
* ``broadcast``: process 0 sends :func:`make_array` (``seed``, ``dtype``, ``shape``) to every
  process's local devices, the others pass None;
* ``strategy_run_reduce`` / ``strategy_values_reduce``: ``MirroredStrategy`` replicas produce
  :func:`replica_value` and ``strategy.reduce`` combines them (``reduce_op``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np


def make_array(seed: int, tensor: int, replica: int, dtype: str, shape) -> np.ndarray:
    """The data of global replica ``replica`` for tensor ``tensor``: the same in every process.

    Example:
        >>> make_array(1, 0, 3, "int32", [2]).dtype.name
        'int32'
    """
    rng = np.random.default_rng([seed, tensor, replica])
    shape = tuple(shape)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(size=shape) * 10).astype(dtype)


def replica_value(replica_id: int) -> np.ndarray:
    """What replica ``replica_id`` of a MirroredStrategy test produces."""
    return np.array([1.0, 2.0, 3.0], np.float32) * np.float32(replica_id + 1)


def encode(arr) -> dict:
    """A JSON form of an array that keeps every bit."""
    a = np.asarray(arr)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "hex": np.ascontiguousarray(a).tobytes().hex()}


def decode(d: dict) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(d["hex"]), dtype=d["dtype"]).reshape(d["shape"])


def _encode_result(value, device: str | None = None) -> list:
    """``[{"device": ..., "dtype": ..., "shape": ..., "hex": ...}]``; a plain array (one
    destination) is said to be on ``device``."""
    from xreduce.distribute import DistributedValues

    if isinstance(value, DistributedValues):
        return [{"device": dev, **encode(v)} for dev, v in zip(value.devices, value.values)]
    return [{"device": device, **encode(value)}]


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    def __init__(self, num_processes: int, process_id: int):
        self.num_processes = num_processes
        self.process_id = process_id

    # --- helpers ---

    def _group(self):
        from xreduce._runtime import process_group

        group = process_group()
        if group is None:
            raise RuntimeError("this step needs a multi-process group: run an init step first")
        return group

    def _per_replica(self, seed: int, tensor: int, dtype: str, shape):
        from xreduce.distribute import PerReplica

        group = self._group()
        replicas = [group.global_devices.index(d) for d in group.local_devices]
        return PerReplica([make_array(seed, tensor, r, dtype, shape) for r in replicas],
                          devices=list(group.local_devices))

    def _only_device(self):
        local = self._group().local_devices
        return local[0] if len(local) == 1 else None

    def _options(self, step: dict):
        from xreduce.distribute import CommunicationOptions

        return CommunicationOptions(timeout_seconds=step["timeout"]) if step.get("timeout") else None

    # --- steps ---

    def barrier(self, step):
        line = sys.stdin.readline()
        return line.strip()

    def sleep(self, step):
        time.sleep(step["seconds"])

    def init(self, step):
        from xreduce import distribution

        for key, env in (("group", "XREDUCE_GROUP"), ("local_devices", "XREDUCE_LOCAL_DEVICES")):
            if key in step:
                if step[key] is None:
                    os.environ.pop(env, None)
                else:
                    os.environ[env] = step[key]
        info = distribution.initialize(num_processes=self.num_processes, process_id=self.process_id)
        group = self._group()
        return {"local_devices": list(info.local_devices), "devices": list(info.devices),
                "global_devices": list(group.global_devices), "group": group.group}

    def shutdown(self, step):
        from xreduce import distribution

        distribution.shutdown()

    def list_devices(self, step):
        from xreduce import distribution

        return distribution.list_devices(step.get("device_type"))

    def reduce(self, step):
        from xreduce.distribute import HierarchicalCopyAllReduce

        if step.get("nbytes"):
            step = dict(step, dtype="float32", shape=[step["nbytes"] // 4])
        value = self._per_replica(step.get("seed", 0), 0, step["dtype"], step["shape"])
        ops = HierarchicalCopyAllReduce(num_packs=step.get("num_packs", 1))
        self._calling(step)
        out = ops.reduce(step.get("reduce_op", "sum"), value, value, options=self._options(step))
        return _encode_result(out, self._only_device()) if not step.get("nbytes") else "ok"

    def batch_reduce(self, step):
        from xreduce.distribute import HierarchicalCopyAllReduce

        seed = step.get("seed", 0)
        values = [self._per_replica(seed, t, spec["dtype"], spec["shape"]) for t, spec in enumerate(step["tensors"])]
        ops = HierarchicalCopyAllReduce(num_packs=step.get("num_packs", 1))
        self._calling(step)
        out = ops.batch_reduce(step.get("reduce_op", "sum"), [(v, v) for v in values], options=self._options(step))
        return [_encode_result(r, self._only_device()) for r in out]

    def prepared(self, step):
        """A prepared batch (``xreduce._prepared``) of ``tensors``, made at its first step of this ``name`` and
        kept: called once per seed of ``seeds``; its results per seed, and how many calls took the prepared
        path so far."""
        import numpy as np
        from xreduce._prepared import PreparedBatch, Spec
        from xreduce.distribute import HierarchicalCopyAllReduce

        group = self._group()
        kept = self.__dict__.setdefault("_prepared", {})
        batch = kept.get(step.get("name", ""))
        if batch is None:
            ops = HierarchicalCopyAllReduce(num_packs=step.get("num_packs", 1))
            specs = [Spec(group.local_devices, group.local_devices, np.dtype(t["dtype"]), tuple(t["shape"]))
                     for t in step["tensors"]]
            batch = kept[step.get("name", "")] = PreparedBatch(ops, step.get("reduce_op", "sum"), specs,
                                                               step.get("timeout"))
        out = []
        for seed in step["seeds"]:
            arrays = [a for t, spec in enumerate(step["tensors"])
                      for a in self._per_replica(seed, t, spec["dtype"], spec["shape"]).values]
            self._calling(step)
            out.append([_encode_result(r, group.local_devices[0]) for r in batch(arrays)])
        return {"results": out, "fast_calls": batch.fast_calls}

    def broadcast(self, step):
        from xreduce.distribute import HierarchicalCopyAllReduce

        group = self._group()
        tensor = make_array(step.get("seed", 0), 0, 0, step["dtype"], step["shape"]) if group.process_id == 0 else None
        self._calling(step)
        out = HierarchicalCopyAllReduce().broadcast(tensor, list(group.local_devices))
        return _encode_result(out, self._only_device())

    def _strategy(self, step, use_run: bool):
        from xreduce.distribute import MirroredStrategy, get_replica_context

        s = MirroredStrategy()
        if use_run:
            value = s.run(lambda: replica_value(get_replica_context().replica_id_in_sync_group))
        else:
            value = s.experimental_distribute_values_from_function(
                lambda ctx: replica_value(ctx.replica_id_in_sync_group))
        ids = [s._first_replica_id() + i for i in range(len(s.extended.worker_devices))]
        self._calling(step)
        out = s.reduce(step.get("reduce_op", "sum"), value, axis=None)
        return {"num_replicas_in_sync": s.num_replicas_in_sync, "replica_ids": ids,
                "worker_devices": list(s.extended.worker_devices),
                "reduced": _encode_result(out, s.extended.worker_devices[0])}

    def strategy_run_reduce(self, step):
        return self._strategy(step, use_run=True)

    def strategy_values_reduce(self, step):
        return self._strategy(step, use_run=False)

    def _calling(self, step):
        _emit({"event": "calling", "i": self._i, "op": step["op"], "t": time.monotonic()})

    def run(self, steps: list[dict]) -> None:
        for i, step in enumerate(steps):
            self._i = i
            op = step["op"]
            try:
                result = getattr(self, op)(step)
            except Exception as e:  # every failure is reported, typed
                _emit({"event": "step", "i": i, "op": op, "ok": False, "t": time.monotonic(),
                       "error": type(e).__name__, "message": str(e),
                       "traceback": traceback.format_exc(limit=3)})
                if step.get("stop_on_error"):
                    break
            else:
                _emit({"event": "step", "i": i, "op": op, "ok": True, "t": time.monotonic(), "result": result})
        _emit({"event": "done"})


# --- the launching side (used by tests/multiprocess/test_multiprocess.py and bench/multiprocess_faults.py) ---


class WorkerProcess:
    """A running worker: its stdout events are collected by a thread, stderr drained.

    Args:
        address: the daemon (``XREDUCE_ADDRESS``).
        num_processes, process_id: this worker's place in the job.
        steps: its script (see the module docstring).
        group: ``XREDUCE_GROUP``; None leaves it unset.
        local_devices: ``XREDUCE_LOCAL_DEVICES``; None leaves it unset.
    """

    def __init__(self, address: str, num_processes: int, process_id: int, steps: list[dict],
                 group: str | None = None, local_devices: str | None = None):
        import subprocess
        import threading

        env = dict(os.environ, XREDUCE_ADDRESS=address, PYTHONUNBUFFERED="1")
        env.pop("XREDUCE_GROUP", None)
        env.pop("XREDUCE_LOCAL_DEVICES", None)
        if group is not None:
            env["XREDUCE_GROUP"] = group
        if local_devices is not None:
            env["XREDUCE_LOCAL_DEVICES"] = local_devices
        self.process_id = process_id
        spec = {"num_processes": num_processes, "process_id": process_id, "steps": steps}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
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

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        """The first event matching ``predicate``, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise TimeoutError(f"worker {self.process_id}: no matching event within {timeout}s; "
                                       f"events={self.events} stderr={''.join(self.stderr)[-2000:]}")
                self._cond.wait(left)

    def wait_ready(self, timeout: float = 30.0) -> dict:
        return self.wait_for(lambda e: e.get("event") == "ready", timeout)

    def wait_step(self, i: int, timeout: float = 30.0) -> dict:
        return self.wait_for(lambda e: e.get("event") == "step" and e["i"] == i, timeout)

    def wait_calling(self, i: int, timeout: float = 30.0) -> dict:
        return self.wait_for(lambda e: e.get("event") == "calling" and e["i"] == i, timeout)

    def send(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 30.0) -> dict[int, dict]:
        """Waits for the worker to exit; returns its step events by step index."""
        try:
            self.proc.wait(timeout)
        except Exception:
            self.kill()
            raise
        self.wait_for(lambda e: e.get("event") == "done", 5.0)
        return self.steps()

    def steps(self) -> dict[int, dict]:
        with self._cond:
            return {e["i"]: e for e in self.events if e.get("event") == "step"}

    def kill(self, sig=None) -> float:
        """Sends SIGKILL (or ``sig``); returns the monotonic time it was sent."""
        import signal

        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGKILL)
        return t

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except Exception:
                    pass


def launch(address: str, steps_by_process: list[list[dict]], group: str | None = None,
           local_devices: list[str | None] | None = None) -> list[WorkerProcess]:
    """Starts one worker per entry of ``steps_by_process`` (process ids in order)."""
    count = len(steps_by_process)
    devices = local_devices or [None] * count
    return [WorkerProcess(address, count, p, steps, group, devices[p]) for p, steps in enumerate(steps_by_process)]


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    import xreduce  # noqa: F401  (imported before "ready", so steps start fast)
    import xreduce.distribution  # noqa: F401

    _emit({"event": "ready", "pid": os.getpid(), "process_id": spec["process_id"]})
    Worker(spec["num_processes"], spec["process_id"]).run(spec["steps"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
