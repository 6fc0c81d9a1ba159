"""A GGUF file's metadata as the Hugging Face config.json and generation_config.json it means.

llama.cpp writes a model's hyperparameters as ``<arch>.<field>`` keys (``llama.block_count``,
``qwen3.attention.head_count_kv``, ...). They map onto the transformers config that the same
model has as a safetensors checkpoint, which ``tpserve/models/spec.py`` then validates like any
other (so a GGUF model runs exactly where its safetensors twin runs):

| general.architecture | Hugging Face architecture                                   |
|----------------------|-------------------------------------------------------------|
| llama                | LlamaForCausalLM (MixtralForCausalLM with ``expert_count``) |
| qwen2                | Qwen2ForCausalLM                                            |
| qwen3                | Qwen3ForCausalLM                                            |
| qwen2moe             | Qwen2MoeForCausalLM                                         |
| qwen3moe             | Qwen3MoeForCausalLM                                         |
| gemma2               | Gemma2ForCausalLM                                           |
| gemma3               | Gemma3ForCausalLM (text; a vision tower is a file apart)    |
| phi3                 | Phi3ForCausalLM (Phi-3, Phi-4; fused q/k/v and gate/up)     |
| smollm3              | SmolLM3ForCausalLM (no rotary in every fourth layer)        |
| gpt-oss              | GptOssForCausalLM (MXFP4 experts, sinks, YaRN)              |

Gemma's hyperparameters that llama.cpp does not write are set as llama.cpp sets them: every
sixth layer global in Gemma 3 and every second in Gemma 2 (unless the file has
``attention.sliding_window_pattern``), a sliding layers' rope base of 10,000 in Gemma 3 (unless
``rope.freq_base_swa``), and queries scaled by the key length, or by ``embedding_length /
head_count`` for the 27B models (62 layers in Gemma 3, 46 in Gemma 2), as Gemma's own configs
have it (``query_pre_attn_scalar``); Gemma 2's soft-caps default to 50 (attention) and 30
(final logits).

gpt-oss's file holds its experts stacked (``ffn_{gate,up,down}_exps``, MXFP4 in llama.cpp's
files, with their biases), a sink logit per head (``attn_sinks``) and the router's bias; the
window is on every other layer from the first, YaRN's betas default to 32 and 1 (not
truncated, as gpt-oss's own config has it) and the SwiGLU clamp is gpt-oss's 7.

Phi-3's file keeps q/k/v and gate/up fused (``attn_qkv``, ``ffn_up``: the names map split
them), its partial rotary (``rope.dimension_count`` below the head size: Phi-4-mini), its
``attention.sliding_window``, which becomes the config's window on every layer, as in the
model's own config, and its LongRoPE (Phi-3.5, Phi-4-mini): the ``rope_factors_long`` /
``rope_factors_short`` tensors' values, ``rope.scaling.original_context_length`` and
``rope.scaling.attn_factor``.

Anything the decoder could not reproduce is refused with the key named: other architectures,
per-layer head counts, partial rotary other than Phi-3's, key and value sizes that differ, a
rope scaling type the rotary embedding lacks, and llama.cpp's ``rope_freqs`` tensor (Llama 3's
scaling stored as per-frequency factors, not parameters).
"""
from __future__ import annotations

import numpy as np

from tpserve.gguf_file.reader import FLOAT_TYPES, GGUFFileError, TensorEntry

ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# SmolLM3: one layer in this many without rotary (llama.cpp's default)
SMOLLM3_NO_ROPE_INTERVAL = 4
# Gemma: one global layer per this many (llama.cpp's default), and the layer count of the 27B
# models, which scale queries by embedding_length / head_count instead of the key length.
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
MIXTRAL = ("mixtral", "MixtralForCausalLM")


def _int(meta: dict, key: str, default=None, *, where: str) -> int:
    value = meta.get(key, default)
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array that is the same for every layer
        else:
            raise GGUFFileError(f"{where}: metadata key {key!r}: per-layer values {value[:8]} are not "
                                "supported (every layer must have the same)")
    if value is None:
        raise GGUFFileError(f"{where}: metadata key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFFileError(f"{where}: metadata key {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _float(meta: dict, key: str, default: float, *, where: str) -> float:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFFileError(f"{where}: metadata key {key!r} must be a number, got {value!r}")
    return float(value)


def _rope_scaling(meta: dict, arch: str, where: str) -> dict | None:
    """The config's rope_scaling: none, linear, or in a gpt-oss file YaRN (betas 32 / 1 unless the
    file says, not truncated: gpt-oss's own config)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if arch == "gpt-oss":
        if kind is None:
            return None
        if kind != "yarn":
            raise GGUFFileError(f"{where}: metadata key '{arch}.rope.scaling.type': {kind!r} is not "
                                "supported (supported: yarn)")
        return {"rope_type": "yarn",
                "factor": _float(meta, f"{arch}.rope.scaling.factor", 32.0, where=where),
                "original_max_position_embeddings": _int(meta, f"{arch}.rope.scaling.original_context_length",
                                                         4096, where=where),
                "beta_fast": _float(meta, f"{arch}.rope.scaling.yarn_beta_fast", 32.0, where=where),
                "beta_slow": _float(meta, f"{arch}.rope.scaling.yarn_beta_slow", 1.0, where=where),
                "truncate": False}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") and factor in (None, 0, 0.0, 1, 1.0):
        return None
    if kind == "linear" or (kind is None and factor is not None):
        factor = _float(meta, f"{arch}.rope.scaling.factor", 1.0, where=where)
        return {"rope_type": "linear", "factor": factor}
    raise GGUFFileError(f"{where}: metadata key '{arch}.rope.scaling.type': {kind!r} is not supported "
                        "(supported: none, linear)")


def hf_config(meta: dict, tensors: list[TensorEntry], where: str) -> tuple[dict, dict]:
    """``(config.json, generation_config.json)`` contents for the model whose metadata is
    ``meta`` (key -> plain value) and whose tensors (of every split part) are ``tensors``.
    ``where`` names the file in errors."""
    arch = meta.get("general.architecture")
    by_name = {t.name: t for t in tensors}
    experts = meta.get(f"{arch}.expert_count") or 0
    if arch == "llama" and experts:
        model_type, hf_arch = MIXTRAL
    elif arch in ARCHITECTURES:
        model_type, hf_arch = ARCHITECTURES[arch]
    else:
        raise GGUFFileError(f"{where}: metadata key 'general.architecture': {arch!r} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)} (and Mixtral as llama with experts)")
    if "rope_freqs.weight" in by_name:
        raise GGUFFileError(f"{where}: tensor 'rope_freqs.weight' (per-frequency rope factors, Llama 3 "
                            "style scaling) is not supported")
    longrope = [by_name.get(f"rope_factors_{kind}.weight") for kind in ("long", "short")]
    if any(longrope) and (arch != "phi3" or not all(longrope)):
        raise GGUFFileError(f"{where}: tensors 'rope_factors_long.weight' and 'rope_factors_short.weight' "
                            "(LongRoPE factors) are supported together, in a phi3 file")

    def n(key, default=None):
        return _int(meta, f"{arch}.{key}", default, where=where)

    hidden = n("embedding_length")
    heads = n("attention.head_count")
    kv_heads = n("attention.head_count_kv", heads) or heads
    if heads < 1 or hidden < 1:
        raise GGUFFileError(f"{where}: metadata: embedding_length and attention.head_count must be >= 1")
    q = by_name.get("blk.0.attn_q.weight")  # without key_length: the q projection's rows per head
    head_dim = n("attention.key_length", q.shape[0] // heads if q is not None and len(q.shape) == 2
                 else hidden // heads)
    value_dim = n("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFFileError(f"{where}: metadata key '{arch}.attention.value_length' ({value_dim}) differs "
                            f"from the key length ({head_dim}): not supported")
    rope_dim = n("rope.dimension_count", head_dim)
    if rope_dim != head_dim and arch != "phi3":
        raise GGUFFileError(f"{where}: metadata key '{arch}.rope.dimension_count': partial rotary "
                            f"({rope_dim} of {head_dim} dimensions) is not supported")
    embd = by_name.get("token_embd.weight")
    if embd is None:
        raise GGUFFileError(f"{where}: tensor 'token_embd.weight' is missing")
    # The vocabulary: the key when written, else the tokenizer's token count, else the table's rows.
    vocab = n("vocab_size", meta.get("tokenizer.ggml.tokens.count") or embd.shape[0])
    layers = n("block_count")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": n("context_length", 2048),
        "rms_norm_eps": _float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, where=where),
        "rope_theta": _float(meta, f"{arch}.rope.freq_base", 10000.0, where=where),
        "rope_scaling": _rope_scaling(meta, arch, where),
        "tie_word_embeddings": "output.weight" not in by_name,
        "torch_dtype": _dtype(tensors),
    }
    has_bias = "blk.0.attn_q.bias" in by_name
    if model_type in ("llama", "qwen3", "qwen3_moe", "mixtral", "smollm3"):
        config["attention_bias"] = has_bias
    if model_type in ("llama", "smollm3"):
        config["mlp_bias"] = "blk.0.ffn_up.bias" in by_name
    if model_type in ("qwen2", "qwen2_moe"):
        config["use_sliding_window"] = False
    ffn = n("feed_forward_length", 0)
    if experts:
        top_k = n("expert_used_count")
        if model_type == "gpt_oss":
            config.update(_gpt_oss_config(meta, arch, config, experts, top_k, ffn, where))
        elif model_type == "mixtral":
            config.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=ffn,
                          sliding_window=None)
        else:
            expert_ffn = n("expert_feed_forward_length", ffn)
            config.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                          intermediate_size=ffn or expert_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm",
                                                       model_type == "qwen3_moe")))
            if model_type == "qwen2_moe":
                config["shared_expert_intermediate_size"] = n("expert_shared_feed_forward_length")
                config["qkv_bias"] = has_bias
    else:
        config["intermediate_size"] = ffn
    if arch in GEMMA_PATTERN:
        config.update(_gemma_config(meta, arch, config, where))
    if arch == "smollm3":  # every interval-th layer without rotary, unless the file says otherwise
        interval = n("no_rope_layer_interval", SMOLLM3_NO_ROPE_INTERVAL)
        config["no_rope_layers"] = [int(interval == 0 or (i + 1) % interval != 0) for i in range(layers)]
        config["use_sliding_window"] = False
    if arch == "phi3":  # partial rotary (Phi-4-mini) and the model's window, as its own config has them
        config["partial_rotary_factor"] = rope_dim / head_dim
        config["sliding_window"] = n("attention.sliding_window", 0) or None
        if all(longrope):
            original = n("rope.scaling.original_context_length")
            scaling = {"rope_type": "longrope", "long_factor": _factors(longrope[0], rope_dim, where),
                       "short_factor": _factors(longrope[1], rope_dim, where),
                       "original_max_position_embeddings": original}
            key = f"{arch}.rope.scaling.attn_factor"
            if meta.get(key) is not None:
                scaling["attention_factor"] = _float(meta, key, 1.0, where=where)
            config.update(rope_scaling=scaling, original_max_position_embeddings=original)
    generation = {}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            config[hf] = value
            generation[hf] = value
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot, int) and "eos_token_id" in generation and eot != generation["eos_token_id"]:
        generation["eos_token_id"] = [generation["eos_token_id"], eot]
    return config, generation


def _gpt_oss_config(meta: dict, arch: str, config: dict, experts: int, top_k: int, ffn: int,
                    where: str) -> dict:
    """gpt-oss's fields: experts, the window on every other layer (the first sliding, as
    llama.cpp has it), q/k/v/o biases and its clamped SwiGLU's limit (YaRN: _rope_scaling)."""
    expert_ffn = _int(meta, f"{arch}.expert_feed_forward_length", ffn, where=where)
    layers = config["num_hidden_layers"]
    return {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": expert_ffn,
            "sliding_window": _int(meta, f"{arch}.attention.sliding_window", where=where),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "attention_bias": True, "swiglu_limit": 7.0}


def _factors(t: TensorEntry, rope_dim: int, where: str) -> list[float]:
    """A LongRoPE factor tensor's values: F32, one per rotary frequency (rope_dim / 2)."""
    if t.type_name != "F32" or t.shape != (rope_dim // 2,):
        raise GGUFFileError(f"{where}: tensor {t.name!r}: LongRoPE factors must be F32 of shape "
                            f"[{rope_dim // 2}] (half the rotary dimensions), got {t.type_name} "
                            f"{list(t.shape)}")
    values = np.fromfile(t.file, dtype="<f4", count=rope_dim // 2, offset=t.offset)
    if values.size != rope_dim // 2 or not np.isfinite(values).all() or (values <= 0).any():
        raise GGUFFileError(f"{where}: tensor {t.name!r}: LongRoPE factors must be positive and finite")
    return [float(v) for v in values]


def _gemma_config(meta: dict, arch: str, config: dict, where: str) -> dict:
    """The Gemma 2 / Gemma 3 fields of the config (module docstring): the activation, the
    per-layer attention types, the window, the query scale, the soft-caps and the local rope."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    window = _int(meta, f"{arch}.attention.sliding_window", where=where)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer: true where the layer slides
        if len(pattern) != layers or not all(isinstance(f, bool) for f in pattern):
            raise GGUFFileError(f"{where}: metadata key '{arch}.attention.sliding_window_pattern' must list "
                                f"{layers} booleans (block_count), got {pattern[:8]!r}")
        sliding = pattern
    else:
        period = _int(meta, f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch], where=where)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    scalar = config["hidden_size"] // heads if layers == GEMMA_27B_LAYERS[arch] else config["head_dim"]
    out = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
           "sliding_window": window,
           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
           "query_pre_attn_scalar": scalar}
    if arch == "gemma2":  # llama.cpp's defaults when the file has no soft-caps: 50 and 30
        out["attn_logit_softcapping"] = _float(meta, f"{arch}.attn_logit_softcapping", 50.0, where=where)
        out["final_logit_softcapping"] = _float(meta, f"{arch}.final_logit_softcapping", 30.0, where=where)
    else:
        if meta.get(f"{arch}.attn_logit_softcapping") is not None:
            raise GGUFFileError(f"{where}: metadata key '{arch}.attn_logit_softcapping': Gemma 3 does not "
                                "soft-cap attention logits")
        final = meta.get(f"{arch}.final_logit_softcapping")
        out["final_logit_softcapping"] = None if final is None else \
            _float(meta, f"{arch}.final_logit_softcapping", 0.0, where=where)
        out["rope_local_base_freq"] = _float(meta, f"{arch}.rope.freq_base_swa", 10000.0, where=where)
    return out


def _dtype(tensors: list[TensorEntry]) -> str:
    """The float dtype a file's matrices were made from: bfloat16 or float16 when its 2-D float
    tensors are, float32 otherwise (quantized files keep their norms in F32)."""
    kinds = {t.type_name for t in tensors if len(t.shape) >= 2 and t.type_name in FLOAT_TYPES}
    if kinds == {"BF16"}:
        return "bfloat16"
    if kinds == {"F16"}:
        return "float16"
    return "float32"
