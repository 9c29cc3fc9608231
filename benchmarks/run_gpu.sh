#!/usr/bin/env bash
# What a session with a GPU runs, in three device calls of under 10 minutes each:
#   bash benchmarks/run_gpu.sh kernels,tests
#        1. kernels: tests/mhla/test_triton.py -m gpu: the compiled kernels against the float64 path on the Wan
#           grids, every input dtype; one case autotuned, the rest with the fixed launch settings (about
#           100 compiles of a few seconds each; exact-fp32 products tune the fixed setting only)
#        2. tests: the other GPU tests (softmax backends, the benchmark scripts at small sizes, the 1.3B app)
#   bash benchmarks/run_gpu.sh wan
#        3. benchmarks.wan_step: Wan2.1-1.3B, flash/linear/mhla/mhla-hybrid, 480x800 and 480x832, fwd + fwd+bwd
#   bash benchmarks/run_gpu.sh profile,attention
#        4. benchmarks.profile_mhla: the fused op's time per kernel at 21x30x50 (v2 and v1, fwd and fwd+bwd)
#        5. benchmarks.attention: the op, bf16, 12 heads x 128, 1k..128k tokens, fwd + fwd+bwd, every softmax
#           backend, kernels v2 and v1
#   bash benchmarks/run_gpu.sh cp
#        6. benchmarks.context_parallel: ring MHLA at 21x30x52 tokens over 1, 2, 4, 8 processes (as many as there
#           are GPUs, one each, NCCL): layer time, all-reduce time, communication share (the scaling, issue 32)
# (no argument: all six, as far as BUDGET_S allows). The timing stages (wan, profile, attention) first run
# benchmarks.check_fused: if impl="auto" would not run the fused kernels (no Triton, kernels that fail to
# build), they are skipped and the script says FUSED PATH NOT TAKEN and exits 3, instead of timing the
# PyTorch path under the kernels' name; PYTHONWARNINGS turns the fallback warning into an error, so a
# fallback part-way through a stage fails it. Exit status: 0 when every stage ran and passed, 1 when one
# failed or ran out of time, 3 when the fused path was not taken, 2 for an unknown stage.
# Writes into $OUT, flat: log.txt and <name>.json/.md/.png of each benchmark; prints the tables last.
# A stage that fails or runs out of its time is logged and the next one runs (no `set -e` on purpose).
#
# The device image has no diffusers: carry its wheel (pure Python) in .whl/, e.g. here, in the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1
# and call the device with carry [".whl"] and command `bash benchmarks/run_gpu.sh wan` (and the others).
# Stage time limits (seconds) can be overridden: BUDGET_S (whole call), KERNELS_S, TESTS_S, WAN_S,
# PROFILE_S, ATTENTION_S, CP_S; each is cut to what is left of BUDGET_S.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_run}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1
# the PyTorch fallback of impl="auto" warns "MHLA Triton kernels failed ...": make it an error here
export PYTHONWARNINGS="error:MHLA Triton kernels failed${PYTHONWARNINGS:+,$PYTHONWARNINGS}"
START=$(date +%s)
BUDGET_S="${BUDGET_S:-570}"
KERNELS_S="${KERNELS_S:-360}"
TESTS_S="${TESTS_S:-200}"
WAN_S="${WAN_S:-560}"
PROFILE_S="${PROFILE_S:-150}"
ATTENTION_S="${ATTENTION_S:-400}"
CP_S="${CP_S:-200}"
STAGES=",${1:-kernels,tests,wan,profile,attention,cp},"
for s in $(echo "${STAGES//,/ }"); do
    case "$s" in kernels | tests | wan | profile | attention | cp) ;; *) echo "unknown stage '$s'; expected kernels, tests, wan, profile, attention, cp" >&2; exit 2 ;; esac
done
SUMMARY=()
STATUS=0

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
        STATUS=1
        return
    fi
    log "=== $name (limit ${limit}s, $(date -u +%H:%M:%S) UTC): $*"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (TIMED OUT)"; fi
    if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=1; fi
    log "=== $name: exit $rc$note after $(($(date +%s) - t0))s"
    SUMMARY+=("$name: exit $rc$note, $(($(date +%s) - t0))s")
}

# fused_path_ok: the timing stages run only when impl="auto" takes the fused kernels (checked once)
FUSED=""
fused_path_ok() {
    if [ -z "$FUSED" ]; then
        log "=== fused path check: python3 -m benchmarks.check_fused"
        if timeout -k 10 300 python3 -m benchmarks.check_fused 2>&1 | tee -a "$LOG"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
            FUSED=yes
        else
            FUSED=no
            log "!!! FUSED PATH NOT TAKEN: impl=\"auto\" would time the PyTorch path; wan, profile and attention are skipped"
            SUMMARY+=("fused path check: FAILED (timing stages skipped)")
            STATUS=3
        fi
    fi
    [ "$FUSED" = yes ]
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
if [[ $STAGES == *,kernels,* ]]; then
    run_stage "kernels" "$KERNELS_S" python3 -m pytest -q -m gpu -p no:cacheprovider tests/mhla/test_triton.py
fi
if [[ $STAGES == *,tests,* ]]; then
    run_stage "gpu tests" "$TESTS_S" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        --ignore=tests/mhla/test_triton.py tests
fi
if [[ $STAGES == *,wan,* ]] && fused_path_ok; then
    run_stage "wan_step" "$WAN_S" python3 -m benchmarks.wan_step --config 1.3b --sizes 81x480x800,81x480x832 \
        --grad-ckpt --warmup 2 --repeats 5 --out-dir "$OUT"
fi
if [[ $STAGES == *,profile,* ]] && fused_path_ok; then
    run_stage "profile" "$PROFILE_S" python3 -m benchmarks.profile_mhla --grid 21x30x50 --out-dir "$OUT"
fi
if [[ $STAGES == *,attention,* ]] && fused_path_ok; then
    run_stage "attention" "$ATTENTION_S" python3 -m benchmarks.attention --dtype bf16 --heads 12 --dim 128 \
        --grids 1x32x32,4x32x32,16x32x32,21x30x50,21x30x52,32x48x48,32x64x64 --passes fwd,fwd+bwd \
        --softmax-backends all --warmup 3 --repeats 10 --out-dir "$OUT"
fi
if [[ $STAGES == *,cp,* ]]; then
    PROCS=$(python3 -c "import torch; n = torch.cuda.device_count(); print(*[p for p in (1, 2, 4, 8) if p <= n])")
    run_stage "context_parallel" "$CP_S" python3 -m benchmarks.context_parallel --device cuda --procs $PROCS \
        --grid 21x30x52 --blocks 7x3x5 --heads 12 --head-dim 128 --out "$OUT/context_parallel_cuda"
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
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'complete' if d.get('meta', {}).get('complete', True) else 'PARTIAL', len(d['rows']), 'rows')" "$f" 2>&1 | tee -a "$LOG"
done
log ""
log "=== summary ($(($(date +%s) - START))s in all)"
for s in "${SUMMARY[@]}"; do log "  $s"; done
ls -la "$OUT" | tee -a "$LOG"
log "=== exit status $STATUS"
exit "$STATUS"
