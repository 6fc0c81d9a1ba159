#!/usr/bin/env bash
# Install tpserve as a user would, from a wheel built out of this checkout, and prove that the
# installed package compiles and loads its C++ CPU operators and serves the bundled model.
#
#   scripts/check_wheel_install.sh [--keep]      (--keep: leave the temporary directory behind)
#
# 1. Copies the package's sources (pyproject.toml, setup.cfg, MANIFEST.in, README.md, tpserve/)
#    into a temporary directory and builds the wheel there (`pip wheel --no-deps`), so nothing
#    is written into the checkout and no stale build/ directory leaks into the wheel.
# 2. Creates a fresh virtualenv, installs torch first, pinned as the Makefile does (an unpinned
#    torch pulls a multi-GB CUDA build; $TORCH_SPEC overrides it), then the wheel and its
#    dependencies. $PYTHON is the interpreter the virtualenv is made from (default python3).
# 3. From a directory outside the checkout (so `import tpserve` is the installed copy) and with an
#    empty operator build cache (TPSERVE_CACHE_DIR, so no earlier build of the same key is
#    reused), builds the operators from the installed files (`python -m
#    tpserve.kernels.cpu_extension`, what `make install` runs), then `tpserve start` on the
#    bundled model, `tpserve generate`, `tpserve status --json` and `tpserve stop`.
# 4. Fails unless the operators were compiled from the installed sources and the daemon reports
#    `cpu_ops: loaded`. The last line says what was checked ("wheel install OK: ...").
set -euo pipefail

case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --keep|"") ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
esac
KEEP="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tpserve-wheel.XXXXXX")"
VENV="$WORK/venv"
VPY="$VENV/bin/python"
RD="$WORK/run"
STARTED=""

cleanup() {
    if [ -n "$STARTED" ]; then
        "$VENV/bin/tpserve" stop --runtime-dir "$RD" --timeout 60 > /dev/null 2>&1 || true
    fi
    if [ "$KEEP" = "--keep" ]; then
        echo "kept $WORK" >&2
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

step() { echo "== $*" >&2; }
# pip, without the lines a find-links entry that is not a directory makes for every package
pip() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

step "building the wheel from a copy of $ROOT"
mkdir -p "$WORK/src" "$WORK/dist"
cp "$ROOT"/{pyproject.toml,setup.cfg,MANIFEST.in,README.md} "$WORK/src/"
cp -R "$ROOT/tpserve" "$WORK/src/tpserve"
find "$WORK/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
"$PYTHON" -m venv "$VENV"
pip wheel --quiet --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/tpserve-*.whl)"
step "built $(basename "$WHEEL"): $("$VPY" -m zipfile -l "$WHEEL" | grep -c 'kernels/csrc/') files under kernels/csrc"

step "installing $TORCH_SPEC, then the wheel, into a fresh virtualenv ($VENV)"
pip install --quiet "$TORCH_SPEC"
pip install --quiet "$WHEEL"

cd "$WORK"  # not the checkout: the installed package is the one imported
export TPSERVE_CACHE_DIR="$WORK/cache" TPSERVE_RUNTIME_DIR="$RD"
unset TPSERVE_CPU_OPS
SITE_PKG="$("$VPY" -c 'import pathlib, tpserve; print(pathlib.Path(tpserve.__file__).parent)')"
case "$SITE_PKG" in
    "$VENV"/*) ;;
    *) echo "FAIL: tpserve imports from $SITE_PKG, not from the virtualenv" >&2; exit 1 ;;
esac

step "building the C++ CPU operators from $SITE_PKG/kernels/csrc"
T0=$(date +%s)
"$VPY" -m tpserve.kernels.cpu_extension
BUILD_S=$(( $(date +%s) - T0 ))
LIB="$(ls "$TPSERVE_CACHE_DIR"/cpu_ops/tpserve_cpu_*.so 2>/dev/null | head -n 1 || true)"
if [ -z "$LIB" ] || ! grep -q " built " "$TPSERVE_CACHE_DIR/cpu_ops/build.log" 2>/dev/null; then
    echo "FAIL: the installed package did not build its C++ CPU operators" >&2
    exit 1
fi

step "tpserve start / generate / status / stop on the bundled model"
"$VENV/bin/tpserve" start --num-kv-blocks 64 > /dev/null
STARTED=1
"$VENV/bin/tpserve" generate "def fibonacci(n):" --max-tokens 32 --ignore-eos --temperature 0.7 --top-k 40 \
    --seed 1 --show-finish 2> "$WORK/generate.err"
cat "$WORK/generate.err" >&2
TOKENS="$(sed -n 's/.*completion_tokens=\([0-9]*\).*/\1/p' "$WORK/generate.err" | tail -n 1)"
"$VENV/bin/tpserve" status --json > "$WORK/status.json"
"$VENV/bin/tpserve" stop --timeout 60 > /dev/null
STARTED=""
read -r CPU_OPS MODEL < <("$VPY" -c 'import json, sys
s = json.load(open(sys.argv[1]))
print(s.get("cpu_ops"), s.get("model"))' "$WORK/status.json")
if [ "$CPU_OPS" != "loaded" ]; then
    echo "FAIL: the daemon reports cpu_ops=$CPU_OPS: $(cat "$WORK/status.json")" >&2
    exit 1
fi
case "$MODEL" in
    "$SITE_PKG"/*) ;;
    *) echo "FAIL: the daemon served $MODEL, not the installed package's bundled model" >&2; exit 1 ;;
esac
if [ "${TOKENS:-0}" -ne 32 ]; then
    echo "FAIL: tpserve generate returned ${TOKENS:-no} tokens, 32 asked" >&2
    exit 1
fi
echo "wheel install OK: CPU operators loaded ($(basename "$LIB") compiled in ${BUILD_S} s from the" \
     "installed package's sources; the daemon's status says cpu_ops=loaded); tpserve generate:" \
     "$TOKENS tokens from the bundled model"
