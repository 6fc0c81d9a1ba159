"""From a Hugging Face config to the plain description the decoder is built from.

The supported architectures share one decoder; they differ only in a few switches:

| architecture       | q/k RMSNorm | q/k/v bias          | o_proj bias         | MLP bias     |
|--------------------|-------------|---------------------|---------------------|--------------|
| Qwen3ForCausalLM   | yes         | ``attention_bias``  | ``attention_bias``  | no           |
| LlamaForCausalLM   | no          | ``attention_bias``  | ``attention_bias``  | ``mlp_bias`` |
| Qwen2ForCausalLM   | no          | yes                 | no                  | no           |

:func:`model_spec` reads the config once, validates it and returns a :class:`ModelSpec`; nothing
below it looks at the Hugging Face config object again.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpserve.models.errors import UnsupportedModelError
from tpserve.models.rotary import SUPPORTED_ROPE_TYPES

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")


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


def model_spec(config) -> ModelSpec:
    """Validate a transformers ``PretrainedConfig`` and describe the model it defines.

    Raises UnsupportedModelError naming the config field for anything tpserve cannot run.
    """
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
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
    return ModelSpec(
        architecture=arch,
        vocab_size=_positive_int(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(config, "intermediate_size"),
        num_layers=_positive_int(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        max_position=_positive_int(config, "max_position_embeddings"),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
    )


def check_tp_size(spec: ModelSpec, tp_size: int) -> None:
    """Raise UnsupportedModelError if the model cannot be split across ``tp_size`` ranks."""
    if spec.num_heads % tp_size:
        raise UnsupportedModelError(
            "num_attention_heads", f"{spec.num_heads} is not divisible by tensor_parallel_size={tp_size}")
    kv = spec.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise UnsupportedModelError(
            "num_key_value_heads",
            f"{kv} and tensor_parallel_size={tp_size}: one must be a multiple of the other")
    if spec.intermediate_size % tp_size:
        raise UnsupportedModelError(
            "intermediate_size", f"{spec.intermediate_size} is not divisible by tensor_parallel_size={tp_size}")
