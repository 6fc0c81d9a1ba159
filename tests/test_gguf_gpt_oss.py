"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture): a tiny gpt-oss checkpoint converted
as llama.cpp's converter converts it (experts stacked and transposed, gate and up de-interleaved
into `ffn_gate_exps` / `ffn_up_exps` with their biases, the router as `ffn_gate_inp`, sinks as
`attn_sinks`, the window and YaRN in the metadata).

* the metadata becomes gpt-oss's config (the window on every other layer from the first, YaRN
  with gpt-oss's betas, not truncated);
* `--quantization none`: the file generates what its checkpoint generates (whose path equals
  transformers': test_arch_gpt_oss.py), with prompts past the window and past YaRN's original
  length;
* MXFP4 experts (llama.cpp's type for them) read back as the `gguf` package's reference
  dequantization, dequantized or (the default) as the exact 5-bit codes the grouped-expert
  kernel runs; natively the file follows its dequantized self.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_arch_gpt_oss import CONFIG, PROMPTS
from test_arch_models import generate
from test_gguf_gemma import add_tensor, finish
from test_gguf_moe import _unpacked

from tpserve.config import EngineConfig
from tpserve.gguf_file import gguf_files, materialize
from tpserve.models.gguf import gguf_quant_config, gguf_weights
from tpserve.models.loader import load_config
from tpserve.models.spec import model_spec

# The checkpoint: test_arch_gpt_oss's (window 8, YaRN from 16 tokens) with gpt-oss's own clamp,
# which a GGUF file does not record.
CHECKPOINT = dict(CONFIG, swiglu_limit=7.0)
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def convert(directory: Path, path: Path, experts_type: str | None = None) -> dict[str, np.ndarray]:
    """Write the checkpoint at ``directory`` as a GGUF file; return the tensors as written (the
    reference dequantization of quantized ones), by GGUF name."""
    from safetensors.numpy import load_file

    cfg = json.loads((directory / "config.json").read_text())
    rope = cfg.get("rope_scaling") or cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    out = {}
    for hf, array in tensors.items():
        array = array.astype(np.float32)
        if hf in glob:
            out[glob[hf]] = add_tensor(w, glob[hf], array, None)
            continue
        _, _, layer, rest = hf.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = add_tensor(w, f"{blk}.attn_sinks.weight", array, None)
            continue
        if rest.startswith("mlp.experts."):
            proj = rest.removeprefix("mlp.experts.")
            # [E, in, out] stored as [E, out, in]; gate and up interleaved in the checkpoint
            rows = array.swapaxes(1, 2) if array.ndim == 3 else array
            parts = ({"gate": rows[:, 0::2], "up": rows[:, 1::2]} if proj.startswith("gate_up")
                     else {"down": rows})
            leaf = "bias" if proj.endswith("_bias") else "weight"
            for kind, part in parts.items():
                name = f"{blk}.ffn_{kind}_exps.{leaf}"
                kind = experts_type if leaf == "weight" else None
                out[name] = add_tensor(w, name, np.ascontiguousarray(part), kind)
            continue
        module, leaf = rest.rsplit(".", 1)
        name = f"{blk}.{LAYER_NAMES[module]}.{leaf}"
        out[name] = add_tensor(w, name, array, None)
    finish(w)
    return out


def test_metadata_becomes_gpt_oss_config(tmp_path, tiny_models_root):  # noqa: F811
    path = tmp_path / "gpt-oss.gguf"
    convert(make_tiny_model(tiny_models_root, "gpt_oss", **CHECKPOINT), path)
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    assert hf["architectures"] == ["GptOssForCausalLM"]
    assert hf["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (hf["sliding_window"], hf["num_local_experts"], hf["num_experts_per_tok"]) == (8, 4, 2)
    assert hf["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    spec = model_spec(load_config(materialize(path)))
    assert spec.attn_sinks and spec.sliding_windows == (8, None, 8)


def test_file_generates_as_its_checkpoint(tmp_path, tiny_models_root):  # noqa: F811
    directory = make_tiny_model(tiny_models_root, "gpt_oss", **CHECKPOINT)
    path = tmp_path / "gpt-oss.gguf"
    convert(directory, path)
    assert any(len(p) > 16 for p in PROMPTS)  # past the window and YaRN's original length
    from_file, _ = generate(path, PROMPTS, quantization="none")
    from_checkpoint, _ = generate(directory, PROMPTS)
    assert from_file == from_checkpoint


def test_mxfp4_experts_read_back_exactly_both_ways(tmp_path, tiny_models_root):  # noqa: F811
    """Dequantized (``--quantization none``) and, by default, as exact 5-bit codes packed for the
    grouped-expert kernel (6 bits per weight, a power-of-two scale per block of 32)."""
    from tpserve.models.group_quant import GROUP8
    from tpserve.models.loader import load_model
    from tpserve.models.moe import FusedMoE
    from tpserve.models.packed_gemm import prepack_model

    directory = make_tiny_model(tiny_models_root, "gpt_oss", **CHECKPOINT)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    written = convert(directory, path, experts_type="MXFP4")
    model_dir = materialize(path)
    spec = model_spec(load_config(model_dir))
    got = dict(gguf_weights(gguf_files(model_dir), spec, None, torch.float32))
    for layer in range(CHECKPOINT["num_hidden_layers"]):
        for kind, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            stacked = written[f"blk.{layer}.ffn_{kind}_exps.weight"]
            for e in range(stacked.shape[0]):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(stacked[e]))), name
    assert gguf_quant_config(gguf_files(model_dir), None, spec, {}).grouped
    model = load_model(model_dir, dtype="float32")
    prepack_model(model)  # biased experts: packed with their biases here
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer, fm in enumerate(layers):
        packed = fm.packed
        assert packed is not None and packed.w13.kind == packed.w2.kind == GROUP8
        assert packed.w13.data.shape[1] * 4 == 3 * packed.w13.n * packed.w13.k  # 6 bits per code
        w = {k: torch.from_numpy(written[f"blk.{layer}.ffn_{k}_exps.weight"]) for k in ("gate", "up", "down")}
        for e in range(fm.num_experts):
            assert torch.equal(_unpacked(packed.w13, e), torch.cat([w["gate"][e], w["up"][e]]))
            assert torch.equal(_unpacked(packed.w2, e), w["down"][e])


def test_mxfp4_experts_natively_follow_the_dequantized_file(tmp_path, tiny_models_root):  # noqa: F811
    """Greedy tokens past the window and YaRN's original length: two expert-parallel ranks generate
    as one; teacher-forced top-1 agreement with the dequantized file of at least 90% for the native
    experts (int8 activations per group) on one rank and on two tensor-parallel ranks (each with
    half of an expert's 32 intermediate features: half of each group of the down projection, which
    so quantizes its activations per 16 instead of 32)."""
    from tpserve import LLM, SamplingParams
    directory = make_tiny_model(tiny_models_root, "gpt_oss", **CHECKPOINT)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    convert(directory, path, experts_type="MXFP4")
    native, _ = generate(path, PROMPTS)
    ep, _ = generate(path, PROMPTS, tensor_parallel_size=2, enable_expert_parallel=True)
    assert ep == native
    sequences = [p + g for p, g in zip(PROMPTS, native)]
    tops = []
    for options in ({"quantization": "none"}, {}, {"tensor_parallel_size": 2}):
        with LLM(str(path), dtype="float32", **options) as llm:
            outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        tops.append([max(e, key=lambda t: e[t].logprob) for o in outs for e in o.prompt_logprobs[1:]])
    for top in tops[1:]:
        same = sum(a == b for a, b in zip(top, tops[0]))
        assert same >= 0.9 * len(tops[0]), (same, len(tops[0]))
