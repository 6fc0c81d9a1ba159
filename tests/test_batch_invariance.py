"""The batch-invariant mode (``batch_invariant=True``, docs/protocol.md "Reproducibility").

Each prompt's token ids and log-probabilities (the sampled token's and the top 2, compared as
floats, so bit for bit) must equal those of the same prompt run alone in a plain engine in the
mode, whatever the situation: 48 prompts submitted together, prompts prefilled in small chunks,
prefixes read from the prefix cache, sequences preempted and recomputed, n-gram speculation,
TP=2. Greedy and seeded sampling (temperature 0.1: drafts get accepted). The default mode is run
on the situations the mode changes (preemption, speculation: a row computed by the prompt path
instead of the decode path), and must differ there, so these tests can fail.

The model: the 40M benchmark model's architecture (Qwen3, bf16) at a small size that still
takes every tiling of the kernels: hidden 128 (two output panels of the packed linear kernels
with AVX-512, four with AVX2), grouped-query attention (4 heads on 2 KV heads), head_dim 32,
steps of more than 64 rows (several row blocks). scripts/determinism.py runs the 40M model itself.
"""
import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, EngineConfig, SamplingParams
from tpserve.errors import ConfigError

SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256, vocab_size=1024, max_position_embeddings=1024)
N_PROMPTS = 48
MAX_TOKENS = 10
SHARED = [(7 * i) % 997 + 5 for i in range(40)]  # a 40-token prefix: two full blocks of 16


def _prompts() -> list[list[int]]:
    """48 prompts of 3-70 tokens; a third share SHARED (prefix hits), a third repeat a phrase
    (what n-gram speculation finds)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(N_PROMPTS):
        n = int(torch.randint(3, 40, (), generator=g))
        body = torch.randint(5, 1000, (n,), generator=g).tolist()
        if i % 3 == 0:
            body = SHARED + body[:20]
        elif i % 3 == 1:
            body = (body[:6] * 5)[: max(n, 12)]
        out.append(body)
    return out


PROMPTS = _prompts()


def _params(seeded: bool) -> list[SamplingParams]:
    if seeded:
        return [SamplingParams(temperature=0.1, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                               logprobs=2) for i in range(N_PROMPTS)]
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
            for _ in range(N_PROMPTS)]


def _record(out) -> tuple:
    """(token ids, each token's {id: logprob} of the top 2 and the sampled one)."""
    c = out.outputs[0]
    logprobs = tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)
    return tuple(c.token_ids), logprobs


def _run(llm: LLM, seeded: bool, together: bool = True, n: int = N_PROMPTS) -> list[tuple]:
    params = _params(seeded)[:n]
    if together:
        return [_record(o) for o in llm.generate(PROMPTS[:n], params, use_tqdm=False)]
    recs = []
    for p, sp in zip(PROMPTS[:n], params):
        llm.reset_prefix_cache()
        recs.append(_record(llm.generate([p], sp, use_tqdm=False)[0]))
    return recs


def _differing(a: list[tuple], b: list[tuple]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    return str(make_tiny_model(tiny_models_root, arch="qwen3", **SHAPE))


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt alone in a plain engine in the mode: the reference, greedy and seeded."""
    with LLM(model, dtype="bfloat16", num_kv_blocks=256, batch_invariant=True) as llm:
        assert llm.stats()["batch_invariant"] is True
        return {seeded: _run(llm, seeded, together=False) for seeded in (False, True)}


# Engine options of each situation, and a check that the situation happened.
SITUATIONS = {
    "batched": (dict(), None),
    "chunked": (dict(max_num_batched_tokens=8, max_stall_tokens=8), None),
    "prefix_hits": (dict(), lambda s: s["prefix_cache_hit_tokens"] >= 32 * 10),
    "preempted": (dict(num_kv_blocks=24, max_num_batched_tokens=64, max_stall_tokens=64),
                  lambda s: s["num_preemptions"] > 0),
    "speculated": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 2,
                                            "disable_by_batch_size": 64}),
                   lambda s: s["spec_decode_num_accepted_tokens"] > 0),
}


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_each_prompt_computes_what_it_computes_alone(model, alone, situation, seeded):
    options, happened = SITUATIONS[situation]
    options = dict(dict(num_kv_blocks=256), **options)
    with LLM(model, dtype="bfloat16", batch_invariant=True, **options) as llm:
        if situation == "prefix_hits":
            _run(llm, seeded)  # fills the prefix cache: the run below reads every shared prefix
        got = _run(llm, seeded)
        stats = llm.stats()
    if happened is not None:
        assert happened(stats), stats
    assert _differing(got, alone[seeded]) == []


def test_the_default_mode_differs_where_the_mode_changes_the_arithmetic(model, alone):
    """Control: without the mode, a preempted sequence's recomputed rows and speculative
    verification rows take the prompt path, whose sums run in another order than the decode
    path's; some log-probabilities move. The reference is the mode's (every row with the decode
    arithmetic), which an alone run without the mode matches (it only ever decodes)."""
    moved = 0
    for situation in ("preempted", "speculated"):
        options = dict(dict(num_kv_blocks=256), **SITUATIONS[situation][0])
        with LLM(model, dtype="bfloat16", **options) as llm:
            moved += len(_differing(_run(llm, False), alone[False]))
    assert moved > 0


def test_the_layer_by_layer_path_and_float32(model, monkeypatch):
    """Without the fused decode stack (every step layer by layer), and in float32: batched
    equals alone in the mode."""
    monkeypatch.setenv("TPSERVE_FUSED_DECODE", "0")
    with LLM(model, dtype="float32", num_kv_blocks=256, batch_invariant=True) as llm:
        assert llm.engine.executor.runner.model.fused_decode is None
        assert _differing(_run(llm, False), _run(llm, False, together=False)) == []


@pytest.mark.parametrize("kind", ["int8", "qwen3_moe"])
def test_int8_and_mixture_of_experts(tiny_models_root, kind):  # noqa: F811
    """int8 weights with int8 activations (quantized per row) and a mixture of experts (tokens
    grouped by expert through the packed kernels): 16 prompts together equal each alone."""
    arch = "qwen3" if kind == "int8" else kind
    path = str(make_tiny_model(tiny_models_root, arch=arch, **SHAPE))
    quant = dict(quantization="int8") if kind == "int8" else {}
    with LLM(path, dtype="bfloat16", num_kv_blocks=256, batch_invariant=True, **quant) as llm:
        assert _differing(_run(llm, True, n=16), _run(llm, True, together=False, n=16)) == []


def test_tp2_batched_equals_alone(model):
    """TP=2 (each rank's shard, the all-reduce between them): 48 prompts together equal each
    alone, seeded (the first 16 run alone: a TP=2 engine's start costs most of this test)."""
    with LLM(model, dtype="bfloat16", num_kv_blocks=256, batch_invariant=True, tensor_parallel_size=2) as llm:
        together = _run(llm, True)
        alone = _run(llm, True, together=False, n=16)
    assert _differing(together[:16], alone) == []


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "flash"])
def test_backends_without_an_invariant_form_are_refused(backend):
    with pytest.raises(ConfigError) as e:
        EngineConfig(batch_invariant=True, attention_backend=backend)
    assert e.value.field == "attention_backend"


def test_unpacked_matmuls_are_refused(monkeypatch):
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    with pytest.raises(ConfigError, match="TPSERVE_PREPACK=0") as e:
        EngineConfig(batch_invariant=True)
    assert e.value.field == "batch_invariant"


def test_a_bad_value_names_the_field():
    with pytest.raises(ConfigError) as e:
        EngineConfig(batch_invariant="yes")
    assert e.value.field == "batch_invariant"


def test_float16_on_cpu_is_refused(model):
    with pytest.raises(ConfigError) as e:
        LLM(model, dtype="float16", num_kv_blocks=64, batch_invariant=True)
    assert e.value.field in ("dtype", "batch_invariant")


# ---- reporting -----------------------------------------------------------------------------------

def test_status_metrics_and_cli_show_the_mode():
    from tpserve.cli.control_cmds import _STATUS_LINES
    from tpserve.cli.options import config_from_options, options_argv
    from tpserve.server.metrics import _EngineCollector

    assert any(key == "batch_invariant" for _, key, _ in _STATUS_LINES)
    for on in (True, False):
        families = {f.name: f for f in _EngineCollector("m", lambda: {"batch_invariant": on}).collect()}
        assert families["tpserve:batch_invariant"].samples[0].value == float(on)
    config = config_from_options({"batch_invariant": True}, resolve=False)
    assert config.batch_invariant is True
    assert "--batch-invariant" in options_argv(config)


def test_triton_backend_engine(tiny_models_root):  # noqa: F811
    """The Triton attention backend (under TRITON_INTERPRET=1 on CPU, tests/conftest.py) in the
    mode: prompts together and in small chunks equal each alone (a tiny shape: the interpreter runs
    a program at a time)."""
    path = str(make_tiny_model(tiny_models_root, arch="qwen3", hidden_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=128, vocab_size=512))
    prompts = [[t % 512 for t in p[:14]] for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2) for _ in prompts]
    kw = dict(dtype="float32", num_kv_blocks=64, attention_backend="triton", batch_invariant=True)
    with LLM(path, **kw) as llm:
        alone = [_record(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
        llm.reset_prefix_cache()
        together = [_record(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, max_num_batched_tokens=8, max_stall_tokens=8, **kw) as llm:
        chunked = [_record(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert _differing(together, alone) == [] and _differing(chunked, alone) == []
