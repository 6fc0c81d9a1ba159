#!/usr/bin/env bash
# Create the virtualenv that holds the benchmark peer `transformers serve`, transformers'
# OpenAI-compatible server.
#
#   scripts/peer_transformers.sh [VENV_DIR]   (default: .peers/transformers, or $TPSERVE_PEER_VENV)
#
# The peer lives in its own virtualenv, in the ignored .peers/ folder and never in tpserve's .venv:
# the `serving` extra brings a web stack (fastapi, uvicorn, openai) tpserve does not need.
# torch is installed first and pinned to the CPU build tpserve uses: an unpinned torch, pulled
# in by transformers' dependencies, would be a multi-GB CUDA build.
# Then `scripts/bench_serving.py --peer-transformers VENV_DIR/bin/python` measures it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
VENV_DIR="${1:-${TPSERVE_PEER_VENV:-$ROOT/.peers/transformers}}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip
"$VENV_DIR/bin/python" -m pip install --quiet torch==2.13.0
"$VENV_DIR/bin/python" -m pip install --quiet 'transformers[serving]' torch==2.13.0

# Smoke check: the server module imports and the versions the benchmark will print.
"$VENV_DIR/bin/python" -c 'import transformers, torch, transformers.cli.serve; print("transformers", transformers.__version__, "torch", torch.__version__)'
echo "peer ready: $VENV_DIR/bin/python"
