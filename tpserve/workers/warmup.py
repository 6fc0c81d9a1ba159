"""The synthetic steps a runner runs at start, before any request.

``warmup_plan``          the memory-peak step the KV sizing measures on a device.
``warmup_sample``        how their rows are sampled (the sampling rank's SamplePlan).
``kernel_warmup_plans``  one small step per attention kernel variant a serving step can
                         launch, so that Triton compiles them at start, not inside the first
                         mixed step that needs them (a 1-3 s stall on a GPU).

Both write nothing to the KV cache (every slot is -1) and read only block 0 through their
block tables, so they are safe on a live cache; their sampled tokens are thrown away.
"""
from __future__ import annotations

import numpy as np

from tpserve.config import EngineConfig
from tpserve.plan import StepPlan
from tpserve.sample_plan import SamplePlan


def warmup_sample(samples: int) -> SamplePlan:
    """``samples`` rows with temperature, top-k and top-p all on (the sampler's costliest
    plain path: it sorts the vocabulary)."""
    return SamplePlan.rows(np.ones(samples, np.float32), top_ks=50, top_ps=0.9,
                           seeds=np.arange(samples, dtype=np.int64))


def warmup_plan(config: EngineConfig) -> StepPlan:
    """The memory-peak step: a prefill of ``max_step_tokens`` tokens (capped by what
    ``max_num_seqs`` sequences can hold) that samples ``max_num_seqs`` rows (capped by the
    token count); sampled with ``warmup_sample`` (temperature, top-k and top-p all on), the
    sampler sorts the vocabulary as its most expensive real step does."""
    cfg = config
    num_tokens = min(cfg.max_step_tokens, cfg.max_num_seqs * cfg.max_model_len)
    num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // max(cfg.max_model_len, 1)))
    lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
    lens[-1] += num_tokens - int(lens.sum())
    cu = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    samples = min(cfg.max_num_seqs, num_tokens)
    rows = np.linspace(0, num_tokens - 1, samples).astype(np.int32)  # distinct: samples <= tokens
    return StepPlan(is_prefill=True, max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()),
                    input_ids=np.zeros(num_tokens, np.int32),
                    positions=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                    slot_mapping=np.full(num_tokens, -1, np.int32), cu_seqlens_q=cu,
                    cu_seqlens_k=cu.copy(), context_lens=lens,
                    block_tables=np.zeros((num_seqs, 0), np.int32), logits_indices=rows)


def synthetic_step(context_lens, new_lens, block_size: int, is_prefill: bool,
                   width: int | None = None) -> StepPlan:
    """A step in which sequence i holds ``context_lens[i]`` cached tokens and adds
    ``new_lens[i]``; block tables ``width`` entries wide (default: what the longest needs), all
    block 0; every slot -1 (nothing is stored); one sampled row per sequence."""
    ctx = np.asarray(context_lens, np.int32)
    new = np.asarray(new_lens, np.int32)
    keys = ctx + new
    b = len(new)
    cu_q = np.zeros(b + 1, np.int32)
    np.cumsum(new, out=cu_q[1:])
    cu_k = np.zeros(b + 1, np.int32)
    np.cumsum(keys, out=cu_k[1:])
    width = max(width or 0, int(-(-keys.max() // block_size)))
    return StepPlan(is_prefill=is_prefill, has_context=bool(is_prefill and ctx.any()),
                    max_seqlen_q=int(new.max()), max_seqlen_k=int(keys.max()),
                    input_ids=np.zeros(int(new.sum()), np.int32),
                    positions=np.concatenate([np.arange(c, c + n, dtype=np.int32)
                                              for c, n in zip(ctx, new)]),
                    slot_mapping=np.full(int(new.sum()), -1, np.int32), cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, context_lens=keys,
                    block_tables=np.zeros((b, width), np.int32), logits_indices=cu_q[1:] - 1)


# Query chunks on either side of the prefill kernel's BLOCK_M switch at 16 rows
# (``paged_prefill.prefill_tiles``).
_SHORT_CHUNK, _LONG_CHUNK = 5, 17


def kernel_warmup_plans(config: EngineConfig) -> list[StepPlan]:
    """One step per attention path a serving step can take: prefill without context and mixed
    steps (a decode row next to a chunk with cached context), each with a short and a long
    chunk (the long ones only where ``max_model_len`` allows such a chunk), and decode steps
    with one-block and ``max_model_len``-wide tables: decode splits the keys of the wide one
    (when that many keys make split-K worth it) and not those of the narrow one, the two
    variants of the decode kernel. Captured graphs run their own decode; eager decode needs
    these."""
    bs, limit = config.block_size, config.max_model_len
    chunks = [n for n in (_SHORT_CHUNK, _LONG_CHUNK) if n < limit] or [1]
    # Context that crosses a block boundary where the length allows it.
    ctx = max(1, min(bs + 3, limit - max(chunks)))
    plans = [synthetic_step([0], [n], bs, is_prefill=True) for n in chunks]
    plans += [synthetic_step([ctx, ctx], [1, n], bs, is_prefill=True) for n in chunks]
    plans.append(synthetic_step([0], [1], bs, is_prefill=False))
    plans.append(synthetic_step([ctx], [1], bs, is_prefill=False, width=-(-limit // bs)))
    return plans
