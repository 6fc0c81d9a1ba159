"""TritonAttention: attention through tpserve's own Triton kernels (CUDA; CPU under the
interpreter for tests). Block size must be a multiple of 16 (checked by ``get_backend`` and by
the kernel wrappers).

    store                      store_kvcache.py      one program per token
    decode                     paged_decode.py       one program per (sequence, KV head)
    prefill with context       paged_prefill.py      PAGED: keys read through block tables
    prefill without context    paged_prefill.py      keys read from the new k/v directly
    run without a cache        paged_prefill.py      same as prefill without context

Prefill without context reads the new tokens' k/v rather than the cache it just wrote: same
values, contiguous rows, no block-table lookups.
"""
from __future__ import annotations

import torch

from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.paged_decode import paged_decode_attention
from tpserve.kernels.paged_prefill import paged_prefill_attention, varlen_prefill_attention
from tpserve.kernels.store_kvcache import store_kvcache


class TritonAttention(AttentionBackend):
    """Paged attention with tpserve's Triton kernels; block_size % 16 == 0."""

    name = "triton"
    supports_cuda_graphs = True

    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if k_cache is None or (meta.is_prefill and not meta.has_context):
            return varlen_prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale)
        if not meta.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.context_lens, scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                       meta.block_tables, meta.max_seqlen_q, scale)
