#!/usr/bin/env bash
# Create the virtualenv of the evaluation harness peer, lm-evaluation-harness (its API and hf
# backends), in the ignored .peers/ folder and never in tpserve's .venv.
#
#   scripts/peer_lm_eval.sh [VENV_DIR]      (default: .peers/lm-eval, or $TPSERVE_LM_EVAL_VENV)
#
# scripts/eval_harness.py then runs lm_eval from it against a tpserve daemon and against the
# same model directory through lm-eval's own hf backend. torch is pinned to the CPU build first
# (an unpinned one pulls a multi-GB CUDA build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
VENV_DIR="${1:-${TPSERVE_LM_EVAL_VENV:-$ROOT/.peers/lm-eval}}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/lm_eval" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
    "$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip
    "$VENV_DIR/bin/python" -m pip install --quiet torch==2.13.0
    "$VENV_DIR/bin/python" -m pip install --quiet 'lm-eval[api,hf]==0.4.*'
fi
"$VENV_DIR/bin/python" -c 'import lm_eval, torch; print("lm_eval", lm_eval.__version__, "torch", torch.__version__)'
echo "peer ready: $VENV_DIR/bin/lm_eval"
