"""End-to-end: tpserve's greedy output equals transformers' for every engine setting.

Greedy output must not depend on block size, preemption, chunked prefill, prefix-cache hits,
the attention backend or batch composition (docs/design.md's last scheduler invariant), in fp32.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, AdmissionError, ConfigError, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [100, 3, 4], list(range(200, 219)),
           [7] * 33]


def hf_greedy(path, prompts, max_tokens=10):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def model_and_ref(request, tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch=request.param)
    return path, hf_greedy(path, PROMPTS)


def generate(path, prompts=PROMPTS, params=GREEDY, **options):
    options.setdefault("dtype", "float32")
    options.setdefault("num_kv_blocks", 256)
    with LLM(str(path), **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_greedy_matches_transformers_across_block_sizes(model_and_ref, block_size):
    path, ref = model_and_ref
    got, stats = generate(path, block_size=block_size, num_kv_blocks=4096 // block_size + 8)
    assert got == ref
    assert stats["kv_blocks_used"] == 0


def test_preemption_keeps_greedy_output(model_and_ref):
    path, ref = model_and_ref
    # 5 prompts of up to 51 tokens with block size 4 need ~40 blocks at once; 20 forces preemption.
    got, stats = generate(path, block_size=4, num_kv_blocks=20)
    assert stats["num_preemptions"] > 0
    assert got == ref


def test_chunked_prefill_keeps_greedy_output(model_and_ref):
    path, ref = model_and_ref
    got, _ = generate(path, max_num_batched_tokens=16)  # longest prompt is 41 tokens
    assert got == ref


def test_prefix_cache_hits_keep_greedy_output(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    shared = list(range(30, 94))  # 64 tokens: 4 full blocks of 16
    prompts = [shared + [5, 6], shared + [7], shared, shared[:32], shared + [8, 9, 10]]
    ref = hf_greedy(path, prompts)
    with LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        # The rest hit the cached prefix; `shared` and `shared[:32]` are fully covered by it.
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in first + rest] == ref
    assert stats["prefix_cache_hit_tokens"] >= 64 + 48 + 32
    # Per request, the prompt tokens served from the cache (a fully cached prompt recomputes its
    # last token), as vLLM's RequestOutput.num_cached_tokens.
    assert [o.num_cached_tokens for o in first + rest] == [0, 64, 63, 31, 64]


def test_batch_composition_does_not_change_greedy_output(model_and_ref):
    path, ref = model_and_ref
    with LLM(str(path), dtype="float32", num_kv_blocks=256) as llm:
        singles = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert singles == ref


def test_triton_backend_under_interpreter(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3", hidden_size=32, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, intermediate_size=64, num_hidden_layers=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41, 42]]
    ref = hf_greedy(path, prompts, max_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got, _ = generate(path, prompts, params, attention_backend="triton", block_size=16,
                      num_kv_blocks=16, max_num_batched_tokens=12)
    assert got == ref


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=s, max_tokens=12, ignore_eos=True)
              for s in (1, 2, 3)]
    prompts = PROMPTS[:3]
    with LLM(str(path), dtype="float32", num_kv_blocks=256) as llm:
        together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
        other_seed = llm.generate([prompts[0]], SamplingParams(temperature=0.8, seed=99, max_tokens=12,
                                                               ignore_eos=True), use_tqdm=False)[0]
    assert together == again == alone
    assert other_seed.token_ids != together[0]


def test_stops_and_finish_reasons(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = hf_greedy(path, [prompt], max_tokens=10)[0]
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        tok = llm.tokenizer
        full = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert full.finish_reason == "length" and full.token_ids == ref
        by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[3]],
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert by_id.finish_reason == "stop" and by_id.token_ids == ref[:ref.index(ref[3]) + 1]
        eos = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
        assert eos.finish_reason in ("stop", "length")
        text = tok.decode(ref, skip_special_tokens=True)
        stop = text[len(text) // 2:len(text) // 2 + 2]
        by_str = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[stop],
                                                       ignore_eos=True), use_tqdm=False)[0]
        assert by_str.finish_reason == "stop"
        assert by_str.text == text[:text.index(stop)]
        assert llm.stats()["kv_blocks_used"] == 0


def test_admission_errors_leave_the_engine_usable(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    with LLM(str(path), dtype="float32", num_kv_blocks=4, block_size=16, max_model_len=128) as llm:
        with pytest.raises(AdmissionError, match="max_model_len"):
            llm.generate([list(range(3, 103))], SamplingParams(max_tokens=50), use_tqdm=False)
        with pytest.raises(AdmissionError, match="num_kv_blocks"):
            llm.generate([list(range(3, 63))], SamplingParams(max_tokens=20), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="prompt"):
            llm.generate([[]], GREEDY, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="prompt"):
            llm.generate([[10 ** 6]], GREEDY, use_tqdm=False)
        ok = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
        assert len(ok.token_ids) == 10
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0


def test_unknown_option_is_a_config_error(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    with pytest.raises(ConfigError, match="blok_size"):
        LLM(str(path), blok_size=16)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(path), block_size=0)


def test_a_single_process_start_removes_rings_of_dead_engines(tiny_models_root):  # noqa: F811
    """A killed TP >= 2 engine leaves its plan ring in /dev/shm; any later start removes it."""
    import os
    import secrets
    import subprocess

    from tpserve.workers.shm_ring import SHM_DIR
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tpserve-{dead.pid}-{secrets.token_hex(4)}"
    live = f"tpserve-{os.getpid()}-{secrets.token_hex(4)}"  # this process may still use it
    for name in (stale, live):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        with LLM(str(path), dtype="float32", num_kv_blocks=16):
            assert not os.path.exists(os.path.join(SHM_DIR, stale))
            assert os.path.exists(os.path.join(SHM_DIR, live))
    finally:
        for name in (stale, live):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
