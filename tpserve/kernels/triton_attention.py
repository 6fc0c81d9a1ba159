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

The batch-invariant mode (``set_batch_invariant``; docs/protocol.md "Reproducibility") sends every
row with a cache to the decode kernel, each query row as a one-row sequence over its visible keys
(its own block-table row and key count), with the fixed split count and ordered merge of
``paged_decode.py``: a row's attention is then the same whatever shares its step, however its
prompt was chunked, and whether it is a prompt, decode or draft-verification row. Prefill pays
for it (a prompt's keys are read once per row, not once per tile of rows).

A layer's sliding window, sinks and soft-cap (attention_options.py) reach every kernel: the
decode kernel divides only a row's window among its shares, the prefill kernel starts a program's
keys at its first row's window.
"""
from __future__ import annotations

import torch

from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.paged_decode import paged_decode_attention
from tpserve.kernels.paged_prefill import paged_prefill_attention, varlen_prefill_attention
from tpserve.kernels.store_kvcache import store_kvcache


class TritonAttention(AttentionBackend):
    """Paged attention with tpserve's Triton kernels; block_size % 16 == 0."""

    name = "triton"
    supports_cuda_graphs = True
    options = frozenset({"window", "sinks", "softcap"})

    batch_invariant = False

    def set_batch_invariant(self, dtype: torch.dtype, head_dim: int) -> None:
        """Every row through the decode kernel's fixed split count from now on (module docstring)."""
        self.batch_invariant = True

    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
        if self.batch_invariant and k_cache is not None:
            return self._rows_as_decodes(q, k_cache, v_cache, meta, scale, opts)
        if k_cache is None or (meta.is_prefill and not meta.has_context):
            return varlen_prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale, opts)
        if not meta.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.context_lens, scale, **_decode_options(opts))
        return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                       meta.block_tables, meta.max_seqlen_q, scale, opts)

    @staticmethod
    def _rows_as_decodes(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         opts: AttentionOptions = PLAIN) -> torch.Tensor:
        """Each query row as a one-row sequence of the decode kernel (the batch-invariant mode).
        No host synchronisation: the row-to-sequence map is built on the device."""
        if not meta.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          scale, invariant=True, **_decode_options(opts))
        cu = meta.cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]
        rows = q.shape[0]
        seqs = torch.arange(q_lens.shape[0], device=q.device)
        seq_of = torch.repeat_interleave(seqs, q_lens, output_size=rows)
        index = torch.arange(rows, device=q.device)
        keys = meta.context_lens.long()[seq_of] - q_lens[seq_of] + (index - cu[seq_of]) + 1
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables[seq_of].contiguous(),
                                      keys.to(torch.int32), scale, invariant=True, **_decode_options(opts))


def _decode_options(opts: AttentionOptions) -> dict:
    return dict(window=opts.window, sinks=opts.sinks_f32(), softcap=opts.softcap)
