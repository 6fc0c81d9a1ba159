"""Mixture-of-experts models (tpserve/models/moe.py) against transformers, fp32, TP=1.

Tiny random Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral checkpoints (8 experts, top-2,
weights of std 0.25 so that routers spread tokens over the experts: every test asserts that at
least half of each layer's experts were chosen). Logits of a batched prefill and decode steps
must equal transformers' (the torch path; and, where the C++ operators are built, packed
weights, the grouped-expert kernel and the fused decode); the offline API's greedy output must
too, across block sizes, preemption, prefix-cache hits, chunked prefill and speculative decoding. Also: the
routing function, the plain-torch experts' partial sums, per-expert and fused checkpoint
names, int8 experts (quantized at load; compressed-tensors checkpoints), and the config
errors that name their field.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_llm import hf_greedy
from test_models import (ATOL, RTOL, PagedKV, random_prompts, reference_prefill_then_decode,
                         tpserve_model)
from test_quantization import make_compressed
from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.models import CheckpointError, UnsupportedModelError
from tpserve.models.decoder import MLP
from tpserve.models.moe import FusedMoE, SparseMoeBlock, experts_reference, route
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.spec import check_tp_size, model_spec

CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # the gated shared expert
    "mixtral": ("mixtral", {}),
    # layers 0, 2 and 3 dense (sparse step 2; layer 3 listed in mlp_only_layers), no renormalisation
    "qwen3_moe-step2": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                          norm_topk_prob=False)),
}
LENGTHS = [5, 11, 17]


def moe_blocks(model) -> list[SparseMoeBlock]:
    layers = model.model.layers
    return [layer.feed_forward for layer in layers if isinstance(layer.feed_forward, SparseMoeBlock)]


def record_routing(model) -> list[set]:
    """Hooks every router; returns one set per sparse layer that fills with the experts chosen."""
    seen = []
    for block in moe_blocks(model):
        chosen = set()
        seen.append(chosen)
        def hook(module, args, out, chosen=chosen, k=block.top_k):
            chosen.update(out.topk(k).indices.flatten().tolist())
        block.gate.register_forward_hook(hook)
    return seen


def assert_varied(seen: list[set], num_experts: int = 8) -> None:
    assert seen, "no sparse layer ran"
    for i, chosen in enumerate(seen):
        assert len(chosen) >= num_experts // 2, f"sparse layer {i} used only experts {sorted(chosen)}"


def pack(model) -> None:
    """Pack the weights as the runner does (the C++ kernels, where built)."""
    prepack_model(model)
    for block in moe_blocks(model):
        block.experts.prepack_experts()


def run(model, prompts, decode_tokens, fused: bool = False):
    """Batched prefill then decode steps (as test_models.run_prefill_then_decode); ``fused``
    asks for the fused decode path, which declines (with a reason) what it does not cover."""
    kv = PagedKV(model, len(prompts), max(map(len, prompts)) + len(decode_tokens))
    if fused:
        reason = model.enable_fused_decode()
        assert reason is None or isinstance(reason, str)
    out = []
    for new in [prompts] + [[[t] for t in row] for row in decode_tokens]:
        ids, pos, meta = kv.step(new)
        out.append(model.compute_logits(model.forward(ids, pos, meta)))
    return out


def assert_logits_equal(got, expected):
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"forward {step}: {m}")


MODES = ["torch", "cpu-packed"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tiny_models_root, case, mode):  # noqa: F811
    arch, overrides = CASES[case]
    path = make_tiny_model(tiny_models_root, arch, **overrides)
    prompts = random_prompts(LENGTHS, 384)
    expected, decode_tokens = reference_prefill_then_decode(path, prompts, num_steps=3)
    model = tpserve_model(path, backend="torch" if mode == "torch" else "cpu")
    if mode != "torch":
        pack(model)
    seen = record_routing(model)
    assert_logits_equal(run(model, prompts, decode_tokens, fused=mode != "torch"), expected)
    assert_varied(seen)
    assert len({int(t) for t in expected[0].argmax(-1)}) > 5
    kinds = [type(layer.feed_forward) for layer in model.model.layers]
    if case == "qwen3_moe-step2":
        assert kinds == [MLP, SparseMoeBlock, MLP, MLP]
    else:
        assert kinds == [SparseMoeBlock] * 2
    names = {n for n, _ in model.named_parameters()}
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert f"model.layers.1.{block}.gate.weight" in names
    assert f"model.layers.1.{block}.experts.w13_weight" in names
    assert ("model.layers.1.mlp.shared_expert_gate.weight" in names) == (arch == "qwen2_moe")


def test_route_softmax_topk_and_renormalisation():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0], [-1.0, 2.0, 0.0, 5.0]])
    w, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    want_w, want_ids = torch.topk(probs, 2, dim=-1)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64  # ties as torch.topk breaks them
    torch.testing.assert_close(w, want_w)
    w, ids = route(logits.to(torch.bfloat16), 2, renormalize=True)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    assert ids[2].tolist() == [3, 1]
    # Renormalised top-k probabilities are the softmax of the top-k logits (Mixtral's form).
    torch.testing.assert_close(w[2], torch.softmax(torch.tensor([5.0, 2.0]), -1), rtol=1e-2, atol=1e-2)


def test_experts_reference_partial_sums_add_up_across_expert_shards():
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 6, 16, 8, 6, 2
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    ids = torch.tensor([[0, 5], [5, 0], [1, 2], [2, 1], [0, 1], [5, 2]])  # experts 3, 4 unused
    weights = torch.rand(t, k, generator=g)
    whole = experts_reference(x, ids, weights, w13, w2)
    want = torch.zeros(t, h)
    for row in range(t):
        for j in range(k):
            ex = int(ids[row, j])
            gu = w13[ex] @ x[row]
            want[row] += weights[row, j] * (w2[ex] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    torch.testing.assert_close(whole, want, atol=1e-4, rtol=1e-4)
    parts = [experts_reference(x, ids, weights, w13[a:b], w2[a:b], expert_start=a)
             for a, b in ((0, 3), (3, 6))]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    none = experts_reference(x, ids, weights, w13[3:5], w2[3:5], expert_start=3)  # no token uses them
    assert torch.equal(none, torch.zeros(t, h))
    assert experts_reference(x[:0], ids[:0], weights[:0], w13, w2).shape == (0, h)
    # The intermediate split: each rank's slice of every expert, partial sums again.
    halves = []
    for r in range(2):
        rows = torch.cat([torch.arange(r * 4, r * 4 + 4), inter + torch.arange(r * 4, r * 4 + 4)])
        halves.append(experts_reference(x, ids, weights, w13[:, rows], w2[:, :, r * 4:r * 4 + 4]))
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-4, rtol=1e-4)


def _rewrite(src, dst, rename=None, drop=None, fuse_experts=False):
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if drop is not None and drop(name):
            continue
        out[rename(name) if rename else name] = t
    if fuse_experts:  # transformers' in-memory layout: experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            gate_up = [torch.cat([out.pop(f"{p}.{e}.gate_proj.weight"), out.pop(f"{p}.{e}.up_proj.weight")])
                       for e in range(8)]
            out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{p}.down_proj"] = torch.stack([out.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    return dst


def test_fused_and_renamed_checkpoints_load_like_per_expert_ones(tiny_models_root, tmp_path):  # noqa: F811
    prompts = random_prompts([7, 4], 384, seed=3)
    decode = [[9, 10]]
    for arch, kw in (("qwen2_moe", dict(fuse_experts=True)),
                     ("mixtral", dict(rename=lambda n: n.replace(".block_sparse_moe.", ".mlp.")))):
        path = make_tiny_model(tiny_models_root, arch)
        want = run(tpserve_model(path), prompts, decode)
        got = run(tpserve_model(_rewrite(path, tmp_path / arch, **kw)), prompts, decode)
        for g, w in zip(got, want):
            assert torch.equal(g, w), arch


def test_missing_and_misshaped_expert_weights_are_reported(tiny_models_root, tmp_path):  # noqa: F811
    path = make_tiny_model(tiny_models_root, "mixtral")
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    bad = _rewrite(path, tmp_path / "missing", drop=lambda n: n == gone)
    with pytest.raises(CheckpointError, match=f"missing weights: {gone}"):
        tpserve_model(bad)
    shape = _rewrite(path, tmp_path / "shape",
                     rename=lambda n: n.replace("experts.2.w2.", "experts.2.w1."),
                     drop=lambda n: n.endswith("experts.2.w1.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.2\.w1\.weight: FusedMoE expert gate"):
        tpserve_model(shape)
    extra = _rewrite(path, tmp_path / "extra", rename=lambda n: n.replace("experts.7.", "experts.8."))
    with pytest.raises(CheckpointError, match=r"unexpected weights.*experts\.8\.w1"):
        tpserve_model(extra)


# ---------------------------------------------------------------- the offline API, greedy

GREEDY_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [100, 3, 4], list(range(200, 219)), [7] * 33]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_and_ref(request, tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch=request.param)
    return path, hf_greedy(path, GREEDY_PROMPTS)


def _generate(path, prompts=GREEDY_PROMPTS, **options):
    from tpserve import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    options.setdefault("dtype", "float32")
    with LLM(str(path), **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.stats(), outs


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_matches_transformers_across_block_sizes(moe_and_ref, block_size):
    path, ref = moe_and_ref
    got, stats, _ = _generate(path, block_size=block_size, num_kv_blocks=4096 // block_size + 8)
    assert got == ref
    assert stats["kv_blocks_used"] == 0


def test_preemption_and_prefix_sharing_keep_greedy_output(moe_and_ref):
    path, ref = moe_and_ref
    got, stats, _ = _generate(path, block_size=4, num_kv_blocks=20)
    assert stats["num_preemptions"] > 0
    assert got == ref
    shared = list(range(30, 94))
    prompts = [shared + [5, 6], shared + [7], shared[:32]]
    got, stats, outs = _generate(path, prompts, block_size=16, num_kv_blocks=64, max_num_seqs=1)
    assert got == hf_greedy(path, prompts)
    assert stats["prefix_cache_hit_tokens"] >= 64 + 31
    assert [o.num_cached_tokens for o in outs] == [0, 64, 31]


def test_chunked_prefill_and_speculative_decoding_keep_greedy_output(moe_and_ref):
    """Prefill chunks of 16 tokens, and n-gram drafts verified several tokens per row."""
    path, ref = moe_and_ref
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": None}
    got, stats, _ = _generate(path, max_num_batched_tokens=16, num_kv_blocks=256, speculative_config=spec)
    assert got == ref
    assert stats["spec_decode_num_drafts"] > 0


# ---------------------------------------------------------------- int8 experts

@pytest.mark.parametrize("prepack", ["1", "0"])
def test_int8_at_load_quantizes_the_experts_and_stays_close(tiny_models_root, monkeypatch,  # noqa: F811
                                                            prepack):
    """With the C++ kernels (where built) and without them (TPSERVE_PREPACK=0: the experts are
    quantized in place and the torch path dequantizes them)."""
    monkeypatch.setenv("TPSERVE_PREPACK", prepack)
    path = make_tiny_model(tiny_models_root, "qwen2_moe")
    prompts = random_prompts([9, 4], 384, seed=2)
    decode = [[5, 7], [11, 13]]
    float_model = tpserve_model(path)
    pack(float_model)
    want = run(float_model, prompts, decode)
    model = tpserve_model(path, quantization="int8")
    blocks = moe_blocks(model)
    assert all(b.experts.quantize_at_load and not b.gate.quantize_at_load for b in blocks)
    assert not blocks[0].shared_expert_gate.quantize_at_load
    assert blocks[0].shared_expert.down_proj.quantize_at_load
    pack(model)
    for b in blocks:  # packed by the kernel, or int8 in place for the torch path
        if prepack == "0":
            assert b.experts.packed is None and b.experts.w13_weight.dtype == torch.int8
        else:
            assert b.experts.packed is not None
    got = run(model, prompts, decode)
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 0.1 * w.abs().max()
        assert not torch.equal(g, w)


def test_int4_at_load_groups_the_experts(tiny_models_root, monkeypatch):  # noqa: F811
    """``--quantization int4-g32``: each expert quantized to 4-bit codes with a scale and a min per
    group (moe_group.py), run by the C++ kernel (int8 activations per group) where built, or
    dequantized by the torch path (TPSERVE_PREPACK=0): the two agree to what the activations'
    rounding moves (this tiny random model amplifies 4-bit weights' error to half its float
    logits, int8's to a third)."""
    from tpserve.models.group_quant import GROUP4
    # (the shared expert: 64 features, whole groups of 32)
    path = make_tiny_model(tiny_models_root, "qwen2_moe", shared_expert_intermediate_size=64)
    prompts = random_prompts([9, 4], 384, seed=2)
    decode = [[5, 7], [11, 13]]
    float_model = tpserve_model(path)
    pack(float_model)
    want = run(float_model, prompts, decode)
    got = {}
    for prepack in ("1", "0"):
        monkeypatch.setenv("TPSERVE_PREPACK", prepack)
        model = tpserve_model(path, quantization="int4-g32")
        blocks = moe_blocks(model)
        assert all(b.experts.group is not None and not b.experts.group.from_checkpoint for b in blocks)
        pack(model)
        for b in blocks:
            fm = b.experts
            assert fm.w13_weight.numel() == 0  # the float experts freed
            if prepack == "0":
                w13, w2 = fm.group.stacks
                assert fm.packed is None and int(w13.codes.max()) < 16 and int(w2.codes.max()) < 16
            else:
                assert fm.packed.w13.kind == fm.packed.w2.kind == GROUP4 and fm.group.stacks is None
        got[prepack] = run(model, prompts, decode)
    for kernel, torch_path, w in zip(got["1"], got["0"], want):
        assert (kernel - torch_path).abs().max() < 0.1 * torch_path.abs().max()
        assert not torch.equal(torch_path, w)


def test_compressed_tensors_int8_experts_load(tiny_models_root, tmp_path):  # noqa: F811
    """W8A16 (routers ignored) computes its dequantized float twin; W8A8 with int8 routers too
    loads and stays close to it."""
    path = make_tiny_model(tiny_models_root, "qwen3_moe")
    prompts = random_prompts([9, 4], 384, seed=2)
    decode = [[5, 7], [11, 13]]
    routers = ("lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    for scheme, ignore, tol in (("W8A16", routers, 1e-4), ("W8A8", ("lm_head",), 0.1)):
        ct = make_compressed(path, tmp_path / scheme, scheme, ignore=ignore)
        names = load_file(str(ct / "model.safetensors")).keys()
        assert "model.layers.1.mlp.experts.7.down_proj.weight_scale" in names
        model = tpserve_model(ct)
        fm = moe_blocks(model)[0].experts
        assert fm.w13_weight.dtype == torch.int8 and fm.w13_weight_scale.shape == (8, 64)
        assert fm.int8_activations == (scheme == "W8A8")
        assert (moe_blocks(model)[0].gate.weight.dtype == torch.int8) == (scheme == "W8A8")
        pack(model)
        got = run(model, prompts, decode)
        twin = tpserve_model(make_compressed(path, tmp_path / f"{scheme}-deq", scheme, ignore=ignore,
                                             dequantized=True))
        pack(twin)
        for g, w in zip(got, run(twin, prompts, decode)):
            assert (g - w).abs().max() <= tol * w.abs().max(), scheme


def test_partly_ignored_experts_are_refused(tiny_models_root, tmp_path):  # noqa: F811
    path = make_tiny_model(tiny_models_root, "qwen3_moe")
    ct = make_compressed(path, tmp_path / "ct", "W8A8")
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.experts.3.up_proj"]
    (ct / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="model.layers.0.mlp.experts are one fused layer"):
        tpserve_model(ct)


# ---------------------------------------------------------------- configs tpserve cannot run

def _config(arch, **changes):
    import transformers
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig}[arch]
    arch_name = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}[arch]
    config = cls(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=300, num_experts_per_tok=2, architectures=[arch_name])
    for key, value in changes.items():  # as a hand-edited config.json could say (no type checks)
        object.__setattr__(config, config.attribute_map.get(key, key), value)
    return config


@pytest.mark.parametrize("arch,changes,field", [
    ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func"),
    ("qwen3_moe", dict(topk_method="noaux_tc"), "topk_method"),
    ("qwen2_moe", dict(n_group=8, topk_group=4), "n_group"),
    ("qwen3_moe", dict(routed_scaling_factor=2.5), "routed_scaling_factor"),
    ("qwen3_moe", dict(first_k_dense_replace=1), "first_k_dense_replace"),
    ("mixtral", dict(n_shared_experts=2), "n_shared_experts"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=128), "shared_expert_intermediate_size"),
    ("qwen3_moe", dict(num_experts_per_tok=9, num_experts=8), "num_experts_per_tok"),
    ("mixtral", dict(num_experts_per_tok=3, num_local_experts=2), "num_experts_per_tok"),
    ("qwen3_moe", dict(num_experts=0), "num_experts"),
    ("mixtral", dict(num_local_experts=None), "num_local_experts"),
    ("qwen2_moe", dict(moe_intermediate_size=0), "moe_intermediate_size"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen3_moe", dict(mlp_only_layers=[7]), "mlp_only_layers"),
    ("qwen3_moe", dict(norm_topk_prob="yes"), "norm_topk_prob"),
    ("mixtral", dict(sliding_window=0), "sliding_window"),
    ("qwen2_moe", dict(use_sliding_window=True), "use_sliding_window"),
])
def test_unsupported_moe_configs_name_the_field(arch, changes, field):
    with pytest.raises(UnsupportedModelError) as e:
        model_spec(_config(arch, **changes))
    assert e.value.field == field


def test_accepted_variants():
    assert model_spec(_config("mixtral", sliding_window=None)).num_experts == 8
    spec = model_spec(_config("mixtral", sliding_window=1 << 20, max_position_embeddings=4096))
    assert spec.sliding_windows == ()  # a window past every position is full attention
    windowed = model_spec(_config("mixtral", sliding_window=128, num_hidden_layers=2))
    assert windowed.sliding_windows == (128, 128)
    assert (spec.norm_topk_prob, spec.moe_module, spec.expert_proj_names) == (True, "block_sparse_moe",
                                                                              ("w1", "w3", "w2"))
    spec = model_spec(_config("qwen3_moe", num_experts=6, moe_intermediate_size=24, scoring_func="softmax"))
    assert [spec.is_sparse_layer(i) for i in range(4)] == [True] * 4 and not spec.has_dense_layers
    spec = model_spec(_config("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[1]))
    assert [spec.is_sparse_layer(i) for i in range(4)] == [False, False, False, True]
    assert spec.qkv_bias and not spec.o_bias and spec.shared_expert_intermediate_size == 5632


@pytest.mark.parametrize("arch,changes,tp,expert_parallel,field", [
    ("qwen3_moe", dict(num_experts=6, moe_intermediate_size=32), 4, True, "num_experts"),
    ("mixtral", dict(num_local_experts=6), 4, True, "num_local_experts"),
    ("qwen3_moe", dict(moe_intermediate_size=30), 4, False, "moe_intermediate_size"),
    ("mixtral", dict(intermediate_size=30), 4, False, "intermediate_size"),
    ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=30), 4, True,
     "shared_expert_intermediate_size"),
])
def test_tp_sizes_that_cannot_split_the_experts(arch, changes, tp, expert_parallel, field):
    spec = model_spec(_config(arch, **changes))
    with pytest.raises(UnsupportedModelError) as e:
        check_tp_size(spec, tp, expert_parallel)
    assert e.value.field == field
    check_tp_size(spec, 2, expert_parallel)  # 2 divides everything


def test_expert_parallel_option():
    from tpserve.cli.options import config_from_options, options_argv
    assert EngineConfig().enable_expert_parallel is False
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        EngineConfig(enable_expert_parallel="yes")
    config = config_from_options({"enable_expert_parallel": True}, resolve=False)
    assert config.enable_expert_parallel is True
    assert "--enable-expert-parallel" in options_argv(config)
    assert "--enable-expert-parallel" not in options_argv(EngineConfig())


def test_fused_moe_shards():
    """Shapes and expert ranges of each mode (the kernels read these attributes)."""
    from tpserve.models.parallel import TPContext
    inter = FusedMoE(8, 2, 64, 32, TPContext(1, 2))
    ep = FusedMoE(8, 2, 64, 32, TPContext(1, 2), expert_parallel=True)
    assert (inter.num_local_experts, inter.expert_start, tuple(inter.w13_weight.shape)) == (8, 0, (8, 32, 64))
    assert (ep.num_local_experts, ep.expert_start, tuple(ep.w2_weight.shape)) == (4, 4, (4, 64, 32))
    assert inter.packed is None and ep.num_experts == 8 and ep.top_k == 2


def test_expert_parallel_rank_reads_only_its_experts(tiny_models_root):  # noqa: F811
    """Rank 1 of 2 with expert parallelism: experts 4-7 loaded, 0-3 never read from the file."""
    from tpserve.models.loader import _other_ranks_experts, checkpoint_files, iter_safetensors
    from tpserve.models.parallel import TPContext
    path = make_tiny_model(tiny_models_root, "mixtral")
    model = tpserve_model(path, TPContext(1, 2), enable_expert_parallel=True)
    skip = _other_ranks_experts(model)
    unread = {k for k, t in iter_safetensors(checkpoint_files(path), skip=skip) if t is None}
    assert unread == {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                      for i in range(2) for e in range(4) for w in ("w1", "w2", "w3")}
    assert skip("model.layers.0.mlp.experts.2.w1.weight")
    assert not skip("model.layers.0.mlp.experts.6.w1.weight")
    fm = moe_blocks(model)[1].experts
    ckpt = load_file(str(path / "model.safetensors"))
    assert torch.equal(fm.w13_weight[1, :32], ckpt["model.layers.1.block_sparse_moe.experts.5.w1.weight"])
    assert torch.equal(fm.w2_weight[3], ckpt["model.layers.1.block_sparse_moe.experts.7.w2.weight"])
    assert _other_ranks_experts(tpserve_model(path, TPContext(1, 2))) is None  # intermediate split


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_one_all_reduce_per_sparse_layer_and_partials_sum_to_the_whole(expert_parallel):
    """Qwen2-MoE's block on two simulated ranks: each calls all_reduce once (the shared
    expert's down projection adds its partial to the experts' instead of reducing alone), and
    the two ranks' partials add up to the unsharded block."""
    import dataclasses
    from test_models_tp import PartialTP
    from tpserve.models.moe import FUSED_DOWN, FUSED_GATE_UP
    from tpserve.models.parallel import TPContext

    calls = []

    @dataclasses.dataclass(frozen=True)
    class CountingTP(PartialTP):
        def all_reduce(self, x):
            calls.append(self.rank)
            return x

    spec = model_spec(_config("qwen2_moe", num_experts=8, moe_intermediate_size=16,
                              shared_expert_intermediate_size=24))
    g = torch.Generator().manual_seed(0)
    w = {"gate": torch.randn(8, 64, generator=g), "gate_up": torch.randn(8, 32, 64, generator=g) * 0.2,
         "down": torch.randn(8, 64, 16, generator=g) * 0.2, "sgu0": torch.randn(24, 64, generator=g) * 0.2,
         "sgu1": torch.randn(24, 64, generator=g) * 0.2, "sd": torch.randn(64, 24, generator=g) * 0.2,
         "sg": torch.randn(1, 64, generator=g)}

    def block(tp):
        b = SparseMoeBlock(spec, tp, expert_parallel)
        b.gate.weight.data.copy_(w["gate"])
        b.experts.weight_loader(b.experts.w13_weight, w["gate_up"], (None, FUSED_GATE_UP))
        b.experts.weight_loader(b.experts.w2_weight, w["down"], (None, FUSED_DOWN))
        sgu = b.shared_expert.gate_up_proj
        sgu.weight_loader(sgu.weight, w["sgu0"], 0)
        sgu.weight_loader(sgu.weight, w["sgu1"], 1)
        b.shared_expert.down_proj.weight_loader(b.shared_expert.down_proj.weight, w["sd"])
        b.shared_expert_gate.weight.data.copy_(w["sg"])
        return b

    x = torch.randn(5, 64, generator=g)
    whole = block(TPContext())(x)
    parts = [block(CountingTP(rank=r, size=2))(x) for r in range(2)]
    assert calls == [0, 1]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-4, rtol=1e-4)
