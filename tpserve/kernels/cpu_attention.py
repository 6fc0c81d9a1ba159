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
too (a row copy per token; slot -1 skips).

Which rows take the kernel: decode rows (a pure decode step, and the leading decode rows of a
mixed step). Prompt rows take the torch backend's SDPA paths instead (varlen over the new tokens
without cached context, gathered keys with it): a long prompt is GEMM-shaped work, and the
kernel's row-at-a-time loop was measured 2.1-2.7x slower there (one 4,000-token prompt on the
40M model, bf16, 2 threads: 4.0-4.4 s against 1.6-1.9 s at every step budget from 256 to
4,096). Keeping every prompt row on the torch paths also keeps docs/protocol.md's promise that
a prefix-cache hit computes the same logits as recomputing the prefix: those two paths widen
and sum alike, while the kernel sums in another order.
"""
from __future__ import annotations

import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.backend import AttentionBackend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.torch_attention import TorchAttention, split_decode_rows, varlen_causal_attention


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
        self._torch = TorchAttention(block_size)  # prompt rows (see the module docstring)

    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if k_cache is None:
            return varlen_causal_attention(q, k, v, meta, scale)
        if not meta.is_prefill:
            return self._paged(q, k_cache, v_cache, meta, scale)
        parts = meta.derived("torch.mixed_parts", lambda: split_decode_rows(meta))
        if parts is None:  # prompt rows only
            return self._torch.attend(q, k, v, k_cache, v_cache, meta, scale)
        (dmeta, dq), (pmeta, _) = parts
        return torch.cat([self._paged(q[:dq], k_cache, v_cache, dmeta, scale),
                          self._torch.attend(q[dq:], None, None, k_cache, v_cache, pmeta, scale)])

    def _paged(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, scale)
        return out
