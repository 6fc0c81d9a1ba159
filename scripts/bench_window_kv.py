"""Sliding-window KV memory on a Gemma 3 1B-like shape (bench_throughput.py --shape gemma3-1b).

The shape keeps Gemma 3 1B's attention layout: 26 layers, five sliding layers (window 512) then a
global one, 4 query heads and 1 KV head of dim 256, block size 16. Two lines:

* ``kv-capacity``: how many sequences of ``--context`` tokens (default 8192) the KV memory of
  ``--kv-gb`` holds at once, driven through the real scheduler and block manager (no model: the
  pool's accounting is the measurement), the windows honoured against every layer global.
  Target: >= 2.5x.
* ``window-decode``: output tok/s of ``--streams`` streams decoding after prompts of
  ``--decode-context`` tokens, random weights, the model with its windows against the same
  weights with the window ignored (``sliding_window`` past the longest sequence: every layer
  global, one KV group). The prompts are prefilled once and timed from a second, prefix-cached
  pass, so the figure is decode. The width (hidden 256, vocab 4096, MLP 1024) is cut so a CPU
  can prefill the contexts; attention, the part the windows change, keeps the 1B's shape.
  Target at 16 streams of 8k: >= 1.5x.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

WINDOW, LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 512, 26, 1, 256, 16


def layer_windows(ignored: bool = False) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer global."""
    return [None if ignored or (i + 1) % 6 == 0 else WINDOW for i in range(LAYERS)]


def kv_capacity(context: int, kv_gb: float, ignored: bool, gen: int = 512) -> tuple[int, int]:
    """(most sequences decoding at once, pool blocks) for ``kv_gb`` of bf16 KV memory, through the
    scheduler: requests of ``context - gen`` prompt tokens keep arriving; the count is taken until
    the first preemption or the first request ends (the pool is full by then)."""
    from tpserve.config import EngineConfig
    from tpserve.kv_groups import group_size, kv_cache_groups
    from tpserve.sampling import SamplingParams
    from tpserve.scheduler import Scheduler, Sequence
    groups = kv_cache_groups(layer_windows(ignored))
    slabs = group_size(groups) if len(groups) > 1 else LAYERS
    block_bytes = 2 * slabs * KV_HEADS * HEAD_DIM * 2 * BLOCK
    blocks = int(kv_gb * (1 << 30)) // block_bytes
    cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=blocks, max_num_seqs=1024, enable_prefix_caching=False,
                       max_num_batched_tokens=2 * context, max_model_len=context, eos_token_ids=[0])
    s = Scheduler(cfg, groups)
    rng = np.random.default_rng(0)
    peak, n = 0, 0
    for _ in range(20 * gen):
        while len(s.waiting) < 2:
            s.add(Sequence(f"r{n}", rng.integers(1, 30000, context - gen).tolist(),
                           SamplingParams(max_tokens=gen, ignore_eos=True)))
            n += 1
        batch = s.schedule()
        done = s.postprocess(batch, np.ones(batch.num_samples, dtype=np.int64))
        if s.num_preemptions or any(q.is_finished for q in done):
            break
        peak = max(peak, sum(1 for q in s.running if not q.is_prefill))
    return peak, blocks


def build_model(path: Path, ignored: bool) -> Path:
    """The narrow Gemma 3 1B-shaped checkpoint; with the window ignored, every layer is declared
    global (same weights, same cost per layer but for attention)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=4096,
               max_position_embeddings=32768, sliding_window=WINDOW,
               layer_types=["sliding_attention" if w else "full_attention" for w in layer_windows(ignored)],
               query_pre_attn_scalar=HEAD_DIM, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == cfg:
        return path
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(cfg))
    return path


def window_decode(root: Path, streams: int, context: int, out: int, dtype: str, ignored: bool) -> float:
    from tpserve import LLM, SamplingParams
    print(f"window-decode: {'window ignored' if ignored else 'windows'}, prefilling {streams} x "
          f"{context - out} tokens", flush=True)
    path = build_model(root / ("gemma3-1b-shape-global" if ignored else "gemma3-1b-shape"), ignored)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 4096, context - out).tolist() for _ in range(streams)]
    blocks_per_seq = -(-context // BLOCK) * (7 if not ignored else 1)
    with LLM(str(path), dtype=dtype, block_size=BLOCK, max_num_seqs=streams, max_model_len=context,
             max_num_batched_tokens=2048, num_kv_blocks=blocks_per_seq * streams * 2) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                           use_tqdm=False)
        dt = time.perf_counter() - t
        hits = llm.stats()["prefix_cache_hit_tokens"]
    assert hits > 0, "the timed pass found no cached prefix"
    return sum(len(r.token_ids) for r in res) / dt


def main(args, isa: str, dtype: str) -> int:
    ctx = args.context or 8192
    win, blocks_w = kv_capacity(ctx, args.kv_gb, ignored=False)
    glob, blocks_g = kv_capacity(ctx, args.kv_gb, ignored=True)
    print(f"kv-capacity shape=gemma3-1b context={ctx} kv_gb={args.kv_gb} windows={win} seqs "
          f"({blocks_w} blocks of 4 layers) global={glob} seqs ({blocks_g} blocks of 26 layers) "
          f"ratio={win / max(glob, 1):.2f}x (target >= 2.5x)", flush=True)
    if args.decode_context:
        root = Path(args.model_dir or "/tmp/tpserve-bench")
        w = window_decode(root, args.streams, args.decode_context, args.decode_tokens, dtype, ignored=False)
        g = window_decode(root, args.streams, args.decode_context, args.decode_tokens, dtype, ignored=True)
        print(f"window-decode shape=gemma3-1b isa={isa} dtype={dtype} streams={args.streams} "
              f"context={args.decode_context} windows={w:.1f} tok/s window-ignored={g:.1f} tok/s "
              f"ratio={w / g:.2f}x (target >= 1.5x at 16 streams of 8k)", flush=True)
    return 0
