"""Dense reference attention and random paged batches, for checking the backends.

Used by the kernel tests and by device checks; not on any serving path. The reference is
deliberately naive (a Python loop over sequences, float64, GQA by ``repeat_interleave``) so
that it shares no code and no layout trick with the backends it checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpserve.kernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    """One attention call: new tokens, a cache holding the context, and the full sequences."""

    q: torch.Tensor            # [T, Hq, D] new tokens' queries
    k: torch.Tensor            # [T, Hkv, D] new tokens' keys (not yet in the cache)
    v: torch.Tensor
    k_cache: torch.Tensor      # [num_blocks, block_size, Hkv, D]; context already stored
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]   # per sequence, all its keys [context + new, Hkv, D]
    values: list[torch.Tensor]


def reference_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        q_lens: list[int], scale: float, *, window: int | None = None,
                        sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Per-sequence causal attention in float64; the new tokens are each sequence's last ones.

    q [T, Hq, D] flat over sequences (q_lens[i] rows each); keys[i]/values[i] [K_i, Hkv, D].
    ``window``, ``sinks``, ``softcap`` as transformers applies them (attention_options.py):
    soft-cap the scaled scores, mask keys with ``q_pos - k_pos >= window``, append the sink
    logit as one more softmax column and drop its probability. Returns float64 [T, Hq, D].
    """
    outs, start = [], 0
    for kk, vv, n in zip(keys, values, q_lens):
        qi = q[start:start + n].double().transpose(0, 1)              # [Hq, n, D]
        group = qi.shape[0] // kk.shape[1]
        ki = kk.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, K, D]
        vi = vv.double().repeat_interleave(group, dim=1).transpose(0, 1)
        k_len = kk.shape[0]
        scores = (qi @ ki.transpose(1, 2)) * scale                    # [Hq, n, K]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(k_len - n, k_len)[:, None]
        kpos = torch.arange(k_len)[None, :]
        hidden = kpos > qpos
        if window is not None:
            hidden = hidden | (qpos - kpos >= window)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(-1, n, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ vi).transpose(0, 1))
        start += n
    return torch.cat(outs)


def random_paged_batch(context_lens: list[int], new_lens: list[int], *, num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       is_prefill: bool = True, seed: int = 0, spare_blocks: int = 2,
                       fill: float = float("nan")) -> PagedBatch:
    """A batch whose sequence i has context_lens[i] cached tokens and new_lens[i] new ones.

    Blocks are a random permutation of the pool, block tables carry one extra -1 column, and
    every slot not holding a context token is set to ``fill`` (NaN by default), so a backend
    that reads a slot it should not shows up as NaN in its output.
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(context_lens)
    k_lens = [c + n for c, n in zip(context_lens, new_lens)]
    nblk = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(nblk) + 1
    tables = torch.full((b, width), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    keys, values, slots = [], [], []
    used = 0

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    for i in range(b):
        tables[i, :nblk[i]] = perm[used:used + nblk[i]].to(torch.int32)
        used += nblk[i]
        pos = torch.arange(k_lens[i])
        slot = tables[i, pos // block_size].long() * block_size + pos % block_size
        kk, vv = rand(k_lens[i], num_kv_heads, head_dim), rand(k_lens[i], num_kv_heads, head_dim)
        c = context_lens[i]
        k_cache.view(-1, num_kv_heads, head_dim)[slot[:c]] = kk[:c]
        v_cache.view(-1, num_kv_heads, head_dim)[slot[:c]] = vv[:c]
        keys.append(kk)
        values.append(vv)
        slots.append(slot[c:])
    q = rand(sum(new_lens), num_heads, head_dim)
    k = torch.cat([kk[c:] for kk, c in zip(keys, context_lens)])
    v = torch.cat([vv[c:] for vv, c in zip(values, context_lens)])
    cu_q = torch.zeros(b + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor(new_lens).cumsum(0)
    cu_k = torch.zeros(b + 1, dtype=torch.int32)
    cu_k[1:] = torch.tensor(k_lens).cumsum(0)
    meta = AttentionMetadata.from_arrays(
        is_prefill=is_prefill, has_context=is_prefill and any(c > 0 for c in context_lens),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, context_lens=torch.tensor(k_lens),
        block_tables=tables, slot_mapping=torch.cat(slots), device=device)
    dev = torch.device(device)
    return PagedBatch(q.to(dev), k.to(dev), v.to(dev), k_cache.to(dev), v_cache.to(dev), meta,
                      keys, values)


def backend_vs_reference(backend, context_lens: list[int], new_lens: list[int], *,
                         is_prefill: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype = torch.float32, seed: int = 0,
                         window: int | None = None, sinks: torch.Tensor | None = None,
                         softcap: float | None = None, device: str | torch.device = "cpu"):
    """Run ``backend.forward`` on a random paged batch; return (batch, output, float64 reference).
    ``window`` / ``sinks`` / ``softcap`` go to both (attention_options.py)."""
    batch = random_paged_batch(context_lens, new_lens, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=backend.block_size, dtype=dtype, is_prefill=is_prefill,
                               seed=seed, device=device)
    scale = 1 / math.sqrt(head_dim)
    dev_sinks = None if sinks is None else sinks.to(batch.q.device)
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                          scale, window=window, sinks=dev_sinks, softcap=softcap)
    return batch, out, reference_attention(batch.q.cpu(), batch.keys, batch.values, new_lens, scale,
                                           window=window, sinks=sinks, softcap=softcap)
