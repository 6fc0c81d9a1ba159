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

(step: layer i is sparse when ``(i + 1) % decoder_sparse_step == 0``.)

Every router is a softmax over the experts followed by top-k; a config asking for another
routing (``scoring_func``, grouped top-k, a routed scaling factor, DeepSeek-style dense first
layers or shared-expert counts) is refused with the field named, never run approximately.

:func:`model_spec` reads the config once, validates it and returns a :class:`ModelSpec`; nothing
below it looks at the Hugging Face config object again.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpserve.models.errors import UnsupportedModelError
from tpserve.models.rotary import SUPPORTED_ROPE_TYPES

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM") + MOE_ARCHITECTURES
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


def _rope(config) -> tuple[float, dict | None]:
    """``(rope_theta, scaling dict or None)`` from either config layout.

    Newer transformers keep both in ``rope_parameters``; older configs have a top-level
    ``rope_theta`` and a ``rope_scaling`` dict whose type key may be called ``type``.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", 10000.0)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            "rope_scaling.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return float(theta), (scaling if rope_type != "default" else None)


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
    experts_field = "num_local_experts" if mixtral else "num_experts"
    inter_field = "intermediate_size" if mixtral else "moe_intermediate_size"
    experts = _positive_int(config, experts_field)
    top_k = _positive_int(config, "num_experts_per_tok")
    if top_k > experts:
        raise UnsupportedModelError(
            "num_experts_per_tok", f"{top_k} is more than the {experts} experts ({experts_field})")
    fields = dict(num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=_positive_int(config, inter_field),
                  num_experts_field=experts_field, moe_intermediate_field=inter_field)
    if mixtral:
        window = getattr(config, "sliding_window", None)
        max_pos = getattr(config, "max_position_embeddings", None)
        covers_all = isinstance(window, int) and isinstance(max_pos, int) and window >= max_pos
        if window is not None and not covers_all:
            raise UnsupportedModelError(
                "sliding_window", f"sliding-window attention is not supported: must be null or at least "
                                  f"max_position_embeddings={max_pos}, got {window!r}")
        return dict(fields, norm_topk_prob=True, moe_module="block_sparse_moe",
                    expert_proj_names=("w1", "w3", "w2"))
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
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError("hidden_act", f"{act!r} is not supported; supported: 'silu'")
    if getattr(config, "use_sliding_window", False):
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
    theta, scaling = _rope(config)
    attention_bias = bool(getattr(config, "attention_bias", False))
    num_layers = _positive_int(config, "num_hidden_layers")
    moe = _moe_fields(config, arch, num_layers)
    qwen3_like = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    elif arch == "Qwen2MoeForCausalLM":
        qkv_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
    elif arch == "MixtralForCausalLM":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = attention_bias
    dense_needed = not moe or any(
        i in moe.get("mlp_only_layers", ()) or (i + 1) % moe.get("decoder_sparse_step", 1)
        for i in range(num_layers))
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
        max_position=_positive_int(config, "max_position_embeddings"),
        rope_theta=theta,
        rope_scaling=scaling,
        # A classifier has no LM head: the (never computed) head shares the embedding.
        tie_word_embeddings=seq_cls or bool(getattr(config, "tie_word_embeddings", False)),
        sequence_classification=seq_cls,
        qk_norm=qwen3_like,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
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
