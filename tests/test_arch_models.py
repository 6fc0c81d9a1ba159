"""Mistral, Phi-3, SmolLM3, Gemma 2 and Gemma 3 (and Gemma 3's multimodal checkpoints) against
transformers, fp32, on tiny random models whose sliding windows (8 tokens) are far shorter than
the prompts and generations, so every window edge is crossed.

Each model: one batched prefill and decode steps through a paged cache give transformers' logits;
greedy generation through the engine gives transformers' tokens at block sizes 16 and 1 (and
transformers' own tokens change when the window is widened, so the equality depends on it).
Gemma 3 also under forced preemption, Gemma 2, Phi-3 and Gemma 3 at TP=2 over two processes.
Phi-3's LongRoPE switches to its long factors at ``original_max_position_embeddings`` token by
token, so its reference is transformers fed one token per pass, and chunked prefill and
preemption give the same tokens. Config fields tpserve does not run are refused by name.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_models import (ATOL, BACKENDS, RTOL, HFSequence, PagedKV, hf_model, random_prompts,
                         reference_prefill_then_decode, run_prefill_then_decode, tpserve_model)
from test_models_tp import gloo_group, run_two_ranks
from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.kernels import cpu_extension
from tpserve.models import CheckpointError, UnsupportedModelError
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.loader import load_config
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.spec import model_spec

WINDOW = 8
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2],
            "long_factor": [3.0, 4.5, 6.0, 9.0]}
# A rotary base per layer type, linear scaling on the full layers.
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}
# name: (factory arch, overrides with the window, overrides that widen every window)
CASES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW), dict(sliding_window=None)),
    "phi3": ("phi3", dict(sliding_window=WINDOW, max_position_embeddings=256, rope_scaling=LONGROPE,
                          original_max_position_embeddings=24, partial_rotary_factor=0.5),
             dict(sliding_window=None, max_position_embeddings=256, rope_scaling=LONGROPE,
                  original_max_position_embeddings=24, partial_rotary_factor=0.5)),
    "smollm3": ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                                no_rope_layers=[1, 0, 1, 0],
                                layer_types=["full_attention", "sliding_attention"] * 2),
                dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0])),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                              query_pre_attn_scalar=24),
               dict(sliding_window=512, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                    query_pre_attn_scalar=24)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, sliding_window=WINDOW, final_logit_softcapping=5.0,
                              query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
               dict(num_hidden_layers=3, sliding_window=512, final_logit_softcapping=5.0,
                    query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
# For Phi-3 (LongRoPE's original length 24): one prompt past it, one that crosses it while
# generating, one that stays below it.
PROMPTS = [list(range(20, 47)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3, 4]]
MAX_TOKENS = 20


def model_path(root, name: str, wide: bool = False):
    arch, narrow_overrides, wide_overrides = CASES[name]
    return make_tiny_model(root, arch, **(wide_overrides if wide else narrow_overrides))


def hf_greedy(path, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def hf_stepwise(path, prompts, num_steps):
    """transformers' logits and greedy tokens with every token fed in a pass of its own (prompts
    too): LongRoPE's factors then follow each token's position, as tpserve rotates (rotary.py),
    rather than the longest position of a pass as ``generate`` makes them.

    Returns ``(logits per forward [prefill rows, then one row per sequence per step], tokens)``."""
    seqs = [HFSequence(hf_model(path)) for _ in prompts]
    prefill = [torch.cat([s.feed([t]) for t in p]) for s, p in zip(seqs, prompts)]
    results, last, tokens = [torch.cat(prefill)], [lg[-1] for lg in prefill], []
    for _ in range(num_steps):
        row = [int(lg.argmax()) for lg in last]
        tokens.append(row)
        last = [s.feed([t])[-1] for s, t in zip(seqs, row)]
        results.append(torch.stack(last))
    return results, tokens


def reference_greedy(name, path, prompts, max_tokens=MAX_TOKENS):
    """transformers' greedy tokens: ``generate``'s, or for Phi-3 the token-by-token passes'."""
    if name != "phi3":
        return hf_greedy(path, prompts, max_tokens)
    _, tokens = hf_stepwise(path, prompts, max_tokens)
    return [list(seq) for seq in zip(*tokens)]


def generate(path, prompts, max_tokens=MAX_TOKENS, **options):
    options.setdefault("dtype", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.stats()


@pytest.fixture(scope="module", params=list(CASES))
def arch_model(request, tiny_models_root):  # noqa: F811
    """(name, path, prompts, transformers' greedy tokens); the tokens change when the windows widen."""
    name = request.param
    path = model_path(tiny_models_root, name)
    ref = reference_greedy(name, path, PROMPTS)
    wide = reference_greedy(name, model_path(tiny_models_root, name, wide=True), PROMPTS)
    assert wide != ref, f"{name}: transformers' output does not depend on the window"
    return name, path, PROMPTS, ref


def test_spec_describes_the_layers(tiny_models_root):  # noqa: F811
    specs = {name: model_spec(load_config(model_path(tiny_models_root, name))) for name in CASES}
    assert specs["mistral"].sliding_windows == (WINDOW, WINDOW)
    assert specs["phi3"].rotary_dim == 8 and specs["phi3"].fused_checkpoint
    assert specs["phi3"].rope_scaling["rope_type"] == "longrope"
    assert specs["smollm3"].rope_layers == (True, False, True, False)
    assert specs["smollm3"].sliding_windows == (None, WINDOW, None, WINDOW)
    g2, g3 = specs["gemma2"], specs["gemma3"]
    assert g2.sliding_windows == (WINDOW, None) and g2.attn_logit_softcap == 4.0
    assert g2.final_logit_softcap == 6.0 and g2.attn_scale == 24 ** -0.5 and g2.hidden_act == "gelu_tanh"
    assert g3.sliding_windows == (WINDOW, None, WINDOW) and g3.qk_norm and g3.gemma_norms
    assert (g3.rope_theta, g3.rope_scaling["factor"], g3.local_rope_theta) == (5000.0, 2.0, 100.0)
    wide = model_spec(load_config(model_path(tiny_models_root, "mistral", wide=True)))
    assert wide.sliding_windows == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_logits_match_transformers(arch_model, backend):
    name, path, _, _ = arch_model
    prompts = random_prompts([21, 9, 3], 384, seed=1)
    want, decode = reference_prefill_then_decode(path, prompts, 5)
    got = run_prefill_then_decode(tpserve_model(path, backend=backend), prompts, decode)
    assert len(got) == len(want) == 6
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} forward {step}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixtral_slides_its_window_like_mistral(tiny_models_root, backend):  # noqa: F811
    path = make_tiny_model(tiny_models_root, "mixtral", sliding_window=WINDOW)
    prompts = random_prompts([21, 9, 3], 384, seed=1)
    want, decode = reference_prefill_then_decode(path, prompts, 5)
    got = run_prefill_then_decode(tpserve_model(path, backend=backend), prompts, decode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    full, _ = reference_prefill_then_decode(make_tiny_model(tiny_models_root, "mixtral"), prompts, 0)
    assert not torch.allclose(full[0], want[0], atol=1e-2)  # the window matters


@pytest.mark.parametrize("block_size", [16, 1])
def test_greedy_generation_matches_transformers(arch_model, block_size):
    name, path, prompts, ref = arch_model
    got, stats = generate(path, prompts, block_size=block_size, num_kv_blocks=2048 // block_size)
    assert got == ref, name
    assert stats["kv_blocks_used"] == 0


def test_preemption_keeps_greedy_output(tiny_models_root):  # noqa: F811
    path = model_path(tiny_models_root, "gemma3")
    ref = hf_greedy(path, PROMPTS)
    # The three sequences reach 47, 31 and 23 tokens. Its layers form three KV groups (one full, two
    # sliding) whose blocks hold one layer each: the longest needs 3 x 12 blocks of 4 when admitted,
    # and 40 (the memory of ~13 three-layer blocks) forces preemption.
    got, stats = generate(path, PROMPTS, block_size=4, num_kv_blocks=40)
    assert stats["num_preemptions"] > 0
    assert got == ref


def test_longrope_switches_factors_at_the_original_length(tiny_models_root):  # noqa: F811
    """Sequences of 20 and 30 tokens (original length 24): one crosses to the long factors while
    decoding, the other within its prefill; each token as transformers rotates it in a pass of its
    own. A whole-prompt pass of transformers (long factors for all 30) differs."""
    path = model_path(tiny_models_root, "phi3")
    model = tpserve_model(path)
    rotary = model.model.rotary
    assert rotary.long_from == 24 and rotary.cos.shape == (256, 4)
    prompts = random_prompts([20, 30], 384, seed=4)
    want, decode = hf_stepwise(path, prompts, 8)
    got = run_prefill_then_decode(model, prompts, decode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    whole_pass, _ = reference_prefill_then_decode(path, prompts, 0)
    assert not torch.allclose(whole_pass[0][20:], want[0][20:], atol=1e-2)


def test_longrope_output_does_not_depend_on_the_schedule(tiny_models_root):  # noqa: F811
    """Chunks of 8 tokens (a prompt's chunks on both sides of the original length), and
    preemption: the same tokens as one pass per token."""
    path = model_path(tiny_models_root, "phi3")
    ref = reference_greedy("phi3", path, PROMPTS)
    chunked, _ = generate(path, PROMPTS, max_num_batched_tokens=8, block_size=16, num_kv_blocks=64)
    assert chunked == ref
    # Every layer slides its window: a decoding sequence holds at most 3 blocks of 4, so it takes
    # twelve sequences to run 14 blocks short.
    preempted, stats = generate(path, PROMPTS * 4, block_size=4, num_kv_blocks=14)
    assert stats["num_preemptions"] > 0
    assert preempted == ref * 4


def _tp_worker(rank: int, store: str, cases: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, path, prompts, decode in cases:
            logits = run_prefill_then_decode(tpserve_model(path, tp), prompts, decode)
            torch.save(logits, os.path.join(out_dir, f"{name}.rank{rank}.pt"))


@pytest.mark.timeout(240)
def test_tp2_matches_transformers(tiny_models_root, tmp_path):  # noqa: F811
    """Soft-capped logits gathered to rank 0; Phi-3's fused tensors split, then sharded; Gemma 3's
    q/k norms and two rotary tables on each rank's heads."""
    cases, expected = [], {}
    for name in ("gemma2", "phi3", "gemma3"):
        path = model_path(tiny_models_root, name)
        prompts = random_prompts([21, 9, 3], 384, seed=2)
        expected[name], decode = reference_prefill_then_decode(path, prompts, 4)
        cases.append((name, str(path), prompts, decode))
    run_two_ranks(_tp_worker, cases, str(tmp_path), timeout=220)
    for name, *_ in cases:
        r0 = torch.load(tmp_path / f"{name}.rank0.pt")
        r1 = torch.load(tmp_path / f"{name}.rank1.pt")
        assert len(r0) == len(expected[name]) == 5
        for g, w in zip(r0, expected[name]):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
        assert all(x is None for x in r1)


def _multimodal_checkpoint(src, dst, new_names: bool):
    """Gemma 3's text model re-saved as a Gemma3ForConditionalGeneration checkpoint (with a stand-in
    vision tower and projector): old ``language_model.model.`` or new ``model.language_model.`` names."""
    from transformers import Gemma3Config
    dst.mkdir()
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures")
    text.pop("tie_word_embeddings")
    config = Gemma3Config(text_config=text, vision_config={"hidden_size": 32, "intermediate_size": 64,
                                                           "num_hidden_layers": 1, "num_attention_heads": 2},
                          tie_word_embeddings=False, architectures=["Gemma3ForConditionalGeneration"])
    config.save_pretrained(dst)
    tensors = {}
    for key, t in load_file(src / "model.safetensors").items():
        if key.startswith("lm_head."):
            tensors[key if new_names else "language_model." + key] = t
        else:
            tail = key.removeprefix("model.")
            tensors[("model.language_model." if new_names else "language_model.model.") + tail] = t
    vision = "model.vision_tower." if new_names else "vision_tower."
    tensors[vision + "vision_model.embeddings.patch_embedding.weight"] = torch.zeros(32, 3, 14, 14)
    projector = ("model." if new_names else "") + "multi_modal_projector.mm_input_projection_weight"
    tensors[projector] = torch.zeros(32, 64)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("new_names", [False, True])
def test_gemma3_multimodal_checkpoint_runs_its_text_tower(tiny_models_root, tmp_path,  # noqa: F811
                                                          new_names):
    src = model_path(tiny_models_root, "gemma3")
    path = _multimodal_checkpoint(src, tmp_path / "mm", new_names)
    spec = model_spec(load_config(path))
    assert spec.architecture == "Gemma3ForConditionalGeneration" and spec.text_tower
    assert spec.sliding_windows == (WINDOW, None, WINDOW) and not spec.tie_word_embeddings
    prompts = random_prompts([21, 4], 384, seed=6)
    want, decode = reference_prefill_then_decode(src, prompts, 3)
    got = run_prefill_then_decode(tpserve_model(path), prompts, decode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    if new_names:  # through the engine: the text config's max_position_embeddings bounds it
        assert EngineConfig(model=str(path)).resolve().max_model_len == 512
        got, _ = generate(path, PROMPTS, block_size=16, num_kv_blocks=64)
        assert got == hf_greedy(src, PROMPTS)


def _edited(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    os.symlink(src / "model.safetensors", dst / "model.safetensors")
    return dst


REFUSED = [  # (model, config changes, field named)
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    ("gemma2", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    ("mistral", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act"),
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    ("phi3", dict(rope_scaling=dict(LONGROPE, long_factor=[1.0, 2.0])), "long_factor"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4}), "long_factor"),
]


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_unsupported_fields_are_refused_by_name(tiny_models_root, tmp_path, case):  # noqa: F811
    name, changes, field = REFUSED[case]
    path = _edited(model_path(tiny_models_root, name), tmp_path / "m", **changes)
    with pytest.raises((UnsupportedModelError, ValueError)) as err:
        tpserve_model(path)
    assert field in str(err.value)


def test_a_misshaped_fused_tensor_is_reported_by_name(tiny_models_root, tmp_path):  # noqa: F811
    src = model_path(tiny_models_root, "phi3")
    dst = tmp_path / "m"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.self_attn.qkv_proj.weight"
    assert tensors[key].shape == (16 * 8, 64)  # q: 4 heads, k and v: 2 heads each, of 16
    tensors[key] = tensors[key][:-16]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{key}: expected 128 rows"):
        tpserve_model(dst)


def test_phi3_int8_checkpoint_splits_its_fused_scales(tiny_models_root, tmp_path):  # noqa: F811
    """A compressed-tensors int8 Phi-3: the fused tensors' per-row scales split with their rows,
    the same logits as the float checkpoint of the same int8 values."""
    from test_quantization import make_compressed
    src = model_path(tiny_models_root, "phi3")
    int8 = make_compressed(src, tmp_path / "w8a8", "W8A8")
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" in load_file(int8 / "model.safetensors")
    dequantized = make_compressed(src, tmp_path / "float", "W8A8", dequantized=True)
    prompts, decode = random_prompts([21, 9], 384, seed=1), [[5, 6], [7, 8]]
    got = run_prefill_then_decode(tpserve_model(int8), prompts, decode)
    want = run_prefill_then_decode(tpserve_model(dequantized), prompts, decode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_partial_rotary_is_refused_outside_phi3(tiny_models_root, tmp_path):  # noqa: F811
    path = _edited(make_tiny_model(tiny_models_root, "llama"), tmp_path / "m", partial_rotary_factor=0.5)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        tpserve_model(path)


def test_fused_decode_refuses_layers_it_cannot_run_and_runs_longrope(tiny_models_root):  # noqa: F811
    assert cpu_extension.available(), cpu_extension._state.get("error")
    for name in CASES:
        model = tpserve_model(model_path(tiny_models_root, name), backend="cpu")
        if name in ("mistral", "gemma2", "gemma3", "smollm3"):  # only the cache and packing lack
            assert why_not_fused(model) == "needs the KV cache"
        else:  # phi3's partial rotary
            assert "shaped layers" in why_not_fused(model), name
    # Phi-3 with full rotary and no window: LongRoPE's long rows reach the fused stack too.
    path = make_tiny_model(tiny_models_root, "phi3", max_position_embeddings=256,
                           original_max_position_embeddings=24, rope_scaling=dict(
        LONGROPE, short_factor=[1.0] * 8, long_factor=[2.0 + i for i in range(8)]))
    prompts = random_prompts([20, 30], 384, seed=4)
    steps = [[7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
    runs = []
    for fused in (False, True):
        model = tpserve_model(path, backend="cpu")
        prepack_model(model)
        kv = PagedKV(model, 2, 40)
        if fused:
            assert model.enable_fused_decode() is None
        out = []
        for new in [prompts] + [[[t] for t in row] for row in steps]:
            out.append(model.compute_logits(model.forward(*kv.step(new))))
        runs.append(out)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    want, _ = hf_stepwise(path, prompts, 0)
    torch.testing.assert_close(runs[0][0], want[0], atol=ATOL, rtol=RTOL)


def test_a_yes_no_score_head_is_refused_over_soft_capped_logits(tiny_models_root):  # noqa: F811
    """The pooling runner's yes/no head is two LM-head rows, a linear score; Gemma 2's capped
    logits are not, so it is refused by the field's name (embeddings still run)."""
    path = model_path(tiny_models_root, "gemma2")
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        LLM(str(path), runner="pooling", num_kv_blocks=64, dtype="float32",
            pooler_config={"score_token_ids": [3, 4]})
    with LLM(str(path), runner="pooling", num_kv_blocks=64, dtype="float32") as llm:
        assert len(llm.embed([[5, 6, 7]])[0].outputs.embedding) == 64
