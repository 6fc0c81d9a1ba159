#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-quantize`, the single-stream benchmark peer, and the
# virtualenv of its checkpoint converter, in the checkout's ignored .peers/ folder.
#
#   scripts/peer_llamacpp.sh [PEER_DIR]     (default: .peers/llamacpp, or $TPSERVE_LLAMACPP_DIR)
#   LLAMACPP_NO_AMX=1 scripts/peer_llamacpp.sh .peers/llamacpp-noamx
#   LLAMACPP_AVX2=1 scripts/peer_llamacpp.sh .peers/llamacpp-avx2
#
# LLAMACPP_NO_AMX=1 builds without AMX instructions (-mno-amx-*): on a CPU with AMX, the build
# with them crashes at start whenever it repacks Q4_0 / Q8_0 weights (its default), so the fair
# peer there is this build, whose AVX-512 repacked kernels run. LLAMACPP_AVX2=1 builds for AVX2
# CPUs (AVX2, FMA, F16C, BMI2; no AVX-512 or AMX): the peer of tpserve's AVX2 build
# (TPSERVE_CPU_ARCH=haswell) when the machine at hand has AVX-512.
# The source is the llama.cpp tree that the `llama-cpp-python` sdist vendors (PyPI is the one
# source reachable here): `pip download --no-binary :all:` fetches the sdist, cmake builds the two
# tools with the machine's native instruction set (GGML_NATIVE) on 2 jobs. The converter
# (vendor/llama.cpp/convert_hf_to_gguf.py) runs in PEER_DIR/venv with its own Python packages:
# torch pinned to the CPU build tpserve uses (an unpinned one is a multi-GB CUDA build),
# transformers, sentencepiece and the vendored gguf-py. Nothing goes into tpserve's .venv.
#
# Afterwards PEER_DIR holds bin/llama-server, bin/llama-quantize, venv/bin/python and
# src/convert_hf_to_gguf.py; scripts/bench_latency.py --llamacpp PEER_DIR converts the benchmark
# models (bf16, then Q8_0 with llama-quantize) and runs llama-server beside tpserve.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
PEER_DIR="${1:-${TPSERVE_LLAMACPP_DIR:-$ROOT/.peers/llamacpp}}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
mkdir -p "$PEER_DIR/bin" "$PEER_DIR/dl"

if [ ! -x "$PEER_DIR/venv/bin/python" ]; then
    "$PYTHON" -m venv "$PEER_DIR/venv"
fi
VPY="$PEER_DIR/venv/bin/python"
"$VPY" -m pip install --quiet --upgrade pip

if [ ! -d "$PEER_DIR/src" ]; then
    "$VPY" -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python -d "$PEER_DIR/dl"
    SDIST="$(ls "$PEER_DIR"/dl/llama_cpp_python-*.tar.gz | head -n 1)"
    tar -xzf "$SDIST" -C "$PEER_DIR/dl"
    mv "$(ls -d "$PEER_DIR"/dl/llama_cpp_python-*/ | head -n 1)vendor/llama.cpp" "$PEER_DIR/src"
fi

if [ ! -x "$PEER_DIR/bin/llama-server" ] || [ ! -x "$PEER_DIR/bin/llama-quantize" ]; then
    EXTRA=(-DGGML_NATIVE=ON)
    if [ "${LLAMACPP_NO_AMX:-0}" = 1 ]; then
        NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        EXTRA+=(-DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX")
    fi
    if [ "${LLAMACPP_AVX2:-0}" = 1 ]; then
        EXTRA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    fi
    cmake -S "$PEER_DIR/src" -B "$PEER_DIR/build" -DCMAKE_BUILD_TYPE=Release "${EXTRA[@]}" \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > "$PEER_DIR/cmake.log"
    cmake --build "$PEER_DIR/build" -j "$JOBS" --target llama-server llama-quantize \
        > "$PEER_DIR/build.log"
    cp "$PEER_DIR/build/bin/llama-server" "$PEER_DIR/build/bin/llama-quantize" "$PEER_DIR/bin/"
fi

"$VPY" -m pip install --quiet torch==2.13.0
"$VPY" -m pip install --quiet torch==2.13.0 numpy sentencepiece safetensors transformers protobuf \
    "$PEER_DIR/src/gguf-py"

"$PEER_DIR/bin/llama-server" --version 2>&1 | head -n 2
"$VPY" -c 'import gguf, transformers; print("converter ready: gguf", gguf.__version__ if hasattr(gguf, "__version__") else "", "transformers", transformers.__version__)'
echo "peer ready: $PEER_DIR"
