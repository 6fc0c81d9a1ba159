#!/usr/bin/env bash
# Check tpserve's whole GPU path in a few minutes: kernels, CUDA graphs, start-up sizing,
# nano-vllm's throughput workload, TP=2. Prints PASS/FAIL lines and figures; exit 1 on any FAIL.
#
#   scripts/gpu_check.sh [--sections kernels,graphs,start,e2e,tp] [--requests N] [--workdir DIR]
#
# Installs nothing from the network. It uses the first Python that imports torch with CUDA:
# $PYTHON, then .venv/bin/python, then python3. tpserve itself is used from this checkout
# (PYTHONPATH), not installed. Packages tpserve needs beyond torch and Triton (transformers,
# safetensors, ...) are installed only from a local wheel directory, if one is given:
#   TPSERVE_WHEELS=DIR scripts/gpu_check.sh        # pip install --no-index --find-links DIR
# Prepare such a directory on a machine with network access (same Python version):
#   scripts/gpu_check.sh --prepare-wheels DIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DEPS="transformers tokenizers safetensors numpy pyzmq msgpack xxhash click tqdm"

if [[ "${1:-}" == "--prepare-wheels" ]]; then
    dir=${2:?usage: scripts/gpu_check.sh --prepare-wheels DIR}
    py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
    exec "$py" -m pip download --only-binary=:all: -d "$dir" $DEPS
fi

pick_python() {
    for py in "${PYTHON:-}" .venv/bin/python python3 python; do
        [[ -n "$py" ]] || continue
        command -v "$py" >/dev/null 2>&1 || [[ -x "$py" ]] || continue
        if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}

if ! PY=$(pick_python); then
    echo "FAIL env: no Python here imports torch with CUDA available (tried \$PYTHON, .venv/bin/python, python3)"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    exit 1
fi
echo "     python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/     gpu: /'

if [[ -n "${TPSERVE_WHEELS:-}" ]]; then
    echo "     installing from $TPSERVE_WHEELS (no network)"
    "$PY" -m pip install -q --no-index --find-links "$TPSERVE_WHEELS" $DEPS || echo "FAIL env: local wheel install"
fi

# Sections whose packages are missing print a SKIP line naming them.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
# The whole check must fit in 8 minutes; sections past the driver's own budget are skipped.
timeout --signal=INT --kill-after=20 480 "$PY" scripts/gpu_check.py "$@"
rc=$?
[[ $rc -eq 124 ]] && echo "FAIL gpu_check: over 8 minutes, stopped"
exit $rc
