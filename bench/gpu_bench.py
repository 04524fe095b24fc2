"""GPU benchmark of xreduce on one machine: the all-reduce against a copy, and CUDA IPC.

Two parts, each against a peer measured in the same run:

1. **all-reduce**: ``--devices`` logical devices (8 on one GPU stand in for a
   DGX-1) all-reduce ``--bytes`` of float32 each (hierarchical copy, SUM), on
   device-resident buffers; reported with nccl-tests' algbw and busbw, and
   against the bandwidth of one device-to-device copy of the same size (a
   CuPy memcpy timed with CUDA events).
2. **CUDA IPC**: two client processes, each holding 4 devices' values in its
   own GPU memory, all-reduce them through a real ``xreduced --backend cupy``:
   the inputs and outputs travel as IPC regions (``RegisterRegion`` with
   ``cuda_ipc``), no bytes cross gRPC. Against the same reduction in-process:
   the ``CupyBackend`` reading the same kind of device arrays and writing
   results into device arrays, without a daemon.

Every result is checked against the exactly known sum. Run
``python bench/gpu_bench.py --help``; needs CuPy and a GPU (and for part 2,
a daemon that supports CUDA IPC regions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _sub in ("server", "client", "bench"):  # runnable from a checkout without installing
    if str(_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(_ROOT / _sub))

import numpy as np  # noqa: E402
from reduce_bench import Resident, inputs, parse_bytes, timed  # noqa: E402

_SERVING = re.compile(r"event=serving address=(\S+)")
LOCAL = 4
"""Devices per client process in the CUDA IPC part."""

COLUMNS = """\
part 1 columns (medians of --iters timed runs after --warmup):
  time(us)        one all-reduce of device-resident buffers, backend synchronized around it
  algbw(GB/s)     size / time (GB = 1e9 bytes); busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce)
  copy(us)        one cudaMemcpyAsync device-to-device of the same size on one GPU, timed with CUDA events
  copybw(GB/s)    size / copy; algbw/copybw and busbw/copybw compare the two
part 2 columns:
  ipc(us)         one BatchReduce of 2 processes x 4 devices through xreduced with IPC regions, as the
                  slower client sees it (event record to reply); the daemon copies inputs in, reduces,
                  and writes results into the clients' output regions
  inproc(us)      the same reduction in this process: CupyBackend on device arrays, results written into
                  device arrays (backend synchronized around it)
  ipc/inproc      time ratio: what the daemon, gRPC and the rendezvous add (1.00 = nothing)
"""


def _log(*parts) -> None:
    print(*parts, flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(_ROOT / "client"), str(_ROOT / "server")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- part 1 ------------------------------------------------------------------------------------


def copy_seconds(nbytes: int, iters: int, warmup: int) -> float:
    """Median seconds of one device-to-device cudaMemcpyAsync of ``nbytes`` on GPU 0, by CUDA events."""
    import cupy

    with cupy.cuda.Device(0):
        src = cupy.ones(nbytes, cupy.uint8)
        dst = cupy.empty_like(src)
        cupy.cuda.Device().synchronize()  # the stream below does not wait on the null stream
        stream = cupy.cuda.Stream(non_blocking=True)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(warmup):
            dst.data.copy_from_device_async(src.data, nbytes, stream)
        stream.synchronize()
        times = []
        for _ in range(iters):
            start.record(stream)
            dst.data.copy_from_device_async(src.data, nbytes, stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        if not bool((dst == 1).all()):
            raise RuntimeError("the device-to-device copy produced wrong bytes")
        del src, dst
    return statistics.median(times)


def all_reduce_part(backend, n: int, nbytes: int, iters: int, warmup: int) -> int:
    """Part 1; returns the number of wrong result elements."""
    from xreduced.engine import SUM, Engine, Value

    dtype = np.dtype(np.float32)
    count = nbytes // dtype.itemsize
    size = count * dtype.itemsize
    arrays, want = inputs(count, dtype, n)
    resident = Resident(backend)
    for d, a in enumerate(arrays):
        resident.put(d, a)
    engine = Engine(resident)
    value = Value(tuple(range(n)), tuple(arrays))

    def run():
        resident.kept.clear()
        return engine.reduce(SUM, value, ())

    t = timed(run, backend.synchronize, iters, warmup)
    run()
    backend.synchronize()
    wrong = sum(int(np.count_nonzero(np.asarray(backend.download(resident.kept[i])).reshape(-1) != want))
                for i in (0, -1))
    resident.kept.clear()
    tc = copy_seconds(size, iters, warmup)
    algbw = size / t / 1e9
    busbw = algbw * 2 * (n - 1) / n
    copybw = size / tc / 1e9
    _log(f"# {'size(B)':>12} {'count':>10} {'type':>7} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
         f"{'#wrong':>7} {'copy(us)':>9} {'copybw(GB/s)':>13} {'algbw/copybw':>13} {'busbw/copybw':>13}")
    _log(f"  {size:>12} {count:>10} {dtype.name:>7} {t * 1e6:>10.1f} {algbw:>12.2f} {busbw:>12.2f} {wrong:>7} "
         f"{tc * 1e6:>9.1f} {copybw:>13.2f} {algbw / copybw:>13.3f} {busbw / copybw:>13.3f}")
    return wrong


# --- part 2: in-process --------------------------------------------------------------------------


class _WriteBack:
    """Wraps a CupyBackend so each result is written into the caller's device
    array (what the daemon does for an output region) instead of downloaded."""

    def __init__(self, backend, outs):
        self._b = backend
        self._outs = outs

    def download(self, buf):
        self._b.write(self._outs[buf.device], buf)
        return np.empty(0, np.uint8)

    def __getattr__(self, name):
        return getattr(self._b, name)


def _device_inputs(count: int, n: int):
    """Device ``d``'s input ``(i % 7) + d`` and the exact sum, on the current GPU."""
    import cupy

    base = (cupy.arange(count, dtype=cupy.int32) % 7).astype(cupy.float32)
    return [base + cupy.float32(d) for d in range(n)], base * cupy.float32(n) + cupy.float32(n * (n - 1) // 2)


def in_process_seconds(backend, n: int, nbytes: int, iters: int, warmup: int) -> tuple[float, int]:
    """Median seconds of the in-process reduction of device arrays into device arrays; and #wrong."""
    import cupy
    from xreduced.engine import SUM, Engine, Value

    count = nbytes // 4
    with cupy.cuda.Device(0):
        xs, want = _device_inputs(count, n)
        outs = [cupy.empty(count, cupy.float32) for _ in range(n)]
        cupy.cuda.Device().synchronize()
    engine = Engine(_WriteBack(backend, outs))
    value = Value(tuple(range(n)), tuple(xs))
    t = timed(lambda: engine.reduce(SUM, value, ()), backend.synchronize, iters, warmup)
    with cupy.cuda.Device(0):
        wrong = sum(int((o != want).sum()) for o in outs)
    return t, wrong


# --- part 2: through the daemon -------------------------------------------------------------------


class _Daemon:
    """``python -m xreduced`` on a free loopback port; stderr drained into ``lines``."""

    def __init__(self, args: list[str], timeout: float):
        self.proc = subprocess.Popen([sys.executable, "-m", "xreduced", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=_env())
        self.lines: list[str] = []
        self.address = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = _SERVING.search(line)
                if m and self.address is None:
                    self.address = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.address is None:
            self.stop()
            raise RuntimeError(f"xreduced did not start within {timeout:g} s:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def ipc_seconds(nbytes: int, iters: int, warmup: int, timeout: float) -> tuple[float, int]:
    """Median seconds of the 2-process IPC reduction through a daemon (per iteration, the slower
    process); and #wrong."""
    deadline = time.monotonic() + timeout
    daemon = _Daemon(["--listen", "127.0.0.1:0", "--backend", "cupy", "--virtual-devices", str(2 * LOCAL)],
                     timeout=min(60.0, timeout))
    workers = []
    try:
        group = f"bench-{uuid.uuid4().hex[:8]}"
        for p in range(2):
            config = {"address": daemon.address, "process_id": p, "group": group, "nbytes": nbytes,
                      "iters": iters, "warmup": warmup}
            workers.append(subprocess.Popen([sys.executable, __file__, "--ipc-worker", json.dumps(config)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()))
        reports = []
        for p, w in enumerate(workers):
            try:
                out, err = w.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"IPC client {p} did not finish within {timeout:g} s") from None
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if w.returncode != 0 or not lines:
                raise RuntimeError(f"IPC client {p} exited {w.returncode}:\n{err[-3000:]}")
            report = json.loads(lines[-1])
            if not report["ok"]:
                raise RuntimeError(f"IPC client {p}: {report['error']}\n{report.get('traceback', '')}\n"
                                   f"daemon log:\n{''.join(daemon.lines)[-3000:]}")
            reports.append(report)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)
        daemon.stop()
    per_iter = [max(ts) for ts in zip(*(r["times"] for r in reports))]
    return statistics.median(per_iter), sum(r["wrong"] for r in reports)


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


def ipc_worker(config: dict) -> dict:
    """One client process of part 2 (run as ``gpu_bench.py --ipc-worker CONFIG``)."""
    import cupy
    import grpc
    from xreduce.v1 import xreduce_pb2 as pb
    from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
    from xreduce.wire import SESSION_METADATA, cuda_ipc

    p, nbytes = config["process_id"], config["nbytes"]
    count = nbytes // 4
    n = 2 * LOCAL
    slot = _align(nbytes)
    base = (cupy.arange(count, dtype=cupy.int32) % 7).astype(cupy.float32)
    want = base * cupy.float32(n) + cupy.float32(n * (n - 1) // 2)
    inputs_ = cupy.empty(LOCAL * slot, cupy.uint8)
    outputs = cupy.zeros(LOCAL * slot + 4096, cupy.uint8)
    cupy.cuda.Device().synchronize()  # the stream below does not wait on the null stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(LOCAL):
            inputs_[i * slot:i * slot + nbytes].view(cupy.float32)[...] = base + cupy.float32(LOCAL * p + i)
    event, event_handle = cuda_ipc.ready_event(inputs_.device.id)
    ein, eout = cuda_ipc.export(inputs_), cuda_ipc.export(outputs)
    devices = [f"GPU:{LOCAL * p + i}" for i in range(LOCAL)]
    times, reply = [], None
    with grpc.insecure_channel(config["address"]) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.CrossDeviceOpsStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(), timeout=600)
        try:
            first = next(session)
            if not first.cuda_ipc:
                return {"ok": False, "error": "OpenSession says the daemon cannot open CUDA IPC handles"}
            md = ((SESSION_METADATA, first.session_id),)
            stub.RegisterRegion(pb.RegisterRegionRequest(
                name="in", cuda_ipc=pb.CudaIpcHandle(mem_handle=ein.mem_handle, device_id=ein.device_id,
                                                     event_handle=event_handle),
                offset=ein.offset, byte_size=ein.nbytes), metadata=md, timeout=30)
            stub.RegisterRegion(pb.RegisterRegionRequest(
                name="out", cuda_ipc=pb.CudaIpcHandle(mem_handle=eout.mem_handle, device_id=eout.device_id),
                offset=eout.offset, byte_size=eout.nbytes), metadata=md, timeout=30)
            value = pb.DistributedValue(components=[
                pb.Component(device=devices[i], tensor=pb.Tensor(
                    dtype=pb.DATA_TYPE_FLOAT32, shape=[count],
                    region=pb.RegionSlice(name="in", offset=i * slot, byte_size=nbytes)))
                for i in range(LOCAL)
            ])
            for it in range(config["warmup"] + config["iters"]):
                request = pb.BatchReduceRequest(
                    reduce_op=pb.REDUCE_OP_SUM, pairs=[pb.ReducePair(value=value)],
                    collective=pb.CollectiveSpec(group=config["group"], num_processes=2, process_id=p, sequence=it),
                    output=pb.RegionSlice(name="out", offset=0, byte_size=eout.nbytes))
                t0 = time.perf_counter()
                event.record(stream)
                reply = stub.BatchReduce(request, metadata=md, timeout=60)
                if it >= config["warmup"]:
                    times.append(time.perf_counter() - t0)
            wrong = 0
            for c in reply.results[0].result.components:
                s = c.tensor.region
                if s.name != "out" or s.byte_size != nbytes:
                    return {"ok": False, "error": f"result on {c.device} not in the output region: {s}"}
                wrong += int((outputs[s.offset:s.offset + nbytes].view(cupy.float32) != want).sum())
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name=""), metadata=md, timeout=30)
        finally:
            session.cancel()
    return {"ok": True, "times": times, "wrong": wrong}


def _worker_main(config: dict) -> int:
    try:
        report = ipc_worker(config)
    except Exception as e:  # report every failure to the parent, which prints it
        details = getattr(e, "details", None)
        report = {"ok": False, "error": f"{type(e).__name__}: {details() if callable(details) else e}",
                  "traceback": traceback.format_exc()}
    print(json.dumps(report), flush=True)
    return 0


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ipc-worker"]:
        return _worker_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=COLUMNS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="logical devices of part 1 (>= 2); default 8")
    p.add_argument("--bytes", type=parse_bytes, default=parse_bytes("256MiB"),
                   help="float32 bytes per device, both parts; default 256MiB")
    p.add_argument("--iters", type=int, default=10, help="timed runs; default 10")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first; default 3")
    p.add_argument("--skip-allreduce", action="store_true", help="skip part 1")
    p.add_argument("--skip-ipc", action="store_true", help="skip part 2")
    p.add_argument("--ipc-timeout", type=float, default=150.0, help="seconds for part 2's daemon run; default 150")
    args = p.parse_args(argv)
    if args.devices < 2 or args.iters < 1 or args.warmup < 0 or args.bytes < 4:
        p.error("--devices must be >= 2, --iters >= 1, --warmup >= 0, --bytes >= 4")

    from xreduced.backends import cupy_backend

    reason = cupy_backend.unavailable_reason()
    if reason is not None:
        _log(f"# gpu_bench: {reason}")
        return 2
    import cupy

    nbytes = args.bytes // 4 * 4
    backend = cupy_backend.CupyBackend(args.devices)
    infos = backend.devices()
    _log(f"# xreduce GPU benchmark: cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
         f"{cupy.cuda.runtime.getDeviceCount()} GPU(s); logical devices: "
         f"{', '.join(sorted({i.physical_device for i in infos}))} x{args.devices}")
    _log(f"# timing: median of {args.iters} runs after {args.warmup} warm-up runs")
    status, wrong = 0, 0
    if not args.skip_allreduce:
        _log(f"## 1. all-reduce (hierarchical copy, SUM) on {args.devices} logical devices, device-resident, "
             f"vs one device-to-device copy of the same size")
        try:
            wrong += all_reduce_part(backend, args.devices, nbytes, args.iters, args.warmup)
        except Exception:  # report and go on to part 2
            _log(f"# part 1 FAILED:\n{traceback.format_exc()}")
            status = 2
        cupy.get_default_memory_pool().free_all_blocks()
    if not args.skip_ipc:
        _log(f"## 2. CUDA IPC: 2 processes x {LOCAL} devices through xreduced vs the same reduction in-process "
             f"(CupyBackend, {2 * LOCAL} logical devices)")
        _log(f"# {'size(B)':>12} {'ipc(us)':>10} {'ipc algbw':>10} {'inproc(us)':>11} {'inproc algbw':>13} "
             f"{'ipc/inproc':>11} {'#wrong':>7}")
        try:
            ip_backend = backend if args.devices == 2 * LOCAL else cupy_backend.CupyBackend(2 * LOCAL)
            t_in, wrong_in = in_process_seconds(ip_backend, 2 * LOCAL, nbytes, args.iters, args.warmup)
            cupy.get_default_memory_pool().free_all_blocks()
            t_ipc, wrong_ipc = ipc_seconds(nbytes, args.iters, args.warmup, args.ipc_timeout)
            wrong += wrong_in + wrong_ipc
            _log(f"  {nbytes:>12} {t_ipc * 1e6:>10.1f} {nbytes / t_ipc / 1e9:>10.2f} {t_in * 1e6:>11.1f} "
                 f"{nbytes / t_in / 1e9:>13.2f} {t_ipc / t_in:>11.3f} {wrong_in + wrong_ipc:>7}")
        except Exception:  # report; the exit status says it failed
            _log(f"# part 2 FAILED:\n{traceback.format_exc()}")
            status = 2
    _log(f"# wrong values: {wrong} {'OK' if wrong == 0 else 'WRONG'}")
    if wrong:
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
