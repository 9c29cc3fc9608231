#!/usr/bin/env bash
# Everything a GPU session checks, in ONE device call of under 9 minutes, stages in order of value:
#   1. build    python3 -m factory.gpu_build: the built-in model built and checked on the GPU, given --out (a
#               staging folder: see $OUT below) and --deadline-s (its limit less 10 s, to write what it has);
#               BUILD_S 500 by default, the time its phases are planned for, so in a 540 s call the stages
#               after it run only when it ends early: name them in a second, short call (a list without
#               build); skipped ("factory/gpu_build.py not present", not a failure) without that module
#   2. video    benchmarks.whole_video: THE HEADLINE, a whole 5-second 480p video (81x480x832, 50 steps, CFG 5,
#               the folder's UniPC shift 3) per variant, end to end (text, denoising, VAE decode each timed) on the
#               random-weight Wan2.1-1.3B folder (built first when missing: ~40 s; the model stage then reuses it),
#               VIDEO_VARIANTS (flash,mhla), compiled, compiled + MagCache (Wan2.1's published ratios: 25 of 50
#               steps computed; its PSNR against the uncached run), both decoding in bf16, then eager (fp32
#               decode; VIDEO_EAGER_STEPS steps timed, the denoising scaled to 50, marked so); the VAE decode's
#               settings (fp32, bf16, bf16 compiled, bf16 tiled) timed alone after. Predicted from the H100's
#               parts (benchmarks/results/whole_video_predicted.md): ~5-6 min in all; MHLA compiled + cached
#               11.1 s (target <= 10 s: missed unless the decode takes <= 0.9 s), 2.56x cuDNN softmax with the
#               same compile and caching (target >= 2.5x)
#   3. kernels  pytest -m gpu tests/mhla/test_triton.py: the compiled kernels against float64 formulas (~2 min)
#   4. model    benchmarks.random_model: a random-weight Wan2.1-1.3B folder (transformer, Wan2.1's VAE,
#               24-layer UMT5-XXL-sized text encoder) built on the GPU and saved; nothing downloaded (reused
#               when video built it: its RANDOM_WEIGHTS.txt is written last)
#   5. cli      python -m pipelines.cli (through benchmarks.cli_e2e) on that folder, 81x480x832,
#               every variant, CLI_STEPS steps: text encoding, denoising and VAE decode each timed
#   6. app      benchmarks.app_compare: the app's Compare engine (app.compare.iter_compare) without gradio's
#               server, every variant, on the same folder
#   7. compile  benchmarks.wan_step --compile blocks: the step torch.compile'd per variant at 81x480x800,
#               softmax (cuDNN) first, MHLA second (the issue's target: MHLA >= 3x the same-compiled cuDNN);
#               cut short by the budget, its partial JSON keeps the variants it finished
#   7b. levers  the same step with the levers on the part every variant pays (benchmarks/NOTES.md, issue 50):
#               LEVERS_MODE (torch.compile mode, default reduce-overhead: CUDA graphs, replayed per block) and
#               fused q, k, v projections (--fuse-qkv), flash, MHLA and linear; against compile's rows, same
#               GPU. Predicted: MHLA 2.93-3.0x the same-compiled cuDNN step (target >= 3x); ~90-150 s
# Measured on an H100 (2026-11-26, benchmarks/results/h100-2026-11-26b/): kernels 118 s, model 36 s, cli 56 s,
# app 152 s before the app's per-video checks streamed over frames (~75 s expected now), compile 60-67 s.
#   8. 14b      benchmarks.wan_14b: Wan2.1-14B at 720p (81x720x1280 = 75,600 tokens), random bf16 weights built on
#               the GPU: B14_LAYERS (4) of its 40 layers timed and SCALED to 40 (said so in the table; 40: the
#               whole model), flash (cuDNN), MHLA, linear, eager then compiled, peak memory each; mhla-hybrid
#               composed. Predicted (benchmarks/results/count_step_14b_75600.md): ~2.5 min; MHLA 3.4x eager and
#               3.8x compiled on an H200 (target >= 3x), softmax attention ~73% of flash's eager step
#   9. op       benchmarks.attention: the operator alone, bf16, B=1, 12 heads x 128, forward and forward+backward,
#               fused MHLA and linear (each also replayed from a CUDA graph: its GPU time without the host's;
#               and every row's host time) against cuDNN softmax at 2,048, 4,096, 8,192, 16,384 and 31,500
#               tokens (issue 50's targets: MHLA <= 0.3 ms forward at 31,500, never slower than cuDNN from 2,048
#               up; benchmarks/NOTES.md has the prediction per size); ~40-90 s with the kernels' compiles
#  10. cp       benchmarks.context_parallel over NCCL: only where there are 2+ GPUs (else "skipped: 1 GPU")
# Before video, compile, levers, 14b, op and the extras that time: "fused path check" (benchmarks.check_fused, FUSED_S).
# Longer extras, not in the default list: tests (the other GPU tests), wan (eager step, 2 sizes, fwd and
# fwd+bwd), profile, attention, and extra (EXTRA_CMD run by bash, first, writing into $STAGE_OUT: a one-off
# check under the same limits and packing). Name stages as one comma list: `bash benchmarks/run_gpu.sh kernels,compile`.
#
# Carried (the device image has torch, Triton, transformers, safetensors, opencv, PyYAML; no diffusers, no
# omegaconf): both as zips of their pure-Python files, imported from in place (.whl/*.zip on PYTHONPATH);
# diffusers cut down to what the project runs (benchmarks/slim_wheel.py: 2.2 MiB instead of the wheel's 6.4 MB),
# omegaconf 0.24 MiB. The tracked tree is 53.3 MB (50.8 MiB; `git ls-files -z | xargs -0 du -cb | tail -1`),
# so with the zips ~53.2 MiB travels of the 64 MiB: ~10.8 MiB left for anything else carried or untracked.
# imageio-ffmpeg (27 MiB) cannot come: the benchmarks write mp4 through OpenCV there and say so
# (benchmarks/device_shims.py).
# Here, in the checkout that calls the device (.whl/ is git-ignored), from the packages installed here:
#   python3 -m benchmarks.slim_wheel --installed diffusers .whl/diffusers-slim.zip
#   python3 -m benchmarks.slim_wheel --installed omegaconf .whl/omegaconf.zip
# (or from a downloaded wheel: `pip download --no-deps ... -d /tmp/whl diffusers==0.42.1`, then
# `python3 -m benchmarks.slim_wheel /tmp/whl/diffusers-0.42.1-py3-none-any.whl .whl/diffusers-slim.zip`);
# then the device call: carry [".whl"], timeout_s 600, command `bash benchmarks/run_gpu.sh`.
#
# $OUT: at most 8 files at every moment, whatever happens (the device brings back 8, 16 MiB each, <= 2 folders
# down; benchmarks/device_out.py). The stages write into a staging folder outside it ($STAGE_OUT); as each
# stage ends its results are published into $OUT: log.txt always (every stage's output, each stage's
# cut to its first and last 2 MiB, the tables, the summary), the tables and data that fit beside it, and
# the rest packed into results_<gpu>.tar.gz. On exit (the end, a failure, a timeout, SIGTERM/INT/HUP) a
# trap stops a running stage, writes the summary and publishes once more. Every file is named by the GPU
# that ran it, as the device names itself (nvidia-smi, else torch): "NVIDIA H200" -> h200, e.g.
# whole_video_h200.json/.md, cli_timings_h200.txt, app_compare_h200.json/.md,
# wan_step_1.3b_compiled-blocks_h200_<date>.json/.md/.png, wan_step_14b_720p_h200_<date>.json/.md,
# operator_h200_<date>.*; the videos and the model folder stay in /tmp.
# One summary table at the end; exit 0 only when every stage named ran and passed; 1 when one failed,
# timed out or had no time left; 3 when impl="auto" would not take the fused kernels (timing stages
# skipped); 2 for an unknown stage; 128+N when stopped by signal N. DRY_RUN=1 prints each stage's command and
# runs none but `extra`, makes the files each stage would write empty and publishes them, so the files $OUT
# would hold show on a CPU (tests/benchmarks/test_run_gpu.py checks the commands' arguments and those files).
# Limits (seconds): BUDGET_S (whole call, default 540 for a timeout_s of 600), FINISH_S (kept back for the end,
# 30), and per stage EXTRA_S, BUILD_S, VIDEO_S, FUSED_S, KERNELS_S, MODEL_S, CLI_S, APP_S, COMPILE_S, LEVERS_S, B14_S,
# OP_S, CP_S, TESTS_S, WAN_S, PROFILE_S, ATTENTION_S; each is cut to what is left of BUDGET_S (and so is every
# probe). A first call whose build stage takes its ~500 s leaves the rest for a second call: `video` alone needs
# ~6 min, `14b` ~2.5 min; name them, e.g. `bash benchmarks/run_gpu.sh video` (BUDGET_S as its timeout allows).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_run}"
DRY_RUN="${DRY_RUN:-0}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1
# fixed kernel launch settings, as the first run's step table (its MHLA 509 ms), and no autotuning compiles
# eating the budget; the kernels stage tunes one case itself. MHLA_AUTOTUNE=1 to time what users get.
export MHLA_AUTOTUNE="${MHLA_AUTOTUNE:-0}"
# the PyTorch fallback of impl="auto" warns "MHLA Triton kernels failed ...": make it an error here
export PYTHONWARNINGS="error:MHLA Triton kernels failed${PYTHONWARNINGS:+,$PYTHONWARNINGS}"
START=$(date +%s)
BUDGET_S="${BUDGET_S:-540}"
FINISH_S="${FINISH_S:-30}" # kept back from the stages for the end: a partial table's render, the summary, packing
KILL_S=5                   # a stage that ignores SIGTERM at its limit is killed this much later
EXTRA_S="${EXTRA_S:-60}"
BUILD_S="${BUILD_S:-500}" # factory/gpu_build.py plans its phases for a deadline of ~500 s
FUSED_S="${FUSED_S:-120}"
KERNELS_S="${KERNELS_S:-150}"
MODEL_S="${MODEL_S:-100}"
CLI_S="${CLI_S:-130}"
APP_S="${APP_S:-150}"
COMPILE_S="${COMPILE_S:-200}"
VIDEO_S="${VIDEO_S:-400}"
B14_S="${B14_S:-220}"
OP_S="${OP_S:-150}"
LEVERS_S="${LEVERS_S:-200}"
LEVERS_MODE="${LEVERS_MODE:-reduce-overhead}"
CP_S="${CP_S:-150}"
TESTS_S="${TESTS_S:-200}"
WAN_S="${WAN_S:-500}"
PROFILE_S="${PROFILE_S:-150}"
ATTENTION_S="${ATTENTION_S:-400}"
MODEL_DIR="${MODEL_DIR:-/tmp/wan2.1-1.3b-RANDOM}"
CLI_STEPS="${CLI_STEPS:-2}"
VIDEO_VARIANTS="${VIDEO_VARIANTS:-flash,mhla}"
VIDEO_EAGER_STEPS="${VIDEO_EAGER_STEPS:-5}"
B14_LAYERS="${B14_LAYERS:-4}"
EXTRA_CMD="${EXTRA_CMD:-}"
PROMPT="a red fox runs through fresh snow, morning light"
DATE=$(date -u +%Y%m%d)
ALL="build,video,kernels,model,cli,app,compile,levers,14b,op,cp"
EXTRA="tests,wan,profile,attention,extra"
STAGES=",${1:-$ALL},"
for s in $(echo "${STAGES//,/ }"); do
    case ",$ALL,$EXTRA," in *",$s,"*) ;; *) echo "unknown stage '$s'; expected some of $ALL,$EXTRA" >&2; exit 2 ;; esac
done
if [[ $STAGES == *,extra,* ]] && [ -z "$EXTRA_CMD" ]; then
    echo "stage 'extra' runs \$EXTRA_CMD, which is empty" >&2
    exit 2
fi
# the stages write into RES (staging, outside $OUT); publish() copies what fits into $OUT after each stage
WORK="${RUN_GPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/run_gpu.XXXXXX")}"
RES="$WORK/results"
mkdir -p "$RES"
export STAGE_OUT="$RES" # where EXTRA_CMD writes its files
ROWS=()
STATUS=0
STAGE_PID=""
STAGE_NAME=""
STAGE_T0=0
EXPECT=()
GPU_NAME=""
GPU_TAG="unknown-gpu"

log() { echo "$*" | tee -a "$LOG"; }
row() { ROWS+=("| $1 | $2 | $3 |"); }

# seconds a stage may still run: what is left of BUDGET_S, less the end's share and a kill's grace
time_left() { echo $((BUDGET_S - ($(date +%s) - START) - FINISH_S - KILL_S)); }
# cut_limit LIMIT_S: LIMIT_S, or less when less is left
cut_limit() { local l; l=$(time_left); if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi; }
# bounded LIMIT_S CMD...: CMD under a limit cut to what is left (1 s at least: `timeout 0` would mean none)
bounded() {
    local l
    l=$(cut_limit "$1")
    shift
    [ "$l" -ge 1 ] || l=1
    timeout -k 2 "$l" "$@"
}

# at most 8 files in $OUT at any moment, the log always one of them; what does not fit goes into one archive
publish() { # publish [--list]
    python3 -I benchmarks/device_out.py publish --results "$RES" --out "$OUT" --log "$(basename "$LOG")" \
        --archive "results_${GPU_TAG}.tar.gz" --state "$WORK/published.json" "$@" >>"$LOG" 2>&1 ||
        log "!!! publish into \$OUT failed (exit $?): the log is there, the results stay in $RES"
}

# gpu_tag NAME: the short file-name tag benchmarks.common.device_kind gives ("NVIDIA H200" -> h200)
gpu_tag() {
    local n t
    n=$(echo "$1" | tr '[:upper:]' '[:lower:]')
    t=$(echo "$n" | grep -oE '\b[a-z]{1,2}[0-9]{2,4}[a-z]?\b' | head -1)
    [ -n "$t" ] || t=$(echo "$n" | sed -E 's/[^a-z0-9]+/-/g; s/^-+//' | cut -c1-20 | sed -E 's/-+$//')
    echo "${t:-unknown-gpu}"
}

# run_stage NAME LIMIT_S CMD...: CMD with its output in the log, at most LIMIT_S seconds and never past
# the whole budget; its row in the summary; its results (in RES) published into $OUT as it ends.
# Returns CMD's exit status. In a dry run CMD is printed, not run (but for `extra`), and the files the
# stage would write (EXPECT) are made empty, so that what $OUT would hold can be checked on a CPU.
run_stage() {
    local name=$1 limit=$2
    shift 2
    limit=$(cut_limit "$limit")
    if [ "$DRY_RUN" = 1 ] && [ "$name" != extra ]; then
        log "=== $name (dry run): $(printf '%q ' "$@")"
        local f
        for f in ${EXPECT[@]+"${EXPECT[@]}"}; do
            mkdir -p "$(dirname "$RES/$f")" && : >"$RES/$f"
        done
        EXPECT=()
        row "$name" "dry run" 0
        publish
        return 0
    fi
    EXPECT=()
    if [ "$limit" -le 10 ]; then
        log "=== $name: skipped, no time left"
        row "$name" "SKIPPED (no time left)" 0
        STATUS=1
        return 1
    fi
    log "=== $name (limit ${limit}s, $(date -u +%H:%M:%S) UTC): $*"
    local from
    from=$(stat -c %s "$LOG")
    STAGE_NAME=$name
    STAGE_T0=$(date +%s)
    # in the background, so that a signal to this script is handled at once (the trap below), not after it
    timeout -k "$KILL_S" "$limit" "$@" >>"$LOG" 2>&1 </dev/null &
    STAGE_PID=$!
    wait "$STAGE_PID"
    local rc=$?
    STAGE_PID=""
    local took=$(($(date +%s) - STAGE_T0))
    python3 -I benchmarks/device_out.py trim-log "$LOG" --from "$from" >/dev/null 2>&1
    local what="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then what="TIMED OUT"; elif [ "$rc" -ne 0 ]; then what="FAILED (exit $rc)"; fi
    if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=1; fi
    log "=== $name: $what after ${took}s"
    row "$name" "$what" "$took"
    if [ "$rc" -ne 0 ]; then render_partial; fi
    publish
    return "$rc"
}

# a stage stopped part-way leaves a partial JSON and no table: render what it measured (out of the end's share)
render_partial() {
    local f l
    for f in "$RES"/*.json; do
        [ -e "$f" ] && [ ! -e "${f%.json}.md" ] || continue
        grep -q '"benchmark"' "$f" 2>/dev/null || continue
        l=$((BUDGET_S - ($(date +%s) - START) - 10))
        [ "$l" -gt 60 ] && l=60
        if [ "$l" -lt 5 ]; then log "no time left to render $f"; return; fi
        timeout -k 2 "$l" python3 -m benchmarks.render "$f" >>"$LOG" 2>&1 || log "could not render $f"
    done
}

skip() { # skip NAME WHY [failing]
    log "=== $1: skipped, $2"
    row "$1" "skipped: $2" 0
    if [ "${3:-}" = failing ] && [ "$STATUS" -eq 0 ]; then STATUS=1; fi
}

# on any exit (the end, a failure, `exit`, SIGTERM/SIGINT/SIGHUP): stop a running stage, the tables and the
# summary into the log, and the results into $OUT. Only SIGKILL skips this; publish() after each stage has
# kept $OUT within the device's limits all along, so even then nothing is lost but the stage that ran.
finish() {
    local rc=$?
    trap - EXIT
    trap '' TERM INT HUP
    if [ -n "$STAGE_PID" ]; then
        kill -TERM "$STAGE_PID" 2>/dev/null # timeout passes it on to the stage's whole process group
        local i
        for i in 1 2 3 4 5 6 7 8 9 10; do
            kill -0 "$STAGE_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL -- "-$STAGE_PID" 2>/dev/null
        log "=== $STAGE_NAME: STOPPED by a signal after $(($(date +%s) - STAGE_T0))s"
        row "$STAGE_NAME" "STOPPED (signal)" "$(($(date +%s) - STAGE_T0))"
        STAGE_PID=""
    fi
    if [ "$rc" -ge 128 ]; then
        log "!!! stopped by a signal (exit $rc)"
        STATUS=$rc
    fi
    if [ "$DRY_RUN" != 1 ]; then
        log ""
        log "=== tables"
        local f
        while IFS= read -r f; do
            [ -n "$f" ] || continue
            log "--- ${f#"$RES"/}"
            tee -a "$LOG" <"$f"
        done < <(find "$RES" -name '*.md' 2>/dev/null | sort)
        for f in "$RES"/cli_timings_*.txt; do
            [ -e "$f" ] || continue
            log "--- the CLI's timings (text encoding, denoising, VAE decode per variant; seconds)"
            tee -a "$LOG" <"$f"
        done
    fi
    log ""
    log "=== summary ($(($(date +%s) - START))s in all, $GPU_NAME)"
    log "| stage | result | s |"
    log "|---|---|---:|"
    local r
    for r in ${ROWS[@]+"${ROWS[@]}"}; do log "$r"; done
    log "=== exit status $STATUS"
    local from
    from=$(stat -c %s "$LOG")
    publish --list
    tail -c "+$((from + 1))" "$LOG" # what $OUT holds, on the console too
    # the staging folder goes unless asked for (RUN_GPU_WORK) or it holds something $OUT could not
    if [ -z "${RUN_GPU_WORK:-}" ] && ! tail -c "+$((from + 1))" "$LOG" | grep -q "not brought back"; then
        rm -rf "$WORK"
    fi
    exit "$STATUS"
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

# the timing stages run only when impl="auto" takes the fused kernels (checked once)
FUSED=""
fused_path_ok() {
    if [ -z "$FUSED" ]; then
        if run_stage "fused path check" "$FUSED_S" python3 -m benchmarks.check_fused; then
            FUSED=yes
        else
            FUSED=no
            case "${ROWS[${#ROWS[@]} - 1]}" in
            *"FAILED (exit"*) # it ran and said no: impl="auto" would time the PyTorch path
                log "!!! FUSED PATH NOT TAKEN: impl=\"auto\" would time the PyTorch path; the timing stages are skipped"
                unset 'ROWS[${#ROWS[@]}-1]'
                row "fused path check" "FAILED (timing stages skipped)" 0
                STATUS=3
                ;;
            *) log "!!! fused path check did not finish: the timing stages are skipped" ;;
            esac
        fi
    fi
    [ "$FUSED" = yes ]
}

if [ "$DRY_RUN" != 1 ]; then
    for z in .whl/*.zip; do # zips of pure-Python packages: imported from in place
        [ -e "$z" ] || continue
        log "=== on PYTHONPATH: $z"
        export PYTHONPATH="$PWD/$z${PYTHONPATH:+:$PYTHONPATH}"
    done
    if compgen -G ".whl/*.whl" >/dev/null; then
        log "=== installing carried wheels: $(ls .whl)"
        bounded 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 &&
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || log "wheel install failed"
    fi
    # the GPU's name, read from the device: every result file is named by it
    GPU_NAMES=$(bounded 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
    GPU_NAME=$(echo "$GPU_NAMES" | head -1)
    [ -n "$GPU_NAME" ] || GPU_NAME=$(bounded 60 python3 -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null | tail -1)
    GPUS=$(echo "$GPU_NAMES" | grep -c .)
    [ "$GPUS" -gt 0 ] || GPUS=$(bounded 60 python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null | tail -1)
    {
        # each probe under a limit cut to what is left (exit 124: it ran out of time, it is not missing)
        bounded 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv ||
            echo "nvidia-smi failed (exit $?)"
        bounded 60 python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" ||
            echo "torch probe failed (exit $?)"
        bounded 30 python3 -c "import triton; print('triton', triton.__version__)" || echo "triton probe failed (exit $?)"
        bounded 60 python3 -c "import diffusers; print('diffusers', diffusers.__version__)" ||
            echo "diffusers not imported (exit $?): carry .whl/diffusers-slim.zip (see the top of this script)"
        bounded 30 python3 -c "import omegaconf; print('omegaconf', omegaconf.__version__)" ||
            echo "omegaconf not imported (exit $?): carry .whl/omegaconf.zip (see the top of this script)"
        git log -1 --format='commit %H %s' 2>/dev/null || true
    } 2>&1 | tee -a "$LOG"
else
    GPU_NAME="${DRY_RUN_GPU_NAME:-dry run}"
    GPUS="${DRY_RUN_GPUS:-2}"
fi
GPU_NAME="${GPU_NAME:-unknown GPU}"
GPU_TAG=$(gpu_tag "$GPU_NAME")
[[ $GPUS =~ ^[0-9]+$ ]] || GPUS=0

log "=== stages: ${STAGES:1:-1} ($GPUS GPUs: $GPU_NAME, files tagged $GPU_TAG; budget ${BUDGET_S}s; staging in $RES)"
if [[ $STAGES == *,extra,* ]]; then # a one-off command under the same limits, writing into $STAGE_OUT
    run_stage "extra" "$EXTRA_S" bash -c "$EXTRA_CMD"
fi
if [[ $STAGES == *,build,* ]]; then # the built-in model, built and checked on the GPU (factory/gpu_build.py)
    if [ -f factory/gpu_build.py ] || [ -f factory/gpu_build/__init__.py ]; then
        limit=$(cut_limit "$BUILD_S")
        # its own deadline 10 s before the limit, so it can write what it has before SIGTERM
        EXPECT=(builtin/build.json builtin/{transformer,transformer-ema,linear,mhla,mhla-hybrid}.safetensors)
        run_stage "build" "$limit" python3 -m factory.gpu_build --out "$RES/builtin" --deadline-s "$((limit > 20 ? limit - 10 : 10))"
    else skip "build" "factory/gpu_build.py not present"; fi
fi
if [[ $STAGES == *,video,* ]] && fused_path_ok; then # the headline: a whole video per variant (builds the folder)
    EXPECT=("whole_video_${GPU_TAG}.json" "whole_video_${GPU_TAG}.md")
    run_stage "video" "$VIDEO_S" python3 -m benchmarks.whole_video --model "$MODEL_DIR" --build-if-missing \
        --size 81x480x832 --steps 50 --guidance 5 --variants "$VIDEO_VARIANTS" --modes compiled,cached,eager \
        --compile blocks --cache mag-wan2.1:0.06 --decode bf16 --eager-steps "$VIDEO_EAGER_STEPS" \
        --softmax-backend sdpa_cudnn --decode-levers fp32,bf16,bf16-compiled,bf16-tiled --decode-rounds 2 \
        --prompt "$PROMPT" --out "$RES/whole_video_${GPU_TAG}"
fi
if [[ $STAGES == *,kernels,* ]]; then
    run_stage "kernels" "$KERNELS_S" python3 -m pytest -q -m gpu -p no:cacheprovider tests/mhla/test_triton.py
fi
MODEL_OK=yes
if [[ $STAGES == *,model,* ]]; then
    if [ "$DRY_RUN" != 1 ] && [ -f "$MODEL_DIR/RANDOM_WEIGHTS.txt" ]; then # complete (written last): video built it
        log "=== model: reusing $MODEL_DIR (built by the video stage)"
        row "model" "reused (built by video)" 0
    else
        [ "$DRY_RUN" = 1 ] || rm -rf "$MODEL_DIR"
        run_stage "model" "$MODEL_S" python3 -m benchmarks.random_model --out "$MODEL_DIR" --size 1.3b || MODEL_OK=no
    fi
fi
if [[ $STAGES == *,cli,* ]]; then
    if [ "$MODEL_OK" = yes ]; then
        EXPECT=("cli_timings_${GPU_TAG}.txt")
        run_stage "cli" "$CLI_S" python3 -m benchmarks.cli_e2e --model "$MODEL_DIR" --variant all --prompt "$PROMPT" \
            --frames 81 --height 480 --width 832 --steps "$CLI_STEPS" --out /tmp/cli.mp4 --no-progress
        if [ "$DRY_RUN" != 1 ]; then # its timings out of the log, into $OUT now
            awk '/^=== cli \(/{on=1} /^=== cli:/{on=0} on && (/^\|/ || /mp4 writer/ || /^model:/)' "$LOG" \
                >"$RES/cli_timings_${GPU_TAG}.txt"
            publish
        fi
    else skip "cli" "no model folder" failing; fi
fi
if [[ $STAGES == *,app,* ]]; then
    if [ "$MODEL_OK" = yes ]; then
        EXPECT=("app_compare_${GPU_TAG}.json" "app_compare_${GPU_TAG}.md")
        run_stage "app" "$APP_S" python3 -m benchmarks.app_compare --model "$MODEL_DIR" --requests 1 --steps 2 \
            --out "$RES/app_compare_${GPU_TAG}"
    else skip "app" "no model folder" failing; fi
fi
if [[ $STAGES == *,compile,* ]] && fused_path_ok; then
    tag="wan_step_1.3b_compiled-blocks_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md" "$tag.png")
    run_stage "compile" "$COMPILE_S" python3 -m benchmarks.wan_step --config 1.3b --sizes 81x480x800 --passes fwd \
        --variants flash,mhla,linear,mhla-hybrid --softmax-backend sdpa_cudnn --compile blocks --warmup 1 --repeats 3 \
        --out-dir "$RES" --tag "$tag"
fi
if [[ $STAGES == *,levers,* ]] && fused_path_ok; then # the shared part's levers: CUDA graphs, fused projections
    tag="wan_step_1.3b_compiled-blocks-${LEVERS_MODE}_fused-qkv_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md" "$tag.png")
    run_stage "levers" "$LEVERS_S" python3 -m benchmarks.wan_step --config 1.3b --sizes 81x480x800 --passes fwd \
        --variants flash,mhla,linear --softmax-backend sdpa_cudnn --compile blocks --compile-mode "$LEVERS_MODE" \
        --fuse-qkv --warmup 3 --repeats 3 --out-dir "$RES" --tag "$tag"
fi
if [[ $STAGES == *,14b,* ]] && fused_path_ok; then # Wan2.1-14B at 720p: a block of layers timed, scaled to 40
    tag="wan_step_14b_720p_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md")
    run_stage "14b" "$B14_S" python3 -m benchmarks.wan_14b --config 14b --size 81x720x1280 --layers "$B14_LAYERS" \
        --variants flash,mhla,linear --modes eager,compiled --compile blocks --softmax-backend sdpa_cudnn \
        --warmup 1 --repeats 3 --out-dir "$RES" --tag "$tag"
fi
if [[ $STAGES == *,op,* ]] && fused_path_ok; then
    tag="operator_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md" "$tag.png")
    run_stage "op" "$OP_S" python3 -m benchmarks.attention --dtype bf16 --heads 12 --dim 128 \
        --grids 2x32x32,4x32x32,8x32x32,16x32x32,21x30x50 --passes fwd,fwd+bwd --impls triton,triton-graph \
        --softmax-backends sdpa_cudnn --warmup 3 --repeats 10 --out-dir "$RES" --tag "$tag"
fi
if [[ $STAGES == *,cp,* ]]; then
    if [ "$GPUS" -ge 2 ]; then
        PROCS=$(for p in 1 2 4 8; do [ "$p" -le "$GPUS" ] && echo "$p"; done)
        EXPECT=("context_parallel_${GPU_TAG}.json")
        run_stage "cp" "$CP_S" python3 -m benchmarks.context_parallel --device cuda --procs $PROCS \
            --grid 21x30x52 --blocks 7x3x5 --heads 12 --head-dim 128 --out "$RES/context_parallel_${GPU_TAG}"
    else skip "cp" "$GPUS GPU (NCCL needs 2+)"; fi
fi
if [[ $STAGES == *,tests,* ]]; then
    run_stage "gpu tests" "$TESTS_S" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        --ignore=tests/mhla/test_triton.py tests
fi
if [[ $STAGES == *,wan,* ]] && fused_path_ok; then
    tag="wan_step_1.3b_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md" "$tag.png")
    run_stage "wan" "$WAN_S" python3 -m benchmarks.wan_step --config 1.3b --sizes 81x480x800,81x480x832 \
        --grad-ckpt --warmup 2 --repeats 5 --out-dir "$RES" --tag "$tag"
fi
if [[ $STAGES == *,profile,* ]] && fused_path_ok; then
    EXPECT=("profile_mhla_${GPU_TAG}_21x30x50.json" "profile_mhla_${GPU_TAG}_21x30x50.md")
    run_stage "profile" "$PROFILE_S" python3 -m benchmarks.profile_mhla --grid 21x30x50 --out-dir "$RES"
fi
if [[ $STAGES == *,attention,* ]] && fused_path_ok; then
    tag="attention_${GPU_TAG}_$DATE"
    EXPECT=("$tag.json" "$tag.md" "$tag.png")
    run_stage "attention" "$ATTENTION_S" python3 -m benchmarks.attention --dtype bf16 --heads 12 --dim 128 \
        --grids 1x32x32,4x32x32,16x32x32,21x30x50,21x30x52,32x48x48,32x64x64 --passes fwd,fwd+bwd \
        --softmax-backends all --warmup 3 --repeats 10 --out-dir "$RES" --tag "$tag"
fi
exit "$STATUS" # finish() (the EXIT trap) writes the summary and publishes the results
