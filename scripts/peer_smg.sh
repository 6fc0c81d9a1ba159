#!/usr/bin/env bash
# Create the virtualenv of the router peer, smg (SGLang's model gateway, from PyPI).
#
#   scripts/peer_smg.sh [VENV_DIR]      (default: .peers/smg, or $TPSERVE_SMG_VENV)
#
# smg lives in its own virtualenv, in the ignored .peers/ folder and never in tpserve's .venv: it is
# a Rust binary with Python launch scripts, started as VENV_DIR/bin/smg in front of tpserve
# daemons (docs/scaling.md). The version is pinned so the tests and benchmarks that run it
# see the same router; a virtualenv that already has it is left alone (a second run costs
# a fraction of a second), so `make test` can call this every time.
set -euo pipefail

SMG_VERSION="1.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
VENV_DIR="${1:-${TPSERVE_SMG_VENV:-$ROOT/.peers/smg}}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV_DIR/bin/smg" ] && \
   [ "$("$VENV_DIR/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))' 2>/dev/null)" = "$SMG_VERSION" ]; then
    exit 0
fi
mkdir -p "$(dirname "$VENV_DIR")"
if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --quiet "smg==$SMG_VERSION"
"$VENV_DIR/bin/smg" launch --help > /dev/null
echo "peer ready: $VENV_DIR/bin/smg (smg $SMG_VERSION)"
