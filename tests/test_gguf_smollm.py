"""A real GGUF model end to end: SmolLM2-135M-Instruct Q4_1 (tests/gguf_models.py fetches it).

With ``--quantization none --dtype float32`` tpserve dequantizes the file at load; its greedy
tokens must be transformers' greedy tokens on the same file (``from_pretrained(dir,
gguf_file=...)``, fp32: the reference). The comparison is teacher-forced: one transformers
forward over each prompt plus tpserve's greedy tokens, whose argmax at every generated position
must be tpserve's next token; that holds exactly when transformers' own greedy decoding would
produce the same tokens, at the cost of one forward per prompt instead of one per token.

By default (the file's quantized blocks repacked onto tpserve's group-quantized kernels) the
teacher-forced top-1 agreement with that reference is at least 95%, and the daemon answers a
chat through the file's own chat template over HTTP, under the file's stem as the model name.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from gguf_models import smollm2_gguf
from test_http import run_cli
from tpserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "Q: What is 12 times 12?\nA:",
    "The largest planet in the solar system",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def tpserve_greedy(gguf_file):
    with LLM(str(gguf_file), quantization="none", dtype="float32", num_kv_blocks=64, block_size=16) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        name = llm.engine.config.model_name
    return prompt_ids, [list(o.outputs[0].token_ids) for o in outs], name


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' fp32 model of the file, and its argmax after every position of each
    prompt followed by tpserve's greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                               dtype=torch.float32).eval()
    return ref_tok, ref


def ref_argmax(ref, sequence: list[int]) -> list[int]:
    with torch.no_grad():
        return ref(torch.tensor([sequence])).logits[0].argmax(-1).tolist()


def test_greedy_tokens_equal_transformers_on_the_gguf_file(tpserve_greedy, reference):
    prompt_ids, generated, name = tpserve_greedy
    ref_tok, ref = reference
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    assert ref.config.tie_word_embeddings
    assert [ref_tok.encode(p, add_special_tokens=False) for p in PROMPTS] == prompt_ids
    agree = 0
    for ids, gen in zip(prompt_ids, generated):
        assert len(gen) == NEW_TOKENS
        ref_next = ref_argmax(ref, ids + gen)[len(ids) - 1:-1]
        assert ref_next == gen, (ids, gen, ref_next)
        agree += 1
    assert agree == len(PROMPTS) >= 8


def test_native_top1_agrees_with_the_reference(gguf_file, tpserve_greedy, reference):
    """The default path (the file's Q4_1 / Q8_0 blocks repacked onto the W4A8 group kernels):
    teacher-forced top-1 agreement with the fp32 reference at least 95%."""
    prompt_ids, generated, _ = tpserve_greedy
    _, ref = reference
    sequences = [ids + gen for ids, gen in zip(prompt_ids, generated)]
    with LLM(str(gguf_file), num_kv_blocks=64, block_size=16) as llm:
        outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same = total = 0
    for seq, out in zip(sequences, outs):
        expected = ref_argmax(ref, seq)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            top1 = next(t for t, lp in entry.items() if lp.rank == 1)
            same += top1 == expected[i - 1]
            total += 1
    assert total == sum(len(s) - 1 for s in sequences)
    print(f"native top-1 agreement with the fp32 reference: {same}/{total} = {same / total:.3f}")
    assert same / total >= 0.95


def test_daemon_answers_a_chat_through_the_files_template(gguf_file):
    rd = tempfile.mkdtemp(prefix="tpg-", dir="/tmp")
    out = run_cli("start", "--model", gguf_file, "--quantization", "none", "--runtime-dir", rd,
                  "--num-kv-blocks", 64, "--http-port", 0,
                  "--startup-timeout", 200, "--max-model-len", 1024)
    try:
        assert out.returncode == 0, out.stderr + out.stdout
        _, url = out.stdout.split()
        models = httpx.get(url + "/v1/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
        text = reply["choices"][0]["message"]["content"]
        assert "Paris" in text, reply
        # The file's template put its default system prompt and the im_start turns around the question.
        assert reply["usage"]["prompt_tokens"] > 20
    finally:
        stop = run_cli("stop", "--runtime-dir", rd, "--timeout", 60)
        shutil.rmtree(rd, ignore_errors=True)
    assert stop.returncode == 0, stop.stderr + stop.stdout
