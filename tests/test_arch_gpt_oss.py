"""gpt-oss (``GptOssForCausalLM``) against transformers, fp32, on a tiny random model: 3 layers
(sliding, full, sliding) with an 8-token window far shorter than the prompts and generations,
4 experts of which 2 per token, attention sinks, q/k/v/o biases, YaRN rotary (untruncated
correction range, as the released models) and a SwiGLU limit low enough that the clamps bite.

transformers' own tokens change when the window widens and when the sinks change, so the
equalities depend on both. MXFP4 experts load, with ``--quantization none``, as their
dequantized values (transformers' dequantization is the reference), and by default as the exact
group codes the grouped-expert kernel runs with their biases and clamped SwiGLU; the fused C++
decode refuses these layers rather than run them without their biases and activation.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_arch_models import _edited, generate, hf_greedy
from test_models import (ATOL, BACKENDS, RTOL, PagedKV, random_prompts, reference_prefill_then_decode,
                         run_prefill_then_decode, tpserve_model)
from test_models_tp import gloo_group, run_two_ranks
from tpserve.kernels import cpu_extension
from tpserve.models import UnsupportedModelError
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.loader import load_config
from tpserve.models.moe import FusedMoE, swiglu_oai
from tpserve.models.group_quant import dequantize, quantize_activations
from tpserve.models.mxfp4 import dequantize_mxfp4, gpt_oss_names, mxfp4_codes
from tpserve.models.norm import Fp32ScaleRMSNorm, RMSNorm
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.rotary import RotaryEmbedding
from tpserve.models.spec import model_spec

WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
CONFIG = dict(num_hidden_layers=3, layer_types=LAYERS, sliding_window=WINDOW, swiglu_limit=1.5,
              rope_parameters=YARN)
PROMPTS = [list(range(20, 47)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3, 4]]
MAX_TOKENS = 20


def gpt_oss(root, **changes):
    return make_tiny_model(root, "gpt_oss", **{**CONFIG, **changes})


@pytest.fixture(scope="module")
def reference(tiny_models_root):  # noqa: F811
    """(path, transformers' greedy tokens), which change with the window and with the sinks."""
    path = gpt_oss(tiny_models_root)
    ref = hf_greedy(path, PROMPTS, MAX_TOKENS)
    assert hf_greedy(gpt_oss(tiny_models_root, sliding_window=512), PROMPTS, MAX_TOKENS) != ref
    tensors = load_file(path / "model.safetensors")
    assert torch.count_nonzero(tensors["model.layers.0.self_attn.sinks"]) == 4
    no_sinks = _with_tensors(path, path.parent / "gpt-oss-no-sinks", {
        k: torch.full_like(t, -30.0) for k, t in tensors.items() if k.endswith("self_attn.sinks")})
    assert hf_greedy(no_sinks, PROMPTS, MAX_TOKENS) != ref
    return path, ref


def _with_tensors(src, dst, replaced: dict):
    """A copy of checkpoint ``src`` with some tensors replaced (built once per session)."""
    if not (dst / "model.safetensors").is_file():
        dst.mkdir(exist_ok=True)
        for name in os.listdir(src):
            if name != "model.safetensors":
                (dst / name).write_bytes((src / name).read_bytes())
        save_file({**load_file(src / "model.safetensors"), **replaced}, dst / "model.safetensors")
    return dst


def test_spec_describes_gpt_oss(tiny_models_root):  # noqa: F811
    spec = model_spec(load_config(gpt_oss(tiny_models_root)))
    assert spec.sliding_windows == (WINDOW, None, WINDOW) and spec.attn_sinks
    assert spec.qkv_bias and spec.o_bias and spec.router_bias and spec.expert_bias
    assert spec.topk_then_softmax and spec.expert_act == "swiglu_oai"
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 1.5)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 32)
    assert spec.rope_theta == 150000.0 and spec.rope_scaling["rope_type"] == "yarn"
    assert all(spec.is_sparse_layer(i) for i in range(3)) and not spec.has_dense_layers


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_equal_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(YARN, truncate=truncate)
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=128,
                          rope_parameters=dict(params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rotary = RotaryEmbedding(16, 128, 150000.0, {k: v for k, v in params.items() if k != "rope_theta"})
    freqs = torch.arange(128, dtype=torch.float32)[:, None] * inv_freq
    assert factor > 1
    assert torch.equal(rotary.cos, freqs.cos() * factor) and torch.equal(rotary.sin, freqs.sin() * factor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_logits_match_transformers(reference, backend):
    path, _ = reference
    prompts = random_prompts([21, 9, 3], 384, seed=1)
    want, decode = reference_prefill_then_decode(path, prompts, 5)
    got = run_prefill_then_decode(tpserve_model(path, backend=backend), prompts, decode)
    assert len(got) == len(want) == 6
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m: f"forward {step}: {m}")


@pytest.mark.parametrize("block_size", [16, 1])
def test_greedy_generation_matches_transformers(reference, block_size):
    path, ref = reference
    got, stats = generate(path, PROMPTS, MAX_TOKENS, block_size=block_size, num_kv_blocks=2048 // block_size)
    assert got == ref
    assert stats["kv_blocks_used"] == 0


def _tp_worker(rank: int, store: str, path: str, prompts: list, decode: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, ep, packed in (("torch", False, False), ("packed", False, True), ("ep", True, True)):
            model = tpserve_model(path, tp, enable_expert_parallel=ep)
            if packed:
                prepack_model(model)
                assert all(m.packed is not None for m in model.modules() if isinstance(m, FusedMoE))
            logits = run_prefill_then_decode(model, prompts, decode)
            torch.save(logits, os.path.join(out_dir, f"{name}.rank{rank}.pt"))


@pytest.mark.timeout(240)
def test_tp2_matches_transformers(reference, tmp_path):
    """Each rank's heads and sinks, and the experts split by intermediate size (the down
    projection's bias added once), in torch and in the C++ kernel, or whole experts per rank
    (expert parallel)."""
    path, _ = reference
    prompts = random_prompts([21, 9, 3], 384, seed=2)
    want, decode = reference_prefill_then_decode(path, prompts, 4)
    run_two_ranks(_tp_worker, str(path), prompts, decode, str(tmp_path), timeout=220)
    for name in ("torch", "packed", "ep"):
        r0 = torch.load(tmp_path / f"{name}.rank0.pt")
        r1 = torch.load(tmp_path / f"{name}.rank1.pt")
        assert len(r0) == len(want) == 5
        for g, w in zip(r0, want):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
        assert all(x is None for x in r1)


def _mxfp4_checkpoint(src, dst):
    """``src`` with its experts replaced by random MXFP4 codes and scales; and the float
    checkpoint of the same values, dequantized by transformers (the reference)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    mx, ref = dst / "mxfp4", dst / "dequantized"
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    quantized, dequantized = {}, {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = tensors[key].shape  # stored [E, in, out]
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(122, 128, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        quantized[key + "_blocks"], quantized[key + "_scales"] = blocks, scales
        dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dequantized[key].shape == tensors[key].shape
    others = {k: t for k, t in tensors.items() if k not in dequantized}
    for path, weights in ((mx, {**others, **quantized}), (ref, {**others, **dequantized})):
        path.mkdir()
        for name in os.listdir(src):
            if name != "model.safetensors":
                (path / name).write_bytes((src / name).read_bytes())
        save_file(weights, path / "model.safetensors")
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(config))
    return mx, ref


def test_mxfp4_experts_load_as_their_dequantized_values(reference, tmp_path):
    path, _ = reference
    mx, ref = _mxfp4_checkpoint(path, tmp_path)
    got, want = tpserve_model(mx, quantization="none"), tpserve_model(ref)
    from tpserve.config import EngineConfig
    assert EngineConfig(model=str(mx), quantization="none").resolve().quantization == "none"  # allowed
    want_params = dict(want.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want_params[name]), name
    # And the float checkpoint computes what transformers computes with those values.
    prompts = random_prompts([21, 9], 384, seed=5)
    expected, decode = reference_prefill_then_decode(ref, prompts, 3)
    for g, w in zip(run_prefill_then_decode(got, prompts, decode), expected):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_mxfp4_experts_run_as_exact_group_codes(reference, tmp_path, monkeypatch):
    """The default: each expert's codes, scales and mins dequantize to transformers' values
    exactly (the torch path, TPSERVE_PREPACK=0: logits as the dequantized checkpoint's); packed,
    the grouped-expert kernel runs them with their biases and clamped SwiGLU as the dequantized
    experts compute on activations quantized to int8 per group of 32 (what the kernel reads)."""
    from tpserve.models.group_quant import GROUP8
    path, _ = reference
    mx, ref = _mxfp4_checkpoint(path, tmp_path)
    want = tpserve_model(ref)
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    got = tpserve_model(mx)
    want_params = dict(want.named_parameters())
    for name, p in got.named_parameters():  # the float modules: as stored
        if ".experts." not in name:
            assert torch.equal(p, want_params[name]), name
    layers = ([m for m in model.modules() if isinstance(m, FusedMoE)] for model in (got, want))
    for fm, ref_fm in zip(*layers):
        w13, w2 = fm.group.stacks
        for e in range(fm.num_local_experts):
            assert torch.equal(w13[e], ref_fm.w13_weight[e]) and torch.equal(w2[e], ref_fm.w2_weight[e])
    prompts = random_prompts([21, 9], 384, seed=5)
    expected, decode = reference_prefill_then_decode(ref, prompts, 3)
    for g, w in zip(run_prefill_then_decode(got, prompts, decode), expected):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    monkeypatch.setenv("TPSERVE_PREPACK", "1")
    packed = tpserve_model(mx)
    prepack_model(packed)
    layers = [m for m in packed.modules() if isinstance(m, FusedMoE)]
    assert all(m.packed is not None and m.packed.kind == GROUP8 for m in layers)
    x = torch.randn(12, layers[0].hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]] * 4)
    weights = torch.full((12, 2), 0.5)
    def int8_rows(t):
        q, s, _ = quantize_activations(t, 32)
        return (q.float().view(t.shape[0], -1, 32) * s[..., None]).view(t.shape)
    for fm, ref_fm in zip(layers, (m for m in want.modules() if isinstance(m, FusedMoE))):
        ref_out = torch.zeros_like(x)
        for t, (row, chosen) in enumerate(zip(x, ids.tolist())):
            for e in chosen:
                gate_up = int8_rows(row[None]) @ ref_fm.w13_weight[e].T + ref_fm.w13_bias[e]
                act = swiglu_oai(gate_up, *fm.swiglu_oai)
                ref_out[t] += 0.5 * (int8_rows(act) @ ref_fm.w2_weight[e].T + ref_fm.w2_bias[e])[0]
        assert (fm(x, ids, weights) - ref_out).abs().max() < 1e-5 * ref_out.abs().max()
    assert why_not_fused(packed) is not None  # biased experts: the module path


def test_mxfp4_codes_and_exponents():
    # byte 0x21: low nibble 1 (0.5), high nibble 2 (1.0); 0xF8: -0.0 then -6.0; scale 127 + k: 2**k.
    blocks = torch.tensor([[[0x21] + [0xF8] * 15]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, torch.tensor([[129]], dtype=torch.uint8))
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [2.0, 4.0, -0.0, -24.0]
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, torch.tensor([[1, 2]], dtype=torch.uint8))
    # As group codes: 2 v + 12 with the scale 2^(s - 128) and the min -12 scales, exactly; every
    # code and exponent (0 and 1: subnormal scales) included.
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 8, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 253, (3, 8), generator=g, dtype=torch.uint8)
    scales[0, :2] = torch.tensor([0, 1])
    codes, group_scales, mins = mxfp4_codes(blocks, scales)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 24 and codes.shape == (3, 256)
    assert torch.equal(dequantize(codes, group_scales, mins), dequantize_mxfp4(blocks, scales))
    with pytest.raises(ValueError, match="exponent 126"):
        mxfp4_codes(blocks, torch.full((3, 8), 253, dtype=torch.uint8))


def test_other_ranks_mxfp4_experts_are_not_dequantized():
    """With expert parallelism a rank gets the experts it does not hold as names without tensors."""
    g = torch.Generator().manual_seed(4)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    blocks = torch.randint(0, 256, (4, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (4, 8, 2), generator=g, dtype=torch.uint8)
    held = {2, 3}
    out = dict(gpt_oss_names([(base + "_scales", scales), (base + "_blocks", blocks)],
                             skip=lambda name: int(name.split(".")[5]) not in held))
    assert len(out) == 8
    for e in range(4):
        gate = out[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
        up = out[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        if e in held:
            whole = dequantize_mxfp4(blocks[e], scales[e])
            assert torch.equal(gate, whole[0::2]) and torch.equal(up, whole[1::2]) and gate.shape == (4, 64)
        else:
            assert gate is None and up is None


def test_an_unpaired_mxfp4_tensor_is_reported_by_name(reference, tmp_path):
    path, _ = reference
    mx, _ = _mxfp4_checkpoint(path, tmp_path)
    tensors = load_file(mx / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, mx / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.down_proj_blocks"):
        tpserve_model(mx)


def test_packed_experts_match_transformers_and_the_fused_decode_refuses(reference):
    """Prepacked, the grouped C++ experts run gpt-oss's biases and clamped SwiGLU (routed in
    torch: top-k, then softmax); the fused decode, which runs neither, refuses the layers."""
    assert cpu_extension.available(), cpu_extension._state.get("error")
    path, _ = reference
    prompts = random_prompts([21, 9], 384, seed=7)
    want, decode = reference_prefill_then_decode(path, prompts, 3)
    model = tpserve_model(path, backend="cpu")
    prepack_model(model)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, FusedMoE))
    assert model.model.layers[0].mlp.gate.packed is not None  # the router, with its bias, is packed
    kv = PagedKV(model, 2, 40)
    assert "gpt-oss" in model.enable_fused_decode()
    got = [model.compute_logits(model.forward(*kv.step(new)))
           for new in [prompts] + [[[t] for t in row] for row in decode]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    assert "gpt-oss" in why_not_fused(model)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_packed_experts_match_the_torch_experts(reference, dtype, tol):
    """The C++ kernel's experts against experts_reference on the same routing, fp32 and bf16
    (the kernel rounds the activation once, the torch ops after each step)."""
    assert cpu_extension.available(), cpu_extension._state.get("error")
    model = tpserve_model(reference[0], backend="cpu", dtype=dtype)
    block = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(37)])
    weights = torch.softmax(torch.randn(37, 2, generator=g), -1)
    want = block.experts.experts(x, ids, weights)
    assert block.experts.prepack_experts()
    got = block.experts.experts(x, ids, weights)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not torch.equal(want, torch.zeros_like(want))


REFUSED = [  # (config changes, field named)
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(swiglu_limit=0), "swiglu_limit"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(rope_parameters=dict(YARN, rope_type="dynamic")), "rope_type"),
]


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_unsupported_fields_are_refused_by_name(reference, tmp_path, case):
    changes, field = REFUSED[case]
    path = _edited(reference[0], tmp_path / "m", **changes)
    with pytest.raises((UnsupportedModelError, ValueError)) as err:
        tpserve_model(path)
    assert field in str(err.value)


def test_norm_rounds_as_transformers_in_bf16():
    """gpt-oss's RMSNorm scales in float32 and rounds once (Llama's rounds before the weight)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16)
    hf = GptOssRMSNorm(96, eps=1e-5)
    hf.weight.data.copy_(weight.float())
    ours = Fp32ScaleRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    ours.weight.data.copy_(weight)
    assert torch.equal(ours(x), hf(x))
    llama = RMSNorm(96, eps=1e-5).to(torch.bfloat16)
    llama.weight.data.copy_(weight)
    assert not torch.equal(llama(x), hf(x))
