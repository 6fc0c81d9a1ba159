"""Group-quantized linear layers (tpserve/models/group_quant.py): ``--quantization int4`` and
checkpoints holding codes / scales / mins, against float models of the dequantized weights;
their configs; TP=2 (gloo) sharding with whole groups per rank."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model
from test_models import random_prompts, run_prefill_then_decode, tpserve_model
from test_models_tp import gloo_group, run_two_ranks
from tpserve.errors import ConfigError
from tpserve.kernels import cpu_extension
from tpserve.models.errors import CheckpointError
from tpserve.models.group_quant import dequantize, quantize_groups
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.parallel import TPContext
from tpserve.models.quantization import EMBEDDING_CODES
from tpserve.quantization import resolve_quantization

SHAPE = dict(hidden_size=128, head_dim=32, intermediate_size=256)
PROMPTS = random_prompts([9, 4], 384, seed=2)
DECODE = [[5, 7], [11, 13]]
# Per module: (group size, bits) of the checkpoint written by make_group_checkpoint; v_proj in
# 8 bits and finer groups than q/k (one packed qkv_proj), as a GGUF Q4_K_M file mixes them.
LAYOUT = {"q_proj": (32, 4), "k_proj": (32, 4), "v_proj": (16, 8), "o_proj": (32, 4),
          "gate_proj": (64, 4), "up_proj": (32, 4), "down_proj": (32, 8), "lm_head": (128, 4)}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), **SHAPE)


def _layout(name: str, default_group: int) -> tuple[int, int] | None:
    module = name.rsplit(".", 1)[0]
    if not name.endswith(".weight") or "embed_tokens" in name or "norm" in name:
        return None
    leaf = module.rsplit(".", 1)[-1]
    return LAYOUT.get(leaf, (default_group, 4)) if default_group == 0 else (default_group, 4)


def make_group_checkpoint(src: Path, dst: Path, group: int = 0, dequantized: bool = False,
                          embedding_codes: bool = False) -> Path:
    """``src``'s linear weights group-quantized (``group`` 0: LAYOUT's mixed groups and bits)
    into a checkpoint of codes / scales / mins at ``dst`` (quant_method "group"), or with
    ``dequantized`` a float checkpoint of the dequantized weights (with ``embedding_codes`` the
    token embedding's too, as ``--quantization int4`` holds it: EMBEDDING_CODES)."""
    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        layout = _layout(name, group)
        if dequantized and embedding_codes and name.endswith("embed_tokens.weight"):
            bits, g = EMBEDDING_CODES
            out[name] = dequantize(*quantize_groups(t, g, bits))
            continue
        if layout is None:
            out[name] = t
            continue
        g, bits = layout
        codes, scales, mins = quantize_groups(t, g, bits)
        module = name.rsplit(".", 1)[0]
        if dequantized:
            out[name] = dequantize(codes, scales, mins)
            continue
        out[f"{module}.weight_codes"] = codes
        out[f"{module}.weight_group_scales"] = scales
        out[f"{module}.weight_group_mins"] = mins
        out[f"{module}.weight_bits"] = torch.tensor(bits, dtype=torch.int64)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    if not dequantized:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "group"}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _logits(path, tp=None, pack=True, **kw):
    model = tpserve_model(path, tp, **kw)
    if pack:
        prepack_model(model)
    return model, run_prefill_then_decode(model, PROMPTS, DECODE)


def _no_prepack(monkeypatch):
    monkeypatch.setenv("TPSERVE_PREPACK", "0")


# ---- configs ---------------------------------------------------------------------------------

def test_int4_configs():
    qc = resolve_quantization("int4", {})
    assert (qc.method, qc.group_size, qc.bits, qc.from_checkpoint) == ("group", 128, 4, False)
    assert resolve_quantization("int4-g32", {}).group_size == 32
    ck = resolve_quantization(None, {"quantization_config": {"quant_method": "group"}})
    assert ck.grouped and ck.from_checkpoint and ck.group_size == 0
    awq = resolve_quantization(None, {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                              "group_size": 128}})
    assert awq.checkpoint_format == "awq" and awq.group_size == 128
    with pytest.raises(ConfigError, match="group_size"):
        resolve_quantization(None, {"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                            "group_size": 100}})
    with pytest.raises(ConfigError, match="bits"):
        resolve_quantization(None, {"quantization_config": {"quant_method": "gptq", "bits": 3,
                                                            "group_size": 128}})
    with pytest.raises(ConfigError, match="already quantized"):
        resolve_quantization("int4", {"quantization_config": {"quant_method": "group"}})
    with pytest.raises(ConfigError, match="needs a checkpoint"):
        resolve_quantization("group", {})


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (4, 128), (6, 16), (5, 32)])
def test_packed_rows_read_back_codes_scales_and_mins(bits, group):
    """An embedding that shares a tied head's codes looks its rows up in the packed layout: for
    any rows (across panels, the padded last one included) the codes, scales and mins come back."""
    from tpserve.models.group_quant import pack_group_weight, packed_rows
    torch.manual_seed(bits + group)
    n, k = 150, 256
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // group) + 0.1
    mins = -torch.rand(n, k // group)
    packed = pack_group_weight(codes, scales, mins, 4 if bits == 4 else 8)
    # codes below 64 are held in 6 bits: 3/4 of a byte each
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    assert packed.data.numel() == -(-n // panel) * panel * k * {4: 4, 5: 6, 6: 6, 8: 8}[bits] // 8
    ids = torch.tensor([0, 149, 63, 64, 17, 17, 100])
    got = packed_rows(packed, ids)
    assert torch.equal(got[0], codes[ids])
    for g, ref in zip(got[1:], (scales, mins)):
        assert torch.equal(g, ref[ids].half().float() if packed.scales.dtype == torch.float16 else ref[ids])


def test_quantize_groups_round_to_nearest():
    w = torch.randn(24, 96)
    for g, bits in ((32, 4), (16, 8), (96, 4)):
        codes, scales, mins = quantize_groups(w, g, bits)
        assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** bits
        assert scales.shape == mins.shape == (24, 96 // g)
        err = (dequantize(codes, scales, mins) - w).abs().view(24, -1, g)
        assert bool((err <= scales[..., None] / 2 + 1e-5).all())
    const = torch.full((2, 32), 0.5)
    codes, scales, mins = quantize_groups(const, 32)
    assert torch.equal(dequantize(codes, scales, mins), const)


# ---- models ------------------------------------------------------------------------------------

def test_checkpoint_codes_equal_the_dequantized_model(float_model, tmp_path, monkeypatch):
    """Codes / scales / mins in a checkpoint (mixed groups and bits inside packed layers) load
    onto the layers: the plain-torch path equals the float model of the dequantized weights."""
    ck = make_group_checkpoint(float_model, tmp_path / "group")
    ref = make_group_checkpoint(float_model, tmp_path / "deq", dequantized=True)
    _no_prepack(monkeypatch)
    model, got = _logits(ck, pack=False)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.group_size == 16 and qkv.weight_group_scales.shape == (128 + 2 * 64, 128 // 16)
    assert model.model.layers[0].feed_forward.gate_up_proj.group_size == 32
    _, want = _logits(ref, pack=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_checkpoint_codes_on_the_kernels(float_model, tmp_path):
    """The same checkpoint packed for the C++ kernels (W4A8 / W8A8 per group): close to the
    dequantized float model."""
    assert cpu_extension.available()
    ck = make_group_checkpoint(float_model, tmp_path / "group")
    ref = make_group_checkpoint(float_model, tmp_path / "deq", dequantized=True)
    model, got = _logits(ck, backend="cpu")
    assert model.model.layers[0].self_attn.qkv_proj.packed.kind == 5  # v_proj's 8-bit codes
    assert model.model.layers[0].self_attn.o_proj.packed.kind == 4
    _, want = _logits(ref, backend="cpu")
    for a, b in zip(got, want):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() < 0.05 * scale
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75


@pytest.mark.parametrize("stack", [True, False])
def test_fused_decode_takes_group_layers(float_model, tmp_path, stack):
    """The fused decode (the whole stack in one call, or two calls per layer as under TP) runs
    group layers through the same kernels as the modules: bit-identical logits."""
    from test_fused_decode import _decode_logits
    ck = make_group_checkpoint(float_model, tmp_path / "group")
    fused = _decode_logits(ck, "float32", None, fused=True, stack=stack)
    modules = _decode_logits(ck, "float32", None, fused=False)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_bad_group_tensors_are_refused(float_model, tmp_path):
    ck = make_group_checkpoint(float_model, tmp_path / "bad", group=32)
    tensors = load_file(str(ck / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight_group_scales"
    tensors[key] = tensors[key][:, :3].contiguous()  # 256 inputs in 3 groups
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.weight_group_scales"):
        tpserve_model(ck)


@pytest.mark.parametrize("group", [128, 32])
def test_int4_at_load_matches_its_dequantized_model(float_model, tmp_path, group):
    ref = make_group_checkpoint(float_model, tmp_path / "deq", group=group, dequantized=True,
                                embedding_codes=True)
    mode = "int4" if group == 128 else "int4-g32"
    model, got = _logits(float_model, backend="cpu", quantization=mode)
    assert model.lm_head.packed is not None and model.lm_head.packed.kind == 4
    _, want = _logits(ref, backend="cpu")
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(got, want)]).mean().item()
    assert agree >= 0.8, agree


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pack", [True, False])
def test_int4_holds_the_embedding_as_8_bit_codes(tmp_path, monkeypatch, tied, pack):
    """--quantization int4 keeps no float embedding table: once packed the rows are looked up in
    8-bit codes per group of 32 (exactly the dequantized codes of round-to-nearest), and a tied
    LM head still takes its 4-bit codes from the float table, not from those codes."""
    from tpserve.models.group_quant import w4a8_reference
    path = make_tiny_model(tmp_path, **SHAPE, tie_word_embeddings=tied)
    table = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].float()
    if not pack:
        _no_prepack(monkeypatch)
    model = tpserve_model(path, backend="cpu", quantization="int4", dtype="float32")
    embed = model.model.embed_tokens
    ids = torch.tensor([0, 383, 5, 5, 200])
    assert torch.equal(embed(ids), table[ids])  # the float table until packed
    prepack_model(model)
    assert embed.reads_codes and embed.weight.numel() == 0
    assert (embed.rows_of.packed is not None) == pack
    if tied:
        assert model.lm_head.weight.numel() == 0  # the one float table, freed
    bits, group = EMBEDDING_CODES
    want = dequantize(*quantize_groups(table, group, bits))
    assert torch.equal(embed(ids), want[ids])
    assert not torch.equal(embed(ids), table[ids])
    hidden = torch.randn(3, SHAPE["hidden_size"])
    head = table if tied else load_file(str(path / "model.safetensors"))["lm_head.weight"].float()
    codes = quantize_groups(head, 128, 4)
    # packed: W4A8 (int8 activations per group); unpacked: the dequantized weight in torch
    ref = w4a8_reference(hidden, *codes) if pack else hidden @ dequantize(*codes).T
    torch.testing.assert_close(model.lm_head(hidden), ref, rtol=1e-4, atol=1e-4)


def test_a_checkpoints_group_that_the_split_cuts_becomes_finer_groups(float_model, tmp_path):
    """o_proj's 128 inputs in one group of 128, over two ranks: each rank's 64 are a group of 64
    with the cut group's scale and min, exactly the checkpoint's weights (quantized at load, the
    split must still keep whole groups: below)."""
    path = make_group_checkpoint(float_model, tmp_path / "g128", group=128)
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.0.self_attn.o_proj.weight"
    want = dequantize(*(tensors[f"{prefix}_{k}"] for k in ("codes", "group_scales", "group_mins")))
    for rank in (0, 1):
        o_proj = tpserve_model(path, TPContext(rank=rank, size=2)).model.layers[0].self_attn.o_proj
        assert o_proj.group_size == 64
        assert torch.equal(dequantize(*o_proj.group_tensors()), want[:, 64 * rank:64 * (rank + 1)])


def test_a_ranks_share_that_is_not_whole_groups_takes_a_finer_group(float_model):
    """o_proj: 128 inputs, 64 per rank of two: not a whole group of 128, so groups of 64 there;
    the column layers keep 128. No multiple of 16 dividing the share is named."""
    from tpserve.models.group_quant import fit_group
    layer = tpserve_model(float_model, TPContext(rank=1, size=2), quantization="int4").model.layers[0]
    assert layer.self_attn.o_proj.group_size == 64 and layer.self_attn.qkv_proj.group_size == 128
    assert (fit_group(2752, 128, "x"), fit_group(384, 128, "x"), fit_group(48, 32, "x")) == (64, 128, 16)
    with pytest.raises(CheckpointError, match="o_proj: 40 input features on this rank are not a multiple"):
        fit_group(40, 128, "o_proj")


def _tp_worker(rank: int, store: str, path: str, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        model, logits = _logits(path, tp, backend="cpu", quantization="int4-g32")
        assert model.model.layers[0].self_attn.o_proj.packed.kind == 4
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, "tp2.pt"))


def test_int4_tp2_equals_tp1(float_model):
    """TP=2 over gloo: each rank quantizes its shard with whole groups, so the activations'
    groups are the same as at TP=1 and only the order of the fp32 sums differs."""
    _, want = _logits(float_model, backend="cpu", quantization="int4-g32")
    with tempfile.TemporaryDirectory() as out:
        run_two_ranks(_tp_worker, str(float_model), out)
        got = torch.load(os.path.join(out, "tp2.pt"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _greedy(path, **options) -> list[list[int]]:
    from tpserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, **options) as llm:
        return [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_offline_int4_greedy_at_tp1_and_tp2(float_model, tmp_path):
    """The offline engine with --quantization int4-g32, one process and two TP ranks (gloo),
    greedy-matches the float model of its own dequantized weights on most tokens."""
    ref = _greedy(make_group_checkpoint(float_model, tmp_path / "deq", group=32, dequantized=True,
                                        embedding_codes=True))
    assert _greedy(float_model) != ref  # 4 bits change this random model's tokens: a real test
    for tp in (1, 2):
        got = _greedy(float_model, quantization="int4-g32", tensor_parallel_size=tp)
        # greedy streams diverge after a first differing token: count the agreeing prefix
        same = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                   for g, r in zip(got, ref))
        assert same >= 0.75 * sum(map(len, ref)), (tp, got, ref)
