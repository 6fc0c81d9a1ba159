"""GGUF mixtures of experts on tpserve's own kernels: a tiny Qwen3-MoE file (gguf's GGUFWriter, the
experts stacked in ``ffn_{gate,up,down}_exps`` as llama.cpp writes them) whose quantized experts
run as group codes (``tpserve/models/moe_group.py``) by default.

* every expert's codes, scales and mins, as packed for the grouped-expert kernel (or kept for the
  torch path without it), give back the ``gguf`` package's dequantization of the bytes written,
  exactly: Q4_0 experts in 4 bits, a K-quant mix (Q4_K gate, Q6_K up, Q8_0 down: groups of 32
  and 16) in 6 bits with the finer group;
* the native model follows the dequantized one (``--quantization none``, fp32): teacher-forced
  top-1 agreement of at least 90%; it generates alike on one rank, two tensor-parallel ranks and
  two expert-parallel ranks;
* a tensor-parallel split that cuts the groups of the down projection makes them finer (exact),
  or, where that leaves no whole groups of 16, is named with the way out;
* older Mixtral files (one tensor per expert) and a layer's experts with a float projection
  (all dequantized), and expert parallelism's other ranks' experts left unread.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from test_gguf_files import K_BLOCK
from test_gguf_gemma import finish

from tpserve.gguf_file import gguf_files, materialize
from tpserve.models.errors import CheckpointError
from tpserve.models.gguf import gguf_quant_config
from tpserve.models.group_quant import GROUP4, GROUP8, dequantize, packed_rows_reference
from tpserve.models.loader import load_config, load_model
from tpserve.models.moe import FusedMoE
from tpserve.models.packed_gemm import PackedWeight
from tpserve.models.spec import model_spec

HIDDEN, EXPERT_FFN, EXPERTS, USED, LAYERS, VOCAB, HEADS, KV_HEADS = 256, 256, 4, 2, 2, 320, 2, 1
Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [300, 2, 9, 11, 40, 41, 42, 43, 44, 45, 46], [100, 3, 4]]


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def _encode(w: np.ndarray, kind: str, rng) -> np.ndarray:
    """``w [..., cols]`` as ``kind``'s blocks: gguf's quantizer, or for the K-quants (which gguf
    cannot quantize) random blocks with small finite scales."""
    if kind not in K_BLOCK:
        return gguf.quants.quantize(w, Q[kind])
    size, halves = K_BLOCK[kind]
    lead = w.shape[:-1]
    blocks = rng.integers(0, 256, size=(*lead, w.shape[-1] // 256, size), dtype=np.uint8)
    for lo, hi in halves:
        scale = (rng.uniform(0.5, 1.5, size=(*lead, w.shape[-1] // 256)) * 0.0005).astype(np.float16)
        blocks[..., lo:hi] = scale[..., None].view(np.uint8)
    return blocks.reshape(*lead, -1)


def write_moe(path: Path, experts: tuple[str, str, str], seed: int = 0, expert_ffn: int = EXPERT_FFN
              ) -> dict[str, np.ndarray]:
    """A tiny Qwen3-MoE file with its experts' gate, up and down stacks in the given types (the
    rest float); returns the experts as a reader must get them back, by GGUF name."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", 512), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("expert_count", EXPERTS),
                       ("expert_used_count", USED), ("expert_feed_forward_length", expert_ffn)):
        w.add_uint32(f"qwen3moe.{key}", value)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN),
              "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        b = f"blk.{i}"
        shapes.update({f"{b}.attn_norm.weight": (HIDDEN,), f"{b}.ffn_norm.weight": (HIDDEN,),
                       f"{b}.attn_q.weight": (HEADS * head_dim, HIDDEN),
                       f"{b}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"{b}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"{b}.attn_output.weight": (HIDDEN, HEADS * head_dim),
                       f"{b}.attn_q_norm.weight": (head_dim,), f"{b}.attn_k_norm.weight": (head_dim,),
                       f"{b}.ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                       f"{b}.ffn_gate_exps.weight": (EXPERTS, expert_ffn, HIDDEN),
                       f"{b}.ffn_up_exps.weight": (EXPERTS, expert_ffn, HIDDEN),
                       f"{b}.ffn_down_exps.weight": (EXPERTS, HIDDEN, expert_ffn)})
    written = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        std = 0.5 if name == "token_embd.weight" else 0.08
        data = (rng.standard_normal(shape) * std).astype(np.float32)
        if "_exps" not in name:
            w.add_tensor(name, data)
            continue
        kind = experts[("gate", "up", "down").index(name.split(".")[2].split("_")[1])]
        raw = _encode(data, kind, rng)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q[kind])
        written[name] = gguf.quants.dequantize(raw, Q[kind])
    finish(w)
    return written


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _unpacked(stack, e: int) -> torch.Tensor:
    one = PackedWeight(data=stack.data[e], kind=stack.kind, n=stack.n, k=stack.k, scales=stack.scales[e],
                       colsum=stack.colsum[e])
    return dequantize(*packed_rows_reference(one, torch.arange(stack.n)))


@pytest.mark.parametrize("prepack", ["1", "0"])
@pytest.mark.parametrize("types", [("Q4_0", "Q4_0", "Q4_0"), ("Q4_K", "Q6_K", "Q8_0")], ids="-".join)
def test_experts_load_as_the_files_codes(tmp_path, monkeypatch, types, prepack):
    monkeypatch.setenv("TPSERVE_PREPACK", prepack)
    path = tmp_path / "moe.gguf"
    written = write_moe(path, types)
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    qc = gguf_quant_config(gguf_files(directory), None, spec, {})
    assert qc.grouped and qc.from_checkpoint
    model = load_model(directory, dtype="float32")
    layers = _experts(model)
    assert len(layers) == LAYERS
    for i, fm in enumerate(layers):
        assert fm.group is not None and fm.w13_weight is None  # no float experts held
        gate, up, down = (torch.from_numpy(written[f"blk.{i}.ffn_{k}_exps.weight"])
                          for k in ("gate", "up", "down"))
        if prepack == "1":  # packed as each layer completed loading
            assert fm.packed is not None and fm.group.stacks is None
            kind = GROUP4 if types[0] == "Q4_0" else GROUP8
            assert fm.packed.w13.kind == fm.packed.w2.kind == kind
            for e in range(EXPERTS):
                assert torch.equal(_unpacked(fm.packed.w13, e), torch.cat([gate[e], up[e]])), (i, e)
                assert torch.equal(_unpacked(fm.packed.w2, e), down[e]), (i, e)
            # read per selected expert: a fraction of its bf16 bytes
            bf16 = 3 * HIDDEN * EXPERT_FFN * 2
            assert fm.packed.bytes_per_expert() < (0.3 if kind == GROUP4 else 0.6) * bf16
        else:  # the torch path: the stacked codes, gate and up at the finer group
            assert fm.packed is None
            w13, w2 = fm.group.stacks
            if types[1] == "Q6_K":
                assert w13.codes.shape[2] // w13.scales.shape[2] == 16
            for e in range(EXPERTS):
                assert torch.equal(w13[e], torch.cat([gate[e], up[e]])) and torch.equal(w2[e], down[e])


def test_experts_with_a_float_projection_are_all_dequantized(tmp_path):
    """A layer's experts are one fused layer: with their up projections in F16, every projection
    of every expert is dequantized (exact); the file's other tensors are float, so nothing of it
    runs as codes."""
    path = tmp_path / "moe-f16-up.gguf"
    written = write_moe(path, ("Q4_0", "F16", "Q4_0"))
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    assert gguf_quant_config(gguf_files(directory), None, spec, {}) is None
    model = load_model(directory, dtype="float32")
    for i, fm in enumerate(_experts(model)):
        assert fm.group is None and fm.w13_weight.dtype == torch.float32
        gate, up, down = (torch.from_numpy(written[f"blk.{i}.ffn_{k}_exps.weight"].astype(np.float32))
                          for k in ("gate", "up", "down"))
        assert torch.equal(fm.w13_weight, torch.cat([gate, up], dim=1)) and torch.equal(fm.w2_weight, down)


def test_other_ranks_experts_are_not_read(tmp_path):
    """Expert parallelism: the experts another rank holds come as names without tensors, neither
    repacked nor dequantized; the others as without ``skip``."""
    from tpserve.models.gguf import gguf_weights
    path = tmp_path / "moe.gguf"
    write_moe(path, ("Q4_0", "Q8_0", "Q4_0"))
    directory = materialize(path)
    spec = model_spec(load_config(directory))
    files = gguf_files(directory)
    for qc in (gguf_quant_config(files, None, spec, {}), None):
        whole = dict(gguf_weights(files, spec, qc, torch.float32))
        got = dict(gguf_weights(files, spec, qc, torch.float32, skip=lambda name: ".experts.1." in name))
        assert got.keys() == whole.keys()
        for name, tensor in got.items():
            if ".experts.1." in name:
                assert tensor is None, name
            else:
                assert torch.equal(tensor, whole[name]), name
        leaf = "weight_codes" if qc is not None else "weight"
        assert whole[f"model.layers.1.mlp.experts.1.down_proj.{leaf}"] is not None


def test_mixtral_files_with_one_tensor_per_expert(tmp_path):
    """Older Mixtral files (llama architecture with ``expert_count``) keep each expert's weights
    apart, ``blk.N.ffn_gate.E.weight`` ...: natively they are that expert's codes, exactly."""
    path = tmp_path / "mixtral.gguf"
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", EXPERT_FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("expert_count", EXPERTS),
                       ("expert_used_count", USED)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN),
              "output_norm.weight": (HIDDEN,), "blk.0.attn_norm.weight": (HIDDEN,),
              "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN),
              "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HEADS * head_dim),
              "blk.0.ffn_gate_inp.weight": (EXPERTS, HIDDEN)}
    for e in range(EXPERTS):
        for k in ("gate", "up", "down"):
            rows, cols = (HIDDEN, EXPERT_FFN) if k == "down" else (EXPERT_FFN, HIDDEN)
            shapes[f"blk.0.ffn_{k}.{e}.weight"] = (rows, cols)
    written = {}
    for name, shape in shapes.items():
        data = (rng.standard_normal(shape) * 0.08 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            raw = gguf.quants.quantize(data, Q.Q8_0)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q.Q8_0)
            written[name] = gguf.quants.dequantize(raw, Q.Q8_0)
        else:
            w.add_tensor(name, data)
    finish(w)
    directory = materialize(path)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    (fm,) = _experts(load_model(directory, dtype="float32"))
    assert fm.packed is not None and fm.packed.kind == GROUP8
    for e in range(EXPERTS):
        gate, up, down = (torch.from_numpy(written[f"blk.0.ffn_{k}.{e}.weight"])
                          for k in ("gate", "up", "down"))
        assert torch.equal(_unpacked(fm.packed.w13, e), torch.cat([gate, up]))
        assert torch.equal(_unpacked(fm.packed.w2, e), down)


def _top1(path: Path, sequences, **options) -> list[list[int]]:
    from tpserve import LLM, SamplingParams
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, **options) as llm:
        outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [[max(entry, key=lambda t: entry[t].logprob) for entry in out.prompt_logprobs[1:]] for out in outs]


def _greedy(path: Path, **options) -> list[list[int]]:
    from tpserve import LLM, SamplingParams
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_native_experts_follow_the_dequantized_model(tmp_path):
    path = tmp_path / "moe-q.gguf"
    write_moe(path, ("Q4_0", "Q8_0", "Q4_1"), seed=1)
    native = _greedy(path)
    assert _greedy(path, tensor_parallel_size=2) == native
    assert _greedy(path, tensor_parallel_size=2, enable_expert_parallel=True) == native
    sequences = [p + g for p, g in zip(PROMPTS, native)]
    want = _top1(path, sequences, quantization="none")
    got = _top1(path, sequences)
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    total = sum(len(x) for x in want)
    assert same >= 0.9 * total, (same, total)


def test_a_split_that_cuts_the_groups():
    """48 of 96 intermediate features per rank: the down projection's groups of 32 that the split
    cuts become groups of 16 with their scale and min (exact); 40 per rank (not whole groups of 16)
    is named, with the way out. Bad pieces are named too."""
    fm = FusedMoE(EXPERTS, USED, 64, 96, SimpleNamespace(rank=1, size=2))
    fm.make_group(from_checkpoint=True)
    scales = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    fm.w2_weight_group_scales.weight_loader(fm.w2_weight_group_scales, scales, (0, "down"))
    kept = fm.group.pieces[(0, "down", "weight_group_scales")]
    assert torch.equal(kept, scales.repeat_interleave(2, dim=1)[:, 3:])  # inputs 48..95, groups of 16
    odd = FusedMoE(EXPERTS, USED, 64, 80, SimpleNamespace(rank=1, size=2))
    odd.make_group(from_checkpoint=True)
    with pytest.raises(CheckpointError, match="this rank's 40 of the 80 intermediate features .from 40. are "
                                              "not whole groups of 16 or of 16.*--enable-expert-parallel"):
        odd.w2_weight_group_scales.weight_loader(odd.w2_weight_group_scales, torch.ones(64, 5), (0, "down"))
    codes = torch.zeros(96, 64)
    with pytest.raises(CheckpointError, match="expected uint8 codes"):
        fm.w13_weight_codes.weight_loader(fm.w13_weight_codes, codes, (1, "gate"))
    with pytest.raises(CheckpointError, match=r"expected \[96, 64 // group\]"):
        fm.w13_weight_group_mins.weight_loader(fm.w13_weight_group_mins, torch.ones(96, 5), (1, "up"))
