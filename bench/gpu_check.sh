#!/usr/bin/env bash
# The first run on a GPU machine, in one command from the repository root, within 9 minutes in all:
#
#   bash bench/gpu_check.sh              # on the GPU machine (no network needed)
#   bash bench/gpu_check.sh --dry-run    # the same steps on the CPU with the tiny preset (CI keeps it working)
#
# Steps, each under its own time limit so that one failure or hang never stops the rest:
#   env         versions (python, torch, CUDA, lightning), the GPU (nvidia-smi), host memory, `ulimit -l`
#   install     wheels from .whl/ if that folder exists (--no-index), then `pip install -e .` without build
#               isolation, dependencies or index: FAIL unless the native CPU optimizer built and loads
#               (dry: only checks that it loads in the current install)
#   pytest      `pytest -m cuda` over every test file holding a CUDA test (dry: all skipped -> SKIP)
#   throughput  bench/throughput.py: llama-3.2-1b (1.24B), seq 4096, micro-batch 1, 4k and 32k tokens per
#               step (accumulate 1 and 8), recompute true and auto, clipped: tokens/s, MFU (flops.py),
#               step time, slots, kept and offloaded blocks per pass, peak GPU memory and the planner's
#   sums        bench/throughput.py at 32k tokens per step (accumulate 8), recompute auto, clipped, with the
#               gradient sums on the GPU (device_grad_sums auto): tokens/s beside the throughput step's same point
#               without them (dry: SKIP; tests/test_bench_throughput.py checks the option reaches the runs)
#   options     the sums step's point twice more, with speculative_step and with compile_blocks: tokens/s of each
#               beside the sums step's (dry: SKIP)
#   fusion      bench/fusion.py: one llama-3.2-1b block's memory-bound kernel time, eager and compiled, against
#               the ratios the schedule model takes for compile_blocks (dry: SKIP; tests/test_fusion.py)
#   peers       FSDP CPU offload (and DeepSpeed ZeRO-3 offload when importable) at 4k tokens, clipped; tokens/s
#               over megatrain's (recompute auto) from the throughput step (dry: SKIP, no Python started)
#   fp8         bench/offload_inputs_dtype.py: the demo with offloaded inputs stored exactly and as fp8, one
#               seed, shortened; SKIP when time is used up or the CLI's jsonargparse is missing
#
# Each step's output goes to <out>/<step>.log (<out>: $GPU_CHECK_OUT, else $OUT/gpu_check when $OUT is set,
# else bench/out/gpu_check); the benchmarks write their tables beside it. Last comes the summary table and
# one line `gpu_check: ...`. Exit code 0 when every required step (env, install, pytest, throughput) passed
# or was skipped, 1 otherwise. GPU_CHECK_BUDGET_S (default 540) is the whole run's budget; GPU_CHECK_STEPS
# (a comma list, e.g. `pytest,peers`) runs only those steps, to repeat some on a machine already set up.
# A dry run has three times each limit (a busy CPU stands in for the GPU; no device time is at stake).
set -u

usage() { sed -n '2,/^set -u/p' "$0" | sed -e 's/^# \{0,1\}//' -e '/^set -u/d'; }
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT_DIR=${GPU_CHECK_OUT:-${OUT:+$OUT/gpu_check}}
OUT_DIR=${OUT_DIR:-bench/out/gpu_check}
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SCALE=$((DRY ? 3 : 1))
BUDGET=${GPU_CHECK_BUDGET_S:-$((540 * SCALE))}
SELECTED=,${GPU_CHECK_STEPS:-env,install,pytest,throughput,sums,options,fusion,peers,fp8},
SITE=${TMPDIR:-/tmp}/gpu_check_site  # wheels from .whl/ (installed with --target, never into the image)
# This checkout's code whatever an earlier editable install points at; the carried wheels after it.
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 DRY ROOT OUT_DIR SITE
export MPLBACKEND=Agg
SKIP_RC=77  # a step that exits with it is reported SKIP (nothing to check here), not FAIL
START=$SECONDS

# -- the steps (each runs in its own bash under `timeout`; a line `KEY: ...` is its summary cell) ------------
step_env() {
    python3 - <<'EOF'
import os, platform, sys
from importlib.metadata import PackageNotFoundError, version
import torch

def installed(name: str) -> str:  # by the metadata: importing them all would take most of the time limit
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"

cuda = torch.cuda.is_available()
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available: {cuda}")
for name in ("lightning", "transformers", "safetensors", "fsspec", "jsonargparse", "deepspeed", "matplotlib", "pytest"):
    print(f"{name} {installed(name)}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, {torch.cuda.device_count()} GPU(s)")
gpu = f"{torch.cuda.get_device_name(0)}" if cuda else "no GPU"
print(f"KEY: torch {torch.__version__} cuda {torch.version.cuda}, lightning {installed('lightning')}, {gpu}")
sys.exit(0 if cuda or os.environ["DRY"] == "1" else 1)
EOF
    local rc=$?
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,power.limit --format=csv
        nvidia-smi topo -m 2>/dev/null | head -5
    else
        echo "nvidia-smi: not found"
    fi
    grep -E '^(MemTotal|MemAvailable|HugePages_Total)' /proc/meminfo
    echo "ulimit -l (memlock): $(ulimit -l)"
    echo "CPUs: $(nproc) usable of $(getconf _NPROCESSORS_ONLN)"
    local mem
    mem=$(awk '/^MemTotal/ {printf "%.0f", $2 / 2^20}' /proc/meminfo)
    echo "KEY: host ${mem} GiB, memlock $(ulimit -l), $(nproc) CPUs"
    return $rc
}

native_check() {
    python3 - <<'EOF'
import sys
from megatrain_lightning.optim import native
if not native.available():
    print(f"KEY: native CPU optimizer NOT loaded: {native.load_error()}")
    sys.exit(1)
info = native.info()
print(f"native: {info}")
print(f"KEY: {native.backend()}, {info['num_threads']} threads, openmp {info['openmp']}")
EOF
}

step_install() {
    if [ "$DRY" = 1 ]; then
        echo "dry run: no reinstall; checking the native optimizer of the current install"
        native_check
        return
    fi
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
            echo "wheels from .whl/ did not all install (the steps that need them will say so)"
    fi
    python3 -m pip install --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -20
    if ! native_check; then
        echo "the editable install left no loadable native optimizer; building it in place"
        python3 setup.py -q build_ext --inplace 2>&1 | tail -30
        native_check
    fi
}

step_pytest() {
    local files
    files=$(grep -lE 'pytest\.mark\.cuda' tests/test_*.py | tr '\n' ' ')
    echo "files holding CUDA tests: $files"
    # shellcheck disable=SC2086
    python3 -m pytest -q -m cuda -rs -p no:cacheprovider $files
    local rc=$? last
    last=$(grep -E '(passed|failed|skipped|error|deselected)' "$OUT_DIR/pytest.log" | tail -1 | tr -d '=')
    echo "KEY: $(echo "$last" | sed 's/^ *//') [$(echo "$files" | wc -w) files]"
    if [ $rc = 0 ] && ! echo "$last" | grep -q passed; then
        [ "$DRY" = 1 ] && return $SKIP_RC  # no GPU: every CUDA test skipped, as expected
        return 1                           # on the GPU machine, a CUDA test that did not run is a failure
    fi
    return $rc
}

# The figures of bench/throughput.py's `run:` lines in a log, one short cell per run.
run_cells() {
    grep -h '^run: ' "$@" | awk '{
        for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = substr($i, length(kv[1]) + 2) }
        head = f["kind"] (f["kind"] == "megatrain" ? " rc=" f["recompute"] : "") " " f["tokens_per_step"]
        if ("error" in f) { print head ": " substr($0, index($0, "error=") + 6); delete f; next }
        printf "%s: %s tok/s mfu %s step %ss slots %s kept %s offl %s peak %s/%s GiB\n", head, f["tokens_per_s"],
            f["mfu"], f["step_s"], f["slots"], f["kept"], f["offloaded"], f["peak_gib"], f["planner_gib"]
        delete f
    }'
}

step_throughput() {
    local left=$(($1 - 20)) args
    if [ "$DRY" = 1 ]; then
        args=(--dry --tokens-per-step 128 --steps 1)
    else
        args=(--shape llama-3.2-1b --seq-len 4096 --micro-batch 1 --tokens-per-step 4k,32k --steps 2 --timeout 90)
    fi
    # "auto" first: the strategy's default is measured even when time runs out before the last run
    python3 bench/throughput.py "${args[@]}" --parts megatrain --recompute auto,true --clip on --warmup 1 \
        --budget-s "$left" --out "$OUT_DIR/throughput"
    local rc=$?
    echo "KEY: $(run_cells "$OUT_DIR/throughput.log" | paste -sd';' | sed 's/;/; /g')"
    return $rc
}

# tokens/s of bench/throughput.py's `run:` line for megatrain, recompute auto, at $2 tokens per step, in log $1
auto_tokens_per_s() {
    grep -h "^run: kind=megatrain recompute=auto tokens_per_step=$2 clip=1 " "$1" 2>/dev/null |
        sed -n 's/.* tokens_per_s=\([0-9.]*\).*/\1/p' | head -1
}

step_sums() {
    local left=$(($1 - 15)) with without
    if [ "$DRY" = 1 ]; then
        echo "KEY: dry run: nothing to compare without a GPU (the option's path: tests/test_bench_throughput.py)"
        return $SKIP_RC
    fi
    python3 bench/throughput.py --shape llama-3.2-1b --seq-len 4096 --micro-batch 1 --tokens-per-step 32k \
        --steps 2 --warmup 1 --parts megatrain --recompute auto --clip on --device-grad-sums auto \
        --timeout "$left" --budget-s "$left" --out "$OUT_DIR/sums"
    local rc=$?
    with=$(auto_tokens_per_s "$OUT_DIR/sums.log" 32768)
    without=$(auto_tokens_per_s "$OUT_DIR/throughput.log" 32768)
    echo "KEY: 32768 tokens/step, clip 1: ${with:-na} tok/s with device sums (auto), ${without:-na} without" \
        "$(awk -v a="$with" -v b="$without" 'BEGIN { if (a > 0 && b > 0) printf "(x%.2f)", a / b }')"
    return $rc
}

step_options() {
    local left=$(($1 - 15)) each sums spec compiled
    if [ "$DRY" = 1 ]; then
        echo "KEY: dry run: nothing to compare without a GPU (the flags' path: tests/test_bench_throughput.py)"
        return $SKIP_RC
    fi
    each=$((left / 2))
    local args=(--shape llama-3.2-1b --seq-len 4096 --micro-batch 1 --tokens-per-step 32k --steps 2 --warmup 1
        --parts megatrain --recompute auto --clip on --device-grad-sums auto --timeout "$each" --budget-s "$each")
    python3 bench/throughput.py "${args[@]}" --speculative-step --out "$OUT_DIR/options-speculative"
    local rc=$?
    spec=$(auto_tokens_per_s "$OUT_DIR/options.log" 32768)
    python3 bench/throughput.py "${args[@]}" --compile --out "$OUT_DIR/options-compile" >"$OUT_DIR/options-compile.log" 2>&1
    rc=$((rc ? rc : $?))
    compiled=$(auto_tokens_per_s "$OUT_DIR/options-compile.log" 32768)
    sums=$(auto_tokens_per_s "$OUT_DIR/sums.log" 32768)
    echo "KEY: 32768 tokens/step, clip 1, device sums: ${sums:-na} tok/s alone, ${spec:-na} with speculative_step," \
        "${compiled:-na} with compile_blocks"
    return $rc
}

step_fusion() {
    if [ "$DRY" = 1 ]; then
        echo "KEY: dry run: nothing to time without a GPU (the model's ratios: tests/test_fusion.py)"
        return $SKIP_RC
    fi
    python3 bench/fusion.py --model llama-3.2-1b --tokens 4096
    local rc=$?
    echo "KEY: $(grep -h '^fusion: ' "$OUT_DIR/fusion.log" | sed 's/^fusion: //')"
    return $rc
}

step_peers() {
    local left=$(($1 - 15)) args mine point=4096
    if [ "$DRY" = 1 ]; then  # bench/throughput.py --dry marks every peer "skipped: needs CUDA" and no more
        echo "KEY: dry run: the peers need CUDA (the harness's skip path: tests/test_bench_throughput.py)"
        return $SKIP_RC
    fi
    args=(--shape llama-3.2-1b --seq-len 4096 --micro-batch 1 --timeout "$left")
    python3 bench/throughput.py "${args[@]}" --tokens-per-step "$point" --parts compare --clip on \
        --budget-s "$left" --out "$OUT_DIR/peers"
    local rc=$?
    # megatrain's tokens/s at the same point (recompute auto, clipped), from the throughput step
    mine=$(auto_tokens_per_s "$OUT_DIR/throughput.log" "$point")
    grep -h '^run: kind=\(fsdp\|deepspeed\)' "$OUT_DIR/peers.log" | awk -v mine="$mine" '{
        match($0, /tokens_per_s=[0-9.]+/); theirs = substr($0, RSTART + 13, RLENGTH - 13)
        split($2, k, "=")
        if (theirs == "") { sub(/.*error=/, ""); cells = cells k[2] ": " $0 "; "; next }
        ratio = (mine != "" && theirs > 0) ? sprintf(" (megatrain/%s %.2f)", k[2], mine / theirs) : ""
        cells = cells k[2] ": " theirs " tok/s" ratio "; "
    } END { sub(/; $/, "", cells); print "KEY: " cells }'
    return $rc
}

step_fp8() {
    if ! python3 -c "import lightning.pytorch.cli as c, sys; sys.exit(0 if c._JSONARGPARSE_SIGNATURES_AVAILABLE else 1)" 2>/dev/null; then
        echo "KEY: the megatrain CLI needs jsonargparse[signatures]: carry its wheels in .whl/ (docs/benchmarks.md, GPU)"
        return $SKIP_RC
    fi
    local args=(--max-steps 50 --dtypes none fp8 --accelerator gpu) steps
    [ "$DRY" = 1 ] && args=(--max-steps 2 --dtypes fp8 --accelerator cpu --val-batches 2)  # the path, not a figure
    steps=${args[1]}
    python3 bench/offload_inputs_dtype.py --seeds 0 "${args[@]}"
    local rc=$?
    echo "KEY: val loss after $steps steps: $(grep -E '^\| (none|fp8) \| 0 \|' "$OUT_DIR/fp8.log" |
        awk -F'|' '{gsub(/ /, "", $2); gsub(/ /, "", $4); printf "%s %s, ", $2, $4}' | sed 's/, $//')"
    return $rc
}
export -f step_env native_check step_install step_pytest run_cells step_throughput auto_tokens_per_s step_sums \
    step_options step_fusion step_peers step_fp8
export SKIP_RC

# -- running them -------------------------------------------------------------------------------------------
NAMES=() STATUS=() TIMES=() KEYS=() REQUIRED_FAILED=0

run_step() {  # name, limit in seconds, required (1/0), least seconds worth starting with
    local name=$1 limit=$(($2 * SCALE)) required=$3 least=${4:-10} left status rc t0 key
    left=$((BUDGET - (SECONDS - START) - 5))
    [ "$limit" -gt "$left" ] && limit=$left
    t0=$SECONDS
    if [[ $SELECTED != *",$name,"* ]]; then
        status=SKIP key="not in GPU_CHECK_STEPS"
    elif [ "$limit" -lt "$least" ]; then
        status=SKIP key="out of time (${left}s of the ${BUDGET}s budget left)"
        echo "$key" >"$OUT_DIR/$name.log"
    else
        echo "[gpu_check $((SECONDS - START))s] $name: up to ${limit}s" >&2
        timeout --kill-after=10 "$limit" bash -c "step_$name $limit" >"$OUT_DIR/$name.log" 2>&1
        rc=$?
        case $rc in
            0) status=ok ;;
            "$SKIP_RC") status=SKIP ;;
            124 | 137) status=TIMEOUT ;;
            *) status=FAIL ;;
        esac
        key=$(grep -h '^KEY: ' "$OUT_DIR/$name.log" | sed 's/^KEY: //' | paste -sd'|' | sed 's/|/; /g')
        [ "$status" = TIMEOUT ] && key="killed after ${limit}s; ${key}"
        [ "$status" = FAIL ] && [ -z "$key" ] && key=$(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -1)
    fi
    if [ "$required" = 1 ] && { [ "$status" = FAIL ] || [ "$status" = TIMEOUT ]; }; then
        REQUIRED_FAILED=$((REQUIRED_FAILED + 1))
    fi
    NAMES+=("$name") STATUS+=("$status") TIMES+=($((SECONDS - t0))) KEYS+=("${key:0:400}")
}

run_step env 20 1
run_step install 90 1
run_step pytest 120 1
run_step throughput 180 1 60
run_step sums 75 0 45
run_step options 150 0 90  # (two runs of the sums step's point: compiling falls in the warm-up)
run_step fusion 90 0 45  # (inductor compiles one block for the GPU, and measures it on the CPU for the model)
run_step peers 180 0 30  # DeepSpeed builds its CPU Adam first: 98 s of its run on the first GPU machine
run_step fp8 "$BUDGET" 0 30

echo
echo "figures per run (bench/throughput.py 'run:' lines; tables in $OUT_DIR/*/throughput.md):"
grep -h '^run: ' "$OUT_DIR"/{throughput,sums,options,options-compile,peers}.log 2>/dev/null | sed 's/^/  /'
echo
printf '%-11s %-8s %5s  %s\n' step status s "key figures"
for i in "${!NAMES[@]}"; do
    printf '%-11s %-8s %5s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "${KEYS[$i]}"
done
count() { local n=0 s; for s in "${STATUS[@]}"; do [ "$s" = "$1" ] && n=$((n + 1)); done; echo $n; }
echo "gpu_check: mode=$([ "$DRY" = 1 ] && echo dry || echo gpu) steps=${#NAMES[@]} ok=$(count ok)" \
    "fail=$(count FAIL) timeout=$(count TIMEOUT) skip=$(count SKIP) required_failed=$REQUIRED_FAILED" \
    "total_s=$((SECONDS - START)) logs=$OUT_DIR"
[ "$REQUIRED_FAILED" = 0 ]
