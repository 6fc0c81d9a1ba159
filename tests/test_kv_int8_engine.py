"""``--kv-cache-dtype int8`` end to end on tiny random-weight models: the pool holds ~2x the
tokens, greedy tokens and prompt log-probabilities stay close to a full-precision cache, prefix
hits, preemption, tensor parallelism, the fused decode and the KV tiers work on int8 blocks, and
bad values are refused naming the field."""
from __future__ import annotations

import random

import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_fused_decode import run_steps
from test_models import PagedKV, random_prompts, tpserve_model
from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.kernels.torch_attention import TorchAttention
from tpserve.models.packed_gemm import prepack_model
from tpserve.server.metrics import ServingMetrics
from tpserve.workers.model_runner import kv_cache_dtype

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(n)] for n in (23, 40, 9, 31)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3")


def run(path, prompts=PROMPTS, params=GREEDY, **kw):
    """(token ids per prompt, prompt log-probabilities per prompt, cached tokens, stats)."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 128)
    with LLM(str(path), **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] if o.prompt_logprobs else []
           for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], lps, [o.num_cached_tokens for o in outs], stats


def _mean_abs(a, b):
    diffs = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(diffs) / len(diffs), max(diffs)


def test_greedy_tokens_and_prompt_logprobs_close_to_the_full_cache(model):
    full, full_lps, _, s = run(model)
    assert s["kv_cache_dtype"] == "float32"
    got, lps, _, s = run(model, kv_cache_dtype="int8")
    assert s["kv_cache_dtype"] == "int8"
    pairs = [(a, b) for x, y in zip(full, got) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.75
    assert all(x[:3] == y[:3] for x, y in zip(full, got))  # the first tokens of a stream do not flip
    mean, worst = _mean_abs(full_lps, lps)
    assert mean < 0.05 and worst < 0.5


def test_bf16_int8_error_is_of_the_size_of_bf16_rounding(model):
    # A random bf16 model's greedy tokens are near ties that bf16's own rounding flips, so the
    # measure is teacher-forced: the prompt log-probabilities against the bf16 cache's, next to
    # the distance of the same model computed in fp32.
    _, bf16_lps, _, s = run(model, dtype="bfloat16")
    assert s["kv_cache_dtype"] == "bfloat16"
    _, lps, _, _ = run(model, dtype="bfloat16", kv_cache_dtype="int8")
    _, fp32_lps, _, _ = run(model)
    mean, worst = _mean_abs(bf16_lps, lps)
    yardstick, _ = _mean_abs(bf16_lps, fp32_lps)
    assert mean < 0.05 and worst < 0.5 and mean < 2 * yardstick


def test_status_and_metrics_name_the_kv_dtype(model):
    with LLM(str(model), dtype="float32", num_kv_blocks=16, kv_cache_dtype="int8") as llm:
        stats = llm.engine.stats()
    assert stats["kv_cache_dtype"] == "int8"
    text = ServingMetrics("m", lambda: stats).render()
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    assert 'cache_dtype="int8"' in line and 'num_gpu_blocks="16"' in line


def test_the_pool_holds_about_twice_the_bf16_tokens(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3", head_dim=64)
    blocks = {}
    for kv in ("auto", "int8"):
        with LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gb=0.002,
                 max_num_seqs=64, max_model_len=512) as llm:
            blocks[kv] = llm.engine.config.num_kv_blocks
            runner = llm.engine.executor.runner
            assert runner.num_blocks * runner.block_bytes <= 0.002 * (1 << 30)
            assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert blocks["int8"] / blocks["auto"] >= 1.85  # (2 * 64 + 8) bytes per head against 256


def test_a_prefix_hit_computes_the_recomputed_logprobs(model):
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def gen(llm):
        out = llm.generate([PROMPTS[1]], p, use_tqdm=False)[0]
        c = out.outputs[0]
        return list(c.token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs], \
            out.num_cached_tokens

    with LLM(str(model), dtype="float32", num_kv_blocks=128, kv_cache_dtype="int8") as llm:
        tokens, lps, cached = gen(llm)
        assert cached == 0
        again = gen(llm)
    assert again == (tokens, lps, 32)  # the same bits from the int8 blocks of the prefix cache


def test_preempted_sequences_finish_with_the_same_tokens(model):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy, _, _, _ = run(model, params=params, kv_cache_dtype="int8", num_kv_blocks=128)
    tight, _, _, s = run(model, params=params, kv_cache_dtype="int8", num_kv_blocks=16,
                         block_size=16, max_num_seqs=4)
    assert s["num_preemptions"] > 0
    assert tight == roomy


def test_tensor_parallel_int8_matches_one_rank(model):
    one, one_lps, _, _ = run(model, kv_cache_dtype="int8")
    two, two_lps, _, _ = run(model, kv_cache_dtype="int8", tensor_parallel_size=2)
    assert two == one
    diffs = [abs(a - b) for x, y in zip(one_lps, two_lps) for a, b in zip(x, y)]
    assert max(diffs) < 1e-3


def _int8_kv(model, num_seqs, max_len):
    kv = PagedKV(model, num_seqs, max_len)
    kv.caches = [(torch.zeros_like(k, dtype=torch.int8), torch.zeros_like(v, dtype=torch.int8),
                  torch.zeros(k.shape[:3]), torch.zeros(k.shape[:3])) for k, v in kv.caches]
    model.set_kv_caches(kv.caches)
    return kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_on_int8_equals_the_module_path_bit_for_bit(model, dtype):
    prompts = random_prompts([9, 4, 17], 384, seed=3)
    results = []
    for fused, stack in ((False, True), (True, True), (True, False)):
        m = tpserve_model(model, backend="cpu", dtype=getattr(torch, dtype))
        prepack_model(m)
        kv = _int8_kv(m, len(prompts), 40)
        if fused:
            assert m.enable_fused_decode() is None
            if not stack:
                m.fused_decode.stack = None  # the layer-by-layer calls of tensor parallelism
        results.append(run_steps(m, kv, prompts, fused))
        assert kv.caches[0][0].abs().max() == 127 and (kv.caches[0][2] > 0).any()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_kv_tiers_store_and_load_int8_blocks_with_their_scales(model, tmp_path):
    bs, pool = 4, 16
    a, others = PROMPTS[1], [[_rng.randrange(3, 380) for _ in range(40)] for _ in range(3)]
    kw = dict(dtype="float32", num_kv_blocks=pool, block_size=bs, kv_cache_dtype="int8",
              kv_offload_dir=str(tmp_path))
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)

    def gen(llm, prompt):
        out = llm.generate([prompt], p, use_tqdm=False)[0]
        c = out.outputs[0]
        return list(c.token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]

    with LLM(str(model), kv_offload_host_gb=0.001, **kw) as llm:
        gen(llm, a)
        pool_hit = gen(llm, a)  # from the pool's prefix cache
        for o in others:
            gen(llm, o)
        before = llm.engine.stats()["kv_offload_host_loads"]
        assert gen(llm, a) == pool_hit
        assert llm.engine.stats()["kv_offload_host_loads"] - before >= 5
        worker = llm.engine.executor.runner.kv_tiers
        assert worker.block_bytes == 2 * 2 * bs * 2 * (16 + 4)  # layers, K/V, slots, heads, codes+scale
    with LLM(str(model), **kw) as llm:  # a restart: the blocks come from disk
        got = gen(llm, a)
        s = llm.engine.stats()
        assert s["kv_offload_disk_loads"] >= 9 and s["kv_offload_disk_corrupt"] == 0
        assert got == pool_hit


def test_bad_kv_cache_dtypes_are_refused_naming_the_field(model):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype: fp8 needs a GPU"):
        LLM(str(model), dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")

    class NoInt8(TorchAttention):
        name, int8_kv = "triton", False
    with pytest.raises(ConfigError, match="kv_cache_dtype: int8 needs the cpu or torch"):
        kv_cache_dtype("int8", torch.bfloat16, torch.device("cpu"), NoInt8())
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu"), NoInt8()) == torch.bfloat16
    assert kv_cache_dtype("int8", torch.float32, torch.device("cpu"), TorchAttention()) == torch.int8


def test_the_cli_option_and_its_environment_variable():
    import click
    from click.testing import CliRunner

    from tpserve.cli.options import config_from_options, engine_options, options_argv

    @click.command()
    @engine_options
    def cmd(**kw):
        config = config_from_options(kw, resolve=False)
        click.echo(f"kv={config.kv_cache_dtype} argv={' '.join(options_argv(config))}")

    out = CliRunner().invoke(cmd, ["--kv-cache-dtype", "int8"])
    assert out.exit_code == 0 and "kv=int8" in out.output and "--kv-cache-dtype int8" in out.output
    assert "kv=int8" in CliRunner().invoke(cmd, [], env={"TPSERVE_KV_CACHE_DTYPE": "int8"}).output
    assert "kv=auto" in CliRunner().invoke(cmd, []).output
    bad = CliRunner().invoke(cmd, ["--kv-cache-dtype", "int4"])
    assert bad.exit_code != 0 and "--kv-cache-dtype" in bad.output
