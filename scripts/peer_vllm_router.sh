#!/usr/bin/env bash
# Create the virtualenv of the second router peer, vllm-router (vLLM's router, from PyPI).
#
#   scripts/peer_vllm_router.sh [VENV_DIR]  (default: .peers/vllm-router, or $TPSERVE_VLLM_ROUTER_VENV)
#
# Its kv_aware policy subscribes to each replica's KV-cache events (tpserve --kv-events-endpoint)
# and routes by the blocks each replica really holds; scripts/bench_router.py runs it. Own
# virtualenv (in the ignored .peers/ folder), never in tpserve's .venv; the version is pinned, and
# a virtualenv that already has it is left alone.
set -euo pipefail

VERSION="0.1.17"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
VENV_DIR="${1:-${TPSERVE_VLLM_ROUTER_VENV:-$ROOT/.peers/vllm-router}}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV_DIR/bin/vllm-router" ] && \
   [ "$("$VENV_DIR/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))' 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
mkdir -p "$(dirname "$VENV_DIR")"
if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --quiet "vllm-router==$VERSION"
"$VENV_DIR/bin/vllm-router" --help > /dev/null
echo "peer ready: $VENV_DIR/bin/vllm-router (vllm-router $VERSION)"
