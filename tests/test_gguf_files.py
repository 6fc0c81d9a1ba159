"""GGUF files the tests write themselves (gguf's GGUFWriter): tiny random-weight models.

* every tensor type tpserve runs (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 through gguf's quantizers;
  Q4_K, Q5_K, Q6_K as random blocks with finite scales, written directly) read back, named
  and un-permuted: each loaded tensor equals the `gguf` package's reference dequantization
  of the bytes written, exactly;
* a tiny llama (q/k rows permuted as llama.cpp's converter does), Qwen3 and Qwen2 served from
  their files: greedy tokens equal transformers' own GGUF loader on the same file;
* split files (gguf-split's naming), found from any part; a missing part is named;
* bad files: truncated, corrupt lengths, unknown version, a tensor whose size does not match
  its type, an unsupported type or architecture, random byte damage: a clear error naming the
  file (and tensor or key), never a crash or hang.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.gguf_file import GGUFFileError, gguf_files, materialize
from tpserve.gguf_file.reader import scan
from tpserve.models.gguf import gguf_quant_config, gguf_weights
from tpserve.models.loader import load_config
from tpserve.models.spec import model_spec

HIDDEN, INTER, VOCAB, LAYERS, HEADS, KV_HEADS = 512, 512, 384, 2, 4, 2  # head_dim 128: Qwen3's default
HEAD_DIM = HIDDEN // HEADS
Q = gguf.GGMLQuantizationType
K_BLOCK = {"Q4_K": (144, [(0, 2), (2, 4)]), "Q5_K": (176, [(0, 2), (2, 4)]), "Q6_K": (210, [(208, 210)])}
# HF tensor -> type, covering every supported type (rows of the K-quants are whole 256-blocks).
TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "Q5_1",
    "model.norm.weight": "F32",
    "model.layers.0.self_attn.q_proj.weight": "Q4_K",
    "model.layers.0.self_attn.k_proj.weight": "Q4_0",
    "model.layers.0.self_attn.v_proj.weight": "Q5_K",
    "model.layers.0.self_attn.o_proj.weight": "Q8_0",
    "model.layers.0.mlp.gate_proj.weight": "Q4_1",
    "model.layers.0.mlp.up_proj.weight": "F16",
    "model.layers.0.mlp.down_proj.weight": "Q5_0",
    "model.layers.1.self_attn.q_proj.weight": "Q6_K",
    "model.layers.1.self_attn.k_proj.weight": "BF16",
    "model.layers.1.self_attn.v_proj.weight": "F32",
    "model.layers.1.self_attn.o_proj.weight": "Q4_1",
    "model.layers.1.mlp.gate_proj.weight": "Q5_K",
    "model.layers.1.mlp.up_proj.weight": "Q4_0",
    "model.layers.1.mlp.down_proj.weight": "Q4_K",
}
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{leaf}"


def hf_float_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
         "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": (HIDDEN,), f"{p}.post_attention_layernorm.weight": (HIDDEN,),
                  f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                  f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                  f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                  f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                  f"{p}.mlp.gate_proj.weight": (INTER, HIDDEN), f"{p}.mlp.up_proj.weight": (INTER, HIDDEN),
                  f"{p}.mlp.down_proj.weight": (HIDDEN, INTER)})
        if arch == "qwen3":
            w.update({f"{p}.self_attn.q_norm.weight": (HEAD_DIM,),
                      f"{p}.self_attn.k_norm.weight": (HEAD_DIM,)})
        if arch == "qwen2":
            w.update({f"{p}.self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
                      f"{p}.self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                      f"{p}.self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,)})
    out = {}
    for name, shape in w.items():
        if name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * (0.5 if "embed" in name else 0.08)).astype(np.float32)
    return out


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, type_name: str, rng) -> np.ndarray:
    """The tensor's bytes (or float array) as written."""
    if type_name == "F32":
        return w.astype(np.float32)
    if type_name == "F16":
        return w.astype(np.float16)
    if type_name in K_BLOCK:  # gguf has no K-quant quantizer: random blocks with finite scales
        size, halves = K_BLOCK[type_name]
        rows, cols = w.shape
        blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for lo, hi in halves:
            scale = (rng.uniform(0.5, 1.5, size=(rows, cols // 256)) * 0.002).astype(np.float16)
            blocks[..., lo:hi] = scale[..., None].view(np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(w, Q[type_name])


def write_model(path: Path, arch: str = "llama", types: dict | None = None, seed: int = 0,
                split_max_tensors: int = 0, meta: dict | None = None,
                skip: tuple = ()) -> dict[str, np.ndarray]:
    """Write a tiny model as GGUF; return the HF-ordered float32 tensors a reader must get back
    (the reference dequantization of the bytes written, llama's q/k permutation undone)."""
    rng = np.random.default_rng(seed + 1)
    types = dict(TYPES if types is None else types)
    weights = hf_float_weights(arch, seed)
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    for key, value in (meta or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    expected = {}
    for hf, w in weights.items():
        if hf in skip:
            continue
        type_name = types.get(hf, "F32")
        heads = HEADS if ".q_proj." in hf else KV_HEADS if ".k_proj." in hf else None
        permuted = arch in ("llama", "smollm3") and heads
        stored = llama_cpp_permute(w, heads) if permuted else w
        data = encode(stored, type_name, rng)
        if type_name in ("F32", "F16"):
            writer.add_tensor(gguf_name(hf), data)
            deq = data.astype(np.float32)
        else:
            writer.add_tensor(gguf_name(hf), data, raw_shape=data.shape, raw_dtype=Q[type_name])
            deq = gguf.quants.dequantize(data, Q[type_name])
        if permuted:  # undo the permutation with its inverse (argsort)
            deq = deq[np.argsort(llama_cpp_permute(np.arange(w.shape[0]), heads))]
        expected[hf] = deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    path = d / "tiny-llama.gguf"
    return path, write_model(path)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    # The model directories made from these files go to a cache of their own.
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def loaded_tensors(path, quantization="none") -> dict[str, torch.Tensor]:
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    return dict(gguf_weights(gguf_files(directory), spec, None, torch.float32))


def test_every_type_reads_back_as_the_reference_dequantization(tiny):
    path, expected = tiny
    got = loaded_tensors(path)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(ref))), name
    # Quantized with gguf's quantizers, the weights are near the floats they came from, in HF order.
    floats = hf_float_weights("llama")
    q = "model.layers.0.self_attn.k_proj.weight"  # Q4_0, permuted in the file
    assert (got[q].numpy() - floats[q]).std() < 0.2 * floats[q].std()


def test_metadata_becomes_the_config(tiny):
    path, _ = tiny
    config = EngineConfig(model=str(path), quantization="none").resolve()
    hf = config.hf_config
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]) == (HIDDEN, INTER, LAYERS)
    heads = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert heads == (HEADS, KV_HEADS, HEAD_DIM)
    assert hf["max_position_embeddings"] == 512 and hf["vocab_size"] == VOCAB
    assert hf["tie_word_embeddings"] is False and config.eos_token_ids == [2]
    assert config.model_name == "tiny-llama" and config.max_model_len == 512


def greedy_dequantized(path: Path, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the file's model, every tensor dequantized to float32."""
    from tpserve import LLM, SamplingParams

    with LLM(str(path), quantization="none", dtype="float32", num_kv_blocks=32, block_size=16) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    generated = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(g) == max_tokens for g in generated)
    return generated


def ref_greedy_agrees(path: Path, prompts, generated) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref.eval()
    for ids, gen in zip(prompts, generated):
        with torch.no_grad():
            logits = ref(torch.tensor([ids + gen])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == gen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tiny_model_greedy_equals_transformers(tmp_path, arch):
    types = {k: v for k, v in TYPES.items() if v not in ("Q4_K", "Q5_K", "Q6_K")}  # transformers: any
    path = tmp_path / f"tiny-{arch}.gguf"
    write_model(path, arch, types=types, seed=3)
    prompts = [[5, 17, 99, 3], [200, 201, 7], [42]]
    ref_greedy_agrees(path, prompts, greedy_dequantized(path, prompts, 6))


def test_split_files_load_from_any_part(tmp_path):
    single = tmp_path / "one.gguf"
    expected = write_model(single, seed=5)
    split = tmp_path / "split.gguf"
    write_model(split, seed=5, split_max_tensors=10)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3 and parts[0].name == "split-00001-of-00003.gguf"
    for part in (parts[0], parts[2]):
        config = EngineConfig(model=str(part), quantization="none").resolve()
        assert config.model_name == "split"
        got = loaded_tensors(part)
        assert sorted(got) == sorted(expected)
        for n, e in expected.items():
            assert torch.equal(got[n], torch.from_numpy(np.ascontiguousarray(e))), n
    parts[1].unlink()
    with pytest.raises(ConfigError, match="split-00002-of-00003.gguf"):
        EngineConfig(model=str(parts[0]), quantization="none").resolve()


# ---- bad files -------------------------------------------------------------------------------
def resolve_error(path) -> str:
    with pytest.raises(ConfigError) as e:
        EngineConfig(model=str(path), quantization="none").resolve()
    assert e.value.field == "model"
    assert str(path) in e.value.reason
    return e.value.reason


def test_truncated_file_names_the_tensor(tiny, tmp_path):
    path, _ = tiny
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    reason = resolve_error(cut)
    assert "blk.1" in reason and "truncated" in reason
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])
    assert "truncated" in resolve_error(head)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty" in resolve_error(empty)


def test_unknown_version_and_bad_magic(tiny, tmp_path):
    path, _ = tiny
    data = bytearray(path.read_bytes())
    v = tmp_path / "v9.gguf"
    v.write_bytes(bytes(data[:4]) + (9).to_bytes(4, "little") + bytes(data[8:]))
    assert "version 9" in resolve_error(v)
    m = tmp_path / "magic.gguf"
    m.write_bytes(b"GGML" + bytes(data[4:]))
    assert "not a GGUF file" in resolve_error(m)


@pytest.mark.timeout(60)
def test_a_corrupt_array_length_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "arr.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"tokenizer.ggml.token_type") + len("tokenizer.ggml.token_type") + 4 + 4
    assert int.from_bytes(data[at:at + 8], "little") == 3
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    reason = resolve_error(path)
    assert "tokenizer.ggml.token_type" in reason and "array" in reason


def test_a_tensor_whose_size_does_not_match_its_type(tmp_path):
    path = tmp_path / "size.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("output_norm.weight", np.zeros((48,), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    original = path.read_bytes()
    # output_norm: retype F32 (0) as Q8_0 (8): 48 values are not whole blocks of 32.
    data = bytearray(original)
    at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8
    assert int.from_bytes(data[at:at + 4], "little") == 0
    data[at:at + 4] = (8).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    reason = resolve_error(path)
    assert "output_norm.weight" in reason and "Q8_0" in reason
    # token_embd (4 x 32 F32) retyped F64 (28): twice the bytes the file holds for it.
    data = bytearray(original)
    at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 16
    assert int.from_bytes(data[at:at + 4], "little") == 0
    data[at:at + 4] = (28).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFileError, match="token_embd.weight.*does not match its type"):
        scan(path)


def test_an_unsupported_type_or_architecture_is_named(tmp_path):
    path = tmp_path / "q3k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 256), np.float32))
    q3k = np.random.default_rng(0).integers(0, 256, size=(4, 110), dtype=np.uint8)  # one 256-block a row
    w.add_tensor("blk.0.ffn_up.weight", q3k, raw_shape=q3k.shape, raw_dtype=Q.Q3_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    reason = resolve_error(path)
    assert "blk.0.ffn_up.weight" in reason and "Q3_K" in reason
    arch = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(arch), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert "'gpt2' is not supported" in resolve_error(arch)


def test_random_damage_never_crashes(tiny, tmp_path):
    """Bytes of the header overwritten at random: the file loads or is refused with a
    GGUFFileError naming it, nothing else."""
    path, _ = tiny
    data = path.read_bytes()
    header = scan(path)[0].offset  # the metadata and tensor infos end before the first tensor
    rng = np.random.default_rng(7)
    refused = 0
    for i in range(150):
        damaged = bytearray(data[:header + 4096])
        for at in rng.integers(4, header, size=rng.integers(1, 4)):
            damaged[at] = rng.integers(0, 256)
        f = tmp_path / f"d{i}.gguf"
        f.write_bytes(bytes(damaged))
        try:
            scan(f)
        except GGUFFileError as e:
            assert str(f) in str(e)
            refused += 1
        f.unlink()
    assert refused > 50


# ---- options -----------------------------------------------------------------------------------
def test_tokenizer_option_and_served_name(tiny, tmp_path):
    path, _ = tiny
    bundled = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"
    config = EngineConfig(model=str(path), tokenizer=str(bundled), quantization="none").resolve()
    assert (config.model_path / "tokenizer.json").read_bytes() == (bundled / "tokenizer.json").read_bytes()
    assert config.model_name == "tiny-llama"
    with pytest.raises(ConfigError) as e:
        EngineConfig(model=str(bundled), tokenizer=str(bundled))
    assert e.value.field == "tokenizer"
    with pytest.raises(ConfigError, match="no such file"):
        EngineConfig(model=str(tmp_path / "absent.gguf")).resolve()


def test_native_codes_equal_the_reference_dequantization(tiny):
    """The default: quantized linear weights as group codes, scales and mins (repacked, not
    requantized; q/k rows un-permuted), float where a merged layer has a float part."""
    path, expected = tiny
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    files = gguf_files(directory)
    qc = gguf_quant_config(files, None, spec, {})
    assert qc.grouped and qc.from_checkpoint
    assert set(qc.ignore) == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                              "model.layers.1.self_attn.q_proj",
                              "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"}
    got = dict(gguf_weights(files, spec, qc, torch.float32))
    native = {n.removesuffix(".weight_codes") for n in got if n.endswith(".weight_codes")}
    assert native == {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                      "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
                      "model.layers.0.mlp.down_proj",
                      "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
                      "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"}
    for module in native:
        codes, scales, mins = (got[f"{module}.weight_{k}"] for k in ("codes", "group_scales", "group_mins"))
        g = codes.shape[1] // scales.shape[1]
        w = scales.repeat_interleave(g, 1) * codes.float() + mins.repeat_interleave(g, 1)
        ref = torch.from_numpy(np.ascontiguousarray(expected[f"{module}.weight"]))
        assert torch.equal(w, ref), module
        bits = int(got[f"{module}.weight_bits"])
        assert int(codes.max()) < 2 ** bits and bits == (4 if TYPES[f"{module}.weight"] in
                                                          ("Q4_0", "Q4_1", "Q4_K") else 8)
    for name in expected:
        if name.removesuffix(".weight") not in native:
            assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(expected[name]))), name


def test_native_model_generates_alike_on_one_and_two_ranks(tiny):
    """Two tensor-parallel ranks: the worker finds the same model directory, and the group
    codes, scales and mins are split by rows or whole groups; the greedy tokens do not move."""
    path, _ = tiny
    tokens = greedy_on_one_and_two_ranks(path)
    assert all(len(t) == 4 and all(0 <= i < VOCAB for i in t) for t in tokens[0])
    assert tokens[0] == tokens[1]


def greedy_on_one_and_two_ranks(path) -> list[list[list[int]]]:
    """Four greedy tokens of two prompts from the file, at TP=1 and at TP=2."""
    from tpserve import LLM, SamplingParams

    tokens = []
    for tp in (1, 2):
        with LLM(str(path), num_kv_blocks=32, block_size=16, tensor_parallel_size=tp) as llm:
            outs = llm.generate([[5, 6, 7], [300, 2, 9, 11]],
                                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    return tokens


def test_a_tied_quantized_embedding_is_held_once_as_the_heads_codes(tmp_path):
    """No output.weight: the LM head shares token_embd. Quantized, it becomes the head's group
    codes (repacked exactly) and the embedding looks its rows up in them, packed or not; no
    float table is held, and the model generates alike on one and two ranks."""
    from tpserve.models.loader import load_model
    from tpserve.models.packed_gemm import prepack_model

    path = tmp_path / "tied.gguf"
    expected = write_model(path, skip=("lm_head.weight",))
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    assert spec.tie_word_embeddings
    files = gguf_files(directory)
    qc = gguf_quant_config(files, None, spec, {})
    assert qc.tied_head_codes
    got = dict(gguf_weights(files, spec, qc, torch.float32))
    assert "model.embed_tokens.weight" not in got
    codes, scales, mins = (got[f"lm_head.weight_{k}"] for k in ("codes", "group_scales", "group_mins"))
    g = codes.shape[1] // scales.shape[1]
    table = torch.from_numpy(np.ascontiguousarray(expected["model.embed_tokens.weight"]))
    assert torch.equal(scales.repeat_interleave(g, 1) * codes.float() + mins.repeat_interleave(g, 1), table)

    model = load_model(directory, dtype=torch.float32)
    embed = model.model.embed_tokens
    assert embed.reads_codes and embed.weight.numel() == 0
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())
    ids = torch.tensor([0, 5, VOCAB - 1, 5, 77])
    assert torch.equal(embed(ids), table[ids])
    prepack_model(model)
    assert model.lm_head.packed is not None and model.lm_head.group_tensors() is None
    assert torch.equal(embed(ids), table[ids])  # now from the packed codes

    tokens = greedy_on_one_and_two_ranks(path)
    assert all(len(t) == 4 for t in tokens[0]) and tokens[0] == tokens[1]


def test_moe_experts_split_per_expert_both_ways(tmp_path):
    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1),
                       ("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", 32)):
        w.add_uint32(f"qwen3moe.{key}", value)
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (64, 32)), ("output_norm.weight", (32,)),
                        ("blk.0.attn_norm.weight", (32,)), ("blk.0.ffn_norm.weight", (32,)),
                        ("blk.0.attn_q.weight", (256, 32)), ("blk.0.attn_k.weight", (128, 32)),
                        ("blk.0.attn_v.weight", (128, 32)), ("blk.0.attn_output.weight", (32, 256)),
                        ("blk.0.attn_q_norm.weight", (128,)), ("blk.0.attn_k_norm.weight", (128,)),
                        ("blk.0.ffn_gate_inp.weight", (4, 32)), ("blk.0.ffn_gate_exps.weight", (4, 32, 32)),
                        ("blk.0.ffn_up_exps.weight", (4, 32, 32)),
                        ("blk.0.ffn_down_exps.weight", (4, 32, 32))):
        data = rng.standard_normal(shape).astype(np.float32) * 0.1
        if name.endswith("exps.weight"):
            q = gguf.quants.quantize(data, Q.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    config = EngineConfig(model=str(path)).resolve()
    assert config.hf_config["architectures"] == ["Qwen3MoeForCausalLM"]
    spec = model_spec(load_config(config.model_path))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 32)
    # Dequantized, every expert's tensor lands under its Hugging Face name; natively (the default)
    # its codes, scales and mins do (tests/test_gguf_moe.py runs them).
    files = gguf_files(config.model_path)
    got = dict(gguf_weights(files, spec, None, torch.float32))
    assert got["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (32, 32)
    qc = gguf_quant_config(files, None, spec, config.hf_config)
    native = dict(gguf_weights(files, spec, qc, torch.float32))
    assert native["model.layers.0.mlp.experts.3.down_proj.weight_codes"].shape == (32, 32)
    assert native["model.layers.0.mlp.experts.3.down_proj.weight_group_scales"].shape == (32, 1)
    from tpserve import LLM, SamplingParams
    for quantization in ("none", None):
        with LLM(str(path), quantization=quantization, dtype="float32", num_kv_blocks=8,
                 block_size=16) as llm:
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3


def test_an_unwritable_cache_is_named(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(blocker / "cache"))
    assert "TPSERVE_GGUF_CACHE_DIR" in resolve_error(path)


def test_cache_is_keyed_by_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, seed=1)
    first = materialize(path)
    os.utime(path, ns=(1, 1))
    second = materialize(path)
    assert first != second and (second / "config.json").is_file()
    shutil.rmtree(first)
