"""Tensor-parallel self-attention over a paged KV cache.

Data flow for flat token rows ``[T, hidden]``:
QKV projection (column-parallel, this rank's heads) -> optional per-head q/k RMSNorm (Qwen3) ->
rotary -> ``backend.forward`` (stores this step's k/v at ``meta.slot_mapping`` in the cache and
attends) -> o_proj (row-parallel, all-reduce). Where the backend fuses them (``fuses_qkv_store``:
the cpu backend, fp32/bf16), the q/k norms, rotary and the store are one pass over the QKV output
(``backend.store_qkv``, the same bits), and ``forward`` only attends (``stored=True``).

The KV cache tensors are owned by the runner, which assigns ``k_cache`` / ``v_cache``
(``[num_blocks, block_size, num_kv_heads_per_rank, head_dim]``) before the first forward; while
they are None the backend attends over the step's own k/v only (a cache-less prefill). With
``--kv-cache-dtype int8`` the caches are int8 and ``k_scale`` / ``v_scale`` (``[num_blocks,
block_size, num_kv_heads_per_rank]`` float32) hold their scales (tpserve/kernels/kv_quant.py).

Per-layer attention options, with the semantics transformers gives them (each layer builds its
own module, so a model mixes sliding and full layers through ``layer_types``):

* ``sliding_window=W``: a query at position p attends to keys at positions p - W + 1 .. p (the
  last W keys including itself; transformers' ``q_pos - k_pos < sliding_window``).
* ``sinks=True``: a learned logit per query head (parameter ``sinks`` [heads of this rank],
  checkpoint name ``<layer>.self_attn.sinks``) joins each softmax's denominator and contributes no
  value (gpt-oss).
* ``logit_softcap=c``: scores become ``c * tanh(scores / c)`` after scaling, before masking
  (Gemma 2's ``attn_logit_softcapping``).
* ``scale``: the factor on q.k, ``head_dim ** -0.5`` unless given (Gemma: ``query_pre_attn_scalar
  ** -0.5``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tpserve.models.linear import QKVParallelLinear, RowParallelLinear
from tpserve.models.norm import GemmaRMSNorm, RMSNorm
from tpserve.models.parallel import TPContext
from tpserve.models.rotary import NoRotary, RotaryEmbedding
from tpserve.models.weights import attach_loader, check_shape, new_param

if TYPE_CHECKING:
    from tpserve.kernels.metadata import AttentionMetadata


class SelfAttention(nn.Module):
    """Grouped-query self-attention for one decoder layer, sharded by heads.

    Checkpoint names below this module: ``q_proj``/``k_proj``/``v_proj`` (packed into
    ``qkv_proj``), ``o_proj``, with ``qk_norm`` also ``q_norm``/``k_norm``, with ``sinks`` also
    ``sinks`` ([num_heads], sliced to this rank's heads). Window, sinks, softcap and scale: see the
    module docstring.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 tp: TPContext, rotary: RotaryEmbedding, backend, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, rms_norm_eps: float = 1e-6,
                 sliding_window: int | None = None, sinks: bool = False,
                 logit_softcap: float | None = None, scale: float | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window: expected an int >= 1 or None, got {sliding_window!r}")
        if logit_softcap is not None and not (isinstance(logit_softcap, (int, float))
                                              and not isinstance(logit_softcap, bool) and logit_softcap > 0):
            raise ValueError(f"logit_softcap: expected a positive float or None, got {logit_softcap!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                      and scale > 0):
            raise ValueError(f"scale: expected a positive float or None, got {scale!r}")
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        self._tp = tp
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, tp, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.sinks = (attach_loader(new_param(self.num_heads), self.sinks_loader) if sinks else None)
        # Plain attributes, not modules: the backend is shared by all layers and holds no weights.
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # an int8 cache's scales, else None
        self.v_scale: torch.Tensor | None = None
        self._fusable: tuple | None = None  # ((dtype, device), whether _can_fuse)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        kv_scales = None if self.k_scale is None else (self.k_scale, self.v_scale)
        stored = self._fused_store(qkv)
        if stored:
            q = self.backend.store_qkv(qkv, self.num_heads, self.num_kv_heads, self.k_cache, self.v_cache,
                                       meta, positions, (self.rotary.cos, self.rotary.sin),
                                       self._qk_norm_args(), kv_scales)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            v = v.contiguous()
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                   window=self.sliding_window, sinks=self.sinks,
                                   softcap=self.logit_softcap, kv_scales=kv_scales, stored=stored)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    #: whether a backend that can (``fuses_qkv_store``) takes the q/k norms, rotary and KV store
    #: in one pass over the QKV output (tests turn it off to compare the two paths)
    fuse_qkv_store = True

    def _fused_store(self, qkv: torch.Tensor) -> bool:
        """Whether this call's q/k norms, rotary and store run as the backend's one pass: a cache
        to store into, and a layer :meth:`_can_fuse` takes (decided once per dtype and device)."""
        if not self.fuse_qkv_store or self.k_cache is None or self.k_cache.numel() == 0:
            return False
        key = (qkv.dtype, qkv.device)
        if self._fusable is None or self._fusable[0] != key:
            self._fusable = (key, self._can_fuse(qkv))
        return self._fusable[1]

    def _can_fuse(self, qkv: torch.Tensor) -> bool:
        """A whole rotary or none, Qwen3's or Gemma's q/k norms or none, a backend that fuses."""
        rotary = self.rotary  # a whole rotary, or none (cos/sin without rows: NoRotary's)
        whole = isinstance(rotary, RotaryEmbedding) and rotary.rotary_dim == self.head_dim
        if not ((whole or isinstance(rotary, NoRotary)) and rotary.cos.device == qkv.device
                and qkv.device.type == "cpu"):
            return False
        if self.q_norm is not None and not (type(self.q_norm) in (RMSNorm, GemmaRMSNorm)
                                            and type(self.k_norm) is type(self.q_norm)
                                            and self.q_norm.eps == self.k_norm.eps
                                            and self.q_norm.weight.dtype == qkv.dtype):
            return False
        fuses = getattr(self.backend, "fuses_qkv_store", None)
        return fuses is not None and fuses(qkv.dtype, self.head_dim)

    def _qk_norm_args(self):
        if self.q_norm is None:
            return None
        gemma = isinstance(self.q_norm, GemmaRMSNorm)
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, gemma

    def sinks_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """The checkpoint's sinks for every head; this rank keeps its own query heads' logits."""
        check_shape(loaded_weight, (self.num_heads * self._tp.size,), "self_attn.sinks")
        with torch.no_grad():
            param.copy_(loaded_weight.narrow(0, self._tp.rank * self.num_heads, self.num_heads))
