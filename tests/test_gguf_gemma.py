"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2` / `gemma3` architectures): tiny
random-weight models written with gguf's GGUFWriter as llama.cpp's converter writes them (norm
weights stored as 1 + w, no q/k permutation, a tied embedding, the window and soft-caps in the
metadata, the layer pattern and local rope base left to their defaults).

* the metadata becomes Gemma's config: per-layer attention types (every sixth layer global in
  Gemma 3, every second in Gemma 2), the window, the query scale, the soft-caps, the local
  rope base; a 27B-sized file scales queries by embedding_length / head_count;
* `--quantization none --dtype float32`: greedy tokens equal transformers' own GGUF loader on
  the same file, with prompts and generations past the window (and transformers' logits move
  when the window is lifted, so the test depends on it);
* the default: quantized linears (and the tied embedding) as group codes that equal the
  reference dequantization, the norms shifted back to w, and the model generates alike on one
  and two ranks.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from test_gguf_files import greedy_dequantized

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.gguf_file import gguf_files, materialize
from tpserve.models.gguf import gguf_quant_config, gguf_weights
from tpserve.models.loader import load_config, load_model
from tpserve.models.spec import model_spec

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 128, 256, 384, 2, 1, 256, 8
LAYERS = {"gemma3": 6, "gemma2": 4}
Q = gguf.GGMLQuantizationType
# Gemma's tensors as llama.cpp names them (HF module -> GGUF).
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
# quantized=True: these linears (and the tied embedding, Q8_0) quantized, as a Q4_x / Q8_0 file holds them
QUANTIZED = {"self_attn.q_proj": "Q8_0", "self_attn.k_proj": "Q4_0", "self_attn.v_proj": "Q4_0",
             "self_attn.o_proj": "Q4_1", "mlp.gate_proj": "Q8_0", "mlp.up_proj": "Q8_0",
             "mlp.down_proj": "Q4_0"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def hf_weights(arch: str, seed: int) -> dict[str, np.ndarray]:
    """Gemma's HF tensors (norm weights as the w of its (1 + w) norm)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS[arch]):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[f"{p}.{norm}.weight"] = (HIDDEN,)
        shapes.update({f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       f"{p}.mlp.gate_proj.weight": (INTER, HIDDEN),
                       f"{p}.mlp.up_proj.weight": (INTER, HIDDEN),
                       f"{p}.mlp.down_proj.weight": (HIDDEN, INTER)})
        if arch == "gemma3":
            shapes.update({f"{p}.self_attn.q_norm.weight": (HEAD_DIM,),
                           f"{p}.self_attn.k_norm.weight": (HEAD_DIM,)})
    out = {}
    for name, shape in shapes.items():
        scale = 0.2 if len(shape) == 1 else 0.05 if "embed" in name else 0.06
        out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{leaf}"


def write_gemma(path: Path, arch: str, seed: int = 0, quantized: bool = False, layers: int | None = None,
                meta: dict | None = None) -> dict[str, np.ndarray]:
    """Write a tiny Gemma model as llama.cpp does; return the HF tensors a reader must get back
    (the reference dequantization of what was written, norms as w)."""
    weights = hf_weights(arch, seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers or LAYERS[arch])
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", 50.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)
    for key, value in (meta or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    expected = {}
    for hf, array in weights.items():
        module = hf.removeprefix("model.").split(".", 2)[-1].rsplit(".", 1)[0]
        if array.ndim == 1:  # llama.cpp's converter writes Gemma's norms as 1 + w, in F32
            stored = array + np.float32(1)
            w.add_tensor(gguf_name(hf), stored)
            expected[hf] = stored - np.float32(1)
            continue
        kind = (QUANTIZED.get(module, "Q8_0" if "embed" in hf else None)) if quantized else None
        expected[hf] = add_tensor(w, gguf_name(hf), array, kind)
    finish(w)
    return expected


def add_tensor(w: gguf.GGUFWriter, name: str, array: np.ndarray, kind: str | None) -> np.ndarray:
    """Add ``array`` to the file as ``kind`` (gguf's quantizer; float when None); return what a
    reader must get back (gguf's reference dequantization)."""
    if kind is None:
        w.add_tensor(name, array)
        return array
    data = gguf.quants.quantize(array, Q[kind])
    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q[kind])
    return gguf.quants.dequantize(data, Q[kind])


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_metadata_becomes_gemmas_config(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gemma(path, arch)
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    layers = LAYERS[arch]
    period = 6 if arch == "gemma3" else 2
    assert hf["architectures"] == [{"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch]]
    assert hf["layer_types"] == ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                 for i in range(layers)]
    assert "full_attention" in hf["layer_types"] and "sliding_attention" in hf["layer_types"]
    assert (hf["sliding_window"], hf["query_pre_attn_scalar"], hf["head_dim"]) == (WINDOW, HEAD_DIM, HEAD_DIM)
    assert hf["hidden_activation"] == "gelu_pytorch_tanh" and hf["tie_word_embeddings"] is True
    if arch == "gemma2":
        assert (hf["attn_logit_softcapping"], hf["final_logit_softcapping"]) == (50.0, 30.0)
    else:
        assert (hf["rope_theta"], hf["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
        assert hf["final_logit_softcapping"] is None
    spec = model_spec(load_config(materialize(path)))
    assert spec.gemma_norms and spec.attn_scale == HEAD_DIM ** -0.5


def test_gemma_metadata_keys_that_change_the_layout(tmp_path):
    # A file's own pattern and local rope base; the 27B's query scale.
    path = tmp_path / "pattern.gguf"
    write_gemma(path, "gemma3", meta={"gemma3.attention.sliding_window_pattern": 3,
                                      "gemma3.rope.freq_base_swa": 20_000.0})
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    assert hf["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert hf["rope_local_base_freq"] == 20_000.0
    flags = tmp_path / "flags.gguf"  # one flag per layer, true where it slides
    write_gemma(flags, "gemma3", meta={"gemma3.attention.sliding_window_pattern": [True, False] * 3})
    hf = EngineConfig(model=str(flags), quantization="none").resolve().hf_config
    assert hf["layer_types"] == ["sliding_attention", "full_attention"] * 3
    short = tmp_path / "short.gguf"
    write_gemma(short, "gemma3", meta={"gemma3.attention.sliding_window_pattern": [True, False]})
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        EngineConfig(model=str(short), quantization="none").resolve()
    big = tmp_path / "big.gguf"
    write_gemma(big, "gemma3", layers=62)
    hf = EngineConfig(model=str(big), quantization="none").resolve().hf_config
    assert hf["query_pre_attn_scalar"] == HIDDEN // HEADS
    capped = tmp_path / "capped.gguf"
    write_gemma(capped, "gemma3", meta={"gemma3.attn_logit_softcapping": 50.0})
    with pytest.raises(ConfigError, match="gemma3.attn_logit_softcapping"):
        EngineConfig(model=str(capped), quantization="none").resolve()


PROMPTS = [[5, 17, 99, 3, 8, 250, 11, 42, 7, 64, 120, 33], [200, 201, 7, 9, 15, 300, 4, 77, 81, 19, 23]]
GENERATED = 8  # prompt + generation past the window of 8


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_greedy_equals_transformers_past_the_window(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}.gguf"
    write_gemma(path, arch, seed=3, quantized=True)
    generated = greedy_dequantized(path, PROMPTS, GENERATED)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref.eval()
    assert ref.config.sliding_window == WINDOW
    windowed = []
    for ids, gen in zip(PROMPTS, generated):
        with torch.no_grad():
            logits = ref(torch.tensor([ids + gen])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == gen
        windowed.append(logits)
    ref.config.sliding_window = 4096  # the window lifted: transformers' logits move
    for ids, gen, logits in zip(PROMPTS, generated, windowed):
        with torch.no_grad():
            lifted = ref(torch.tensor([ids + gen])).logits[0]
        assert (lifted - logits).abs().max() > 1e-3


def test_native_gemma_codes_norms_and_ranks(tmp_path):
    path = tmp_path / "native-gemma3.gguf"
    expected = write_gemma(path, "gemma3", seed=5, quantized=True)
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    files = gguf_files(directory)
    qc = gguf_quant_config(files, None, spec, {})
    got = dict(gguf_weights(files, spec, qc, torch.float32))
    native = {n.removesuffix(".weight_codes") for n in got if n.endswith(".weight_codes")}
    layers = {f"model.layers.{i}.{m}" for i in range(LAYERS["gemma3"]) for m in QUANTIZED}
    assert native == layers | {"lm_head"}
    for module in native - {"lm_head"}:
        codes, scales, mins = (got[f"{module}.weight_{k}"] for k in ("codes", "group_scales", "group_mins"))
        g = codes.shape[1] // scales.shape[1]
        w = scales.repeat_interleave(g, 1) * codes.float() + mins.repeat_interleave(g, 1)
        assert torch.equal(w, torch.from_numpy(expected[f"{module}.weight"])), module
    norms = [n for n in expected if n.endswith("norm.weight")]
    assert len(norms) == 1 + 6 * LAYERS["gemma3"]
    for name in norms:  # the file's 1 + w back to w
        assert torch.equal(got[name], torch.from_numpy(expected[name])), name
    from tpserve import LLM, SamplingParams

    tokens = []
    for tp in (1, 2):
        with LLM(str(path), num_kv_blocks=32, block_size=16, tensor_parallel_size=tp) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert all(len(t) == 4 and all(0 <= i < VOCAB for i in t) for t in tokens[0])
    assert tokens[0] == tokens[1]
    model = load_model(directory, dtype=torch.float32)  # the tied table: the head's codes, looked up
    table = torch.from_numpy(expected["model.embed_tokens.weight"])
    ids = torch.tensor([0, 5, VOCAB - 1, 77])
    assert model.model.embed_tokens.reads_codes and torch.equal(model.model.embed_tokens(ids), table[ids])
