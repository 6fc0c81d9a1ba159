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

Anything the decoder could not reproduce is refused with the key named: other architectures,
per-layer head counts, partial rotary (``rope.dimension_count`` below the head size), key and
value sizes that differ, a rope scaling type the rotary embedding lacks, and llama.cpp's
``rope_freqs`` tensor (Llama 3's scaling stored as per-frequency factors, not parameters).
"""
from __future__ import annotations

from tpserve.gguf_file.reader import FLOAT_TYPES, GGUFFileError, TensorEntry

ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
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
    kind = meta.get(f"{arch}.rope.scaling.type")
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
    if rope_dim != head_dim:
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
    if model_type in ("llama", "qwen3", "qwen3_moe", "mixtral"):
        config["attention_bias"] = has_bias
    if model_type == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in by_name
    if model_type in ("qwen2", "qwen2_moe"):
        config["use_sliding_window"] = False
    ffn = n("feed_forward_length", 0)
    if experts:
        top_k = n("expert_used_count")
        if model_type == "mixtral":
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


def _dtype(tensors: list[TensorEntry]) -> str:
    """The float dtype a file's matrices were made from: bfloat16 or float16 when its 2-D float
    tensors are, float32 otherwise (quantized files keep their norms in F32)."""
    kinds = {t.type_name for t in tensors if len(t.shape) >= 2 and t.type_name in FLOAT_TYPES}
    if kinds == {"BF16"}:
        return "bfloat16"
    if kinds == {"F16"}:
        return "float16"
    return "float32"
