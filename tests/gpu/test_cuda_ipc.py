"""CUDA IPC: CuPy arrays of another process, read and written in place (needs a GPU).

A CUDA IPC handle cannot be opened by the process that made it, so every test
starts helper processes: this file run as a script (``python
tests/gpu/test_cuda_ipc.py export|client CONFIG``), talking one JSON object per
line over its stdin and stdout.

* ``export``: makes CuPy arrays (the input at an offset inside a larger pool
  allocation, written on a stream behind a long-running kernel and followed by
  an interprocess event), prints their IPC handles, and on request checks what
  was written into its output array.
* ``client``: one process of a two-process job against a real ``xreduced
  --backend cupy``: registers its input and output arrays as CUDA IPC regions
  with the raw RPCs, runs ``BatchReduce`` with region tensors and an output
  region, and checks the results in its own memory.

Skipped, with the reason, where CuPy or a GPU is missing; run with
``pytest -m gpu tests/gpu/test_cuda_ipc.py`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid

import numpy as np
import pytest
from children import child_env

HERE = pathlib.Path(__file__).resolve()
COUNT = 1 << 20  # float32 items of the exported input and output
SPIN_CYCLES = 200_000_000  # GPU clock cycles the exporter's stream spins before writing the input
TENSORS = [(1000, 3), (5,), (257, 4)]  # the end-to-end batch (float32)
LOCAL = 4  # devices per client process in the end-to-end test


def _reason() -> str | None:
    from xreduced.backends import cupy_backend

    return cupy_backend.unavailable_reason()


_REASON = _reason() if __name__ != "__main__" else None
needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"GPU backend unavailable: {_REASON}"),
    pytest.mark.timeout(60),
]


def _gpu_test(fn):
    for mark in reversed(needs_gpu):
        fn = mark(fn)
    return fn


class _Child:
    """This file run as a helper process; JSON lines both ways, every read bounded."""

    def __init__(self, mode: str, config: dict):
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), mode, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=child_env(),
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()[-6000:]

    def recv(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the helper said nothing within {timeout:g} s; "
                                 f"its stderr:\n{self.stderr()}") from None
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"the helper exited with {self.proc.returncode}; its stderr:\n{self.stderr()}")
        return json.loads(line)

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()


def _want_input() -> np.ndarray:
    return np.arange(COUNT, dtype=np.float32) * np.float32(3) + np.float32(1)


def _same(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
    g, w = got.reshape(-1), want.reshape(-1)
    bad = np.flatnonzero(g.view(f"u{g.dtype.itemsize}") != w.view(f"u{w.dtype.itemsize}"))
    assert bad.size == 0, f"{what}: {bad.size} items differ, first at {bad[:5].tolist()}: got {g[bad[:5]]}"


@pytest.fixture(scope="module")
def gpu():
    from xreduced.backends import cupy_backend

    return cupy_backend.CupyBackend(8)


@pytest.fixture
def exporter():
    child = _Child("export", {"count": COUNT, "spin_cycles": SPIN_CYCLES})
    try:
        yield child
    finally:
        child.close()


def _open(gpu, spec: dict, event: str = "", offset: int = 0, size: int | None = None):
    return gpu.open_ipc(bytes.fromhex(spec["handle"]), spec["device_id"], spec["offset"] + offset,
                        spec["nbytes"] - offset if size is None else size, bytes.fromhex(event))


# --- the SDK's side, in one process ------------------------------------------------------------


def test_export_needs_cupy_and_names_the_extra():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed: the missing-extra message cannot show")
    from xreduce.wire import cuda_ipc

    with pytest.raises(ImportError, match=r"xreduce\[gpu\]"):
        cuda_ipc.export(np.zeros(4))
    with pytest.raises(ImportError, match=r"xreduce\[gpu\]"):
        cuda_ipc.ready_event(0)


@_gpu_test
def test_export_finds_the_allocation_and_the_offset():
    import cupy
    from xreduce.wire import cuda_ipc

    block = cupy.zeros(1 << 20, cupy.uint8)
    whole, part = cuda_ipc.export(block), cuda_ipc.export(block[4096:8192])
    assert len(whole.mem_handle) == 64 and whole.mem_handle == part.mem_handle
    assert whole.buffer_id == part.buffer_id and whole.alloc_size == part.alloc_size
    assert part.offset - whole.offset == 4096 and part.nbytes == 4096
    assert 0 <= whole.offset and whole.offset + whole.nbytes <= whole.alloc_size
    assert whole.device_id == block.device.id
    other = cuda_ipc.export(cupy.zeros(1 << 20, cupy.uint8))
    # Another array may or may not share the pool allocation; the id and the handle agree either way.
    assert (other.buffer_id == whole.buffer_id) == (other.mem_handle == whole.mem_handle)
    event, handle = cuda_ipc.ready_event(block.device.id)
    assert isinstance(handle, bytes) and len(handle) == 64
    event.record(cupy.cuda.get_current_stream())
    event.synchronize()
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuda_ipc.export(np.zeros(4))
    with pytest.raises(ValueError, match="empty"):
        cuda_ipc.export(cupy.zeros(0))
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_ipc.export(cupy.zeros((4, 4))[:, 1])


# --- the daemon's backend against another process's memory -----------------------------------


@_gpu_test
def test_open_read_and_write_another_process_memory(gpu, exporter):
    import cupy
    from xreduced.backends import cupy_backend

    msg = exporter.recv(45)
    x, y = msg["x"], msg["y"]
    assert x["offset"] > 0, "the input should sit inside its allocation, not at its start"
    rx, ry = _open(gpu, x, msg["event"]), _open(gpu, y)
    try:
        assert rx.has_event and not ry.has_event
        assert rx.array.dtype == np.uint8 and rx.array.shape == (COUNT * 4,)
        want = _want_input()
        # The exporter's stream is still spinning: only the IPC event orders this read after its write.
        buf = gpu.upload(5, cupy_backend.device_view(rx.array, np.float32, (COUNT,)))
        _same(gpu.download(buf), want, "upload of the IPC input (device stream waited on the event)")
        rx.wait(None, timeout=30)
        with cupy.cuda.Device(rx.device_id):
            _same(rx.array[4 * 10:4 * 30].view(cupy.float32).get(), want[10:30], "direct read after wait()")
        total = gpu.add(buf, gpu.upload(5, np.ones(COUNT, np.float32)))
        gpu.write(cupy_backend.device_view(ry.array, np.float32, (COUNT,)), total)
        host = np.empty(COUNT, np.float32)
        gpu.write(host, total)
        half = np.empty((COUNT // 2, 2), np.float32)  # a result written into another shape of the same size
        gpu.write(half, total)
        gpu.synchronize()
        _same(host, want + np.float32(1), "write into a host array")
        _same(half.reshape(-1), want + np.float32(1), "write into a reshaped host array")
        exporter.send({"op": "check", "add": 1.0})
        report = exporter.recv(30)
        assert report["mismatches"] == 0, f"the exporter's output array after write(): {report}"
        with pytest.raises(ValueError, match="write"):
            gpu.write(np.empty(3, np.float32), total)
        with pytest.raises(ValueError, match="write"):
            gpu.write(np.empty(COUNT, np.float64), total)
    finally:
        rx.close()
        ry.close()
    rx.close()  # idempotent


@_gpu_test
def test_engine_reduces_ipc_inputs_bit_exactly(gpu, exporter):
    """Region views as every replica's input, through the engine, against numpy."""
    from xreduced.backends import cupy_backend
    from xreduced.backends.numpy_backend import NumpyBackend
    from xreduced.engine import SUM, Engine, Value

    msg = exporter.recv(45)
    x = msg["x"]
    region = _open(gpu, x, msg["event"])
    try:
        n = COUNT // 8
        views = [cupy_backend.device_view(region.array[4 * n * p:4 * n * (p + 1)], np.float32, (n,))
                 for p in range(8)]
        want_in = _want_input().reshape(8, n)
        got = Engine(gpu).reduce(SUM, Value(tuple(range(8)), tuple(views)), ())
        want = Engine(NumpyBackend(8)).reduce(SUM, Value(tuple(range(8)), tuple(want_in)), ())
        assert got.devices == want.devices and got.route == want.route
        for d, g, w in zip(got.devices, got.arrays, want.arrays):
            _same(g, w, f"engine SUM of IPC inputs on device {d}")
    finally:
        region.close()


@_gpu_test
def test_two_regions_share_one_mapping(gpu, exporter):
    import cupy

    msg = exporter.recv(45)
    x = msg["x"]
    whole = _open(gpu, x, msg["event"])
    part = _open(gpu, x, offset=4 * 10, size=4 * 20)
    want = _want_input()
    try:
        whole.wait(None, timeout=30)
        whole.close()
        with cupy.cuda.Device(part.device_id):
            _same(part.array.view(cupy.float32).get(), want[10:30], "the second region after the first closed")
    finally:
        whole.close()
        part.close()


@_gpu_test
def test_open_ipc_rejects_bad_input_and_keeps_working(gpu, exporter):
    msg = exporter.recv(45)
    x = msg["x"]
    handle = bytes.fromhex(x["handle"])
    cases = [
        (dict(mem_handle=handle[:10], device_id=x["device_id"], offset=0, byte_size=16), "cuda_ipc.mem_handle"),
        (dict(mem_handle=handle, device_id=99, offset=0, byte_size=16), "cuda_ipc.device_id"),
        (dict(mem_handle=handle, device_id=-1, offset=0, byte_size=16), "cuda_ipc.device_id"),
        (dict(mem_handle=handle, device_id=x["device_id"], offset=0, byte_size=16, event_handle=b"xyz"),
         "cuda_ipc.event_handle"),
        (dict(mem_handle=handle, device_id=x["device_id"], offset=-1, byte_size=16), "offset"),
        (dict(mem_handle=handle, device_id=x["device_id"], offset=0, byte_size=0), "byte_size"),
        (dict(mem_handle=handle, device_id=x["device_id"], offset=x["alloc_size"] - 8, byte_size=64), "byte_size"),
        (dict(mem_handle=os.urandom(64), device_id=x["device_id"], offset=0, byte_size=16), "cuda_ipc.mem_handle"),
    ]
    for kwargs, field in cases:
        shown = {k: (f"<{len(v)} bytes>" if isinstance(v, bytes) else v) for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
            gpu.open_ipc(**kwargs)
        assert str(info.value).startswith(field), f"{shown}: {info.value}"
    assert not gpu._opened, f"a rejected open left a mapping behind: {len(gpu._opened)}"
    region = _open(gpu, x, msg["event"])
    try:
        region.wait(None, timeout=30)
        got = gpu.download(gpu.upload(0, region.array[:64].view("float32")))
        _same(got, _want_input()[:16], "a good open after the bad ones")
    finally:
        region.close()


# --- the whole path: two processes, the daemon, regions ------------------------------------------


@_gpu_test
def test_two_processes_reduce_through_the_daemon_with_ipc_regions(start_daemon):
    proc = start_daemon("--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", "8", timeout=30)
    clients = []
    try:
        group = f"ipc-{uuid.uuid4().hex[:8]}"
        clients = [_Child("client", {"address": proc.address, "process_id": p, "group": group}) for p in (0, 1)]
        for p, child in enumerate(clients):
            report = child.recv(45)
            assert report["ok"], f"client {p}: {report['error']}\n{report.get('traceback', '')}\n{proc.log()[-4000:]}"
            assert report["regions"] == [["in", "cuda_ipc"], ["out", "cuda_ipc"]], report["regions"]
            code, details = report["bad_register"]
            assert code == "INVALID_ARGUMENT" and "cuda_ipc.mem_handle" in details, report["bad_register"]
            assert report["devices"] == [
                [f"/job:localhost/replica:0/task:0/device:GPU:{LOCAL * p + i}" for i in range(LOCAL)]
            ] * len(TENSORS)
            for t, shape in enumerate(TENSORS):
                want = _sum_of_replicas(t, shape)
                for i, hexed in enumerate(report["results"][t]):
                    got = np.frombuffer(bytes.fromhex(hexed), np.float32).reshape(shape)
                    _same(got, want, f"client {p} tensor {t} component {i}, read from its output region")
    finally:
        for child in clients:
            child.close()
        code = proc.terminate()
    assert code == 0, f"xreduced exited {code}:\n{proc.log()[-4000:]}"


def _replica(t: int, r: int, shape) -> np.ndarray:
    """Global replica ``r``'s tensor ``t``: small integers, so every sum is exact in float32."""
    size = int(np.prod(shape))
    return ((np.arange(size) * (r + 1) + 7 * t) % 13 - 6).astype(np.float32).reshape(shape)


def _sum_of_replicas(t: int, shape) -> np.ndarray:
    total = np.zeros(shape, np.float32)
    for r in range(2 * LOCAL):
        total += _replica(t, r, shape)
    return total


# --- helper processes --------------------------------------------------------------------------

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _export_main(config: dict) -> None:
    import cupy
    from xreduce.wire import cuda_ipc

    count = config["count"]
    block = cupy.zeros(count * 4 + 8192, cupy.uint8)
    x = block[4096:4096 + count * 4].view(cupy.float32)
    y = cupy.zeros(count, cupy.float32)
    spin = cupy.RawKernel(_SPIN, "spin")
    cupy.cuda.Device().synchronize()
    event, event_handle = cuda_ipc.ready_event(x.device.id)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(config["spin_cycles"]),))
        x[...] = cupy.arange(count, dtype=cupy.float32) * cupy.float32(3) + cupy.float32(1)
    event.record(stream)

    def spec(a):
        e = cuda_ipc.export(a)
        return {"handle": e.mem_handle.hex(), "device_id": e.device_id, "offset": e.offset,
                "nbytes": e.nbytes, "alloc_size": e.alloc_size}

    _say({"x": spec(x), "y": spec(y), "event": event_handle.hex()})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "check":
            cupy.cuda.Device().synchronize()
            want = cupy.arange(count, dtype=cupy.float32) * cupy.float32(3) + cupy.float32(1 + request["add"])
            bad = int((y != want).sum())
            _say({"mismatches": bad, "head": y[:4].get().tolist()})
    stream.synchronize()


def _client_main(config: dict) -> None:
    try:
        _say(_client(config))
    except Exception as e:  # report every failure to the test, which shows it
        details = getattr(e, "details", None)
        label = f"{type(e).__name__}: {details() if callable(details) else e}"
        _say({"ok": False, "error": label, "traceback": traceback.format_exc()})


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


def _client(config: dict) -> dict:
    import cupy
    import grpc
    from xreduce.v1 import xreduce_pb2 as pb
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduce.wire import SESSION_METADATA, cuda_ipc

    p = config["process_id"]
    devices = [f"GPU:{LOCAL * p + i}" for i in range(LOCAL)]
    slots, offset = [], 0  # (tensor, component) -> byte offset in the input allocation
    for shape in TENSORS:
        nbytes = int(np.prod(shape)) * 4
        slots.append([(offset + i * _align(nbytes), nbytes) for i in range(LOCAL)])
        offset += LOCAL * _align(nbytes)
    inputs = cupy.zeros(offset, cupy.uint8)
    outputs = cupy.zeros(2 * offset + 4096, cupy.uint8)
    cupy.cuda.Device().synchronize()
    event, event_handle = cuda_ipc.ready_event(inputs.device.id)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for t, shape in enumerate(TENSORS):
            for i, (start, nbytes) in enumerate(slots[t]):
                inputs[start:start + nbytes].view(cupy.float32)[...] = cupy.asarray(
                    _replica(t, LOCAL * p + i, shape).reshape(-1))
    event.record(stream)
    ein, eout = cuda_ipc.export(inputs), cuda_ipc.export(outputs)

    with grpc.insecure_channel(config["address"]) as channel:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb_grpc.CrossDeviceOpsStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(), timeout=50)
        try:
            first = next(session)
            if not first.cuda_ipc:
                return {"ok": False, "error": "OpenSession says the daemon cannot open CUDA IPC handles"}
            md = ((SESSION_METADATA, first.session_id),)
            try:
                stub.RegisterRegion(pb.RegisterRegionRequest(
                    name="bad", cuda_ipc=pb.CudaIpcHandle(mem_handle=bytes(64), device_id=ein.device_id),
                    offset=0, byte_size=16), metadata=md, timeout=20)
                bad = ["OK", "a zero handle was accepted"]
            except grpc.RpcError as e:
                bad = [e.code().name, e.details()]
            stub.RegisterRegion(pb.RegisterRegionRequest(
                name="in", cuda_ipc=pb.CudaIpcHandle(mem_handle=ein.mem_handle, device_id=ein.device_id,
                                                     event_handle=event_handle),
                offset=ein.offset, byte_size=ein.nbytes), metadata=md, timeout=20)
            stub.RegisterRegion(pb.RegisterRegionRequest(
                name="out", cuda_ipc=pb.CudaIpcHandle(mem_handle=eout.mem_handle, device_id=eout.device_id),
                offset=eout.offset, byte_size=eout.nbytes), metadata=md, timeout=20)
            listed = stub.ListRegions(pb.ListRegionsRequest(), metadata=md, timeout=20)
            pairs = [
                pb.ReducePair(value=pb.DistributedValue(components=[
                    pb.Component(device=devices[i], tensor=pb.Tensor(
                        dtype=pb.DATA_TYPE_FLOAT32, shape=list(shape),
                        region=pb.RegionSlice(name="in", offset=start, byte_size=nbytes)))
                    for i, (start, nbytes) in enumerate(slots[t])
                ]))
                for t, shape in enumerate(TENSORS)
            ]
            reply = stub.BatchReduce(pb.BatchReduceRequest(
                reduce_op=pb.REDUCE_OP_SUM, pairs=pairs,
                collective=pb.CollectiveSpec(group=config["group"], num_processes=2, process_id=p, sequence=0),
                output=pb.RegionSlice(name="out", offset=0, byte_size=eout.nbytes),
            ), metadata=md, timeout=40)
            host = outputs.get()
            results, names = [], []
            for t, result in enumerate(reply.results):
                shape, hexed, seen = TENSORS[t], [], []
                for c in result.result.components:
                    s = c.tensor.region
                    if c.tensor.raw_data or s.name != "out":
                        return {"ok": False, "error": f"result {t} on {c.device} was not written into the output "
                                                      f"region: region={s.name!r}, {len(c.tensor.raw_data)} raw bytes"}
                    if s.offset % 64 or s.byte_size != int(np.prod(shape)) * 4 or list(c.tensor.shape) != list(shape):
                        return {"ok": False, "error": f"result {t} on {c.device}: slice {s.offset}+{s.byte_size}, "
                                                      f"shape {list(c.tensor.shape)}"}
                    hexed.append(host[s.offset:s.offset + s.byte_size].tobytes().hex())
                    seen.append(c.device)
                results.append(hexed)
                names.append(seen)
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name=""), metadata=md, timeout=20)
        finally:
            session.cancel()
    return {"ok": True, "results": results, "devices": names, "bad_register": bad,
            "regions": [[r.name, r.kind] for r in listed.regions]}


if __name__ == "__main__":
    {"export": _export_main, "client": _client_main}[sys.argv[1]](json.loads(sys.argv[2]))
