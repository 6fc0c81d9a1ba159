"""Benchmark models: Qwen3-architecture checkpoints with random weights, built locally.

    build_bench_model(path) -> path    the ~40M-parameter model of the throughput benchmarks:
                                        hidden 512, 8 layers, 8 heads, 4 KV heads, head_dim 64,
                                        intermediate 1536, vocab 32768, bf16.
    build_bench_model(path, **QWEN3_0_6B)  the Qwen3-0.6B shape (hidden 1024, 28 layers, 16 heads,
                                        8 KV heads, head_dim 128, intermediate 3072, vocab
                                        151936, tied embeddings), where GEMMs dominate a step.
    build_bench_model(path, **TINY)     2 layers of width 64 (vocab 32768): scripts' smoke runs.
No tokenizer is needed: benchmarks send token ids.

    id_text(ids) -> str                 the text form of token ids, for servers that take text
    write_id_tokenizer(path, vocab)     a tokenizer that reads that text back as the same ids
"""
from __future__ import annotations

import json
from pathlib import Path

BENCH_CONFIG = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, intermediate_size=1536, vocab_size=32768,
                    max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-6,
                    rope_theta=1_000_000.0, bos_token_id=1, eos_token_id=2)


# Overrides of BENCH_CONFIG giving Qwen3-0.6B's shape (random weights).
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                  tie_word_embeddings=True)


# Overrides of BENCH_CONFIG giving a model of a few layers and widths, the vocabulary kept (the
# benchmarks draw token ids up to 32768): the smallest size of a script's smoke run (seconds on a CPU).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            intermediate_size=128)

# A benchmark shape's name -> its BENCH_CONFIG overrides and its default directory under /tmp/tpserve-bench.
SHAPE_OVERRIDES = {"40m": {}, "0.6b": QWEN3_0_6B, "tiny": TINY}
SHAPE_DIRS = {"40m": "qwen3-40m", "0.6b": "qwen3-0.6b-shape", "tiny": "qwen3-tiny"}


def build_bench_model(path: str | Path, seed: int = 0, dtype: str = "bfloat16", **overrides) -> Path:
    """Write the benchmark checkpoint into ``path`` (skipped if it is already there)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    cfg_dict = dict(BENCH_CONFIG, **overrides)
    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == dict(cfg_dict, seed=seed, dtype=dtype):
        return path
    torch.manual_seed(seed)
    config = Qwen3Config(**cfg_dict, torch_dtype=dtype)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(dict(cfg_dict, seed=seed, dtype=dtype)))
    return path


def id_text(ids) -> str:
    """Token ids as words ``t<id>`` separated by single spaces: ``[5, 7]`` -> ``"t5 t7"``."""
    return " ".join(f"t{int(i)}" for i in ids)


def write_id_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write into ``path`` a word-level tokenizer of ``vocab_size`` words ``t0 .. t<vocab-1>``.

    Encoding ``id_text(ids)`` gives back exactly ``ids``, and decoding one id at a time gives one
    piece of text per id, so a server that takes text prompts sees the same prompt lengths as
    one fed ids, and streams one text event per generated token. No word is special (nothing is
    skipped when decoding) and nothing is added around a prompt (no BOS).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return path


def count_params(path: str | Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return {"layers": n * per_layer, "lm_head": h * v, "embedding": h * v}
