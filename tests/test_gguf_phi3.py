"""Phi-3 GGUF files (llama.cpp's `phi3` architecture): tiny random-weight models written with
gguf's GGUFWriter as llama.cpp's converter writes them, q/k/v fused in `attn_qkv` and gate/up in
`ffn_up`, no q/k permutation.

* the metadata becomes Phi-3's config: the window (every layer), partial rotary (Phi-4-mini's
  `rope.dimension_count` below the head size), LongRoPE from its factor tensors: a tiny Phi-3
  checkpoint with all three, converted as llama.cpp's converter does, generates from its GGUF
  file what it generates from its safetensors (whose path equals transformers':
  test_arch_models.py), past LongRoPE's original length;
* `--quantization none --dtype float32`: greedy tokens equal transformers' own GGUF loader;
* the default: the fused tensors' rows become q/k/v and gate/up group codes equal to the
  reference dequantization, and the model generates alike on one and two ranks.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from test_gguf_files import greedy_dequantized, ref_greedy_agrees
from test_gguf_gemma import add_tensor, finish
from model_factory import make_tiny_model, tiny_models_root  # noqa: F401

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.gguf_file import gguf_files, materialize
from tpserve.models.gguf import gguf_quant_config, gguf_weights
from tpserve.models.loader import load_config
from tpserve.models.spec import model_spec

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, LAYERS = 256, 512, 384, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def write_phi3(path: Path, seed: int = 0, quantized: bool = False, meta: dict | None = None,
               extra: tuple = (), rope_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    """A tiny Phi-3 file; returns its tensors by GGUF name as a reader must get them back."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_qkv.weight": (QKV, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (2 * INTER, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)  # (transformers: Phi-3's default pad id 32000 is past this vocabulary)
    for key, value in (meta or {}).items():
        w.add_uint32(key, value)
    out = {}
    for name, shape in list(shapes.items()) + [(e, (HEAD_DIM // 2,)) for e in extra]:
        if len(shape) == 1:
            array = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            array = (rng.standard_normal(shape) * (0.5 if "embd" in name else 0.08)).astype(np.float32)
        linear = quantized and len(shape) == 2 and "blk" in name
        kind = ("Q8_0" if "ffn" in name else "Q4_0") if linear else None
        out[name] = add_tensor(w, name, array, kind)
    finish(w)
    return out


def test_metadata_becomes_phi3s_config(tmp_path):
    path = tmp_path / "phi.gguf"
    write_phi3(path, meta={"phi3.attention.sliding_window": 64}, rope_dim=HEAD_DIM * 3 // 4)
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    assert hf["architectures"] == ["Phi3ForCausalLM"] and hf["sliding_window"] == 64
    assert hf["partial_rotary_factor"] == 0.75 and hf["head_dim"] == HEAD_DIM
    spec = model_spec(load_config(materialize(path)))
    assert spec.rotary_dim == HEAD_DIM * 3 // 4
    plain = tmp_path / "plain.gguf"
    write_phi3(plain)
    hf = EngineConfig(model=str(plain), quantization="none").resolve().hf_config
    assert hf["sliding_window"] is None and hf["partial_rotary_factor"] == 1.0
    half = tmp_path / "half-longrope.gguf"  # one factor tensor without the other
    write_phi3(half, extra=("rope_factors_long.weight",))
    with pytest.raises(ConfigError, match="rope_factors_short.weight"):
        EngineConfig(model=str(half), quantization="none").resolve()


def gguf_from_phi3_checkpoint(directory: Path, path: Path) -> None:
    """Write the Phi-3 checkpoint at ``directory`` as llama.cpp's converter writes it: fused
    q/k/v and gate/up as they are, LongRoPE's factors as tensors, its lengths and attention
    factor as metadata."""
    import json
    import math

    from safetensors.numpy import load_file

    cfg = json.loads((directory / "config.json").read_text())
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    scaling = cfg.get("rope_scaling") or cfg["rope_parameters"]  # (transformers 5 writes the latter)
    original, longest = cfg["original_max_position_embeddings"], cfg["max_position_embeddings"]
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(longest)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(int(head_dim * cfg["partial_rotary_factor"]))
    w.add_rope_freq_base(cfg.get("rope_theta") or scaling["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(longest / original) / math.log(original)))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    for hf, array in tensors.items():
        if hf in glob:
            name = glob[hf]
        else:
            _, _, layer, rest = hf.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            name = f"blk.{layer}.{names[module]}.{leaf}"
        w.add_tensor(name, array.astype(np.float32))
    for kind in ("long", "short"):
        w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(scaling[f"{kind}_factor"], dtype=np.float32))
    finish(w)


def test_longrope_window_and_partial_rotary_as_the_checkpoint(tmp_path, tiny_models_root):  # noqa: F811
    from test_arch_models import CASES, PROMPTS, generate

    arch, overrides, _ = CASES["phi3"]  # window 8, LongRoPE from 24 tokens, half the head rotated
    directory = make_tiny_model(tiny_models_root, arch, **overrides)
    path = tmp_path / "phi3-longrope.gguf"
    gguf_from_phi3_checkpoint(directory, path)
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    assert hf["rope_scaling"]["rope_type"] == "longrope" and hf["original_max_position_embeddings"] == 24
    assert any(len(p) > 24 for p in PROMPTS)
    from_file, _ = generate(path, PROMPTS, quantization="none")
    from_checkpoint, _ = generate(directory, PROMPTS)
    assert from_file == from_checkpoint


def test_greedy_equals_transformers(tmp_path):
    path = tmp_path / "tiny-phi3.gguf"
    write_phi3(path, seed=3, quantized=True)
    prompts = [[5, 17, 99, 3], [200, 201, 7], [42]]
    ref_greedy_agrees(path, prompts, greedy_dequantized(path, prompts, 6))


def test_native_fused_rows_become_each_projections_codes(tmp_path):
    from tpserve import LLM, SamplingParams

    path = tmp_path / "native-phi3.gguf"
    expected = write_phi3(path, seed=5, quantized=True)
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    files = gguf_files(directory)
    qc = gguf_quant_config(files, None, spec, {})
    got = dict(gguf_weights(files, spec, qc, torch.float32))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        qkv, up = expected[f"blk.{i}.attn_qkv.weight"], expected[f"blk.{i}.ffn_up.weight"]
        parts = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv],
                 "self_attn.v_proj": qkv[q + kv:],
                 "mlp.gate_proj": up[:INTER], "mlp.up_proj": up[INTER:],
                 "self_attn.o_proj": expected[f"blk.{i}.attn_output.weight"],
                 "mlp.down_proj": expected[f"blk.{i}.ffn_down.weight"]}
        for module, ref in parts.items():
            key = f"model.layers.{i}.{module}"
            codes, scales, mins = (got[f"{key}.weight_{k}"] for k in ("codes", "group_scales", "group_mins"))
            g = codes.shape[1] // scales.shape[1]
            w = scales.repeat_interleave(g, 1) * codes.float() + mins.repeat_interleave(g, 1)
            assert torch.equal(w, torch.from_numpy(np.ascontiguousarray(ref))), key
    tokens = []
    for tp in (1, 2):
        with LLM(str(path), num_kv_blocks=32, block_size=16, tensor_parallel_size=tp) as llm:
            outs = llm.generate([[5, 6, 7], [300, 2, 9, 11]], SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert all(len(t) == 4 for t in tokens[0]) and tokens[0] == tokens[1]
