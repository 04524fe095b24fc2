"""Regenerate the gRPC stubs under client/xreduce/v1 from protos/.

Usage: python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to client/; the drift test passes a temporary folder and
compares. The stubs are committed; run this after every .proto change with
the grpcio-tools version pinned in pyproject.toml's dev extra.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the *_pb2.py, *_pb2.pyi and *_pb2_grpc.py files into out_dir."""
    protos = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client"
    for path in generate(target):
        print(path.relative_to(target))
