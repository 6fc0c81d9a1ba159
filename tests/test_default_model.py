"""The bundled default model: loadable by transformers, sane tokenizer, Python-looking output.

Also runs scripts/train_default_model.py in --quick mode to check that the script itself
writes a loadable, reproducible model directory.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tpserve.config import DEFAULT_MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "train_default_model.py"
SNIPPETS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\n    # mixed   spacing  \n",
    "x = {'naïve': \"€\", 'tab\\t': 1}  \r\n\n  \n",
    " leading space and trailing newline\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    m = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    return m.eval()


def test_directory_is_a_small_complete_hf_model():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    for required in ("config.json", "model.safetensors", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "training_report.json"):
        assert required in names, f"{required} missing from {DEFAULT_MODEL_DIR}"
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert total <= 20 * 1024 * 1024, f"default model directory is {total} bytes, limit 20 MiB"


def test_config_is_qwen3():
    config = AutoConfig.from_pretrained(DEFAULT_MODEL_DIR)
    assert config.model_type == "qwen3"
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.tie_word_embeddings is True
    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"
    with safe_open(str(DEFAULT_MODEL_DIR / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


@pytest.mark.parametrize("text", SNIPPETS)
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.eos_token_id not in ids, "plain text must not gain special tokens"
    assert tokenizer.decode(ids) == text


def test_eos_ids_agree(tokenizer):
    gen = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert tokenizer.eos_token == "<|endoftext|>"
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert gen["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|endoftext|>"


STDLIB_STYLE = '''class Queue:
    """A first-in, first-out queue of items."""

    def __init__(self, maxsize=0):
        self.maxsize = maxsize
        self._items = []

    def put(self, item):
        """Put an item into the queue."""
        if self.maxsize > 0 and len(self._items) >= self.maxsize:
            raise ValueError("queue is full")
        self._items.append(item)

    def get(self):
        """Remove and return the first item."""
        if not self._items:
            raise IndexError("get from an empty queue")
        return self._items.pop(0)
'''


def test_model_predicts_python_far_better_than_chance(model, tokenizer):
    """The shipped weights are trained: cross-entropy on unseen stdlib-style code is far below
    ln(vocab), which is where untrained weights sit (about 8.3 nats for 4096 tokens)."""
    ids = torch.tensor([tokenizer(STDLIB_STYLE).input_ids])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.6 * math.log(model.config.vocab_size), loss


def test_greedy_fibonacci_completion_is_indented_python(model, tokenizer):
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    completion = tokenizer.decode(out[0, ids.size(1):])
    assert re.search(r"\n[ \t]+\S", completion), completion


def _quick_run(out: Path) -> subprocess.Popen:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--out", str(out)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_quick_training_run_writes_loadable_reproducible_model(tmp_path):
    # Two runs side by side: the second checks reproducibility without doubling wall time.
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [_quick_run(o) for o in outs]
    for proc in procs:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, log
        assert "held-out loss" in log and "unigram baseline" in log, log

    a, b = outs
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between runs"

    report = json.loads((a / "training_report.json").read_text())
    assert report["heldout_files"] >= 1 and report["train_files"] > report["heldout_files"]
    assert report["steps"] == report["sizes"]["steps"] and not report["stopped_early"]
    assert math.isfinite(report["heldout_loss"]) and math.isfinite(report["unigram_baseline_loss"])
    assert {s["prompt"] for s in report["samples"]} >= {"def fibonacci(n):", "class Stack:"}

    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    text = "def f(x):\n    return x\n"
    assert tok.decode(tok(text).input_ids) == text
    assert json.loads((a / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.size(1), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tpserve_greedy_equals_transformers_on_the_bundled_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):"]
    # fp32 on both sides: the bf16 checkpoint is upcast the same way, so logits agree closely.
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            out = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
            refs.append(out[0, ids.shape[1]:].tolist())
    with LLM(dtype="float32", num_kv_blocks=64) as llm:  # model=None: the bundled model
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for ref, out in zip(refs, got):
        # transformers stops at EOS too; its output includes the EOS token, as ours does.
        assert out.token_ids == ref
        assert out.text == tok.decode(ref, skip_special_tokens=True)
