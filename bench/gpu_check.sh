#!/usr/bin/env bash
# One-shot GPU check: gpu-marked tests, then the head benchmark at full sizes, results into $1.
#
# Usage:  bash bench/gpu_check.sh [OUT_DIR]        (default OUT_DIR: bench/results)
#
# Needs only: a CUDA GPU, python3 (>= 3.10) with torch (>= 2.6) and triton (3.6 .. 3.9), and a C
# compiler (cc, gcc, clang or $CC: triton builds its launcher with one). pytest runs the tests
# when present; safetensors, numpy and matplotlib are optional. No vLLM, no transformers, no
# network: the tree installs itself with `pip install --no-deps --no-build-isolation --no-index
# -e .` (falling back to a PYTHONPATH shim when pip cannot install), the collected test files
# import neither engine, the head benchmark is a plain script and the report needs torch only
# (without safetensors its storage table says so instead).
#
# Steps and time bounds (the whole script stays under 6 minutes on an H200):
#   0. preflight: torch, CUDA, triton present, or exit 2 at once with the reason; then names
#      every missing optional piece (pytest, C compiler, safetensors, numpy, matplotlib) and
#      what it costs                                                               (seconds)
#   1. install the tree                                                           (<= 45 s)
#   2. EAGLE_FAST_REQUIRE_GPU=1 pytest -m gpu tests/test_lm_head*.py
#      tests/test_draft_topk_triton.py; skipped, with a line saying so, without pytest (<= 140 s)
#   3. bench/bench_lm_head.py --device cuda: target cases first (lse+argmax, topk64, draft32k =
#      draft+argmax, each provider warmed up, then timed side by side against the bare bf16
#      GEMM, the fp32 baseline and the kernel as it was before issue 29, frozen in
#      bench/triton_before/), stops starting new cases after 100 s, and rewrites its JSON
#      after every case                                                           (<= 150 s)
#   4. bench/report.py: RESULTS.md (+ plot when matplotlib is there)               (seconds)
# Writes into OUT_DIR: lm_head-cuda.json, gpu_tests.log, bench_lm_head.log, environment.txt,
# RESULTS.md (only when OUT_DIR is not bench/results, whose page is bench/RESULTS.md) and
# lm_head-cuda.png. Exit status: 0 when the benchmark ran clean and the tests passed or could
# not run for want of pytest (a missed speed target is reported in the JSON, not an error), 1
# when tests, benchmark or report failed, 2 when there is no usable GPU.
#
# GPU_CHECK_DRY_RUN=1 rehearses the script on a CPU machine: no CUDA required, no pip (the
# shim), no C compiler (the interpreter), the tests run (and fail: EAGLE_FAST_REQUIRE_GPU=1
# without a GPU), and the benchmark runs its --smoke suite instead of the CUDA one, for at most
# GPU_CHECK_DRY_BENCH_S seconds of cases (default: all of them). Only for testing this script.
set -uo pipefail

PY=${PYTHON:-python3}
# a relative interpreter path (e.g. .venv/bin/python) must survive the cd's below
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
OUT=${1:-}
if [ -n "$OUT" ]; then mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2; fi
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUT=${OUT:-$REPO/bench/results}
mkdir -p "$OUT" || exit 2
DRY=${GPU_CHECK_DRY_RUN:-0}
T0=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }
fail=0

# --- 0. preflight: fail fast and say why -------------------------------------------------------
log "preflight ($PY)"
GPU_CHECK_DRY_RUN=$DRY "$PY" - <<'EOF'
import sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    sys.exit(f"gpu_check: FAILED preflight: torch is not importable ({type(e).__name__}: {e})")
import os
if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_DRY_RUN") == "1":
    print(f"torch {torch.__version__}: no CUDA; DRY RUN (rehearsal on CPU)")
    sys.exit(0)
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: FAILED preflight: no CUDA device visible to torch {torch.__version__} "
             f"(torch.version.cuda={torch.version.cuda}, torch.cuda.device_count()={torch.cuda.device_count()}); "
             "this script measures the Triton kernel and needs a CUDA GPU")
try:
    import triton
except Exception as e:  # noqa: BLE001
    sys.exit(f"gpu_check: FAILED preflight: triton is not importable ({type(e).__name__}: {e})")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
EOF
rc=$?
if [ $rc -ne 0 ]; then
    exit 2
fi
# what is missing but not fatal, each with what it costs
missing=()
have_pytest=1
"$PY" -c "import pytest" 2>/dev/null || { have_pytest=0; missing+=("pytest (the gpu tests are skipped)"); }
if [ -n "${CC:-}" ]; then
    command -v "${CC%% *}" >/dev/null || missing+=("the C compiler CC=$CC (triton cannot build its launcher: every Triton launch fails)")
elif ! command -v cc >/dev/null && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then
    [ "$DRY" = "1" ] || missing+=("a C compiler: cc, gcc, clang or \$CC (triton cannot build its launcher: every Triton launch fails)")
fi
"$PY" -c "import safetensors" 2>/dev/null || missing+=("safetensors (the report leaves out its storage table)")
"$PY" -c "import numpy" 2>/dev/null || missing+=("numpy (triton's interpreter and some test helpers need it)")
"$PY" -c "import matplotlib" 2>/dev/null || missing+=("matplotlib (no plot)")
for m in ${missing[@]+"${missing[@]}"}; do log "preflight: missing $m"; done
[ ${#missing[@]} -eq 0 ] && log "preflight: nothing missing"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: ${EAGLE_FAST_GIT_SHA:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}"
    "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} > "$OUT/environment.txt" 2>&1

# --- 1. install the tree ---------------------------------------------------------------------
log "installing the tree (pip --no-deps --no-build-isolation --no-index -e .)"
check_import() {
    (cd /tmp && "$PY" -c "import eagle_fast.kernels as k, pathlib, sys; p = pathlib.Path(k.__file__).resolve(); sys.exit(0 if str(p).startswith('$REPO/') else f'eagle_fast.kernels resolves to {p}, not this tree')")
}
if [ "$DRY" != "1" ] && timeout 45 "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -e . \
        > "$OUT/install.log" 2>&1 && check_import; then
    log "installed (editable)"
else
    # No pip, PEP 668 "externally managed", old setuptools...: import the tree through a shim
    # package dir instead (eagle_fast/* plus kernels/ as eagle_fast/kernels), nothing installed.
    [ "$DRY" = "1" ] && log "dry run: no pip; using a PYTHONPATH shim" \
        || log "pip install failed (see install.log); using a PYTHONPATH shim"
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/eagle_fast"
    for f in "$REPO"/eagle_fast/*; do ln -s "$f" "$SHIM/eagle_fast/$(basename "$f")"; done
    ln -sfn "$REPO/kernels" "$SHIM/eagle_fast/kernels"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    if ! (cd /tmp && "$PY" -c "import eagle_fast.kernels; from eagle_fast.kernels import lm_head"); then
        echo "gpu_check: FAILED: cannot import eagle_fast.kernels from this tree, even through the shim" >&2
        exit 1
    fi
fi

# --- 2. gpu-marked tests ---------------------------------------------------------------------
log "gpu tests: EAGLE_FAST_REQUIRE_GPU=1 pytest -m gpu tests/test_lm_head*.py tests/test_draft_topk_triton.py"
if [ "$have_pytest" = "1" ]; then
    # shellcheck disable=SC2086
    EAGLE_FAST_REQUIRE_GPU=1 timeout 140 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_lm_head*.py tests/test_draft_topk_triton.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    trc=${PIPESTATUS[0]}
    if [ "$trc" -eq 124 ]; then
        log "gpu tests: TIMED OUT after 140 s"
        fail=1
    elif [ "$trc" -ne 0 ]; then
        log "gpu tests: FAILED (exit $trc)"
        fail=1
    else
        log "gpu tests: passed"
    fi
else
    log "gpu tests: SKIPPED: pytest is not installed for $PY (pip install pytest); the benchmark still runs"
    echo "SKIPPED: pytest is not installed for $PY" > "$OUT/gpu_tests.log"
fi

# --- 3. head benchmark at full sizes -----------------------------------------------------------
log "head benchmark (CUDA, full sizes) -> $OUT/lm_head-cuda.json"
BENCH_ARGS=(--device cuda --out "$OUT" --budget-s 100)
[ "$DRY" = "1" ] && BENCH_ARGS=(--device cpu --smoke --out "$OUT" --budget-s "${GPU_CHECK_DRY_BENCH_S:-inf}")
timeout 150 "$PY" bench/bench_lm_head.py "${BENCH_ARGS[@]}" 2>&1 \
    | tee "$OUT/bench_lm_head.log" | grep -E "^(PASS|FAIL|N/A)|^time budget|Error|error" | cut -c1-300
brc=${PIPESTATUS[0]}
if [ "$brc" -eq 124 ]; then
    log "benchmark: TIMED OUT after 150 s (the JSON holds every case finished before)"
    fail=1
elif [ "$brc" -ne 0 ]; then
    log "benchmark: exit $brc (1 = a provider errored or a target FAILED; see bench_lm_head.log)"
    grep -qs '"status": "error' "$OUT"/lm_head-*.json && fail=1
fi

# --- 4. report -------------------------------------------------------------------------------
log "report (torch only) -> $OUT"
if [ "$OUT" = "$REPO/bench/results" ]; then
    "$PY" bench/report.py --results "$OUT" || fail=1
else
    "$PY" bench/report.py --results "$OUT" --page "$OUT/RESULTS.md" || fail=1
fi
log "done: exit $fail; results in $OUT"
exit $fail
