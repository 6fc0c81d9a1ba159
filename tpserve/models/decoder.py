"""The decoder-only transformer shared by Qwen3, Llama, Qwen2, their mixtures of experts
(Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss), Mistral, Phi-3, SmolLM3, Gemma 2 and Gemma 3,
tensor-parallel.

Module tree (names match Hugging Face checkpoints, except the packed ``qkv_proj`` and
``gate_up_proj``, see :attr:`CausalLM.packed_modules_mapping`)::

    CausalLM
    ├─ model: DecoderModel
    │   ├─ embed_tokens: VocabParallelEmbedding
    │   ├─ layers[i]: DecoderLayer
    │   │   ├─ input_layernorm, post_attention_layernorm: RMSNorm (Gemma: GemmaRMSNorm, and
    │   │   │  pre_feedforward_layernorm, post_feedforward_layernorm)
    │   │   ├─ self_attn: SelfAttention (qkv_proj, [q_norm, k_norm], o_proj, [sinks])
    │   │   └─ mlp: MLP (gate_up_proj, down_proj)
    │   │      or, on a sparse layer, SparseMoeBlock (gate, experts, [shared_expert,
    │   │      shared_expert_gate]; see moe.py), named ``block_sparse_moe`` for Mixtral
    │   └─ norm: RMSNorm
    └─ lm_head: ParallelLMHead (shares embed_tokens.weight when tie_word_embeddings)

Per layer, the spec decides the attention window (``layer_types``), the rotary table (Gemma 3's
local base on sliding layers, none on SmolLM3's ``no_rope_layers``) and the attention scale and
soft-cap and its sinks (gpt-oss); ``compute_logits`` applies a final logit soft-cap (Gemma).

The runner calls exactly: ``forward(input_ids, positions, meta)``, ``compute_logits(hidden)``,
``set_kv_caches(caches)`` and reads ``num_layers``, ``num_kv_heads_per_rank``, ``head_dim``,
``vocab_size``, ``dtype``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tpserve.models.activation import gated_activation
from tpserve.models.attention import SelfAttention
from tpserve.models.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.models.fused_decode import FusedDecode, why_not_fused
from tpserve.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tpserve.models.moe import SparseMoeBlock
from tpserve.models.norm import Fp32ScaleRMSNorm, GemmaRMSNorm, RMSNorm
from tpserve.models.parallel import TPContext
from tpserve.models.rotary import NoRotary, RotaryEmbedding
from tpserve.models.spec import ModelSpec, check_tp_size

if TYPE_CHECKING:
    from tpserve.kernels.metadata import AttentionMetadata


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: column-parallel gate/up, row-parallel down (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext, bias: bool = False,
                 act: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp, bias=bias)
        self.act = gated_activation(act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _attention_options(spec: ModelSpec, layer_index: int) -> dict:
    """SelfAttention's per-layer options that differ from plain causal attention."""
    options = dict(sliding_window=spec.window(layer_index), logit_softcap=spec.attn_logit_softcap,
                   scale=spec.attn_scale, sinks=spec.attn_sinks or None)
    return {k: v for k, v in options.items() if v is not None}


def _norm_class(spec: ModelSpec) -> type[nn.Module]:
    if spec.gemma_norms:
        return GemmaRMSNorm
    return Fp32ScaleRMSNorm if spec.fp32_norm_scale else RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual stream travels separately (fused adds).

    With Gemma's norms the attention output is normalised (``post_attention_layernorm``) before
    it joins the residual, the MLP input by ``pre_feedforward_layernorm`` and its output by
    ``post_feedforward_layernorm``.
    """

    def __init__(self, spec: ModelSpec, tp: TPContext, rotary: RotaryEmbedding, backend,
                 layer_index: int = 0, expert_parallel: bool = False):
        super().__init__()
        norm = _norm_class(spec)
        self.gemma_norms = spec.gemma_norms
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, tp, rotary, backend,
            qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=spec.qk_norm, rms_norm_eps=spec.rms_norm_eps,
            **_attention_options(spec, layer_index))
        if spec.qk_norm and spec.gemma_norms:
            self.self_attn.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        if spec.gemma_norms:
            self.pre_feedforward_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        if spec.is_sparse_layer(layer_index):
            # Under the checkpoint's name: ``mlp``, or Mixtral's ``block_sparse_moe``.
            self.feed_forward_name = spec.moe_module
            setattr(self, spec.moe_module, SparseMoeBlock(spec, tp, expert_parallel))
        else:
            self.feed_forward_name = "mlp"
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, tp, bias=spec.mlp_bias,
                           act=spec.hidden_act)

    @property
    def feed_forward(self) -> nn.Module:
        """The layer's MLP: the dense one or the sparse expert block."""
        return getattr(self, self.feed_forward_name)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        if self.gemma_norms:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.feed_forward(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm: ids -> last hidden states."""

    def __init__(self, spec: ModelSpec, tp: TPContext, backend, expert_parallel: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        # Embeddings times sqrt(hidden_size), the factor rounded to the model dtype (Gemma).
        self.embedding_scale = spec.hidden_size ** 0.5 if spec.embedding_scale else None
        # One rotary table shared by every layer (positions are the same for all of them); Gemma 3's
        # sliding layers share a second one with their own base, SmolLM3's no-rope layers none.
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling,
                                      rotary_dim=spec.rotary_dim or None)
        local = self.rotary
        if spec.local_rope_theta is not None:
            local = RotaryEmbedding(spec.head_dim, spec.max_position, spec.local_rope_theta,
                                    spec.local_rope_scaling)
        no_rope = NoRotary(spec.head_dim)

        def rotary_of(i: int):
            if not spec.uses_rope(i):
                return no_rope
            return local if spec.window(i) is not None else self.rotary
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, rotary_of(i), backend, i, expert_parallel)
                                    for i in range(spec.num_layers))
        self.norm = _norm_class(spec)(spec.hidden_size, spec.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: the embedding rows, times the scale where the model has one."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=torch.float32).to(hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A tensor-parallel shard of a decoder-only causal LM (one per rank).

    ``expert_parallel`` (``--enable-expert-parallel``): a mixture of experts' ranks hold whole
    experts instead of a slice of every expert (moe.py).

    Build it with uninitialised weights, then fill them with :func:`tpserve.models.loader.load_model`
    (or call each parameter's ``weight_loader``).
    """

    # checkpoint module name -> (packed module name, shard id passed to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: ModelSpec, tp: TPContext, backend, expert_parallel: bool = False):
        super().__init__()
        check_tp_size(spec, tp.size, expert_parallel)
        self.spec = spec
        self.tp = tp
        self.expert_parallel = expert_parallel
        self.model = DecoderModel(spec, tp, backend, expert_parallel)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            # Same vocabulary split as the embedding, so the shards coincide and can be shared.
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = spec.num_layers
        self.head_dim = spec.head_dim
        self.vocab_size = spec.vocab_size
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads
        # Decode steps through the fused C++ layer ops, once enabled (see fused_decode.py).
        self.fused_decode: FusedDecode | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (flat rows of all sequences) -> hidden ``[T, hidden_size]``.

        Identical on every rank (the last op of each layer is an all-reduce).
        """
        if self.fused_decode is not None and not meta.is_prefill:
            return self.fused_decode(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    def enable_fused_decode(self) -> str | None:
        """Run decode steps through the fused layer ops when the model qualifies (packed weights,
        the cpu attention backend, its KV cache set); returns None, or why it does not."""
        reason = why_not_fused(self)
        self.fused_decode = FusedDecode(self) if reason is None else None
        return reason

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden [S, hidden_size]`` -> logits ``[S, vocab_size]`` in the model's dtype on rank 0,
        None elsewhere. Not widened here: a greedy step only needs their argmax, and the sampler
        and the logprobs widen what they use.

        Every rank must call it (it gathers across the group).
        """
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcap
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def set_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Give layer i its ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads_per_rank,
        head_dim]``, or ``(k_cache, v_cache, k_scale, v_scale)`` for an int8 cache (kernels/kv_quant.py)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"set_kv_caches: got {len(kv_caches)} (k, v) pairs, the model has {self.num_layers} layers")
        for layer, caches in zip(self.model.layers, kv_caches):
            k_cache, v_cache, *scales = caches
            layer.self_attn.k_cache = k_cache
            layer.self_attn.v_cache = v_cache
            layer.self_attn.k_scale, layer.self_attn.v_scale = scales or (None, None)
        if self.fused_decode is not None:
            self.enable_fused_decode()  # its layer stack holds the caches it was built with
