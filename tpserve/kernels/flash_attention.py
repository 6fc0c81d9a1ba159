"""FlashAttention: attention through the optional ``flash_attn`` package (flash-attn 2, CUDA).

``flash_attn`` is imported on the first forward, not at module import, so selecting the
backend never fails on a machine without it (``get_backend`` reports that instead).

    store                      our Triton ``store_kvcache``
    prefill without context    flash_attn_varlen_func(q, k, v) over the new tokens
    prefill with context       flash_attn_varlen_func(q, k_cache, v_cache, block_table=...)
    decode                     flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
                                                       cache_seqlens=, block_table=)

flash-attn aligns its causal mask to the bottom-right corner when a sequence has fewer
queries than keys, which is exactly tpserve's "new tokens are the last ones" rule. Its paged
KV cache needs pages (our blocks) of a multiple of 256 tokens, and it computes in fp16/bf16
only.
"""
from __future__ import annotations

import torch

from tpserve.kernels.attention_backend import FLASH_DTYPES, AttentionBackend
from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.metadata import AttentionMetadata


class FlashAttention(AttentionBackend):
    """flash-attn 2 paged attention; CUDA, fp16/bf16, block_size % 256 == 0."""

    name = "flash"
    supports_cuda_graphs = True

    def __init__(self, block_size: int = 256):
        super().__init__(block_size)
        self._flash = None

    def _lib(self):
        if self._flash is None:
            import flash_attn  # optional dependency: only where this backend was selected
            self._flash = flash_attn
        return self._flash

    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        from tpserve.kernels.store_kvcache import store_kvcache
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
        if q.dtype not in FLASH_DTYPES:
            raise ValueError(f"q: the flash backend computes in float16/bfloat16, got {q.dtype}; "
                             "use the triton or torch backend for this dtype")
        fa = self._lib()
        if k_cache is None or (meta.is_prefill and not meta.has_context):
            # The keys are exactly the new tokens: cu_seqlens_k == cu_seqlens_q.
            return fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q,
                softmax_scale=scale, causal=True)
        if not meta.is_prefill:
            out = fa.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        return fa.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
            causal=True, block_table=meta.block_tables)
