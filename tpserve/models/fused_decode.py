"""A decode step through the C++ fused layer ops: two calls per layer instead of ~45 operators.

At batch 1 a small model's decode step was more Python dispatch than arithmetic (the 40M
benchmark model: ~400 operator calls per step, ~2 ms of a 7 ms step). ``decode_attention``
runs a layer's norm, QKV projection, q/k norms, rotary, KV store, paged attention and o_proj in
one call, ``decode_mlp`` the norm, gate/up, SiLU-and-mul and down projection in another
(``tpserve/kernels/csrc/cpu_ops.cpp``). They call the very functions the module path calls, in
the same order, so the logits are bit-identical to it (tests/test_fused_decode.py). With tensor
parallelism the all-reduce of each half stays here, in Python, between the calls. Without it the
whole stack, embedding and final norm included, is one call of a ``DecodeStack`` built once with every layer's
weights and KV cache (16 op calls fewer per step at 8 layers: each costs 5-9 us of argument
conversion, against a ~3 ms step of the 40M model; 4% of that step, measured in one process
alternating the two).

Mixture-of-experts layers (moe.py's SparseMoeBlock) take the same two halves: the MLP half runs
the norm, the router, the C++ routing (softmax, top-k, renormalisation), the shared expert and
its sigmoid gate (Qwen2-MoE) and the grouped experts (``moe_ops.cpp``) in the one call; the
module path on packed experts calls the same functions, so the bits are the same. Under tensor
parallelism a MoE layer's half is the stack object's ``mlp`` method (its experts' views are
built once with the stack), and the all-reduce stays here between the calls, as for dense layers.

An int8 KV cache (``--kv-cache-dtype int8``) goes to the attention half with its scales: the
key and value heads are quantized into their slots as the module path's store quantizes them,
and the decode path reads the int8 codes (the same functions, so the same bits).

A layer's sliding window, attention sinks and logit soft-cap (``SelfAttention``'s options) go to
its attention half: the C++ decode path reads only the keys of each row's window, as the module
path's CpuAttention does (the same function, so the same bits). With several KV-cache groups
(sliding and full layers: ``workers/kv_group_runner.py``) each layer reads its group's block
tables and slot mapping (``meta.groups``).

Gemma's layers (Gemma 2 and 3) run in the stack too: its (1 + w) norms, the post-attention and
post-feedforward norms, GELU-tanh and the embedding scale (applied here, as the module path
does), the C++ functions of the module path in its order, so the same bits. Under tensor
parallelism the halves' ops leave their outputs unnormalised (``gemma=True``) and the post-norms
run here after each all-reduce, as the module path orders them.

Layers without rotary (SmolLM3's no-rope layers, ``rotary.NoRotary``) hand the ops cos/sin tables
without rows, which skip the rotation.

Group-quantized layers (``group_quant.py``: 4/8-bit codes) are packed weights of kinds 4 and 5,
which the C++ ``linear_into`` runs through ``quant_ops.cpp``: the stack takes them unchanged.

It takes pure decode steps (``meta.is_prefill`` False) of a model whose every layer is packed
(``prepack_model``; a MoE layer's experts, router and shared expert too), with the C++ attention
backend, fp32 or bf16, head_dim % 16 == 0 and its KV cache set; :func:`why_not_fused` says why a
model does not qualify, and the model then runs its modules as before. The plan's block tables
are checked once per step, before the first layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpserve.kernels import cpu_extension

if TYPE_CHECKING:
    from tpserve.kernels.metadata import AttentionMetadata
    from tpserve.models.decoder import CausalLM


def _linear_args(layer, bias: bool = True) -> tuple:
    p = layer.packed
    return (p.data, p.kind, p.scales, p.colsum, layer.bias if bias else None)


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _moe_linears(block) -> list:
    """The linear layers of a sparse block the fused path reads packed."""
    layers = [block.gate]
    if block.shared_expert is not None:
        layers += [block.shared_expert.gate_up_proj, block.shared_expert.down_proj]
        if block.shared_expert_gate is not None:
            layers.append(block.shared_expert_gate)
    return layers


def why_not_fused(model: CausalLM) -> str | None:
    """None if :class:`FusedDecode` can run ``model``'s decode steps, else the reason."""
    from tpserve.kernels.cpu_attention import CpuAttention
    if model.device.type != "cpu" or not cpu_extension.available():
        return "needs a CPU model and the C++ operators"
    if model.dtype not in (torch.float32, torch.bfloat16) or model.head_dim % 16:
        return "needs fp32/bf16 and head_dim % 16 == 0"
    spec = model.spec
    llama = not spec.gemma_norms and spec.hidden_act == "silu" and not spec.embedding_scale
    gemma = spec.gemma_norms and spec.hidden_act == "gelu_tanh"
    if spec.rotary_dim or not (llama or gemma):
        return "needs Llama- or Gemma-shaped layers (SiLU, or Gemma's norms and GELU; whole rotary or none)"
    if spec.router_bias or spec.topk_then_softmax or spec.expert_bias or spec.expert_act != "silu":
        return ("needs softmax-then-top-k routing without a router bias and SiLU experts without "
                "biases (not gpt-oss's)")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.feed_forward
        if not isinstance(getattr(attn.backend, "inner", attn.backend), CpuAttention):
            return "needs the cpu attention backend"
        if attn.k_cache is None:
            return "needs the KV cache"
        linears = [attn.qkv_proj, attn.o_proj]
        if _is_moe(mlp):
            if mlp.experts.packed is None:
                return "needs every layer's experts packed (prepack_model)"
            linears += _moe_linears(mlp)
        else:
            linears += [mlp.gate_up_proj, mlp.down_proj]
        if any(m.packed is None for m in linears):
            return "needs every linear layer packed (prepack_model)"
    return None


def _group_of(attn) -> int:
    """The KV-cache group a layer reads (its GroupBackend's; 0 without groups)."""
    return getattr(attn.backend, "group", 0)


def _attention_options(attn) -> tuple:
    """A layer's window (0: none), sinks (float32 [heads] or None) and soft-cap (0: none), as the
    C++ attention takes them."""
    sinks = None if attn.sinks is None else attn.sinks.detach().to(torch.float32).contiguous()
    return (attn.sliding_window or 0, sinks, attn.logit_softcap or 0.0)


class MoeArgs(tuple):
    """A sparse layer's arguments of ``DecodeStack.add_moe_layer`` after the attention half's
    (in place of a dense layer's ``decode_mlp`` arguments)."""


class FusedDecode:
    """Runs a packed model's decode steps with the fused layer ops (see the module docstring).

    The per-layer arguments that do not change between steps (weights, norms, sizes) are
    gathered once here; a step passes only its hidden states and metadata.
    """

    def __init__(self, model: CausalLM):
        reason = why_not_fused(model)
        if reason is not None:
            raise ValueError(f"fused decode: {reason}")
        self.model = model
        self.tp = model.tp
        self.layers = []
        self.gemma = model.spec.gemma_norms
        self.groups = [_group_of(layer.self_attn) for layer in model.model.layers]
        # Per KV-cache group, the window whose blocks every step must hold (0: a layer of the
        # group reads every key): the layer-by-layer path checks each group's tables with it.
        self.group_windows: dict[int, int] = {}
        for g, layer in zip(self.groups, model.model.layers):
            w, seen = layer.self_attn.sliding_window or 0, self.group_windows.get(g)
            self.group_windows[g] = w if seen is None else (0 if 0 in (w, seen) else max(w, seen))
        first = self.tp.rank == 0  # a row-parallel bias is added once, on rank 0
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.feed_forward
            attn_args = (layer.input_layernorm.weight, layer.input_layernorm.eps,
                         a.q_norm.weight if a.q_norm is not None else None,
                         a.k_norm.weight if a.k_norm is not None else None,
                         a.num_heads, a.num_kv_heads, a.head_dim, a.rotary.cos, a.rotary.sin, a.scale,
                         *_linear_args(a.qkv_proj), *_linear_args(a.o_proj, first), *_attention_options(a))
            # Gemma: the MLP half's norm (with the residual) is pre_feedforward_layernorm.
            mlp_norm = layer.pre_feedforward_layernorm if self.gemma else layer.post_attention_layernorm
            post = (mlp_norm.weight, mlp_norm.eps)
            if _is_moe(mlp):
                mlp_args = MoeArgs((*post, *_moe_args(mlp, first)))
            else:
                mlp_args = (*post, mlp.gate_up_proj.output_size_per_rank // 2,
                            *_linear_args(mlp.gate_up_proj), *_linear_args(mlp.down_proj, first))
            self.layers.append((a, attn_args, mlp_args))
        # Without tensor parallelism the whole stack is one C++ call (DecodeStack in cpu_ops.cpp):
        # nothing happens between the layer halves, and each op call costs microseconds of
        # argument conversion. It holds the KV cache tensors: CausalLM.set_kv_caches builds a
        # new FusedDecode. With tensor parallelism a model with MoE layers builds it too: their
        # MLP halves are its `mlp` calls (the experts' per-expert views are made once, here).
        has_moe = any(isinstance(mlp_args, MoeArgs) for *_, mlp_args in self.layers)
        self.layer_stack = self._build_stack() if self.tp.size == 1 or has_moe else None
        self.stack = self.layer_stack if self.tp.size == 1 else None

    def _build_stack(self):
        stack = torch.classes.tpserve_cpu.DecodeStack()
        for i, (a, attn_args, mlp_args) in enumerate(self.layers):
            (ln_w, eps, q_norm, k_norm, heads, kv_heads, head_dim, cos, sin, scale,
             qd, qk, qs, qc, qb, od, ok, os_, oc, ob, window, sinks, softcap) = attn_args
            attention = (a.k_cache, a.v_cache, ln_w, eps, q_norm, k_norm, heads, kv_heads, head_dim,
                         cos, sin, scale, [qd, qs, qc, qb], [qk, ok], [od, os_, oc, ob])
            if isinstance(mlp_args, MoeArgs):
                stack.add_moe_layer(*attention, *mlp_args)
            else:
                post_w, post_eps, inter, gd, gk, gs, gc, gb, dd, dk, ds, dc, db = mlp_args
                stack.add_layer(*attention, post_w, post_eps, inter, [gd, gs, gc, gb], [gk, dk],
                                [dd, ds, dc, db])
            if window or sinks is not None or softcap:
                stack.set_attention_options(i, window, sinks, softcap)
            if a.k_scale is not None:
                stack.set_kv_scales(i, a.k_scale, a.v_scale)
            if self.gemma:
                layer = self.model.model.layers[i]
                stack.set_gemma(i, layer.post_attention_layernorm.weight,
                                layer.post_feedforward_layernorm.weight)
            if self.groups[i]:
                stack.set_group(i, self.groups[i])
        norm = self.model.model.norm
        (stack.set_gemma_norm if self.gemma else stack.set_norm)(norm.weight, norm.eps)
        if not self._embeds_here():  # else `run_groups` takes the rows, embedded here
            stack.set_embedding(self.model.model.embed_tokens.weight)
        return stack

    def _embeds_here(self) -> bool:
        """Whether a step's rows are embedded here (``DecoderModel.embed``) rather than in the
        stack: a table of codes (a tied head's), or Gemma's scaled embedding."""
        return self.model.model.embed_tokens.reads_codes or self.model.model.embedding_scale is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        ops = torch.ops.tpserve_cpu
        if self.stack is not None:
            metas = getattr(meta, "groups", None) or [meta]
            ids = self.model.model.embed(input_ids) if self._embeds_here() else input_ids
            return self.stack.run_groups(ids, positions, [m.slot_mapping for m in metas],
                                         [m.block_tables for m in metas], meta.cu_seqlens_q,
                                         meta.context_lens)
        metas = getattr(meta, "groups", None) or [meta]
        a0 = self.layers[0][0]
        for g, window in self.group_windows.items():
            ops.check_block_tables(metas[g].block_tables, meta.cu_seqlens_q, meta.context_lens,
                                   a0.k_cache.shape[0], a0.k_cache.shape[1], window)
        hidden = self.model.model.embed(input_ids)
        residual = torch.empty_like(hidden)
        other = torch.empty_like(hidden)
        layers = self.model.model.layers
        for i, (attn, attn_args, mlp_args) in enumerate(self.layers):
            m = metas[self.groups[i]]
            ops.decode_attention(other, residual, hidden, i > 0, positions, attn.k_cache, attn.v_cache,
                                 m.slot_mapping, m.block_tables, meta.context_lens, *attn_args,
                                 k_scale=attn.k_scale, v_scale=attn.v_scale, gemma=self.gemma)
            self.tp.all_reduce(other)
            if self.gemma:  # the post-norms of the summed halves (the ops leave them to us)
                other = layers[i].post_attention_layernorm(other)
            if isinstance(mlp_args, MoeArgs):
                self.layer_stack.mlp(i, hidden, residual, other)
            else:
                ops.decode_mlp(hidden, residual, other, *mlp_args, gemma=self.gemma)
            self.tp.all_reduce(hidden)
            if self.gemma:
                hidden = layers[i].post_feedforward_layernorm(hidden)
        hidden, _ = self.model.model.norm(hidden, residual)
        return hidden


def _moe_args(block, first: bool) -> tuple:
    """A sparse block's arguments of ``DecodeStack.add_moe_layer`` after the post-attention norm."""
    gate = block.gate.packed
    experts = block.experts.packed
    round_weights = bool(getattr(block, "round_weights", False))
    router_ints = [gate.kind, gate.n, block.top_k, int(block.renormalize), int(round_weights)]
    router = [gate.data, gate.scales, gate.colsum, None]
    args = experts.stack_args()
    expert_tensors = [args[0], args[2], args[3], None, args[4], args[6], args[7], None]
    expert_ints = [args[1], args[5], *args[8:]]
    shared_gate_up, shared_down, shared_gate, shared_ints = [], [], [], []
    if block.shared_expert is not None:
        se = block.shared_expert
        shared_gate_up = list(_linear_args(se.gate_up_proj))
        shared_down = list(_linear_args(se.down_proj, first))
        kinds = [shared_gate_up.pop(1), shared_down.pop(1)]
        gate_kind = 0
        if block.shared_expert_gate is not None:
            shared_gate = list(_linear_args(block.shared_expert_gate))
            gate_kind = shared_gate.pop(1)
        shared_ints = [*kinds, gate_kind, se.gate_up_proj.output_size_per_rank // 2]
    return (router, router_ints, expert_tensors, expert_ints, shared_gate_up, shared_down, shared_gate,
            shared_ints)
