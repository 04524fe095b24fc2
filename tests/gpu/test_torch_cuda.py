"""``xreduce.torch`` with CUDA tensors: 2 ranks on a ``--backend cupy`` daemon, against Gloo with the same tensors.

Each rank (this file run as a script: ``python tests/gpu/test_torch_cuda.py worker BACKEND``) puts its tensors on
the GPU, all-reduces, broadcasts and all-gathers them, then trains a small MLP on the GPU with DDP for a few steps,
and prints one JSON object: the results' and the weights' bytes as hex digests. Over ``xreduce`` the tensors go to
the daemon by CUDA IPC (CuPy views of the tensors, DLPack); the digests must equal Gloo's (2 ranks: the same
additions). Skipped, with the reason, where torch has no CUDA or the daemon's GPU backend is unavailable; run with
``pytest -m gpu tests/gpu/test_torch_cuda.py`` on a GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve()


def _reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    from xreduced.backends import cupy_backend

    why = cupy_backend.unavailable_reason()
    return None if why is None else f"GPU backend unavailable: {why}"


def _digest(t) -> str:
    """The first 16 hex digits of the sha256 of a tensor's bytes."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def worker(backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "xreduce":
        import xreduce.torch  # noqa: F401 - registers the backend
    torch.cuda.set_device(0)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    out = {}
    x = torch.arange(1000, dtype=torch.float32, device="cuda") * (rank + 1) / 7
    dist.all_reduce(x)
    out["all_reduce"] = _digest(x)
    b = torch.randn(333, generator=torch.Generator().manual_seed(rank)).cuda()
    dist.broadcast(b, 1)
    out["broadcast"] = _digest(b)
    parts = [torch.empty(5, device="cuda") for _ in range(2)]
    dist.all_gather(parts, torch.full((5,), float(rank), device="cuda"))
    out["all_gather"] = _digest(torch.cat(parts))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(10 + rank)
    for _ in range(5):
        xs = torch.randn(8, 16, generator=data).cuda()
        opt.zero_grad()
        ddp(xs).square().mean().backward()
        opt.step()
    out["weights"] = _digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    print(json.dumps({"rank": rank, **out}), flush=True)
    dist.destroy_process_group()


def _run(backend: str, address: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "XREDUCE_ADDRESS": address}
        procs.append(subprocess.Popen([sys.executable, str(HERE), "worker", backend], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.splitlines()[-1]))
    return results


_REASON = _reason() if __name__ != "__main__" else None


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_cuda_tensors_reduce_through_the_daemon_to_gloos_bytes(start_module_daemon):
    with tempfile.TemporaryDirectory(prefix="xr-torch-") as tmp:
        daemon = start_module_daemon("--listen", f"unix:{tmp}/xreduced.sock", "--backend", "cupy",
                                     "--virtual-devices", "2", "--collective-timeout", "60", timeout=60)
        ours = _run("xreduce", daemon.address)
        theirs = _run("gloo", daemon.address)
    for mine, gloo in zip(ours, theirs):
        assert mine == gloo


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2])
