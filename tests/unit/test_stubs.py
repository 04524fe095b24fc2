"""The committed gRPC stubs match what the pinned grpcio-tools makes of protos/."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_have_not_drifted(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)], check=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "the generator produced nothing"
    for rel in fresh:
        committed = ROOT / "client" / rel
        assert committed.exists(), f"{rel} is generated but not committed; run scripts/gen_protos.py"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} differs from protos/; run scripts/gen_protos.py"
        )


def test_buf_lint_passes():
    buf = pathlib.Path(sys.executable).parent / "buf"
    result = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
