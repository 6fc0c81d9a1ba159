"""Log-probabilities: computed in the sampler on rank 0, carried per token in engine outputs."""
import math

import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, InvalidFieldError, SamplingParams
from tpserve.sample_plan import SamplePlan
from tpserve.workers.sampler import Sampler, compute_logprobs


def test_compute_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    tokens = torch.tensor([4, 0, 49])
    lp, top_ids, top_lp, ranks = compute_logprobs(logits, tokens, 5, ranks=True)
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(lp, ref[torch.arange(3), tokens])
    assert top_ids.shape == (3, 5) and top_lp.shape == (3, 5)
    assert torch.equal(top_ids[:, 0], ref.argmax(-1))
    assert torch.allclose(top_lp, ref.gather(1, top_ids))
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    # 1-based rank in the distribution: 1 + the tokens more likely than the sampled one.
    order = ref.argsort(dim=-1, descending=True)
    want = [int((order[i] == tokens[i]).nonzero()) + 1 for i in range(3)]
    assert ranks.tolist() == want
    lp0, ids0, lps0, ranks0 = compute_logprobs(logits, tokens, 0)
    assert torch.equal(lp0, lp) and ids0.shape == (3, 0) and lps0.shape == (3, 0)
    assert ranks0 is None  # not asked: the daemon reports no ranks and skips that pass


def test_logprobs_ignore_temperature():
    """Reported logprobs are the model's, whatever temperature the token was sampled with."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler()
    tok = sampler(logits, SamplePlan.rows([5.0], seeds=3))
    lp, _, _, _ = compute_logprobs(logits, tok, 1)
    assert math.isclose(float(lp[0]), float(torch.log_softmax(logits, -1)[0, tok[0]]), rel_tol=1e-6)


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_engine_reports_one_entry_per_token(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root)
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4) as llm:
        engine = llm.engine
        greedy = _run(engine, "g", list(range(10, 23)),
                      SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
        ids = [t for o in greedy for t in o.new_token_ids]
        lps = [lp for o in greedy for lp in o.logprobs]
        assert len(ids) == len(lps) == 6
        for tok, lp in zip(ids, lps):
            assert len(lp.top) == 3
            assert lp.top[0][0] == tok and math.isclose(lp.top[0][1], lp.logprob)  # greedy = best
            assert lp.logprob <= 0.0 and lp.rank == 1
        sampled = _run(engine, "s", list(range(10, 23)),
                       SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, logprobs=0))
        assert [len(o.logprobs) for o in sampled] == [len(o.new_token_ids) for o in sampled]
        assert all(lp.top == [] and lp.logprob <= 0.0 and lp.rank >= 1 for o in sampled for lp in o.logprobs)
        plain = _run(engine, "p", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
        assert all(o.logprobs is None for o in plain)
        engine.logprob_ranks = False  # as the daemon runs it: no rank pass, rank None
        unranked = _run(engine, "u", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, logprobs=1,
                                                                prompt_logprobs=1))
        assert [lp.rank for o in unranked for lp in o.logprobs] == [None, None]
        assert [e.rank for e in unranked[0].prompt_logprobs[1:]] == [None, None]
        engine.logprob_ranks = True
        assert all(o.queue_time is not None and o.queue_time >= 0 for o in plain)
        assert engine.scheduler._num_logprob_seqs == 0


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_logprobs_bounds(bad):
    with pytest.raises(InvalidFieldError) as e:
        SamplingParams(logprobs=bad)
    assert e.value.field == "logprobs"


def test_offline_generate_returns_logprobs(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root)
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 4
        # vLLM's shape: {token id: Logprob}; greedy, so the sampled token is the rank-1 one.
        assert [[t for t, e in d.items() if e.rank == 1] for d in out.logprobs] == [[t] for t in out.token_ids]
        assert all(d[t].logprob <= 0.0 for t, d in zip(out.token_ids, out.logprobs))
        plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert plain.outputs[0].logprobs is None
