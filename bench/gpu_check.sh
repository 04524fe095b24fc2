#!/usr/bin/env bash
# The device-machine check of the CuPy backend, in one unattended run:
#   1. find a Python that imports cupy (else make a fresh venv and pip install -e '.[gpu,dev]'),
#   2. print the GPUs (nvidia-smi -L) and the versions in use,
#   3. pytest -q -m gpu tests/test_cupy_backend.py (with --noconftest: the module needs none of
#      conftest's fixtures, and so a grpcio/protobuf too old for the stubs fails only the tests
#      that use the stubs, not the whole session),
#   4. python bench/reduce_bench.py --backend cupy --devices 8 --min-bytes 1MiB --max-bytes 256MiB,
# all within BUDGET_S seconds (default 480 = 8 minutes).
#
# Usage (from the repo root or anywhere): bash bench/gpu_check.sh
# Environment:
#   PYTHON    interpreter to try first (then .venv/bin/python, python3, python)
#   BUDGET_S  total seconds for everything (default 480)
#   OUT       if set, logs land there: pytest.log, junit.xml, bench.log
#   VENV      where a fresh venv goes when one is needed (default /tmp/xreduce-gpu-venv)
# Wheels in .whl/*.whl (carried to the device machine) are installed with --no-index into
# /tmp/site before the tests run, for packages the machine lacks (e.g. grpcio-health-checking).
# Exit status: 0 all passed; 1 the GPU tests failed or timed out; 2 no usable Python;
# 3 the tests passed but the benchmark failed, timed out or found wrong values.
set -euo pipefail

cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-480}
VENV=${VENV:-/tmp/xreduce-gpu-venv}
LOGS=${OUT:-/tmp/xreduce-gpu-check}
mkdir -p "$LOGS"
START=$SECONDS

say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

export PYTHONUNBUFFERED=1
# The packages live in client/ and server/: importable from the checkout without installing.
export PYTHONPATH="$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"

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
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# --- 2. what we run on ---------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true
else
    say "nvidia-smi not found"
fi
"$PY" - <<'EOF' || true
import importlib
for name in ("cupy", "numpy", "ml_dtypes", "grpc", "google.protobuf", "pytest", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report every missing piece at once
        print(f"  {name}: NOT IMPORTABLE ({type(e).__name__}: {e})")
try:
    import cupy
    rt = cupy.cuda.runtime
    print(f"  CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
          f"{rt.getDeviceCount()} GPU(s)")
except Exception as e:
    print(f"  CUDA: {type(e).__name__}: {e}")
EOF
if ! err=$("$PY" -c 'import xreduced.server, xreduce._codec, xreduce.v1.xreduce_pb2_grpc' 2>&1); then
    say "WARNING: the project does not import with $PY; the tests will fail:"
    printf '%s\n' "$err" | tail -n 3
    say "  carry the missing wheels in .whl/ (grpcio-health-checking, grpcio-reflection, and"
    say "  grpcio/protobuf if too old for the committed stubs: grpcio>=1.85.1, protobuf>=7.35.1)"
fi

# --- 3. the GPU tests ----------------------------------------------------------
t_tests=$(min 300 $(($(left) - 90)))
say "pytest -q -m gpu tests/test_cupy_backend.py (timeout ${t_tests}s)"
tests_rc=0
if [ "$t_tests" -lt 30 ]; then
    say "FAILED: too little time left for the tests"
    tests_rc=124
else
    timeout -k 10 "$t_tests" "$PY" -m pytest -q -m gpu -p no:cacheprovider --noconftest \
        --junitxml "$LOGS/junit.xml" tests/test_cupy_backend.py >"$LOGS/pytest.log" 2>&1 || tests_rc=$?
    # The summary (failures, skip reasons, counts) is at the end; keep the output bounded.
    tail -n 80 "$LOGS/pytest.log"
fi
case $tests_rc in
    0) say "GPU tests: passed" ;;
    124 | 137) say "GPU tests: TIMED OUT after ${t_tests}s" ;;
    *) say "GPU tests: FAILED (pytest exit $tests_rc)" ;;
esac

# --- 4. the benchmark ----------------------------------------------------------
t_bench=$(($(left) - 5))
bench_rc=0
if [ "$t_bench" -lt 20 ]; then
    say "benchmark: skipped, only ${t_bench}s left"
    bench_rc=124
else
    say "python bench/reduce_bench.py --backend cupy --devices 8 --min-bytes 1MiB --max-bytes 256MiB (timeout ${t_bench}s)"
    timeout -k 5 "$t_bench" "$PY" bench/reduce_bench.py --backend cupy --devices 8 \
        --min-bytes 1MiB --max-bytes 256MiB 2>&1 | tee "$LOGS/bench.log" || bench_rc=$?
    case $bench_rc in
        0) say "benchmark: done" ;;
        124 | 137) say "benchmark: TIMED OUT after ${t_bench}s" ;;
        *) say "benchmark: FAILED (exit $bench_rc)" ;;
    esac
fi

say "total $((SECONDS - START))s; tests exit $tests_rc, benchmark exit $bench_rc"
if [ "$tests_rc" -ne 0 ]; then
    exit 1
elif [ "$bench_rc" -ne 0 ]; then
    exit 3
fi
exit 0
