"""What docs/protocol.md promises about reproducibility, checked on logits bit for bit.

* The same requests run the same way give identical logits (so identical greedy and seeded
  tokens), in fp32 and bf16.
* A request running alone computes the same logits whether its prefix is recomputed or read
  from the prefix cache (filled by another request, in another batch), in fp32 and bf16: the
  prefill attention over new tokens and the attention over cached keys do the same arithmetic.
* Seeded sampling draws do not depend on the batch: tests/test_sampler.py.

Logits are read by wrapping the rank-0 runner's sampler (TP 1 runs it in this process).
"""
import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, SamplingParams

SHARED = list(range(30, 70))  # 40 tokens: two full blocks of 16 are cached
P = SHARED + [5, 6, 7, 8, 9, 10, 11, 12, 13]
Q = SHARED + list(range(300, 323))
OTHERS = [[100, 3, 4], list(range(200, 251)), [7] * 21]


class LogitSpy:
    """Records the logits row of every (seed, step) the sampler sees."""

    def __init__(self, llm: LLM):
        runner = llm.engine.executor.runner
        self.sampler = runner.sampler
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        runner.sampler = self

    def sample(self, logits, plan):
        for i in range(logits.shape[0]):
            self.rows[(int(plan.seeds[i]), int(plan.steps[i]))] = logits[i].float().clone()
        return self.sampler.sample(logits, plan)

    def of(self, seed: int) -> list[torch.Tensor]:
        return [v for (s, _), v in sorted(self.rows.items()) if s == seed]


def run(llm, spy, prompts, seeds, reset=True):
    """Greedy generation tagged by seed; returns the token ids and the logits per seed."""
    if reset:
        llm.reset_prefix_cache()
    spy.rows.clear()
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=s) for s in seeds]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], {s: spy.of(s) for s in seeds}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_requests_the_same_way_give_identical_logits(model, dtype):
    with LLM(str(model), dtype=dtype, num_kv_blocks=128) as llm:
        spy = LogitSpy(llm)
        prompts, seeds = [P] + OTHERS, [1, 2, 3, 4]
        tokens1, logits1 = run(llm, spy, prompts, seeds)
        tokens2, logits2 = run(llm, spy, prompts, seeds)
    assert tokens1 == tokens2
    assert all(same(logits1[s], logits2[s]) for s in seeds)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_hit_computes_the_same_logits_as_recomputing(model, dtype):
    with LLM(str(model), dtype=dtype, num_kv_blocks=128, block_size=16) as llm:
        spy = LogitSpy(llm)
        cold_tokens, cold = run(llm, spy, [P], [1])
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        run(llm, spy, [Q] + OTHERS, [2, 3, 4, 5])  # Q caches SHARED's blocks in a batch of four
        warm_tokens, warm = run(llm, spy, [P], [1], reset=False)
        assert llm.stats()["prefix_cache_hit_tokens"] - hits_before >= 32
    assert warm_tokens == cold_tokens
    assert same(cold[1], warm[1]), max((a - b).abs().max().item() for a, b in zip(cold[1], warm[1]))


@pytest.mark.parametrize("dtype", ["bfloat16"])  # fp32: see docs/protocol.md
def test_a_hit_that_leaves_one_prompt_row_computes_the_same_logits(model, dtype):
    """Two cached blocks of a 33-token prompt leave one row to compute: its attention must not
    take the decode rows' arithmetic."""
    prompt = SHARED[:33]
    with LLM(str(model), dtype=dtype, num_kv_blocks=128, block_size=16) as llm:
        spy = LogitSpy(llm)
        cold_tokens, cold = run(llm, spy, [prompt], [1])
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        warm_tokens, warm = run(llm, spy, [prompt], [1], reset=False)
        assert llm.stats()["prefix_cache_hit_tokens"] - hits_before == 32
    assert warm_tokens == cold_tokens
    assert same(cold[1], warm[1])
