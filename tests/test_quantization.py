"""int8 weights: ``--quantization int8`` and compressed-tensors checkpoints (W8A8, W8A16) as
llm-compressor writes them, built here from a tiny float model; their TP=2 sharding; and the
errors for quantization configs tpserve cannot load."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model
from test_models import random_prompts, run_prefill_then_decode, tpserve_model
from test_models_tp import gloo_group, run_two_ranks
from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.models.errors import CheckpointError, UnsupportedModelError
from tpserve.models.packed_gemm import INT8, INT8_DYNAMIC, prepack_model, quantize_int8
from tpserve.models.quantization import checkpoint_tensors, unpack_int32
from tpserve.quantization import QuantConfig, resolve_quantization

WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
           "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None}
TOKEN_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
              "group_size": None, "observer": None, "actorder": None, "block_structure": None}


def ct_config(scheme: str, ignore=("lm_head",)) -> dict:
    """A quantization_config as llm-compressor saves it for scheme W8A8 or W8A16."""
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": "int-quantized" if scheme == "W8A8" else "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(WEIGHTS),
                                          "input_activations": dict(TOKEN_ACTS) if scheme == "W8A8" else None,
                                          "output_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 8-bit packing: four weights + 128 per int32, low byte first."""
    u = (q.to(torch.int64) + 128).view(q.shape[0], -1, 4)
    words = (u << (torch.arange(4) * 8)).sum(-1)
    return (words - (words >= 2 ** 31) * 2 ** 32).to(torch.int32)


def make_compressed(src: Path, dst: Path, scheme: str, ignore=("lm_head",), dequantized: bool = False) -> Path:
    """``src``'s weights quantized per channel into a compressed-tensors checkpoint at ``dst``;
    with ``dequantized`` a float checkpoint of the int8 weights times their scales instead."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name
                and module not in ignore):
            out[name] = t
            continue
        q, scale = quantize_int8(t)
        if dequantized:
            out[name] = (q.float() * scale[:, None]).to(t.dtype)
        elif scheme == "W8A16":
            out[f"{module}.weight_packed"] = pack_int32(q)
            out[f"{module}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int32)
            out[f"{module}.weight_scale"] = scale[:, None].to(t.dtype)
        else:
            out[name] = q
            out[f"{module}.weight_scale"] = scale[:, None].to(t.dtype)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    if not dequantized:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = ct_config(scheme, ignore)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=False)


def _run(path, tp=None, **kw):
    model = tpserve_model(path, tp, **kw)
    prepack_model(model)
    prompts = random_prompts([9, 4], 384, seed=2)
    return model, run_prefill_then_decode(model, prompts, [[5, 7], [11, 13]])


def test_w8a8_checkpoint_equals_quantizing_at_load(float_model, tmp_path):
    ct = make_compressed(float_model, tmp_path / "w8a8", "W8A8", ignore=())
    model, got = _run(ct)
    assert model.lm_head.packed.kind == INT8_DYNAMIC
    assert model.model.layers[0].self_attn.qkv_proj.packed.kind == INT8_DYNAMIC
    at_load, want = _run(float_model, quantization="int8")
    assert at_load.model.layers[0].mlp.down_proj.packed.kind == INT8_DYNAMIC
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # same int8 weights, same scales, same kernel


def test_w8a16_pack_quantized_computes_the_dequantized_model(float_model, tmp_path):
    ct = make_compressed(float_model, tmp_path / "w8a16", "W8A16")
    model, got = _run(ct)
    layer = model.model.layers[1]
    assert layer.self_attn.o_proj.packed.kind == INT8 and layer.mlp.gate_up_proj.packed.kind == INT8
    assert model.lm_head.packed.kind != INT8  # ignored: stays float
    _, want = _run(make_compressed(float_model, tmp_path / "deq", "W8A16", dequantized=True))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def test_int8_at_load_stays_close_to_float(float_model):
    _, q = _run(float_model, quantization="int8")
    _, f = _run(float_model)
    for a, b in zip(q, f):
        assert (a - b).abs().max() < 0.1 * b.abs().max()


def test_unpacking_int32_words():
    q = torch.tensor([[-128 + 1, 127, 0, -5, 3, 4, -7, 9]], dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_int32(q), torch.tensor([1, 8]), "w"), q)
    with pytest.raises(CheckpointError, match="expected int32"):
        unpack_int32(pack_int32(q), torch.tensor([1, 12]), "w")
    stream = [("a.weight_packed", pack_int32(q)), ("b.bias", torch.zeros(1)),
              ("a.weight_shape", torch.tensor([1, 8])), ("a.weight_zero_point", torch.zeros(1, 1))]
    assert [k for k, _ in checkpoint_tensors(stream)] == ["b.bias", "a.weight"]
    with pytest.raises(CheckpointError, match="non-zero zero points"):
        list(checkpoint_tensors([("a.weight_zero_point", torch.ones(1, 1))]))
    with pytest.raises(CheckpointError, match="no a.weight_shape"):
        list(checkpoint_tensors([("a.weight_packed", pack_int32(q))]))


def test_quantization_sources():
    assert resolve_quantization(None, {}) is None
    assert resolve_quantization("int8", {}) == QuantConfig("int8", True, False)
    w8a16 = resolve_quantization(None, {"quantization_config": ct_config("W8A16")})
    assert (w8a16.int8_activations, w8a16.from_checkpoint, w8a16.packed_int32) == (False, True, True)
    assert not w8a16.quantizes("lm_head") and w8a16.quantizes("model.layers.0.mlp.up_proj")
    w8a8 = resolve_quantization("compressed-tensors", {"quantization_config": ct_config("W8A8", ["re:.*down_proj"])})
    assert w8a8.int8_activations and not w8a8.packed_int32
    assert not w8a8.quantizes("model.layers.3.mlp.down_proj") and w8a8.quantizes("lm_head")


def _bad(mutate):
    qc = ct_config("W8A8")
    mutate(qc)
    return {"quantization_config": qc}


@pytest.mark.parametrize("hf, requested, field", [
    (_bad(lambda q: q.update(quant_method="bitsandbytes")), None, "quant_method"),
    (_bad(lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4)), None, "weights.num_bits"),
    (_bad(lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)),
     None, "weights.strategy"),
    (_bad(lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False)),
     None, "input_activations.dynamic"),
    (_bad(lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False)), None, "weights.symmetric"),
    (_bad(lambda q: q.update(kv_cache_scheme={"num_bits": 8})), None, "kv_cache_scheme"),
    (_bad(lambda q: q.update(format="float-quantized")), None, "format"),
    (_bad(lambda q: q.pop("config_groups")), None, "config_groups"),
    (_bad(lambda q: q["config_groups"]["group_0"].update(targets=["re:.*q_proj"])), None, "targets"),
    (_bad(lambda q: None), "int8", "already quantized"),
    ({}, "compressed-tensors", "has none"),
    ({}, "int3", "must be one of"),
])
def test_unsupported_quantization_is_refused_naming_the_field(hf, requested, field):
    with pytest.raises(ConfigError, match=field) as e:
        resolve_quantization(requested, hf)
    assert e.value.field == "quantization"


def test_the_engine_refuses_it_at_start(float_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(float_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="version: tpserve reads AWQ's 'gemm' layout"):
        EngineConfig(model=str(bad)).resolve()
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model=str(float_model), quantization="fp8")


def test_a_partly_ignored_fused_layer_is_refused(float_model, tmp_path):
    ct = make_compressed(float_model, tmp_path / "partial", "W8A8", ignore=("lm_head",))
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.self_attn.k_proj"]
    (ct / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="one fused layer"):
        tpserve_model(ct)


def test_llm_generates_with_int8(float_model, tmp_path):
    from tpserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for path, quant in ((float_model, "int8"), (make_compressed(float_model, tmp_path / "c", "W8A16"), None)):
        llm = LLM(str(path), quantization=quant, kv_cache_memory_gb=0.05)
        outs.append(llm.generate([[5, 9, 11]], params)[0].outputs[0].token_ids)
        llm.shutdown()
    assert all(len(o) == 6 for o in outs)


def _tp_worker(rank: int, store: str, cases: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, path, quant in cases:
            _, sharded = _run(path, tp, quantization=quant)
            if rank == 0:
                _, reference = _run(path, quantization=quant)
                torch.save({"sharded": sharded, "reference": reference}, os.path.join(out_dir, f"{name}.pt"))


@pytest.mark.timeout(180)
def test_tp2_shards_int8_weights_and_scales(float_model, tmp_path):
    """W8A16 at TP=2 computes TP=1's logits (only the order of sums differs); W8A8 quantizes a
    row-parallel layer's activations over each rank's slice, so it stays close."""
    cases = [("w8a16", str(make_compressed(float_model, tmp_path / "w8a16", "W8A16", ignore=())), None, 1e-4),
             ("w8a8", str(float_model), "int8", 0.1)]
    run_two_ranks(_tp_worker, [c[:3] for c in cases], str(tmp_path))
    for name, _, _, tol in cases:
        r = torch.load(tmp_path / f"{name}.pt")
        for got, want in zip(r["sharded"], r["reference"]):
            assert (got - want).abs().max() <= tol * want.abs().max(), name


def test_none_means_float_and_refuses_a_quantized_checkpoint():
    """``--quantization none``: nothing for a float checkpoint, gpt-oss's MXFP4 experts
    dequantized; any other quantized checkpoint is refused, naming the option."""
    from tpserve.errors import ConfigError
    from tpserve.quantization import resolve_quantization
    assert resolve_quantization("none", {}) is None
    assert resolve_quantization("none", {"quantization_config": {"quant_method": "mxfp4"}}) is None
    assert resolve_quantization(None, {"quantization_config": {"quant_method": "mxfp4"}}).grouped
    with pytest.raises(ConfigError, match="none: this checkpoint is quantized"):
        resolve_quantization("none", {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                              "group_size": 128}})
