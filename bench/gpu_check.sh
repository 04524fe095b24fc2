#!/usr/bin/env bash
# The device-machine check of the CuPy backend, in one unattended run:
#   1. find a Python that imports cupy (else make a fresh venv and pip install -e '.[gpu,dev]'),
#   2. print the GPUs (nvidia-smi -L) and the versions in use,
#   3. pytest -q -m gpu tests/gpu/test_cupy_backend.py   (at most 150 s)
#   4. pytest -q -m gpu tests/gpu/test_cuda_ipc.py (at most 90 s), then tests/gpu/test_sdk_cuda_ipc.py (150 s)
#      (conftest imports the stubs only for the fixtures that use them, so a grpcio/protobuf
#      too old for the stubs fails only the tests that use the stubs),
#   5. pytest -q -m gpu tests/gpu/test_nodes_nccl.py (at most 150 s): two daemons on the one GPU as two
#      nodes, their node sums on NCCL (engine gloo+nccl), then one daemon SIGKILLed mid-collective;
#      needs torch too (Gloo carries the rest: the cluster extra, or the dev extra's pinned torch),
#   5b. pytest -q -m gpu tests/gpu/test_torch_cuda.py (at most 120 s): xreduce.torch with CUDA tensors, 2 ranks
#      on the daemon by CUDA IPC against Gloo (needs a torch with CUDA; skipped with the reason otherwise),
#   6. python bench/gpu_bench.py: 8 logical devices, 256 MiB float32 all-reduce against a
#      device-to-device copy; CUDA IPC from 2 processes through the daemon against in-process
#      (at most 120 s),
# each step under its own timeout, all within BUDGET_S seconds (default 540 = 9 minutes): a step
# gets what is left after keeping time for the later steps, and is skipped below 30 s.
#
# Usage (from the repo root or anywhere): bash bench/gpu_check.sh
# Environment:
#   PYTHON    interpreter to try first (then .venv/bin/python, python3, python)
#   BUDGET_S  total seconds for everything (default 540)
#   OUT       if set, logs land there (else /tmp/xreduce-gpu-check): pytest_backend.log,
#             junit_backend.xml, pytest_ipc.log, junit_ipc.xml, pytest_sdkipc.log, junit_sdkipc.xml,
#             pytest_nodes.log, junit_nodes.xml, pytest_torch.log, junit_torch.xml, bench.log
#   VENV      where a fresh venv goes when one is needed (default /tmp/xreduce-gpu-venv)
# Wheels in .whl/*.whl (carried to the device machine) are installed with --no-index into
# /tmp/site before the tests run, for packages the machine lacks (e.g. grpcio-health-checking).
# Exit status: 0 all passed; 1 GPU tests failed, timed out, or were all skipped; 2 no usable
# Python; 3 the tests passed but the benchmark failed, timed out or found wrong values.
set -euo pipefail

cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-540}
VENV=${VENV:-/tmp/xreduce-gpu-venv}
LOGS=${OUT:-/tmp/xreduce-gpu-check}
mkdir -p "$LOGS"
START=$SECONDS

say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

export PYTHONUNBUFFERED=1
# The packages live in client/, server/ and bench/: importable from the checkout without installing.
export PYTHONPATH="$PWD/client:$PWD/server:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"

say "repo: $PWD; budget ${BUDGET_S}s; logs in $LOGS"

# --- 1. a Python with cupy ---------------------------------------------------
PY=""
for cand in ${PYTHON:-} .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import cupy' >/dev/null 2>&1; then
        PY=$(command -v "$cand")
        break
    fi
done
if [ -z "$PY" ]; then
    base=$(command -v python3 || command -v python || true)
    if [ -z "$base" ]; then
        say "FAILED: no python3 on PATH"
        exit 2
    fi
    say "no interpreter imports cupy: creating a fresh venv $VENV from $base and running"
    say "  pip install -e '.[gpu,dev]'   (downloads cupy-cuda12x and the rest: needs a package index)"
    rm -rf "$VENV"
    "$base" -m venv "$VENV"
    if ! timeout -k 5 "$(min 300 "$(left)")" "$VENV/bin/python" -m pip install -q -e '.[gpu,dev]'; then
        say "FAILED: pip install -e '.[gpu,dev]' did not complete (no network? carry wheels in .whl/)"
        exit 2
    fi
    PY="$VENV/bin/python"
fi
say "python: $PY ($("$PY" -V 2>&1))"

if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing carried wheels into /tmp/site (--no-index --no-deps): $(cd .whl && echo *.whl)"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl; then
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    else
        say "WARNING: the carried wheels did not install with $PY; going on with what it has"
    fi
fi

# --- 2. what we run on ---------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true
else
    say "nvidia-smi not found"
fi
"$PY" - <<'EOF' || true
import importlib
for name in ("cupy", "numpy", "ml_dtypes", "grpc", "google.protobuf", "pytest", "pytest_timeout", "torch"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report every missing piece at once
        print(f"  {name}: NOT IMPORTABLE ({type(e).__name__}: {e})")
try:
    from cupy.cuda import nccl
    print(f"  NCCL available {nccl.available}, version {nccl.get_version() if nccl.available else '-'}")
except Exception as e:
    print(f"  NCCL: {type(e).__name__}: {e}")
try:
    import cupy
    rt = cupy.cuda.runtime
    print(f"  CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
          f"{rt.getDeviceCount()} GPU(s)")
except Exception as e:
    print(f"  CUDA: {type(e).__name__}: {e}")
EOF
if ! err=$("$PY" -c 'import xreduced.server, xreduce.wire.codec, xreduce.v1.xreduce_pb2_grpc' 2>&1); then
    say "WARNING: the project does not import with $PY; the tests will fail:"
    printf '%s\n' "$err" | tail -n 3
    say "  carry the missing wheels in .whl/ (grpcio-health-checking, grpcio-reflection, and"
    say "  grpcio/protobuf if too old for the committed stubs: grpcio>=1.85.1, protobuf>=7.35.1)"
fi

# --- 3, 4, 5. the GPU tests ---------------------------------------------------------
# step_timeout CAP RESERVE: seconds for a step, keeping RESERVE for the steps after it.
step_timeout() { min "$1" $(($(left) - $2 - 5)); }

run_tests() {  # run_tests NAME FILE CAP RESERVE -> sets rc_NAME
    local name=$1 file=$2 t rc=0
    t=$(step_timeout "$3" "$4")
    if [ "$t" -lt 30 ]; then
        say "$file: SKIPPED, only ${t}s left"
        eval "rc_$name=124"
        return
    fi
    say "pytest -q -m gpu $file (timeout ${t}s)"
    # -o addopts: in this process, one test at a time on the one GPU (and no need for pytest-xdist)
    timeout -k 10 "$t" "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts=-ra \
        --junitxml "$LOGS/junit_$name.xml" "$file" >"$LOGS/pytest_$name.log" 2>&1 || rc=$?
    # The summary (failures, skip reasons, counts) is at the end; keep the output bounded.
    tail -n 60 "$LOGS/pytest_$name.log"
    if [ "$rc" -eq 0 ] && ! tail -n 3 "$LOGS/pytest_$name.log" | grep -Eq '[0-9]+ passed'; then
        say "$file: nothing passed: every test was skipped (the reasons are above)"
        rc=5
    fi
    case $rc in
        0) say "$file: passed" ;;
        124 | 137) say "$file: TIMED OUT after ${t}s" ;;
        *) say "$file: FAILED (pytest exit $rc)" ;;
    esac
    eval "rc_$name=$rc"
}

rc_backend=0
rc_ipc=0
rc_sdkipc=0
rc_nodes=0
rc_torch=0
# The reserves keep time for the later steps: the benchmark 70 s, the nodes step 120 s more, 120 s more for
# test_sdk_cuda_ipc, 60 s more for test_cuda_ipc (each step's time beyond its 30 s minimum comes from the slack).
run_tests backend tests/gpu/test_cupy_backend.py 150 370
run_tests ipc tests/gpu/test_cuda_ipc.py 90 310
run_tests sdkipc tests/gpu/test_sdk_cuda_ipc.py 150 190
run_tests nodes tests/gpu/test_nodes_nccl.py 150 100
run_tests torch tests/gpu/test_torch_cuda.py 120 70

# --- 6. the benchmark ------------------------------------------------------------
t_bench=$(step_timeout 120 0)
bench_rc=0
if [ "$t_bench" -lt 30 ]; then
    say "benchmark: SKIPPED, only ${t_bench}s left"
    bench_rc=124
else
    ipc_timeout=$((t_bench * 2 / 3))
    say "python bench/gpu_bench.py --ipc-timeout $ipc_timeout (timeout ${t_bench}s)"
    timeout -k 5 "$t_bench" "$PY" bench/gpu_bench.py --ipc-timeout "$ipc_timeout" 2>&1 \
        | tee "$LOGS/bench.log" || bench_rc=${PIPESTATUS[0]}
    case $bench_rc in
        0) say "benchmark: done" ;;
        1) say "benchmark: WRONG VALUES" ;;
        124 | 137) say "benchmark: TIMED OUT after ${t_bench}s" ;;
        *) say "benchmark: FAILED (exit $bench_rc)" ;;
    esac
fi

say "total $((SECONDS - START))s; test_cupy_backend exit $rc_backend, test_cuda_ipc exit $rc_ipc," \
    "test_sdk_cuda_ipc exit $rc_sdkipc, test_nodes_nccl exit $rc_nodes, test_torch_cuda exit $rc_torch," \
    "benchmark exit $bench_rc"
# test_torch_cuda's exit is reported, not counted: a GPU host's torch may be a CPU build (it then skips).
if [ "$rc_backend" -ne 0 ] || [ "$rc_ipc" -ne 0 ] || [ "$rc_sdkipc" -ne 0 ] || [ "$rc_nodes" -ne 0 ]; then
    exit 1
elif [ "$bench_rc" -ne 0 ]; then
    exit 3
fi
exit 0
