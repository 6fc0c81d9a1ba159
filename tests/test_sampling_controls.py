"""Sampling controls end to end (offline API, fp32, greedy): each one changes the tokens exactly
as its definition says, checked against a reference decode loop over transformers' logits with
the control applied by hand (vLLM's formulas); n completions; prompt log-probabilities."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, SamplingParams
from tpserve.errors import InvalidFieldError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45)), [100, 3, 4, 3, 100]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4) as llm:
        yield path, hf, llm


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def reference(hf, prompt, process, max_tokens=MAX_TOKENS, stop_ids=()):
    """Greedy decode where ``process(logits, prompt, output)`` edits each step's logits."""
    out: list[int] = []
    for _ in range(max_tokens):
        x = hf_logits(hf, prompt + out)[-1].clone()
        x = process(x, prompt, out)
        tok = int(x.argmax())
        out.append(tok)
        if tok in stop_ids:
            break
    return out


def penalize(rep=1.0, freq=0.0, pres=0.0):
    def f(x, prompt, out):
        seen = set(prompt) | set(out)
        for t in seen:
            x[t] = x[t] * (1.0 / rep) if x[t] > 0 else x[t] * rep
        for t in set(out):
            x[t] -= freq * out.count(t) + pres
        return x
    return f


def run(llm, prompts, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), ignore_eos=True, **kw)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
                                dict(frequency_penalty=1.5), dict(presence_penalty=1.5),
                                dict(frequency_penalty=-0.8, presence_penalty=0.9, repetition_penalty=1.2)])
def test_penalties_equal_the_reference(setup, kw):
    _, hf, llm = setup
    proc = penalize(kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0),
                    kw.get("presence_penalty", 0.0))
    got = run(llm, PROMPTS, **kw)
    assert got == [reference(hf, p, proc) for p in PROMPTS]
    assert got != run(llm, PROMPTS)  # the penalty changed something


def test_penalties_beside_plain_requests_and_after_preemption(setup, tiny_models_root):  # noqa: F811
    path, hf, _ = setup
    proc = penalize(1.5, 0.5, 0.5)
    want = [reference(hf, p, proc, max_tokens=24) for p in PROMPTS]
    plain = [reference(hf, p, lambda x, *_: x, max_tokens=24) for p in PROMPTS]
    pen = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                         frequency_penalty=0.5, presence_penalty=0.5)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # A pool of 14 blocks of 4 tokens cannot hold all six sequences: preemptions recompute.
    with LLM(str(path), dtype="float32", num_kv_blocks=14, block_size=4) as llm:
        outs = llm.generate(PROMPTS * 2, [pen] * 3 + [greedy] * 3, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == want + plain


def test_logit_bias_and_allowed_token_ids(setup):
    _, hf, llm = setup
    base = run(llm, PROMPTS[:1])[0]
    bias = {base[0]: -100.0, 77: 30.0}

    def biased(x, *_):
        for t, b in bias.items():
            x[t] += b
        return x
    assert run(llm, PROMPTS[:1], logit_bias=bias) == [reference(hf, PROMPTS[0], biased)]
    allowed = [3, 50, 77, base[1]]

    def only(x, *_):
        keep = torch.full_like(x, float("-inf"))
        keep[allowed] = x[allowed]
        return keep
    got = run(llm, PROMPTS[:1], allowed_token_ids=allowed)[0]
    assert got == reference(hf, PROMPTS[0], only) and set(got) <= set(allowed)


def test_min_tokens_bans_stop_ids_until_reached(setup):
    _, hf, llm = setup
    base = run(llm, PROMPTS[:1])[0]
    stop = [base[0], base[2]]
    early = run(llm, PROMPTS[:1], stop_token_ids=stop)[0]
    assert early == base[:1]  # the first token stops it
    got = run(llm, PROMPTS[:1], stop_token_ids=stop, min_tokens=4)[0]

    def ban_until(x, prompt, out):
        if len(out) < 4:
            x[stop] = float("-inf")
        return x
    assert got == reference(hf, PROMPTS[0], ban_until, stop_ids=stop)
    assert len(got) >= 4 and not set(got[:4]) & set(stop)


def test_bad_words_ban_every_tokenization_where_it_would_complete(setup):
    _, hf, llm = setup
    tok = llm.tokenizer
    base = run(llm, PROMPTS[:1])[0]
    word = tok.decode(base[1:3])  # a two-token span of the greedy output
    from tpserve.engine import bad_words_token_ids
    seqs = bad_words_token_ids(tok, [word])
    got = run(llm, PROMPTS[:1], bad_words=[word])[0]

    def ban(x, prompt, out):
        for w in seqs:
            if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]):
                x[w[-1]] = float("-inf")
        return x
    assert got == reference(hf, PROMPTS[0], ban)
    assert got != base
    for w in seqs:  # no banned sequence occurs in the output
        assert all(got[i:i + len(w)] != w for i in range(len(got)))


def test_n_completions_share_the_prompt_blocks_and_seeds_are_per_completion(setup):
    _, _, llm = setup
    prompt = list(range(30, 60))
    before = llm.stats()["prefix_cache_hit_tokens"]
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 8 for c in out.outputs)
    hits = llm.stats()["prefix_cache_hit_tokens"] - before
    assert hits >= 3 * (len(prompt) // 4) * 4  # the three later completions reuse the full blocks
    # Completion i is the seed + i request of n = 1.
    for i, c in enumerate(out.outputs):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0]
        assert c.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_prompt_logprobs_equal_transformers_and_survive_chunking_and_cache(setup, tiny_models_root):  # noqa: F811
    path, hf, llm = setup
    prompt = PROMPTS[1]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    want_top = [ref[i - 1].topk(3) for i in range(1, len(prompt))]
    sp = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == [] and first.outputs[0].finish_reason == "length"
    again = llm.generate([prompt], sp, use_tqdm=False)[0]  # its blocks are cached now: no hit taken
    # Chunked prefill (8-token steps) gives the same values.
    with LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8) as small:
        chunked = small.generate([prompt], sp, use_tqdm=False)[0]
    for out in (first, again, chunked):
        lps = out.prompt_logprobs  # vLLM's: None, then per prompt token {token id: Logprob}
        assert lps[0] is None and len(lps) == len(prompt)
        np.testing.assert_allclose([d[t].logprob for t, d in zip(prompt[1:], lps[1:])], want, atol=2e-4)
        for d, (vals, ids) in zip(lps[1:], want_top):
            top = sorted((e.rank, t, e.logprob) for t, e in d.items() if e.rank <= 3)
            assert [t for _, t, _ in top] == ids.tolist()
            np.testing.assert_allclose([v for _, _, v in top], vals.tolist(), atol=2e-4)


def test_include_stop_str_truncate_and_bounds(setup):
    _, _, llm = setup
    tok = llm.tokenizer
    base = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    text = base.text
    stop = text[3:5]
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
    assert cut.text == text[:text.index(stop) + len(stop)] and cut.finish_reason == "stop"
    short = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=5),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == PROMPTS[1][-5:]
    assert tok is not None
    for bad, field in [(dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                       (dict(presence_penalty=2.5), "presence_penalty"), (dict(n=0), "n"),
                       (dict(logit_bias={1: 101}), "logit_bias[1]"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
                       (dict(bad_words=[""]), "bad_words[0]"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
                       (dict(prompt_logprobs=21), "prompt_logprobs")]:
        with pytest.raises(InvalidFieldError) as e:
            SamplingParams(**bad)
        assert e.value.field == field
    with pytest.raises(InvalidFieldError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert e.value.field.startswith("params.logit_bias")
    assert llm.stats()["kv_blocks_used"] == 0 and math.isfinite(llm.stats()["uptime_s"])
