#!/usr/bin/env bash
# What a session with a GPU runs, in two device calls of under 10 minutes each:
#   bash benchmarks/run_gpu.sh tests,wan     1. the GPU tests (python -m pytest -m gpu: fused kernels vs the
#                                               dense reference, compiled)
#                                            2. benchmarks.wan_step: Wan2.1-1.3B, flash/linear/mhla/mhla-hybrid,
#                                               480x800 and 480x832, fwd + fwd+bwd
#   bash benchmarks/run_gpu.sh profile,attention
#                                            3. benchmarks.profile_mhla: the fused op's time per kernel at
#                                               21x30x50 (v2 and v1, fwd and fwd+bwd) with each kernel's bytes
#                                            4. benchmarks.attention: the op, bf16, 12 heads x 128, 1k..128k
#                                               tokens, fwd + fwd+bwd, every softmax backend, kernels v2 and v1
# (no argument: all four in one call, if the time allows). The first call of the fused kernels for each
# new shape autotunes them (compiles 8 launch settings per kernel), which is why the stages are split.
# Writes into $OUT, flat: log.txt and <name>.json/.md/.png of each benchmark; prints the tables last.
# A stage that fails or runs out of its time is logged and the next one runs (no `set -e` on purpose).
#
# The device image has no diffusers: carry its wheel (pure Python) in .whl/, e.g. here, in the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1
# and call the device with carry [".whl"] and command `bash benchmarks/run_gpu.sh`.
# Stage time limits (seconds) can be overridden: BUDGET_S (whole script), TESTS_S, WAN_S.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_run}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET_S="${BUDGET_S:-570}"
TESTS_S="${TESTS_S:-240}"
WAN_S="${WAN_S:-570}"
STAGES=",${1:-tests,wan,profile,attention},"
for s in $(echo "${STAGES//,/ }"); do
    case "$s" in tests | wan | profile | attention) ;; *) echo "unknown stage '$s'; expected tests, wan, profile, attention" >&2; exit 2 ;; esac
done
SUMMARY=()

log() { echo "$*" | tee -a "$LOG"; }

# run_stage NAME LIMIT_S CMD...: runs CMD with its output in the log, at most LIMIT_S seconds and never
# past the whole budget; records its exit status.
run_stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START) - 5))
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$limit" -le 10 ]; then
        log "=== $name: skipped, no time left"
        SUMMARY+=("$name: skipped (no time left)")
        return
    fi
    log "=== $name (limit ${limit}s, $(date -u +%H:%M:%S) UTC): $*"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (TIMED OUT)"; fi
    log "=== $name: exit $rc$note after $(($(date +%s) - t0))s"
    SUMMARY+=("$name: exit $rc$note, $(($(date +%s) - t0))s")
}

if compgen -G ".whl/*.whl" >/dev/null; then
    log "=== installing carried wheels: $(ls .whl)"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 &&
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || log "wheel install failed"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
    python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    python3 -c "import triton; print('triton', triton.__version__)"
    python3 -c "import diffusers; print('diffusers', diffusers.__version__)" || echo "diffusers MISSING: wan_step will fail (carry .whl, see the top of this script)"
} 2>&1 | tee -a "$LOG"

log "=== stages: ${STAGES:1:-1}"
if [[ $STAGES == *,tests,* ]]; then
    run_stage "gpu tests" "$TESTS_S" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests
fi
if [[ $STAGES == *,wan,* ]]; then
    run_stage "wan_step" "$WAN_S" python3 -m benchmarks.wan_step --config 1.3b --sizes 81x480x800,81x480x832 \
        --grad-ckpt --warmup 2 --repeats 5 --out-dir "$OUT"
fi
if [[ $STAGES == *,profile,* ]]; then
    run_stage "profile" 150 python3 -m benchmarks.profile_mhla --grid 21x30x50 --out-dir "$OUT"
fi
if [[ $STAGES == *,attention,* ]]; then
    run_stage "attention" 600 python3 -m benchmarks.attention --dtype bf16 --heads 12 --dim 128 \
        --grids 1x32x32,4x32x32,16x32x32,21x30x50,21x30x52,32x48x48,32x64x64 --passes fwd,fwd+bwd \
        --softmax-backends all --warmup 3 --repeats 10 --out-dir "$OUT"
fi

# a stage stopped part-way leaves a partial JSON and no table: render what it measured
for f in "$OUT"/*.json; do
    [ -e "$f" ] || continue
    [ -e "${f%.json}.md" ] || python3 -m benchmarks.render "$f" >>"$LOG" 2>&1 || log "could not render $f"
done
log ""
log "=== tables"
for f in "$OUT"/*.md; do
    [ -e "$f" ] || continue
    log "--- $(basename "$f")"
    tee -a "$LOG" <"$f"
done
for f in "$OUT"/*.json; do
    [ -e "$f" ] || continue
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'complete' if d['meta'].get('complete') else 'PARTIAL', len(d['rows']), 'rows')" "$f" 2>&1 | tee -a "$LOG"
done
log ""
log "=== summary ($(($(date +%s) - START))s in all)"
for s in "${SUMMARY[@]}"; do log "  $s"; done
ls -la "$OUT" | tee -a "$LOG"
