"""Sliding-window KV groups end to end: Gemma 3 and Mistral (tiny, random weights, fp32) through
the engine give transformers' greedy tokens while the sliding layers' blocks follow the window:
prompts and generations far past the 8-token window, block sizes 16 and 1, forced preemption,
prefix-cache hits after the window moved, and TP=2."""
from __future__ import annotations

import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_arch_models import CASES, PROMPTS, hf_greedy
from tpserve import LLM, SamplingParams
from tpserve.kv_groups import FULL, SLIDING


def path_of(root, name):
    arch, narrow, _ = CASES[name]
    return make_tiny_model(root, arch, **narrow)


def run(path, prompts, max_tokens=20, **options):
    options.setdefault("dtype", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), **options) as llm:
        bm = llm.engine.scheduler.block_manager
        peak = []
        step = llm.engine.scheduler.postprocess

        def watched(batch, *a, **kw):  # the sliding groups' blocks per sequence after each step
            out = step(batch, *a, **kw)
            bm.check_integrity()
            for seq in llm.engine.scheduler.running:
                for g, table in enumerate(bm.tables(seq)):
                    if bm.groups[g].window is not None and not seq.is_prefill:
                        peak.append(len(table) - table.count(-1))
            return out

        llm.engine.scheduler.postprocess = watched
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        groups = list(bm.groups)
        assert bm.num_free_blocks == bm.num_blocks
    return [o.token_ids for o in outs], stats, groups, max(peak, default=0)


@pytest.fixture(scope="module")
def gemma3(tiny_models_root):  # noqa: F811
    path = path_of(tiny_models_root, "gemma3")
    return path, hf_greedy(path, PROMPTS)


@pytest.mark.parametrize("block_size", [16, 1])
def test_gemma3_groups_follow_the_window(gemma3, block_size):
    path, ref = gemma3
    got, stats, groups, peak = run(path, PROMPTS, block_size=block_size, num_kv_blocks=2048 // block_size)
    assert got == ref
    assert [g.kind for g in groups] == [FULL, SLIDING, SLIDING] and groups[1].window == 8
    assert 0 < peak <= -(-8 // block_size) + 1  # ceil(W / block_size) + 1


def test_gemma3_forced_preemption(gemma3):
    path, ref = gemma3
    # The longest sequence needs 12 blocks of 4 in each of 3 groups at admission: 40 is tight.
    got, stats, _, _ = run(path, PROMPTS, block_size=4, num_kv_blocks=40)
    assert stats["num_preemptions"] > 0
    assert got == ref


def test_gemma3_prefix_hits_after_the_window_moved(gemma3, tiny_models_root):  # noqa: F811
    path, _ = gemma3
    long = PROMPTS[0] + PROMPTS[1]  # 38 tokens: the window has long left the first blocks
    prompts = [long, long + [7, 7, 9]]
    ref = hf_greedy(path, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
        second = llm.generate(prompts[1:], params, use_tqdm=False)[0].token_ids
        hits = llm.stats()["prefix_cache_hit_tokens"]
    assert [first, second] == ref
    assert hits >= 36  # the first prompt's full blocks, served with only the window's blocks held


def test_mistral_one_sliding_group(tiny_models_root):  # noqa: F811
    path = path_of(tiny_models_root, "mistral")
    ref = hf_greedy(path, PROMPTS)
    got, _, groups, peak = run(path, PROMPTS, block_size=4, num_kv_blocks=256)
    assert got == ref
    assert [(g.kind, g.window) for g in groups] == [(SLIDING, 8)] and 0 < peak <= 3


@pytest.mark.timeout(300)
def test_gemma3_tp2(gemma3):
    path, ref = gemma3
    got, stats, groups, peak = run(path, PROMPTS, block_size=4, num_kv_blocks=40, tensor_parallel_size=2)
    assert got == ref and len(groups) == 3 and stats["num_preemptions"] > 0


def test_bench_capacity_counts_the_windows_blocks():
    """bench_throughput.py --shape gemma3-1b's capacity line, small: at 2k contexts the pool holds
    over twice the sequences with the windows (the 8k target is 2.5x; 8k gives ~4.6x)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_window_kv import kv_capacity
    windows, blocks = kv_capacity(2048, 0.25, ignored=False, gen=128)
    every_layer_global, global_blocks = kv_capacity(2048, 0.25, ignored=True, gen=128)
    assert blocks > 6 * global_blocks  # the same memory in blocks of 4 layers, not 26
    assert every_layer_global >= 4 and windows > 2 * every_layer_global


def test_gemma3_speculative_decoding(gemma3):
    path, ref = gemma3
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    got, stats, _, peak = run(path, PROMPTS, block_size=4, num_kv_blocks=256, speculative_config=spec)
    assert got == ref and stats["spec_decode_num_drafts"] > 0
    assert 0 < peak <= 3
