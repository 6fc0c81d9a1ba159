"""Speculative decoding end to end (offline API and engine, fp32 tiny models): greedy output
equals transformers' with drafts verified (block sizes, preemption, prefix hits, mixed steps,
TP=2); sampled and controlled output equals the output without speculation, token for token
(the acceptance is the race coupling of the rejection rule, workers/rejection.py); and the
sampled distribution at a drafted position is the model's, which a wrong rule fails."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_llm import hf_greedy
from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.engine import Engine
from tpserve.sample_plan import SamplePlan, kept_rows
from tpserve.scheduler import Scheduler, Sequence
from tpserve.workers import sampler as sampler_module
from tpserve.workers.sampler import Sampler

# Drafts at any batch size: these tests check outputs with drafts, not when drafts pay.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None}
# Copy-heavy prompts (repeated spans; the model loops on some) beside plain ones.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [100, 3, 4], [7] * 33, [5, 6, 7, 8] * 3,
           list(range(200, 219))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    return path, hf_greedy(path, PROMPTS, max_tokens=24)


def generate(path, prompts=PROMPTS, params=GREEDY, spec=SPEC, **options):
    options.setdefault("dtype", "float32")
    options.setdefault("num_kv_blocks", 256)
    with LLM(str(path), speculative_config=spec, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    return outs, stats


def assert_verified(stats, min_run=2):
    """Drafts were proposed and runs of at least ``min_run`` drafts were accepted."""
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens_per_pos"][min_run - 1] > 0, stats


# ---- greedy equals transformers --------------------------------------------------------------

@pytest.mark.parametrize("arch,block_size", [("qwen3", 1), ("qwen3", 16), ("llama", 16)])
def test_greedy_with_drafts_matches_transformers(tiny_models_root, qwen3, arch, block_size):  # noqa: F811
    path, ref = qwen3 if arch == "qwen3" else (make_tiny_model(tiny_models_root, arch=arch), None)
    ref = ref if ref is not None else hf_greedy(path, PROMPTS, max_tokens=24)
    outs, stats = generate(path, block_size=block_size, num_kv_blocks=4096 // block_size)
    assert [o.token_ids for o in outs] == ref
    assert_verified(stats)
    assert 1 < stats["spec_decode_mean_acceptance_length"] <= 5
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1


def test_greedy_with_drafts_under_preemption_and_prefix_hits(tiny_models_root, qwen3):  # noqa: F811
    path, ref = qwen3
    # 6 prompts of up to 65 tokens in 24 blocks of 4: decodes preempt others.
    outs, stats = generate(path, block_size=4, num_kv_blocks=24)
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == ref
    assert_verified(stats)
    # Prefix-cache hits: the same prompts again, from the cache.
    shared = list(range(30, 94))
    prompts = [shared + [5, 6], shared, shared[:32] + [7] * 8]
    ref2 = hf_greedy(path, prompts, max_tokens=24)
    with LLM(str(path), dtype="float32", num_kv_blocks=128, speculative_config=SPEC) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in first + rest] == ref2
    assert stats["prefix_cache_hit_tokens"] >= 63 + 32 and stats["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_with_drafts_in_mixed_steps(qwen3, tp):
    """Prompts arrive while others verify drafts: steps hold plain decode rows, draft rows and
    prefill chunks together (with tp=2 they also travel to a worker rank)."""
    path, ref = qwen3
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128, block_size=4,
                          max_num_batched_tokens=16, tensor_parallel_size=tp, speculative_config=SPEC)
    arrivals = [(0, 3), (0, 4), (2, 1), (4, 0), (6, 2), (8, 5)]
    got = {i: [] for _, i in arrivals}
    kinds = set()
    with Engine(config) as engine:
        schedule = engine.scheduler.schedule

        def watched():
            batch = schedule()
            if batch.drafts and batch.is_prefill:
                kinds.add("drafts+prefill")
            if batch.drafts and not all(batch.drafts):
                kinds.add("drafts+plain")
            return batch

        engine.scheduler.schedule = watched
        step = 0
        while step < 300 and (arrivals or engine.has_unfinished()):
            while arrivals and arrivals[0][0] <= step:
                _, i = arrivals.pop(0)
                engine.add_request(f"p{i}", PROMPTS[i], GREEDY)
            for out in engine.step():
                got[int(out.request_id[1:])] += out.new_token_ids
            step += 1
        stats = engine.stats()
    assert [got[i] for i in range(len(PROMPTS))] == ref
    assert kinds == {"drafts+prefill", "drafts+plain"}, kinds
    assert_verified(stats)


# ---- sampling and logits controls: the same tokens as without drafts ---------------------------

# Settings under which drafts get accepted with this model (low temperatures; negative
# penalties favour repeats), so that kept tokens come from draft rows.
CONTROLLED = [
    dict(temperature=0.3, top_p=0.9, top_k=50),
    dict(temperature=0.5, min_p=0.05),
    dict(temperature=0.0, frequency_penalty=-0.3, presence_penalty=0.2),
    dict(temperature=0.3, presence_penalty=0.3, repetition_penalty=0.9),
    dict(temperature=0.0, min_tokens=12, stop_token_ids=[168, 169, 40]),
    dict(temperature=0.0, logit_bias={168: -3.0, 40: 2.0}, logprobs=3),
    dict(temperature=0.9, allowed_token_ids=list(range(150, 200)) + [7, 40], logprobs=2),
    dict(temperature=0.0, bad_words=["ab"]),
]


@pytest.mark.parametrize("controls", CONTROLLED, ids=lambda c: ",".join(c))
def test_seeded_and_controlled_output_is_the_output_without_drafts(qwen3, controls):
    """Every draft row sees the controls it would see with the drafts before it accepted
    (penalty counts, min_tokens, bad words), so each kept token is the non-speculative one."""
    path, _ = qwen3
    params = [SamplingParams(max_tokens=24, ignore_eos="stop_token_ids" not in controls, seed=s, **controls)
              for s in range(len(PROMPTS))]
    plain, _ = generate(path, params=params, spec=None)
    spec, stats = generate(path, params=params, spec=dict(SPEC, num_speculative_tokens=3))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    if "logprobs" in controls:
        for a, b in zip((o.outputs[0] for o in spec), (o.outputs[0] for o in plain)):
            assert len(a.logprobs) == len(a.token_ids)
            assert [x[t].logprob for t, x in zip(a.token_ids, a.logprobs)] == \
                pytest.approx([x[t].logprob for t, x in zip(b.token_ids, b.logprobs)], abs=1e-4)
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
    assert_verified(stats, min_run=2)


def bigram_decode(controls: dict, spec: dict | None, table: np.ndarray, bad_words=()) -> tuple[list, dict]:
    """Scheduler + the real Sampler over a bigram 'model' (a row's logits are ``table`` at its
    input token), so the controls alone shape the output; returns the completions and stats."""
    s = Scheduler(EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
                               max_model_len=128, eos_token_ids=[0], speculative_config=spec))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [6, 7, 8, 9, 6, 7], [3, 3, 3, 3]]
    seqs = []
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=30, ignore_eos=True, seed=i, bad_words=["w"] if bad_words else [],
                            **controls)
        q = Sequence(f"r{i}", prompt, sp, seed=i)
        q.bad_words_ids = [list(w) for w in bad_words]  # what the engine tokenizes the words into
        s.add(q)
        seqs.append(q)
    sampler = Sampler()
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    while s.has_unfinished():
        batch = s.schedule()
        plan = s.build_plan(batch)
        sample = s.build_sample_plan(batch, plan)
        sample.check(plan.num_samples, table.shape[1])
        logits = t(table[plan.input_ids[plan.logits_indices]])
        tokens, accepted = sampler.sample(logits, sample)
        tokens = tokens.numpy()
        if accepted is not None:
            tokens = tokens[kept_rows(sample.draft_counts, accepted)]
        s.postprocess(batch, tokens, accepted)
        s.check_integrity()
    return [q.completion_token_ids for q in seqs], s.stats()


@pytest.mark.parametrize("controls,bad_words", [
    (dict(temperature=0.0, frequency_penalty=0.6), ()),
    (dict(temperature=0.0, presence_penalty=0.8), ()),
    (dict(temperature=0.0, repetition_penalty=1.6), ()),
    (dict(temperature=0.7, frequency_penalty=0.3, presence_penalty=0.2, top_k=5), ()),
    (dict(temperature=0.0, min_tokens=9, stop_token_ids=[2, 5, 8]), ()),
    (dict(temperature=0.0), [(4, 5), (8, 9, 10), (1,)]),
    (dict(temperature=0.0, logit_bias={2: 1.5, 9: -2.0}, min_p=0.2), ()),
], ids=["frequency", "presence", "repetition", "sampled-penalties", "min_tokens", "bad_words", "bias"])
def test_each_draft_row_sees_the_controls_of_its_position(controls, bad_words):
    """Controls whose state moves with every token (penalty counts, min_tokens, bad words) are
    applied to a draft row as if the drafts before it were accepted: the output with drafts is
    the output without them, token for token, while many drafts are accepted."""
    rng = np.random.default_rng(7)
    table = (rng.standard_normal((12, 12)) * 0.3 + np.eye(12)[[(i + 1) % 12 for i in range(12)]] * 2
             ).astype(np.float32)  # mostly "the next token is the input + 1": loops, drafts match
    plain, _ = bigram_decode(controls, None, table, bad_words)
    drafted, stats = bigram_decode(controls, dict(SPEC, num_speculative_tokens=4), table, bad_words)
    assert drafted == plain
    assert stats["spec_decode_num_accepted_tokens_per_pos"][1] > 0, stats


def test_stop_strings_cut_an_accepted_run(qwen3, monkeypatch):
    """Text that loops (the model restricted to letter tokens, a repeated prompt): a stop string
    completed inside a run of accepted drafts ends the output there, as without drafts, also
    when it only counts after min_tokens."""
    path, _ = qwen3
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        tok = llm.tokenizer
    letters = [i for i in range(3, 384) if (t := tok.decode([i])).strip() and t.isascii()
               and t.replace(" ", "").isalpha()]
    prompt = letters[:10] * 3

    def params(stop, min_tokens=0):
        return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                              allowed_token_ids=letters, min_tokens=min_tokens)
    cases = [params("cacn"), params("cace"), params("acc"), params("cacn", min_tokens=8), params("ccach")]
    cuts = []
    find = Engine._find_stop_string

    def recorded(req, new_ids, finished):
        cut = find(req, new_ids, finished)
        if cut is not None:
            cuts.append((cut, len(new_ids)))
        return cut

    monkeypatch.setattr(Engine, "_find_stop_string", staticmethod(recorded))
    plain, _ = generate(path, [prompt] * len(cases), cases, spec=None)
    cuts.clear()
    spec, stats = generate(path, [prompt] * len(cases), cases)
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == \
        [(o.token_ids, o.text, o.finish_reason) for o in plain]
    assert all(o.finish_reason == "stop" for o in spec), [(o.text, o.finish_reason) for o in spec]
    assert plain[0].text != plain[3].text                   # min_tokens moved the stop
    assert any(cut < n for cut, n in cuts), cuts            # tokens after the stop were dropped
    assert stats["spec_decode_num_accepted_tokens"] > 0


# ---- the distribution at a drafted position ---------------------------------------------------

def chi_square_critical(df: int, z: float = 3.72) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z 3.72: one-sided 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over bins of expected count >= 5 (the rest pooled), and its df."""
    n = counts.sum()
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * n
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_sampled_distribution_with_drafts_is_the_models(tiny_models_root, monkeypatch):  # noqa: F811
    """Small vocabulary; the prompt holds every token, so after the first sampled token t0 the
    proposer always drafts t0 + 1, t0 + 2. Over many seeds, the tokens at positions 1 and 2
    (sampled in the step that verifies those drafts) must follow the model: t1 the mixture
    sum_t0 p(t0) p(t1 | t0), t2 p(t2 | t0, t1) for each frequent (t0, t1), with drafts and
    without. A wrong rule, keeping every draft, fails the same bound at position 2."""
    path = make_tiny_model(tiny_models_root, arch="qwen3", vocab_size=259)
    prompt, temp, n = list(range(3, 259)), 0.5, 1500
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def probs(prefixes):
        with torch.inference_mode():
            return (hf(torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1] / temp).softmax(-1)

    p0 = probs([()])[0]
    mixture = (p0[:, None] * probs([(t,) for t in range(259)])).sum(0).numpy()
    params = [SamplingParams(temperature=temp, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    spec = dict(SPEC, num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1,
                disable_by_batch_size=None)

    def run(spec_config):
        with LLM(str(path), dtype="float32", num_kv_blocks=n + 64, speculative_config=spec_config) as llm:
            llm.generate([prompt], SamplingParams(max_tokens=0), use_tqdm=False)  # into the cache
            outs = llm.generate([prompt] * n, params, use_tqdm=False)
            stats = llm.stats()
        return np.array([o.token_ids[:3] for o in outs]), stats

    def position2_statistic(toks):
        """Summed chi-square of t2 against p(t2 | t0, t1) over (t0, t1) seen >= 60 times."""
        pairs, counts = np.unique(toks[:, :2], axis=0, return_counts=True)
        pairs = pairs[counts >= 60]
        assert len(pairs) >= 3
        total, dfs = 0.0, 0
        for pair, p2 in zip(pairs, probs([tuple(x) for x in pairs.tolist()]).numpy()):
            group = toks[(toks[:, 0] == pair[0]) & (toks[:, 1] == pair[1]), 2]
            stat, df = chi_square(np.bincount(group, minlength=259), p2)
            total, dfs = total + stat, dfs + df
        return total, dfs

    plain, _ = run(None)
    drafted, stats = run(spec)
    assert stats["spec_decode_num_drafts"] >= n  # every sequence verified drafts at position 1
    for toks in (plain, drafted):
        stat, df = chi_square(np.bincount(toks[:, 1], minlength=259), mixture)
        assert stat < chi_square_critical(df), (stat, df)
        stat, df = position2_statistic(toks)
        assert stat < chi_square_critical(df), (stat, df)
    # The coupling makes the two runs agree seed by seed, not only in distribution.
    assert (plain == drafted).all()
    # A wrong rule: keep every draft (so t2 is sampled after t0 + 1, whatever t1 was).
    monkeypatch.setattr(sampler_module, "accept",
                        lambda tokens, counts, drafts: (np.asarray(counts) + 1).astype(np.int32))
    wrong, _ = run(spec)
    stat, df = position2_statistic(wrong)
    assert stat > 10 * chi_square_critical(df), (stat, df)


def test_acceptance_rule_against_two_wrong_ones():
    """At the sampler: rows p0 (the drafted position) and p1 (after the draft) over 8 tokens,
    20,000 seeds. The kept first token must follow p0 and, when the draft was kept, the second
    must follow p1. Two wrong rules fail the same chi-square bound: 'accept d with probability
    p(d), else a fresh draw from p' (d not removed) and 'accept d with probability
    p(d) / max p, else a draw from p without d' (too generous)."""
    n, v = 20_000, 8
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, v, generator=g) * 1.5
    d = int(rows[0].argsort()[-2])                 # the second most likely token: drafts fail often
    logits = rows.repeat(n, 1)                     # [2n, v]: sequence i has rows 2i, 2i+1
    plan = SamplePlan.rows(np.ones(2 * n), top_ks=0, top_ps=1.0, seeds=np.arange(n).repeat(2),
                           steps=np.tile([5, 6], n), draft_counts=np.ones(n, np.int32),
                           draft_tokens=np.full(n, d, np.int32))
    tokens, accepted = Sampler().sample(logits, plan)
    tokens = tokens.numpy().reshape(n, 2)
    p0, p1 = rows.softmax(-1).numpy()
    first = tokens[:, 0]
    kept_draft = accepted == 2
    assert (kept_draft == (first == d)).all() and 0.05 < kept_draft.mean() < 0.95
    for counts, probs in ((np.bincount(first, minlength=v), p0),
                          (np.bincount(tokens[kept_draft, 1], minlength=v), p1)):
        stat, df = chi_square(counts, probs)
        assert stat < chi_square_critical(df), (stat, df)
    rng = np.random.default_rng(1)
    u = rng.random(n)
    without_d = np.where(np.arange(v) == d, 0.0, p0) / (1 - p0[d])
    wrong_rules = (np.where(u < p0[d], d, rng.choice(v, size=n, p=p0)),
                   np.where(u < p0[d] / p0.max(), d, rng.choice(v, size=n, p=without_d)))
    for wrong in wrong_rules:
        stat, df = chi_square(np.bincount(wrong, minlength=v), p0)
        assert stat > chi_square_critical(df), (stat, df)


def test_prompt_logprobs_beside_draft_rows(qwen3):
    """A prompt scored in chunks while other sequences verify drafts in the same steps: its
    prompt log-probabilities (rows after the draft rows) equal those of a plain run."""
    path, _ = qwen3
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)]
    prompts = [[7] * 33, [5, 6, 7, 8] * 3, [42] * 20, list(range(30, 90))]
    runs = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        with LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4, max_num_batched_tokens=24,
                 max_stall_tokens=24, speculative_config=spec) as llm:
            llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            engine = llm.engine
            for i, (p, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"q{i}", p, sp, detokenize=False)
            schedule, together = engine.scheduler.schedule, []

            def watched():
                batch = schedule()
                together.append(bool(batch.drafts) and any(
                    q.sampling_params.prompt_logprobs is not None for q in batch.seqs[batch.num_decodes:]))
                return batch

            engine.scheduler.schedule = watched
            lps = None
            while engine.has_unfinished():
                for out in engine.step():
                    if out.prompt_logprobs is not None:
                        lps = (lps or []) + out.prompt_logprobs
            runs[name] = lps
    assert any(together)  # (of the speculative run) draft rows and prompt-logprob rows in one step
    plain, spec = runs["plain"], runs["spec"]
    assert plain[0] is None and spec[0] is None and len(plain) == len(spec) == 60
    assert [x.logprob for x in spec[1:]] == pytest.approx([x.logprob for x in plain[1:]], abs=1e-4)
