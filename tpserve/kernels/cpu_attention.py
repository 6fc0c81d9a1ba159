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

The operator has three paths. Decode rows (a pure decode step, and the leading decode rows of a
mixed step) take its decode path: one work item per sequence, streaming whole slot rows. Prompt
rows (fp32/bf16, head_dim % 16 == 0) take its tiled prompt path: a work item is 32 query rows of
one sequence and one KV head with every query head of its group, keys come in tiles of 16 at
absolute positions, widened and transposed once per item, so a query's 16 scores are head_dim
vector FMAs; the softmax is online over tiles. Work items go out largest first. Measured on the
40M benchmark model's prompt shapes (8 query / 4 KV heads of 64, bf16, 2 threads): 22 prompts of
32-256 tokens (3,357 rows) 7.3-7.9 ms against 25-27 ms for torch's SDPA paths (whose padding,
widening and length groups cost more than the math at these lengths); one 2,000-token prompt
35-38 ms against 33-36 ms; one 4,000-token prompt 145 ms against 120 ms (torch's flash kernel
multiplies bf16 pairs; this loop is fp32 FMAs at ~110 GFLOP/s, paced by the per-row softmax and
the key transposition: an AVX512-BF16 dot-product variant was no faster, and 64-key tiles were
~10% faster on long prompts but ~15% slower on short ones); the benchmark's whole prefill of 64
prompts (8,862 tokens) went from 2.31 to 1.78 s. Other prompt rows (fp16, other head sizes) take
the torch backend's SDPA paths; the operator's general row-at-a-time kernel remains for whole
plans of those.

docs/protocol.md promises that a prefix-cache hit computes the same logits as recomputing the
prefix, when a request runs alone. The prompt path keeps it by construction: a row's arithmetic
depends only on its position and its keys (tiles are aligned to absolute positions, and a row
reads exactly its visible keys), never on which rows share its call. So every prompt row, even a
prefill plan's single row left by a hit, is sent with ``prompt=True``; a lone row must not take
the decode path, whose sums run in another order.

In the batch-invariant mode (``batch_invariant``, docs/protocol.md "Reproducibility") every row
goes to the operator with ``rows=True``: each query row, prompt or decode, speculative
verification or a preempted sequence's recomputation, is computed with the decode path's
arithmetic over exactly its visible keys, so a token's attention does not depend on what shares
its step, how its prompt was chunked, nor on the path that computed its row. Rows the operator
cannot take that way (fp16, head_dim % 16 != 0) are refused when the backend is put in the mode.

A layer's sliding window, sinks and logit soft-cap (attention_options.py) go to the operator with
its rows, on every path: the decode path reads only the keys of a row's window, the prompt path
starts at the key tile holding an item's first window key and skips tiles that left a row's window,
so a windowed layer's cost follows its window; a sink is the softmax's starting maximum and sum.
Measured (one thread, bf16, a Xeon with AVX-512 and AMX, shared machine): a decode of 16
sequences at 8,192 keys, 8 query / 4 KV heads of 64, 34.7 ms over every key against 0.83 ms with
a 512-key window (4 / 1 heads of 256: 23.6 against 1.0 ms); one 8,192-token prompt 1,562 against
199 ms (1,389 against 170 ms).
A row's arithmetic still depends only on its position and its keys, so the reproducibility
promises above hold for windowed layers too.

An int8 cache (``--kv-cache-dtype int8``, kv_quant.py) goes to the same operator with its scales:
the store quantizes each head's row, the decode path widens a slot's int8 codes in registers and
multiplies a key's scale into its scores and a value's into its softmax weights, the prompt path
applies both as it widens a tile. Rows the operator's vector paths do not take (fp16, head_dim %
16 != 0) read the int8 cache through the torch backend, which dequantizes after its gather.
"""
from __future__ import annotations

import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.torch_attention import TorchAttention, split_decode_rows, varlen_causal_attention


class CpuAttention(AttentionBackend):
    """Paged attention over the cache in place; CPU tensors, any block size >= 1, fp32/bf16/fp16."""

    name = "cpu"
    supports_cuda_graphs = False
    options = frozenset({"window", "sinks", "softcap"})
    int8_kv = True

    #: every row with the decode arithmetic (the batch-invariant mode): see the module docstring
    batch_invariant = False

    def __init__(self, block_size: int = 16):
        super().__init__(block_size)
        if not cpu_extension.available():
            raise RuntimeError("the cpu attention backend needs tpserve's C++ CPU operators, "
                               "which could not be built on this machine")
        self._ops = cpu_extension.ops()
        self._torch = TorchAttention(block_size)  # prompt rows (see the module docstring)

    def fuses_qkv_store(self, dtype: torch.dtype, head_dim: int) -> bool:
        # Only where attend reads every row from the cache (the operator's tiled paths).
        return dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim <= 512

    def store_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], qk_norm=None,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """From the fused QKV projection's output ``qkv [T, (Hq + 2 Hkv) D]`` to the cache in one
        pass (the operator ``qkv_to_cache``): the q/k norms (``qk_norm``: (q_weight, k_weight,
        eps, gemma) or None), the rotary embedding (``rope``: float32 cos/sin tables
        [max_position, D / 2]; tables without rows: none) and the keys' and values' store at
        meta.slot_mapping. Returns the rotated queries [T, Hq, D]."""
        head_dim = k_cache.shape[-1]
        q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype)
        q_w, k_w, eps, gemma = qk_norm if qk_norm is not None else (None, None, 0.0, False)
        self._ops.qkv_to_cache(qkv, q, k_cache, v_cache, positions, meta.slot_mapping, rope[0], rope[1],
                               q_w, k_w, eps, num_heads, num_kv_heads, gemma, *(kv_scales or (None, None)))
        return q

    def store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        if kv_scales is None:
            self._ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        else:
            self._ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping, *kv_scales)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float, opts: AttentionOptions = PLAIN, kv_scales=None) -> torch.Tensor:
        if k_cache is None:
            return varlen_causal_attention(q, k, v, meta, scale, opts)
        window = opts.window or 0
        meta.derived(("cpu.tables_checked", window),
                     lambda: self._check_tables(k_cache, meta, window) or True)
        sc = kv_scales
        if sc is not None and not self._tiles_prompts(q):  # not the operator's vector paths
            return self._torch.attend(q, k, v, k_cache, v_cache, meta, scale, opts, kv_scales=sc)
        if self.batch_invariant:
            return self._paged(q, k_cache, v_cache, meta, scale, opts, rows=True, kv_scales=sc)
        if not meta.is_prefill:
            return self._paged(q, k_cache, v_cache, meta, scale, opts, kv_scales=sc)
        tiled = self._tiles_prompts(q)
        parts = meta.derived("torch.mixed_parts", lambda: split_decode_rows(meta))
        if parts is None:  # prompt rows only
            if tiled:
                return self._paged(q, k_cache, v_cache, meta, scale, opts, prompt=True, kv_scales=sc)
            return self._torch.attend(q, k, v, k_cache, v_cache, meta, scale, opts)
        (dmeta, dq), (pmeta, _) = parts
        decode = self._paged(q[:dq], k_cache, v_cache, dmeta, scale, opts, kv_scales=sc)
        if tiled:
            return torch.cat([decode, self._paged(q[dq:], k_cache, v_cache, pmeta, scale, opts, prompt=True,
                                                  kv_scales=sc)])
        rest = self._torch.attend(q[dq:], None, None, k_cache, v_cache, pmeta, scale, opts)
        return torch.cat([decode, rest])

    def set_batch_invariant(self, dtype: torch.dtype, head_dim: int) -> None:
        """Compute every row with the decode arithmetic from now on; refuses (ValueError) a model
        whose rows the operator cannot take that way."""
        if dtype not in (torch.float32, torch.bfloat16) or head_dim % 16:
            raise ValueError(f"the cpu attention backend computes rows batch-invariantly in float32 or "
                             f"bfloat16 with head_dim % 16 == 0, got {dtype} and head_dim {head_dim}")
        self.batch_invariant = True

    @staticmethod
    def _tiles_prompts(q: torch.Tensor) -> bool:
        """Whether the operator's tiled prompt path takes these rows (see the module docstring)."""
        return q.dtype in (torch.float32, torch.bfloat16) and q.shape[-1] % 16 == 0

    def _paged(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               opts: AttentionOptions = PLAIN, prompt: bool = False, rows: bool = False,
               kv_scales=None) -> torch.Tensor:
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = -1 if meta.num_decodes is None else meta.num_decodes
        self._ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, scale, prompt, nd, True, rows,  # checked in attend
                                  opts.window or 0, opts.sinks_f32(), opts.softcap or 0.0,
                                  *(kv_scales or (None, None)))
        return out

    def _check_tables(self, k_cache, meta: AttentionMetadata, window: int) -> None:
        """The step's block tables against the cache, once per step and window (the first such
        layer's call); blocks before every row's window are not needed."""
        self._ops.check_block_tables(meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                     k_cache.shape[0], k_cache.shape[1], window)
