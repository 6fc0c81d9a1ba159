"""The fused decode path on mixture-of-experts models (router, routing, shared expert and grouped
experts in the MLP half's one call): bit-identical to the module path on packed experts, whole
stack and layer by layer, for every weight kind; and a model whose experts are not packed is not
fused."""
from __future__ import annotations

import os

import pytest
import torch

from model_factory import make_tiny_model
from test_models import PagedKV, random_prompts, tpserve_model
from test_fused_decode import run_steps
from test_models_tp import gloo_group, run_two_ranks
from tpserve.kernels import cpu_extension
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.moe import SparseMoeBlock
from tpserve.models.packed_gemm import prepack_model

# The C++ operators are under test: `make test` builds them, so their absence is a failure.
assert cpu_extension.available(), cpu_extension._state.get("error")

CASES = {  # name: (make_tiny_model arch and overrides, dtype, --quantization)
    "qwen3_moe-fp32": ("qwen3_moe", dict(), "float32", None),
    # dense layers 0 and 2 between sparse ones, no renormalisation, bf16 (routing weights rounded)
    "qwen3_moe-step2-bf16": ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2,
                                                norm_topk_prob=False), "bfloat16", None),
    "qwen2_moe-shared-bf16": ("qwen2_moe", dict(), "bfloat16", None),
    "mixtral-int8": ("mixtral", dict(), "float32", "int8"),
    # 4-bit group-quantized experts (and dense layers), int8 activations per group
    "qwen3_moe-int4-bf16": ("qwen3_moe", dict(), "bfloat16", "int4-g32"),
}


def _decode_logits(path, dtype, quant, fused: bool, stack: bool = True, tp=None, expert_parallel=False):
    model = tpserve_model(path, tp, backend="cpu", dtype=dtype, quantization=quant,
                          enable_expert_parallel=expert_parallel)
    prepack_model(model)
    blocks = [layer.feed_forward for layer in model.model.layers
              if isinstance(layer.feed_forward, SparseMoeBlock)]
    assert blocks and all(b.experts.packed is not None for b in blocks)
    for b in blocks:  # weights large enough that the routers spread tokens over the experts
        b.gate.packed.data.mul_(4)  # (routers stay float under every --quantization)
    prompts = random_prompts([9, 4, 17], 384, seed=3)
    kv = PagedKV(model, len(prompts), 40)
    if fused:
        assert model.enable_fused_decode() is None
        assert (model.fused_decode.stack is not None) == (model.tp.size == 1)
        assert model.fused_decode.layer_stack is not None  # MoE layers: their MLP halves
        if not stack:
            model.fused_decode.stack = None  # the layer-by-layer calls tensor parallelism takes
    out, chosen = run_steps(model, kv, prompts, fused), set()
    for b in blocks:
        x = torch.randn(64, b.gate.input_size).to(model.dtype)
        chosen.update(b.gate(x).topk(b.top_k).indices.flatten().tolist())
    assert len(chosen) >= 6  # of 8 experts: the routers spread tokens
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_of_moe_layers_equals_the_module_path_bit_for_bit(tmp_path, name):
    arch, overrides, dtype, quant = CASES[name]
    path = make_tiny_model(tmp_path, arch=arch, **overrides)
    plain = _decode_logits(path, dtype, quant, fused=False)
    for stack in (True, False):
        fused = _decode_logits(path, dtype, quant, fused=True, stack=stack)
        for a, b in zip(plain, fused):
            assert torch.equal(a, b)


def test_unpacked_experts_are_not_fused(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen3_moe")
    model = tpserve_model(path, backend="cpu")
    prepack_model(model)
    PagedKV(model, 1, 16)
    block = model.model.layers[0].feed_forward
    block.experts.packed = None
    assert "experts packed" in why_not_fused(model)
    assert model.enable_fused_decode() is not None and model.fused_decode is None


def _tp_worker(rank: int, store: str, cases: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, path, expert_parallel in cases:
            logits = {fused: _decode_logits(path, "float32", None, fused, tp=tp,
                                            expert_parallel=expert_parallel)
                      for fused in (False, True)}
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"{name}.pt"))
            else:
                assert all(x is None for x in logits[True])


@pytest.mark.timeout(240)
def test_fused_decode_of_moe_layers_at_tp2_equals_the_module_path(tmp_path):
    """Both sharding modes: the layer-by-layer fused path (the stack's MLP halves, the all-reduce
    in Python between the calls) gives rank 0 the module path's logits bit for bit."""
    cases = [("qwen2_moe-intermediate", str(make_tiny_model(tmp_path, arch="qwen2_moe")), False),
             ("mixtral-expert-parallel", str(make_tiny_model(tmp_path, arch="mixtral")), True)]
    run_two_ranks(_tp_worker, cases, str(tmp_path), timeout=220)
    for name, _, _ in cases:
        logits = torch.load(tmp_path / f"{name}.pt")
        assert len(logits[True]) == 4
        for a, b in zip(logits[False], logits[True]):
            assert torch.equal(a, b), name
