#!/usr/bin/env bash
# Check tpserve's whole GPU path: kernels, CUDA graphs, start-up sizing, greedy output against
# transformers, nano-vllm's throughput workload, TP=2, speculative decoding, the MoE experts kernel
# and a MoE model's greedy tokens. Each section (stage) runs in its own
# process under its own timeout, so a sticky CUDA error, a crash or a hang in one stage costs
# that stage only. Prints every stage's PASS/FAIL/SKIP lines and figures, then one summary line;
# exit 1 on any FAIL.
#
#   scripts/gpu_check.sh [--dry-run] [--sections env,kernels,...] [--out DIR]
#                        [--timeout STAGE=SECONDS]... [--grace SECONDS] [--budget SECONDS]
#                        [gpu_check.py options: --requests N --workdir DIR]
#
#   --dry-run   every stage on the CPU at tiny shapes (scripts/gpu_check.py --dry-run): checks
#               this script and the stages' code, not a GPU; needs no CUDA.
#   --out DIR   where the logs go (default $OUT, else ./gpu-check-out): DIR/gpu_check/<stage>.log
#               per stage, DIR/gpu_check/summary.txt.
#   --timeout   one stage's limit (defaults below); --grace: seconds between SIGTERM and SIGKILL
#               for a stage past its limit (a process stuck in the driver ignores SIGTERM);
#               --budget: the whole run's limit; a stage gets what is left, and one that would
#               get under 30 s is skipped.
#
# Installs nothing from the network. It uses the first Python that imports torch with CUDA
# (with --dry-run: that imports torch): $PYTHON, then .venv/bin/python, then python3. tpserve
# itself is used from this checkout (PYTHONPATH), not installed. Packages tpserve needs beyond
# torch and Triton (transformers, safetensors, ...) are installed only from a local wheel
# directory, if one is given:
#   TPSERVE_WHEELS=DIR scripts/gpu_check.sh        # pip install --no-index --find-links DIR
# Prepare such a directory on a machine with network access (same Python version):
#   scripts/gpu_check.sh --prepare-wheels DIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DEPS="transformers tokenizers safetensors numpy pyzmq msgpack xxhash click tqdm"
STAGES="env kernels graphs start hf e2e tp spec moe"
declare -A LIMIT=([env]=90 [kernels]=240 [graphs]=180 [start]=180 [hf]=180 [e2e]=240 [tp]=240 [spec]=180 [moe]=240)

if [[ "${1:-}" == "--prepare-wheels" ]]; then
    dir=${2:?usage: scripts/gpu_check.sh --prepare-wheels DIR}
    py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
    exec "$py" -m pip download --only-binary=:all: -d "$dir" $DEPS
fi

usage() { echo "usage: scripts/gpu_check.sh [--dry-run] [--sections LIST] [--out DIR] [--timeout STAGE=S] [--grace S] [--budget S] [gpu_check.py options]" >&2; exit 2; }
DRY=0
SELECTED=$STAGES
OUT_DIR=${OUT:-$ROOT/gpu-check-out}
GRACE=15
BUDGET=540
PASS_ON=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --sections) [[ $# -ge 2 ]] || usage; SELECTED=${2//,/ }; shift ;;
        --out) [[ $# -ge 2 ]] || usage; OUT_DIR=$2; shift ;;
        --timeout)
            [[ $# -ge 2 && "$2" =~ ^([a-z0-9]+)=([0-9]+)$ ]] || { echo "--timeout: expected STAGE=SECONDS, got '${2:-}'" >&2; exit 2; }
            [[ -n "${LIMIT[${BASH_REMATCH[1]}]:-}" ]] || { echo "--timeout: unknown stage '${BASH_REMATCH[1]}'; stages: $STAGES" >&2; exit 2; }
            LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
        --grace) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || usage; GRACE=$2; shift ;;
        --budget) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || usage; BUDGET=$2; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) PASS_ON+=("$1") ;;
    esac
    shift
done
for stage in $SELECTED; do
    [[ -n "${LIMIT[$stage]:-}" ]] || { echo "--sections: unknown stage '$stage'; stages: $STAGES" >&2; exit 2; }
done

pick_python() {
    local probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
    [[ $DRY -eq 1 ]] && probe='import torch'
    for py in "${PYTHON:-}" .venv/bin/python python3 python; do
        [[ -n "$py" ]] || continue
        command -v "$py" >/dev/null 2>&1 || [[ -x "$py" ]] || continue
        if "$py" -c "$probe" 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}

if ! PY=$(pick_python); then
    if [[ $DRY -eq 1 ]]; then
        echo "FAIL env: no Python here imports torch (tried \$PYTHON, .venv/bin/python, python3)"
    else
        echo "FAIL env: no Python here imports torch with CUDA available (tried \$PYTHON, .venv/bin/python, python3)"
        command -v nvidia-smi >/dev/null && nvidia-smi -L
    fi
    exit 1
fi
LOGS="$OUT_DIR/gpu_check"
mkdir -p "$LOGS" || { echo "FAIL env: cannot create $LOGS"; exit 1; }
echo "     python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')), logs in $LOGS"
[[ $DRY -eq 0 ]] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/     gpu: /'

if [[ -n "${TPSERVE_WHEELS:-}" ]]; then
    echo "     installing from $TPSERVE_WHEELS (no network)"
    "$PY" -m pip install -q --no-index --find-links "$TPSERVE_WHEELS" $DEPS || echo "FAIL env: local wheel install"
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
[[ $DRY -eq 1 ]] && export TRITON_INTERPRET=1 && PASS_ON+=(--dry-run)

T0=$SECONDS
declare -A STATUS
pass=0; fail=0; skip=0
for stage in $SELECTED; do
    log="$LOGS/$stage.log"
    left=$(( BUDGET - (SECONDS - T0) ))
    limit=${LIMIT[$stage]}
    (( left < limit )) && limit=$left
    if (( limit < 30 && limit < ${LIMIT[$stage]} )); then
        line="SKIP $stage: run budget spent ($(( SECONDS - T0 )) s of $BUDGET s)"
        echo "$line" | tee "$log"
        STATUS[$stage]="skipped"; skip=$((skip + 1))
        continue
    fi
    echo "---- $stage (limit $limit s, log $log)"
    started=$SECONDS
    # timeout runs the stage in its own process group and signals all of it (torchrun ranks
    # too); --kill-after follows up with SIGKILL for a process that does not stop.
    timeout --signal=TERM --kill-after="$GRACE" "$limit" \
        "$PY" scripts/gpu_check.py --sections "$stage" "${PASS_ON[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    took=$(( SECONDS - started ))
    p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log"); s=$(grep -c '^SKIP ' "$log")
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
    if [[ $rc -eq 124 || ( $rc -eq 137 && $took -ge $limit ) ]]; then
        line="FAIL $stage: timed out after $limit s (stopped$([[ $rc -eq 137 ]] && echo " with SIGKILL"))"
    elif [[ $rc -gt 128 ]]; then
        line="FAIL $stage: killed by signal $(( rc - 128 )) ($(kill -l $(( rc - 128 )) 2>/dev/null || echo '?')) after $took s"
    elif [[ $rc -ne 0 ]] && ! grep -q '^gpu_check: ' "$log"; then
        line="FAIL $stage: exited with code $rc before its summary, after $took s"
    elif [[ $rc -ne 0 || $f -gt 0 ]]; then
        line=""  # its own FAIL lines say why
        STATUS[$stage]="FAIL"
    else
        STATUS[$stage]="ok"
    fi
    if [[ -n "${line:-}" ]]; then
        echo "$line" | tee -a "$log"
        fail=$((fail + 1)); STATUS[$stage]="FAIL"
    fi
    line=""
    echo "     $stage: ${STATUS[$stage]} in $took s ($p PASS, $f FAIL, $s SKIP)"
done

{
    for stage in $SELECTED; do
        grep -h '^\(PASS\|FAIL\|SKIP\) ' "$LOGS/$stage.log" 2>/dev/null
    done
    stages=""
    for stage in $SELECTED; do stages+=" $stage=${STATUS[$stage]}"; done
    echo "gpu_check: $pass PASS, $fail FAIL, $skip SKIP in $(( SECONDS - T0 )) s; stages:$stages"
} > "$LOGS/summary.txt"
tail -n 1 "$LOGS/summary.txt"
[[ $fail -eq 0 ]]
