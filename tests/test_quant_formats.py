"""4-bit safetensors checkpoints: AWQ (GEMM), GPTQ (sym/asym, v1/v2) and compressed-tensors
pack-quantized group schemes (W4A16 / W4A8), written here in each format's documented layout from
a tiny random float model (the writers below pack the tensors the way each library saves them),
decoded by tpserve/models/quant_formats.py into codes/scales/mins exactly, and loaded onto the
group-quant layer greedy-equal to the same weights dequantized into a float checkpoint (fp32);
a mixture of experts' experts as group codes too; one format at TP=2; unsupported variants
refused with the field named."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model
from test_models import PagedKV, random_prompts, run_prefill_then_decode, tpserve_model
from test_models_tp import gloo_group, run_two_ranks
from tpserve.errors import ConfigError
from tpserve.kernels import cpu_extension
from tpserve.models.errors import CheckpointError
from tpserve.models.group_quant import GROUP4, dequantize
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.quant_formats import AWQ_ORDER, decode_checkpoint, unpack_words
from tpserve.quantization import resolve_quantization

GROUP = 32  # the tiny model's hidden size is 64: groups of 32 keep TP=2 row shards group-aligned


# ---- the writers: each format's layout, written from its documentation ---------------------------

def pack(values: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Pack unsigned ``values`` (< 2**bits) into int32 words along ``axis``: slot ``k`` of a word
    (bits ``bits * k``) holds element ``order[k]`` of its run of ``32 // bits`` (default ``k``)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    order = range(per) if order is None else order
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for k, j in enumerate(order):
        words |= v[..., j] << np.uint32(bits * k)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32))


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int = 0, scale_dtype=torch.float16):
    """Round-to-nearest group quantization of ``w [out, in]`` the way GPTQ/AWQ define it:
    ``w ~ (q - z) * s`` with unsigned ``q``, fp16 ``s``; symmetric: ``z = 2**(bits-1)``.
    Returns ``(q, z, s)`` as ``[out, in]``, ``[out, G]``, ``[out, G]`` (s float16) and the
    dequantized fp32 weight."""
    out, k = w.shape
    group = k if group == -1 else group  # -1: one group per row (GPTQ's per channel)
    maxq = 2 ** bits - 1
    wg = w.float().reshape(out, k // group, group)
    if sym:
        s = (wg.abs().amax(-1) / (maxq / 2)).clamp_min(1e-4).to(scale_dtype)
        z = torch.full_like(s, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / maxq).clamp_min(1e-4).to(scale_dtype)
        z = torch.round(-lo / s.float()).clamp(min_zero, maxq).to(torch.int64)
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, maxq).to(torch.int64)
    deq = ((q - z[..., None]).float() * s.float()[..., None]).reshape(out, k)
    return q.reshape(out, k), z, s, deq


def awq_tensors(w, group):
    q, z, s, deq = quantize(w, 4, group, sym=False)
    # AutoAWQ WQLinear_GEMM: [in, out] packed along out in AWQ's interleaved nibble order.
    return {"qweight": pack(q.t().numpy(), 4, 1, AWQ_ORDER), "qzeros": pack(z.t().numpy(), 4, 1, AWQ_ORDER),
            "scales": s.t().contiguous()}, deq


def gptq_tensors(w, group, bits=4, sym=True, v2=False):
    # v1 stores z - 1 (wrapping): a zero of 0 would read back as 2**bits; keep z >= 1 there.
    q, z, s, deq = quantize(w, bits, group, sym, min_zero=0 if v2 else 1)
    stored = z if v2 else z - 1
    k = w.shape[1]
    return {"qweight": pack(q.t().numpy(), bits, 0), "qzeros": pack(stored.t().numpy(), bits, 1),
            "scales": s.t().contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // (k // s.shape[1])
            }, deq


def ct_tensors(w, group, sym=True, bits=4, scale_dtype=torch.float16):
    q, z, s, deq = quantize(w, bits, group, sym, scale_dtype=scale_dtype)
    # compressed-tensors packs signed values plus 2**(bits-1): the unsigned q here; its signed
    # zero point z - 2**(bits-1) likewise, packed along the output axis.
    out = {"weight_packed": pack(q.numpy(), bits, 1), "weight_shape": torch.tensor(list(w.shape)),
           "weight_scale": s}
    if not sym:
        out["weight_zero_point"] = pack(z.numpy(), bits, 0)
    return out, deq


def ct_config(group, sym=True, acts=False, bits=4, actorder=None):
    channel = group == -1  # strategy "channel": one scale per output row
    weights = {"num_bits": bits, "type": "int", "symmetric": sym,
               "strategy": "channel" if channel else "group", "group_size": None if channel else group,
               "dynamic": False, "actorder": actorder, "observer": "minmax", "block_structure": None}
    token = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
             "group_size": None, "actorder": None, "block_structure": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": token if acts else None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def format_config(fmt: str, group: int, **kw) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": kw.get("bits", 4), "group_size": group, "desc_act": False,
                "sym": kw.get("sym", True), "static_groups": False, "true_sequential": True,
                "checkpoint_format": "gptq_v2" if fmt == "gptq_v2" else "gptq"}
    return ct_config(group, sym=kw.get("sym", True), acts=kw.get("acts", False), bits=kw.get("bits", 4))


def format_tensors(fmt, w, group, kw):
    """One weight in ``fmt``: (its tensors by leaf name, the weight they dequantize to)."""
    if fmt == "awq":
        return awq_tensors(w, group)
    if fmt.startswith("gptq"):
        return gptq_tensors(w, group, kw.get("bits", 4), kw.get("sym", True), fmt == "gptq_v2")
    return ct_tensors(w, group, kw.get("sym", True), kw.get("bits", 4), kw.get("scale_dtype", torch.float16))


def write_checkpoint(src: Path, dst: Path, fmt: str, group: int = GROUP, keep: tuple = (), **kw
                     ) -> tuple[Path, Path]:
    """``src``'s linear layers (not the embedding, not the LM head, none whose name holds one of
    ``keep``) in ``fmt`` at ``dst``, and the same weights dequantized as a float checkpoint at
    ``dst``-float; returns both paths."""
    ref = dst.with_name(dst.name + "-float")
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quant, deq_all = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        linear = name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name
        if not linear or module == "lm_head" or any(k in name for k in keep):
            quant[name] = deq_all[name] = t
            continue
        parts, deq = format_tensors(fmt, t, group, kw)
        quant.update({f"{module}.{leaf}": v for leaf, v in parts.items()})
        deq_all[name] = deq
    for d, ts in ((dst, quant), (ref, deq_all)):
        (d / "model.safetensors").unlink()
        save_file(ts, str(d / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = format_config(fmt, group, **kw)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


# ---- decoding, exactly ---------------------------------------------------------------------------

def test_unpack_words_orders():
    vals = np.arange(32, dtype=np.uint32).reshape(2, 16) % 16
    assert torch.equal(unpack_words(pack(vals, 4, 1), 4, 1), torch.from_numpy(vals.astype(np.uint8)))
    assert torch.equal(unpack_words(pack(vals, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER),
                       torch.from_numpy(vals.astype(np.uint8)))
    tall = np.arange(64, dtype=np.uint32).reshape(16, 4) % 256
    assert torch.equal(unpack_words(pack(tall, 8, 0), 8, 0), torch.from_numpy(tall.astype(np.uint8)))
    # AWQ's interleaving: the nibble at bits 4..7 of the first word is column 2
    word = int(pack(vals[:1], 4, 1, AWQ_ORDER)[0, 0]) & 0xFFFFFFFF
    assert (word >> 4) & 0xF == vals[0, 2] and (word >> 16) & 0xF == vals[0, 1]


CASES = [("awq", {}), ("gptq", {"sym": True}), ("gptq", {"sym": False}), ("gptq_v2", {"sym": False}),
         ("gptq", {"sym": True, "bits": 8}), ("compressed-tensors", {"sym": True}),
         ("compressed-tensors", {"sym": False}), ("compressed-tensors", {"sym": False, "bits": 8}),
         ("gptq", {"sym": False, "group": -1}), ("compressed-tensors", {"sym": True, "group": -1}),
         ("gptq", {"sym": True, "group": 512}),
         ("compressed-tensors", {"sym": False, "scale_dtype": torch.bfloat16})]


@pytest.mark.parametrize("fmt, kw", CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in CASES])
def test_decoding_gives_the_formats_dequantized_weights_exactly(fmt, kw):
    torch.manual_seed(0)
    group = kw.get("group", 64)
    w = torch.randn(48, 1024 if group == 512 else 128) * 0.3
    parts, deq = format_tensors(fmt, w, group, kw)
    stream = [("m.bias", torch.ones(3))] + [(f"m.proj.{k}", v) for k, v in sorted(parts.items())]
    bits = kw.get("bits", 4)
    out = dict(decode_checkpoint(stream, fmt, bits, zero_points=not kw.get("sym", True)))
    codes, scales, mins = (out[f"m.proj.weight_{n}"] for n in ("codes", "group_scales", "group_mins"))
    assert torch.equal(out["m.bias"], torch.ones(3))
    assert codes.dtype == torch.uint8 and codes.shape == w.shape and int(codes.max()) < 2 ** bits
    # groups the kernels have: 64 as written; per channel (128 inputs) -> 128; 512 -> 256
    want_groups = w.shape[1] // {64: 64, -1: 128, 512: 256}[group]
    assert scales.dtype == mins.dtype == torch.float32 and scales.shape == (48, want_groups)
    assert ("m.proj.weight_bits" in out) == (bits == 8)
    assert torch.equal(dequantize(codes, scales, mins), deq)
    assert (deq - w).abs().max() < 0.2 * w.abs().max()  # and it is the weight, quantized


def test_decoder_errors_name_the_tensor():
    w = torch.randn(16, 64)
    parts, _ = gptq_tensors(w, 32)
    with pytest.raises(CheckpointError, match=r"a\.proj: the checkpoint has g_idx, qweight, scales but no"):
        list(decode_checkpoint([(f"a.proj.{k}", v) for k, v in parts.items() if k != "qzeros"], "gptq"))
    shuffled = dict(parts, g_idx=torch.randperm(64).to(torch.int32) // 32)
    with pytest.raises(CheckpointError, match=r"a\.proj\.g_idx: .*desc_act"):
        list(decode_checkpoint([(f"a.proj.{k}", v) for k, v in sorted(shuffled.items())], "gptq"))
    late = [(f"a.proj.{k}", v) for k, v in sorted(parts.items()) if k != "g_idx"]
    late.append(("a.proj.g_idx", shuffled["g_idx"]))
    with pytest.raises(CheckpointError, match=r"a\.proj\.g_idx"):
        list(decode_checkpoint(late, "gptq"))
    bad = dict(parts, scales=parts["scales"][:, :8])
    with pytest.raises(CheckpointError, match=r"a\.proj\.scales: expected shape"):
        list(decode_checkpoint([(f"a.proj.{k}", v) for k, v in bad.items()], "gptq"))
    ct, _ = ct_tensors(w, 32, sym=False)
    stream = [(f"b.{k}", v) for k, v in sorted(ct.items())]
    with pytest.raises(CheckpointError, match=r"b\.weight_zero_point: comes after"):
        list(decode_checkpoint(stream, "compressed-tensors", zero_points=False))
    # another rank's tensors (None) stay None
    none = [(f"c.{k}", None) for k in ("qweight", "qzeros", "scales")]
    assert dict(decode_checkpoint(none, "awq")) == {f"c.weight_{n}": None for n in ("codes", "group_scales",
                                                                                     "group_mins")}


# ---- loading a model, greedy-equal to the dequantized float model --------------------------------

@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=False)


def greedy(model, prompts, steps: int, tp_ranks: int = 1) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of every prompt for ``steps`` tokens; the tokens and each step's logits
    (with ``tp_ranks`` > 1 rank 0's tokens are broadcast: the other ranks get no logits)."""
    kv = PagedKV(model, len(prompts), max(map(len, prompts)) + steps)
    new, tokens, logits = prompts, [[] for _ in prompts], []
    for _ in range(steps):
        ids, pos, meta = kv.step(new)
        out = model.compute_logits(model.forward(ids, pos, meta))
        chosen = torch.zeros(len(prompts), dtype=torch.int64)
        if out is not None:
            last = out if len(out) == len(prompts) else out[torch.tensor([len(p) for p in new]).cumsum(0) - 1]
            logits.append(last)
            chosen = last.argmax(-1)
        if tp_ranks > 1:
            torch.distributed.broadcast(chosen, src=0)
        new = [[int(t)] for t in chosen]
        for seq, t in zip(tokens, new):
            seq += t
    return tokens, logits


PROMPTS = random_prompts([7, 3, 11], 384, seed=5)


@pytest.mark.parametrize("fmt, kw", [("awq", {}), ("gptq", {"sym": True}), ("gptq", {"sym": False}),
                                     ("compressed-tensors", {"sym": True}),
                                     ("compressed-tensors", {"sym": False, "acts": True}),
                                     ("gptq", {"sym": False, "group": -1})],
                         ids=["awq", "gptq-sym", "gptq-asym", "ct-w4a16", "ct-w4a8-asym", "gptq-per-channel"])
def test_checkpoint_loads_greedy_equal_to_its_dequantized_weights(float_model, tmp_path, fmt, kw):
    quant, ref = write_checkpoint(float_model, tmp_path / fmt, fmt, **kw)
    model = tpserve_model(quant)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_codes.dtype == torch.uint8
    # per channel: down_proj's rows of 128 inputs become groups of 128
    assert layer.mlp.down_proj.group_size == (128 if kw.get("group") == -1 else GROUP)
    got, got_logits = greedy(model, PROMPTS, 6)
    want, want_logits = greedy(tpserve_model(ref), PROMPTS, 6)
    assert got == want
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


@pytest.mark.parametrize("fmt, kw", [("gptq", {"sym": True}), ("awq", {})], ids=["gptq", "awq"])
def test_a_mixture_of_experts_checkpoint_loads_its_experts_as_codes(tmp_path, monkeypatch, fmt, kw):
    """Qwen3-MoE with its experts (and attention) in 4 bits, its routers float, as GPTQ and AWQ
    write them: the experts load as group codes (moe_group.py) equal to the format's dequantized
    weights (the torch path, TPSERVE_PREPACK=0: greedy and logits as the float twin's); packed, the
    kernels run each layer's experts as the torch path does, but for int8 activations' rounding."""
    from tpserve.models.moe import FusedMoE
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    src = make_tiny_model(tmp_path / "src", "qwen3_moe", tie_word_embeddings=False)
    quant, ref = write_checkpoint(src, tmp_path / fmt, fmt, keep=("mlp.gate.",), **kw)
    assert "model.layers.0.mlp.experts.5.down_proj.scales" in load_file(str(quant / "model.safetensors"))
    model = tpserve_model(quant)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.group is not None and m.group.from_checkpoint for m in experts)
    got, got_logits = greedy(model, PROMPTS, 6)
    want, want_logits = greedy(tpserve_model(ref), PROMPTS, 6)
    assert got == want
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())
    monkeypatch.setenv("TPSERVE_PREPACK", "1")
    packed = [m for m in tpserve_model(quant).modules() if isinstance(m, FusedMoE)]
    gen = torch.Generator().manual_seed(0)
    for torch_path, kernel in zip(experts, packed):
        assert kernel.packed is not None and kernel.packed.kind == GROUP4
        x = torch.randn(40, 64, generator=gen)
        ids, weights = torch.randint(0, 8, (40, 2), generator=gen), torch.rand(40, 2, generator=gen)
        want = torch_path(x, ids, weights)
        assert (kernel(x, ids, weights) - want).abs().max() < 0.03 * want.abs().max()


def test_a_gptq_v2_qwen2_checkpoint_keeps_its_biases(tmp_path_factory, tmp_path):
    """Qwen2's q/k/v biases stay float next to the codes (the formats quantize weights only)."""
    qwen2 = make_tiny_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", tie_word_embeddings=True)
    quant, ref = write_checkpoint(qwen2, tmp_path / "gptq2", "gptq_v2", sym=False)
    assert "model.layers.0.self_attn.q_proj.bias" in load_file(str(quant / "model.safetensors"))
    model = tpserve_model(quant)
    assert model.model.layers[0].self_attn.qkv_proj.weight_codes.shape == (128, 64)
    got, got_logits = greedy(model, PROMPTS, 6)
    want, want_logits = greedy(tpserve_model(ref), PROMPTS, 6)
    assert got == want
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def test_a_w4a8_checkpoint_runs_on_the_kernels(float_model, tmp_path):
    """compressed-tensors W4A8 (asymmetric) packed for the C++ kernels: int8 activations per group,
    so close to (not equal to) the dequantized float model."""
    assert cpu_extension.available()
    quant, ref = write_checkpoint(float_model, tmp_path / "w4a8", "compressed-tensors", sym=False, acts=True)
    prompts = random_prompts([9, 4], 384, seed=2)
    decode = [[5, 7], [11, 13]]
    model = tpserve_model(quant, backend="cpu")
    assert prepack_model(model) > 0
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.packed.kind == GROUP4 and layer.mlp.down_proj.packed.kind == GROUP4
    assert model.lm_head.packed.kind != GROUP4  # ignored: float
    got = run_prefill_then_decode(model, prompts, decode)
    want = run_prefill_then_decode(tpserve_model(ref, backend="cpu"), prompts, decode)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75


def _tp_worker(rank: int, store: str, quant: str, ref: str, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        model = tpserve_model(quant, tp)
        layer = model.model.layers[0]
        down = layer.mlp.down_proj
        shapes = [tuple(down.weight_codes.shape), tuple(down.weight_group_scales.shape),
                  tuple(layer.self_attn.qkv_proj.weight_codes.shape)]
        tokens, logits = greedy(model, PROMPTS, 5, tp_ranks=2)
        if rank == 0:
            want, want_logits = greedy(tpserve_model(ref), PROMPTS, 5)
            torch.save({"tokens": tokens, "logits": logits, "want": want, "want_logits": want_logits,
                        "shapes": shapes}, os.path.join(out_dir, "tp.pt"))


@pytest.mark.timeout(180)
def test_tp2_shards_a_gptq_checkpoint_group_aligned(float_model, tmp_path):
    quant, ref = write_checkpoint(float_model, tmp_path / "gptq", "gptq", sym=False)
    run_two_ranks(_tp_worker, str(quant), str(ref), str(tmp_path))
    r = torch.load(tmp_path / "tp.pt")
    # down_proj: 128 inputs split in two: 64 codes and 2 groups of 32 per rank; q/k/v rows halved.
    assert r["shapes"] == [(64, 64), (64, 2), ((64 + 2 * 32) // 2, 64)]
    assert r["tokens"] == r["want"]
    for g, w in zip(r["logits"], r["want_logits"]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


# ---- unsupported variants ----------------------------------------------------------------------------

def _cfg(fmt, mutate):
    qc = format_config(fmt, 128)
    mutate(qc)
    return {"quantization_config": qc}


def _ct_weights(**kw):
    def mutate(qc):
        qc["config_groups"]["group_0"]["weights"].update(kw)
    return mutate


@pytest.mark.parametrize("hf, field", [
    (_cfg("awq", lambda q: q.update(version="gemv")), "version"),
    (_cfg("awq", lambda q: q.update(bits=3)), "bits"),
    (_cfg("awq", lambda q: q.update(zero_point=False)), "zero_point"),
    (_cfg("gptq", lambda q: q.update(bits=3)), "bits"),
    (_cfg("gptq", lambda q: q.update(group_size=100)), "group_size"),
    (_cfg("gptq", lambda q: q.update(checkpoint_format="marlin")), "checkpoint_format"),
    (_cfg("compressed-tensors", _ct_weights(num_bits=2)), "weights.num_bits"),
    (_cfg("compressed-tensors", _ct_weights(strategy="channel")), "weights.group_size: must be null"),
    (_cfg("gptq", lambda q: q.update(group_size=8)), "group_size"),
    (_cfg("compressed-tensors", _ct_weights(group_size=100)), "weights.group_size"),
    (_cfg("compressed-tensors", _ct_weights(actorder="group")), "weights.actorder"),
    (_cfg("compressed-tensors", _ct_weights(type="float")), "weights.type"),
    (_cfg("compressed-tensors", lambda q: q["config_groups"]["group_0"].update(format="marlin-24")),
     "format"),
    (_cfg("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor")),
     "weights.num_bits"),
])
def test_unsupported_variants_are_refused_naming_the_field(hf, field):
    with pytest.raises(ConfigError, match=field):
        resolve_quantization(None, hf)


def test_supported_variants_resolve():
    for fmt, kw, want in [("awq", {}, "awq"), ("gptq", {}, "gptq"), ("gptq_v2", {}, "gptq_v2"),
                          ("compressed-tensors", {"sym": False}, "compressed-tensors")]:
        qc = resolve_quantization(None, {"quantization_config": format_config(fmt, 128, **kw)})
        assert qc.grouped and qc.from_checkpoint and qc.group_size == 128 and qc.bits == 4
        assert qc.checkpoint_format == want
    # per channel, or groups the kernels lack: each layer's group from its shapes (decoder re-expresses)
    for fmt, group in [("gptq", -1), ("gptq", 512), ("compressed-tensors", -1), ("awq", 1024)]:
        qc = resolve_quantization(None, {"quantization_config": format_config(fmt, group)})
        assert qc.grouped and qc.group_size == 0
