"""Tensor-parallel self-attention over a paged KV cache.

Data flow for flat token rows ``[T, hidden]``:
QKV projection (column-parallel, this rank's heads) -> optional per-head q/k RMSNorm (Qwen3) ->
rotary -> ``backend.forward`` (stores this step's k/v at ``meta.slot_mapping`` in the cache and
attends) -> o_proj (row-parallel, all-reduce).

The KV cache tensors are owned by the runner, which assigns ``k_cache`` / ``v_cache``
(``[num_blocks, block_size, num_kv_heads_per_rank, head_dim]``) before the first forward; while
they are None the backend attends over the step's own k/v only (a cache-less prefill).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tpserve.models.linear import QKVParallelLinear, RowParallelLinear
from tpserve.models.norm import RMSNorm
from tpserve.models.parallel import TPContext
from tpserve.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tpserve.kernels.metadata import AttentionMetadata


class SelfAttention(nn.Module):
    """Grouped-query self-attention for one decoder layer, sharded by heads.

    Checkpoint names below this module: ``q_proj``/``k_proj``/``v_proj`` (packed into
    ``qkv_proj``), ``o_proj``, and with ``qk_norm`` also ``q_norm``/``k_norm``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 tp: TPContext, rotary: RotaryEmbedding, backend, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, tp, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        # Plain attributes, not modules: the backend is shared by all layers and holds no weights.
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v.contiguous(), self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
