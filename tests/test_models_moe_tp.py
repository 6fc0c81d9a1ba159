"""Mixtures of experts at TP=2 (two CPU processes over gloo), in both sharding modes.

Intermediate sharding (every rank a slice of every expert) and expert parallelism (each rank
four whole experts of eight, a token's top-2 often split across the ranks) must give rank 0
transformers' logits for a batched prefill and decode steps; int8 expert checkpoints must give
their TP=1 logits (scales sharded with the rows they scale). One pair of processes runs every
case, packed as the runner packs (C++ kernels where built).
"""
from __future__ import annotations

import os

import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_models import ATOL, RTOL, random_prompts, reference_prefill_then_decode, tpserve_model
from test_models_moe import moe_blocks, pack, record_routing, run
from test_models_tp import gloo_group, run_two_ranks
from test_quantization import make_compressed

LENGTHS = [5, 9, 3]
STEPS = 2
# name: (arch, factory overrides, enable_expert_parallel)
CASES = {
    "qwen2_moe-intermediate": ("qwen2_moe", {}, False),
    "qwen2_moe-expert-parallel": ("qwen2_moe", {}, True),
    "mixtral-intermediate": ("mixtral", {}, False),
    "mixtral-expert-parallel": ("mixtral", {}, True),
    "qwen3_moe-step2-expert-parallel": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                                          mlp_only_layers=[3]), True),
}


def _tp_worker(rank: int, store: str, cases: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, path, expert_parallel, prompts, decode in cases:
            model = tpserve_model(path, tp, enable_expert_parallel=expert_parallel)
            pack(model)
            seen = record_routing(model)
            logits = run(model, prompts, decode)
            fm = moe_blocks(model)[0].experts
            info = {"expert_start": fm.expert_start, "num_local_experts": fm.num_local_experts,
                    "w2_shape": tuple(fm.w2_weight.shape) if fm.packed is None else None,
                    "seen": [sorted(s) for s in seen]}
            torch.save({"logits": logits, "info": info}, os.path.join(out_dir, f"{name}.rank{rank}.pt"))


@pytest.mark.timeout(240)
def test_tp2_both_sharding_modes_equal_transformers(tiny_models_root, tmp_path):  # noqa: F811
    cases, expected = [], {}
    for name, (arch, overrides, expert_parallel) in CASES.items():
        path = make_tiny_model(tiny_models_root, arch, **overrides)
        prompts = random_prompts(LENGTHS, 384, seed=5)
        expected[name], decode = reference_prefill_then_decode(path, prompts, STEPS)
        cases.append((name, str(path), expert_parallel, prompts, decode))
    # int8 expert checkpoints: compared with the same checkpoint at TP=1
    base = make_tiny_model(tiny_models_root, "qwen2_moe")
    routers = ["lm_head"] + [f"model.layers.{i}.mlp.{g}" for i in range(2)
                             for g in ("gate", "shared_expert_gate")]
    w8a16 = make_compressed(base, tmp_path / "w8a16", "W8A16", ignore=tuple(routers))
    prompts = random_prompts(LENGTHS, 384, seed=5)
    decode = [[7, 8, 9], [10, 11, 12]]
    for name, ep in (("w8a16-intermediate", False), ("w8a16-expert-parallel", True)):
        single = tpserve_model(w8a16)
        pack(single)
        expected[name] = run(single, prompts, decode)
        cases.append((name, str(w8a16), ep, prompts, decode))

    run_two_ranks(_tp_worker, cases, str(tmp_path), timeout=220)

    for name, _, expert_parallel, _, _ in cases:
        r0 = torch.load(tmp_path / f"{name}.rank0.pt")
        r1 = torch.load(tmp_path / f"{name}.rank1.pt")
        assert len(r0["logits"]) == len(expected[name]) == 1 + STEPS
        for step, (got, want) in enumerate(zip(r0["logits"], expected[name])):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{name} forward {step}: {m}")
        assert all(x is None for x in r1["logits"]), "only rank 0 receives logits"
        i0, i1 = r0["info"], r1["info"]
        assert i0["seen"] == i1["seen"], "both ranks route alike"
        assert all(len(s) >= 4 for s in i0["seen"]), (name, i0["seen"])
        if expert_parallel:
            assert (i0["expert_start"], i1["expert_start"], i0["num_local_experts"]) == (0, 4, 4)
            if i0["w2_shape"] is not None:
                assert i0["w2_shape"][0] == 4 and i0["w2_shape"][2] == 32  # whole experts
        else:
            assert (i0["expert_start"], i1["expert_start"], i0["num_local_experts"]) == (0, 0, 8)
            if i0["w2_shape"] is not None:
                assert i0["w2_shape"][0] == 8 and i0["w2_shape"][2] == 16  # half of each expert


@pytest.mark.timeout(240)
def test_llm_with_expert_parallel_workers_matches_transformers(tiny_models_root):  # noqa: F811
    """--enable-expert-parallel reaches the worker rank: experts of 33 cannot be split in
    two along their intermediate size, so only whole experts per rank can serve this model."""
    from transformers import AutoModelForCausalLM
    from tpserve import LLM, SamplingParams
    from tpserve.models import UnsupportedModelError
    from tpserve.models.spec import check_tp_size, model_spec
    from tpserve.models.loader import load_config
    path = make_tiny_model(tiny_models_root, "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size"):
        check_tp_size(model_spec(load_config(path)), 2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [7] * 19]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
             num_kv_blocks=128) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # transformers' grouped-GEMM experts need 16-byte strides: its per-expert loop instead
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              experts_implementation="eager").eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want
