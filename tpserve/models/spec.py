"""From a Hugging Face config to the plain description the decoder is built from.

The supported architectures share one decoder; they differ only in a few switches:

| architecture       | q/k RMSNorm | q/k/v bias          | o_proj bias         | MLP bias     |
|--------------------|-------------|---------------------|---------------------|--------------|
| Qwen3ForCausalLM   | yes         | ``attention_bias``  | ``attention_bias``  | no           |
| LlamaForCausalLM   | no          | ``attention_bias``  | ``attention_bias``  | ``mlp_bias`` |
| Qwen2ForCausalLM   | no          | yes                 | no                  | no           |

and three mixtures of experts, whose layers' MLP is a sparse block of experts (``moe.py``):

| architecture        | attention           | sparse layers             | top-k renormalised | shared expert |
|---------------------|---------------------|---------------------------|--------------------|---------------|
| Qwen3MoeForCausalLM | Qwen3's             | step, ``mlp_only_layers`` | ``norm_topk_prob`` | no            |
| Qwen2MoeForCausalLM | Qwen2's, qkv_bias   | step, ``mlp_only_layers`` | ``norm_topk_prob`` | yes, gated    |
| MixtralForCausalLM  | Llama's, no bias    | all                       | always             | no            |
| GptOssForCausalLM   | gpt-oss's (below)   | all                       | see below          | no            |

(step: layer i is sparse when ``(i + 1) % decoder_sparse_step == 0``.)

and five whose layers differ in how they attend or normalise:

| architecture       | per-layer attention                         | other switches                          |
|--------------------|---------------------------------------------|-----------------------------------------|
| MistralForCausalLM | ``sliding_window`` on every layer           | Llama's layer (Mixtral's window too)    |
| Phi3ForCausalLM    | ``sliding_window`` on every layer           | fused ``qkv_proj`` / ``gate_up_proj``   |
|                    |                                             | checkpoint weights, LongRoPE, partial   |
|                    |                                             | rotary (``partial_rotary_factor``)      |
| SmolLM3ForCausalLM | ``layer_types`` with ``use_sliding_window`` | no rotary where ``no_rope_layers[i]`` 0 |
| Gemma2ForCausalLM  | ``layer_types`` (sliding / full)            | Gemma's layer (below), attention logit  |
|                    |                                             | soft-capping                            |
| Gemma3ForCausalLM  | ``layer_types`` (sliding / full), rotary    | Gemma's layer, (1 + w) q/k RMSNorm      |
|                    | base per type (``rope_local_base_freq``)    |                                         |

Gemma's layer: (1 + w) RMSNorm in float32, a norm on the attention output and around the MLP
(``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``), embeddings scaled by
sqrt(hidden_size) in the model dtype, ``query_pre_attn_scalar ** -0.5`` as the attention scale,
GELU-tanh (``hidden_activation``) and ``final_logit_softcapping`` on the LM head's logits.
``Gemma3ForConditionalGeneration`` checkpoints run as their text tower (``text_config``); the
vision weights are not loaded.

gpt-oss (``GptOssForCausalLM``): q/k/v/o biases (``attention_bias``), a learned sink logit per
head (``self_attn.sinks``), ``layer_types`` sliding / full, YaRN rotary; its router
(``mlp.router``, with a bias) takes the top-k of the logits and a softmax over those k; its
experts have biases and a clamped, sigmoid-gated SwiGLU (``swiglu_alpha``, ``swiglu_limit``:
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``), stored
transposed with gate and up columns interleaved, or as MXFP4 blocks and scales (loader.py).

Every other router is a softmax over the experts followed by top-k; a config asking for another
routing (``scoring_func``, grouped top-k, a routed scaling factor, DeepSeek-style dense first
layers or shared-expert counts) is refused with the field named, never run approximately.

:func:`model_spec` reads the config once, validates it and returns a :class:`ModelSpec`; nothing
below it looks at the Hugging Face config object again.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpserve.models.errors import UnsupportedModelError
from tpserve.models.rotary import SUPPORTED_ROPE_TYPES

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM") + GEMMA_ARCHITECTURES
SUPPORTED_ARCHITECTURES = (("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM") + MOE_ARCHITECTURES
                           + WINDOWED_ARCHITECTURES)
_LAYER_TYPES = ("sliding_attention", "full_attention")
# Sequence-classification checkpoints (--runner pooling's classify): the same decoder, a score
# head (``score.weight``, read by the pooling rank: workers/pooler.py) instead of an LM head.
SEQ_CLS_ARCHITECTURES = {a.replace("ForCausalLM", "ForSequenceClassification"): a
                         for a in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")}
# Routing and expert-layout fields of other MoE families: any value but the neutral one means a
# model tpserve would compute wrongly. (field, accepted values)
_FOREIGN_MOE_FIELDS = (
    ("scoring_func", (None, "softmax")),
    ("topk_method", (None, "greedy")),
    ("router_type", (None, "softmax", "topk")),
    ("n_group", (None, 0, 1)),
    ("topk_group", (None, 0, 1)),
    ("routed_scaling_factor", (None, 1, 1.0)),
    ("moe_layer_freq", (None, 1)),
    ("first_k_dense_replace", (None, 0)),
    ("n_shared_experts", (None, 0)),
    ("num_shared_experts", (None, 0)),
    ("moe_shared_expert_intermediate_size", (None, 0)),
    ("expert_layout", (None,)),
)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the decoder needs, in tpserve's words."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Mixture of experts (num_experts 0: a dense model). Sizes are global (before sharding).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    # Where the checkpoint keeps a layer's sparse block, and the names of one expert's
    # gate, up and down projections.
    moe_module: str = "mlp"
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # The config fields behind num_experts / moe_intermediate_size (for error messages).
    num_experts_field: str = "num_experts"
    moe_intermediate_field: str = "moe_intermediate_size"
    # Top-k weights rounded to the activation dtype before they scale an expert's output
    # (transformers' Qwen routers do; Mixtral's keeps them in fp32).
    round_routing_weights: bool = False
    # A *ForSequenceClassification checkpoint: its ``score.weight`` is the pooler's, not the
    # decoder's (loader.py skips it).
    sequence_classification: bool = False
    # Per-layer attention (empty tuples: every layer full, with rotary).
    sliding_windows: tuple[int | None, ...] = ()  # layer i's window, None for a full layer
    rope_layers: tuple[bool, ...] = ()  # whether layer i applies rotary (SmolLM3)
    local_rope_theta: float | None = None  # sliding layers' rotary base (Gemma 3); None: rope_theta
    local_rope_scaling: dict | None = None
    rotary_dim: int = 0  # rotated features per head (0: head_dim)
    # Layer shape switches (Gemma's: see the module docstring).
    gemma_norms: bool = False  # (1 + w) RMSNorm, post-attention norm on the attention output,
    #                            pre/post-feedforward norms
    hidden_act: str = "silu"  # the MLP's gated activation: "silu" or "gelu_tanh"
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    fused_checkpoint: bool = False  # Phi-3: q/k/v and gate/up stored as one tensor each
    text_tower: bool = False  # a multimodal checkpoint whose language model is under ``language_model``
    # gpt-oss: attention sinks, router and expert biases, top-k then softmax routing, and the
    # experts' clamped SwiGLU ("swiglu_oai", with swiglu_alpha / swiglu_limit; else "silu").
    attn_sinks: bool = False
    fp32_norm_scale: bool = False  # RMSNorm weight applied in float32, one rounding (norm.py)
    router_bias: bool = False
    expert_bias: bool = False
    topk_then_softmax: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window, None when it attends to the whole sequence."""
        return self.sliding_windows[i] if self.sliding_windows else None

    def uses_rope(self, i: int) -> bool:
        return self.rope_layers[i] if self.rope_layers else True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the sparse expert block (as transformers decides)."""
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_sparse_layer(i) for i in range(self.num_layers))


def _rope(config, params: dict | None = None, default_theta: float = 10000.0,
          partial_rotary: bool = False) -> tuple[float, dict | None, float]:
    """``(rope_theta, scaling dict or None, partial_rotary_factor)`` from either config layout.

    Newer transformers keep all in ``rope_parameters`` (Gemma 3: one such dict per layer type,
    passed as ``params``); older configs have a top-level ``rope_theta`` and a ``rope_scaling``
    dict whose type key may be called ``type``. ``partial_rotary``: whether the architecture
    rotates part of a head (else a factor other than 1 is refused).
    """
    if params is None:
        params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", getattr(config, "rope_theta", default_theta))
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", default_theta)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    factor = scaling.pop("partial_rotary_factor", None)
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    factor = 1.0 if factor is None else factor
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise UnsupportedModelError("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    if factor != 1 and not partial_rotary:
        raise UnsupportedModelError("partial_rotary_factor", f"{factor!r} is not supported for this "
                                                             "architecture; must be 1.0")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            "rope_scaling.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope" and "original_max_position_embeddings" not in scaling:
        old = getattr(config, "original_max_position_embeddings", None)
        if old is not None:
            scaling["original_max_position_embeddings"] = old
    return float(theta), (scaling if rope_type != "default" else None), float(factor)


def _positive_int(config, field: str) -> int:
    value = getattr(config, field, None)
    if not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(field, f"must be a positive integer, got {value!r}")
    return value


def _moe_fields(config, arch: str, num_layers: int) -> dict:
    """The ModelSpec fields of a mixture of experts (validated), or {} for a dense model."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    for field, accepted in _FOREIGN_MOE_FIELDS:
        value = getattr(config, field, None)
        if value not in accepted:
            raise UnsupportedModelError(
                field, f"{value!r} is not supported: tpserve routes with a softmax over the experts "
                       f"and top-k; accepted: {', '.join(repr(a) for a in accepted)}")
    mixtral = arch == "MixtralForCausalLM"
    gpt_oss = arch == "GptOssForCausalLM"
    experts_field = "num_local_experts" if mixtral or gpt_oss else "num_experts"
    inter_field = "intermediate_size" if mixtral or gpt_oss else "moe_intermediate_size"
    experts = _positive_int(config, experts_field)
    top_k = _positive_int(config, "num_experts_per_tok")
    if top_k > experts:
        raise UnsupportedModelError(
            "num_experts_per_tok", f"{top_k} is more than the {experts} experts ({experts_field})")
    fields = dict(num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=_positive_int(config, inter_field),
                  num_experts_field=experts_field, moe_intermediate_field=inter_field)
    if mixtral:  # its sliding_window, as Mistral's: _windows
        return dict(fields, norm_topk_prob=True, moe_module="block_sparse_moe",
                    expert_proj_names=("w1", "w3", "w2"))
    if gpt_oss:
        # Its softmax runs in the logits' dtype: the weights scale the experts in that dtype.
        return dict(fields, router_bias=True, expert_bias=True, topk_then_softmax=True,
                    round_routing_weights=True, expert_act="swiglu_oai",
                    swiglu_alpha=_positive_number(config, "swiglu_alpha", 1.702),
                    swiglu_limit=_positive_number(config, "swiglu_limit", 7.0))
    norm = getattr(config, "norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise UnsupportedModelError("norm_topk_prob", f"must be true or false, got {norm!r}")
    step = _positive_int(config, "decoder_sparse_step")
    dense = getattr(config, "mlp_only_layers", None) or []
    if not isinstance(dense, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise UnsupportedModelError(
            "mlp_only_layers", f"must be a list of layer indices in [0, {num_layers}), got {dense!r}")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = _positive_int(config, "shared_expert_intermediate_size")
    elif getattr(config, "shared_expert_intermediate_size", None):
        raise UnsupportedModelError(
            "shared_expert_intermediate_size", f"{arch} has no shared expert; must be unset or 0")
    return dict(fields, norm_topk_prob=norm, decoder_sparse_step=step,
                mlp_only_layers=tuple(sorted(set(dense))), shared_expert_intermediate_size=shared,
                round_routing_weights=True)


def _positive_number(config, field: str, default: float | None = None) -> float:
    value = getattr(config, field, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise UnsupportedModelError(field, f"must be a positive number, got {value!r}")
    return float(value)


def _optional_cap(config, field: str) -> float | None:
    return None if getattr(config, field, None) is None else _positive_number(config, field)


def _layer_types(config, num_layers: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    if (not isinstance(types, (list, tuple)) or len(types) != num_layers
            or any(t not in _LAYER_TYPES for t in types)):
        raise UnsupportedModelError(
            "layer_types", f"must list {num_layers} entries (num_hidden_layers), each one of "
                           f"{', '.join(_LAYER_TYPES)}; got {types!r}")
    return list(types)


def _windows(config, arch: str, num_layers: int, max_pos: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers decides per arch."""
    window = getattr(config, "sliding_window", None)
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        # Every layer slides (transformers' Mistral, Mixtral and Phi-3 have no per-layer types).
        types = getattr(config, "layer_types", None)
        if window is not None and types is not None and any(t != "sliding_attention" for t in types):
            raise UnsupportedModelError(
                "layer_types", f"{arch} slides every layer; a full_attention entry is not supported")
        if window is None:
            return ()
        window = _positive_int(config, "sliding_window")
        # A window as long as the longest sequence never drops a key.
        return () if window >= max_pos else (window,) * num_layers
    if arch == "SmolLM3ForCausalLM":
        if not getattr(config, "use_sliding_window", False) or window is None:
            return ()
        types = _layer_types(config, num_layers)
    elif arch in GEMMA_ARCHITECTURES or arch == "GptOssForCausalLM":
        types = _layer_types(config, num_layers)
    else:
        return ()
    if "sliding_attention" not in types:
        return ()
    window = _positive_int(config, "sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope_layers(config, arch: str, num_layers: int) -> tuple[bool, ...]:
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = getattr(config, "no_rope_layers", None)
    if (not isinstance(flags, (list, tuple)) or len(flags) != num_layers
            or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise UnsupportedModelError(
            "no_rope_layers", f"must list {num_layers} flags (num_hidden_layers), 1 where a layer "
                              f"uses rotary and 0 where not; got {flags!r}")
    return () if all(flags) else tuple(bool(f) for f in flags)


def _gemma_fields(config, arch: str) -> dict:
    """The Gemma 2 / Gemma 3 switches, validated."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    act = getattr(config, "hidden_activation", None)
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError("hidden_activation",
                                    f"{act!r} is not supported; supported: 'gelu_pytorch_tanh'")
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedModelError("use_bidirectional_attention",
                                    "bidirectional attention is not supported; must be false")
    attn_cap = _optional_cap(config, "attn_logit_softcapping")
    if attn_cap is not None and arch != "Gemma2ForCausalLM":
        # transformers' Gemma 3 attention never applies it: refused rather than guessed.
        raise UnsupportedModelError("attn_logit_softcapping", f"{arch} does not soft-cap attention logits; "
                                                              "must be null")
    return dict(gemma_norms=True, hidden_act="gelu_tanh", embedding_scale=True,
                attn_scale=_positive_number(config, "query_pre_attn_scalar") ** -0.5,
                attn_logit_softcap=attn_cap,
                final_logit_softcap=_optional_cap(config, "final_logit_softcapping"))


def model_spec(config) -> ModelSpec:
    """Validate a transformers ``PretrainedConfig`` and describe the model it defines.

    Raises UnsupportedModelError naming the config field for anything tpserve cannot run.
    """
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    seq_cls = arch is None and any(a in SEQ_CLS_ARCHITECTURES for a in archs)
    if seq_cls:
        arch = SEQ_CLS_ARCHITECTURES[next(a for a in archs if a in SEQ_CLS_ARCHITECTURES)]
    if arch is None:
        raise UnsupportedModelError(
            "architectures", f"{archs!r} names no supported architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    outer = config
    text_tower = arch == "Gemma3ForConditionalGeneration"
    if text_tower:  # the language model's own config; its vision tower is not run
        config = getattr(config, "text_config", None)
        if config is None:
            raise UnsupportedModelError("text_config", f"{arch} needs a text_config")
    if arch not in GEMMA_ARCHITECTURES:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError("hidden_act", f"{act!r} is not supported; supported: 'silu'")
    if arch not in ("SmolLM3ForCausalLM",) and getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError("use_sliding_window", "sliding-window attention is not supported; must be false")

    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if heads % kv_heads:
        raise UnsupportedModelError(
            "num_key_value_heads", f"{kv_heads} must divide num_attention_heads={heads}")
    if head_dim % 2:
        raise UnsupportedModelError("head_dim", f"must be even for rotary embedding, got {head_dim}")
    local_theta = local_scaling = None
    params = getattr(config, "rope_parameters", None)
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        by_type = params if isinstance(params, dict) and "full_attention" in params else {}
        theta, scaling, _ = _rope(config, by_type.get("full_attention") or None, 1_000_000.0)
        if by_type.get("sliding_attention"):
            local_theta, local_scaling, _ = _rope(config, by_type["sliding_attention"])
        else:
            local_theta = float(getattr(config, "rope_local_base_freq", 10000.0))
        rotary_factor = 1.0
    else:
        default_theta = 150000.0 if arch == "GptOssForCausalLM" else 10000.0
        theta, scaling, rotary_factor = _rope(config, default_theta=default_theta,
                                              partial_rotary=arch == "Phi3ForCausalLM")
    rotary_dim = int(head_dim * rotary_factor)
    if rotary_dim % 2 or rotary_dim < 2:
        raise UnsupportedModelError("partial_rotary_factor",
                                    f"head_dim {head_dim} x {rotary_factor} must "
                                    f"give an even rotary dimension, got {rotary_dim}")
    attention_bias = bool(getattr(config, "attention_bias", False))
    num_layers = _positive_int(config, "num_hidden_layers")
    max_pos = _positive_int(config, "max_position_embeddings")
    moe = _moe_fields(config, arch, num_layers)
    qwen3_like = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    elif arch == "Qwen2MoeForCausalLM":
        qkv_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
    elif arch in ("MixtralForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"):
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = attention_bias
    dense_needed = not moe or any(
        i in moe.get("mlp_only_layers", ()) or (i + 1) % moe.get("decoder_sparse_step", 1)
        for i in range(num_layers))
    tied = getattr(outer, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(config, "tie_word_embeddings", False)
    return ModelSpec(
        architecture=arch,
        vocab_size=_positive_int(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=(_positive_int(config, "intermediate_size") if dense_needed
                           else getattr(config, "intermediate_size", 0) or 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        max_position=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
        # A classifier has no LM head: the (never computed) head shares the embedding.
        tie_word_embeddings=seq_cls or bool(tied),
        sequence_classification=seq_cls,
        qk_norm=qwen3_like or arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=(bool(getattr(config, "mlp_bias", False))
                  if arch in ("LlamaForCausalLM", "SmolLM3ForCausalLM") else False),
        sliding_windows=_windows(config, arch, num_layers, max_pos),
        rope_layers=_rope_layers(config, arch, num_layers),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        fused_checkpoint=arch == "Phi3ForCausalLM",
        text_tower=text_tower,
        attn_sinks=arch == "GptOssForCausalLM",
        fp32_norm_scale=arch == "GptOssForCausalLM",
        **_gemma_fields(config, arch),
        **moe,
    )


def check_tp_size(spec: ModelSpec, tp_size: int, expert_parallel: bool = False) -> None:
    """Raise UnsupportedModelError if the model cannot be split across ``tp_size`` ranks.

    Experts are split along their intermediate size (every rank holds a slice of every expert),
    or with ``expert_parallel`` (``--enable-expert-parallel``) whole experts per rank."""
    if spec.num_heads % tp_size:
        raise UnsupportedModelError(
            "num_attention_heads", f"{spec.num_heads} is not divisible by tensor_parallel_size={tp_size}")
    kv = spec.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise UnsupportedModelError(
            "num_key_value_heads",
            f"{kv} and tensor_parallel_size={tp_size}: one must be a multiple of the other")
    if spec.has_dense_layers and spec.intermediate_size % tp_size:
        raise UnsupportedModelError(
            "intermediate_size", f"{spec.intermediate_size} is not divisible by tensor_parallel_size={tp_size}")
    if not spec.is_moe:
        return
    if expert_parallel:
        if spec.num_experts % tp_size:
            raise UnsupportedModelError(
                spec.num_experts_field, f"{spec.num_experts} experts cannot be split evenly across "
                                        f"tensor_parallel_size={tp_size} ranks (enable_expert_parallel)")
    elif spec.moe_intermediate_size % tp_size:
        raise UnsupportedModelError(
            spec.moe_intermediate_field, f"{spec.moe_intermediate_size} is not divisible by "
                                         f"tensor_parallel_size={tp_size} (or pass enable_expert_parallel)")
    if spec.shared_expert_intermediate_size % tp_size:
        raise UnsupportedModelError(
            "shared_expert_intermediate_size", f"{spec.shared_expert_intermediate_size} is not divisible by "
                                               f"tensor_parallel_size={tp_size}")
