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

A layer's options (attention_options.py) map onto flash-attn's arguments: a sliding window W is
``window_size=(W - 1, 0)`` (W - 1 keys to the left of the query's own, none to the right, on the
same bottom-right-aligned diagonal), a soft-cap is ``softcap`` (applied to the scaled scores, as
Gemma 2's). flash-attn 2 has no sinks: the call also returns each row's log-sum-exp (``lse``) of
its scores, and the output is rescaled by ``e^lse / (e^lse + e^sink) = sigmoid(lse - sink)``,
which is the softmax with the sink's term in its denominator (element-wise, no host sync).
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
    options = frozenset({"window", "sinks", "softcap"})

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
        extra = flash_options(opts)
        sinks = opts.sinks
        # With sinks, the rows' log-sum-exp too: varlen returns (out, softmax_lse [Hq, T], probs).
        varlen_extra = {**extra, "return_attn_probs": True} if sinks is not None else extra
        if k_cache is None or (meta.is_prefill and not meta.has_context):
            # The keys are exactly the new tokens: cu_seqlens_k == cu_seqlens_q.
            out = fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q,
                softmax_scale=scale, causal=True, **varlen_extra)
            return out if sinks is None else _sink_varlen(out, sinks)
        if not meta.is_prefill:
            out = fa.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True,
                **({**extra, "return_softmax_lse": True} if sinks is not None else extra))
            if sinks is None:
                return out.squeeze(1)
            out, lse = out  # [B, 1, Hq, D], [B, Hq, 1]
            return _rescale(out.squeeze(1), lse[:, :, 0], sinks)
        out = fa.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
            causal=True, block_table=meta.block_tables, **varlen_extra)
        return out if sinks is None else _sink_varlen(out, sinks)


def flash_options(opts: AttentionOptions) -> dict:
    """flash-attn keyword arguments for a layer's options (none for plain attention, so a
    flash-attn without them still runs plain models)."""
    extra = {}
    if opts.window is not None:
        extra["window_size"] = (opts.window - 1, 0)
    if opts.softcap is not None:
        extra["softcap"] = opts.softcap
    return extra


def _sink_varlen(result, sinks: torch.Tensor) -> torch.Tensor:
    out, lse = result[0], result[1]  # [T, Hq, D], [Hq, T]
    return _rescale(out, lse.transpose(0, 1), sinks)


def _rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [T, Hq, D] of a softmax without sinks, lse [T, Hq] its rows' log-sum-exp: the output
    with each head's sink in the denominator."""
    factor = torch.sigmoid(lse.float() - sinks.float()[None, :])
    return (out.float() * factor[:, :, None]).to(out.dtype)
