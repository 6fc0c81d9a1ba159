"""CpuAttention: paged attention on CPU that reads the KV cache in place (C++ operators).

Why a C++ kernel: the plain-torch backend (``torch_attention.py``) first gathers every
sequence's keys and values through its block table into padded ``[B, max_k]`` buffers, then runs
SDPA over the padding with a mask. At decode batch 64 on the 40M benchmark model that plumbing
(gather, widening copies, masked SDPA over padding) was more than half of a step. The kernel in
``csrc/cpu_ops.cpp`` walks each sequence's block table itself and folds key tiles into an
online softmax in fp32, so nothing is gathered, padded or masked, and the work per sequence is
exactly its own keys. Measured on the benchmark's decode shape (64 sequences, 32-500 keys,
8 query / 4 KV heads of 64, one layer, one thread): 3.9 ms bf16 / 6.7 ms fp32 against 27 / 24 ms
for the torch backend; a whole bf16 decode step at batch 64 (scripts/profile_step.py, 2 threads)
went from 95 ms to 42 ms, attention from 31 + 11 (gather) + 17 (copies) ms to 13.5 ms.
(Shared, noisy machine; the kernel is bound by reading the cache.)
FlexAttention and inductor were not chosen: both need a compile step per shape family, and
neither reads a block table without materialising a gather on CPU.

One kernel serves decode (q_len 1), prefill with cached context and mixed batches (decode rows
beside prefill chunks in one plan): sequence i's q_len_i query rows are the last rows of its
context_lens[i] keys and attend causally. Work is split over (sequence, chunk of 16 query rows)
with ``at::parallel_for``, i.e. ``torch.get_num_threads()`` threads. The K/V store is a C++ loop
too (a row copy per token; slot -1 skips). Runs without a cache (warm-up), and prefills in
which no sequence has cached context, use the torch backend's varlen SDPA: with nothing to read
through a block table, its GEMM-tiled kernel is faster.
"""
from __future__ import annotations

import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.backend import AttentionBackend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.torch_attention import varlen_causal_attention


class CpuAttention(AttentionBackend):
    """Paged attention over the cache in place; CPU tensors, any block size >= 1, fp32/bf16/fp16."""

    name = "cpu"
    supports_cuda_graphs = False

    def __init__(self, block_size: int = 16):
        super().__init__(block_size)
        if not cpu_extension.available():
            raise RuntimeError("the cpu attention backend needs tpserve's C++ CPU operators, "
                               "which could not be built on this machine")
        self._ops = cpu_extension.ops()

    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        # Every step with a cache goes through the paged kernel, plain prefills included: torch's
        # fused SDPA is faster on a prompt without cached context (measured 20 vs 28 ms for
        # 8 x 256 prompt tokens), but it sums in another order, and docs/protocol.md promises
        # that a prefix-cache hit computes the same logits as recomputing the prefix.
        if k_cache is None:
            return varlen_causal_attention(q, k, v, meta, scale)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, scale)
        return out
