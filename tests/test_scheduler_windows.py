"""The scheduler over sliding-window KV groups, against a fake windowed model.

The fake runner reads only its plan: for each token it writes (prefix digest, token) into the
slot of every group (group 0's from the plan's slot mapping, the others' derived from their
tables, as the real runner does), and its next token depends on the prefix digest and on the
tokens each group's window sees, read through that group's block table. So a block dropped
too early, a wrong prefix-cache hit or a stale slot row changes the output or fails an
assertion; the reference computes the same function from the token list alone."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpserve.kv_groups import kv_cache_groups
from tpserve.config import EngineConfig
from tpserve.sample_plan import kept_rows
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence
from tpserve.workers.rejection import accept

MOD = (1 << 61) - 1
EOS = 0


def digest(prev: int, tok: int) -> int:
    return (prev * 1_000_003 + tok + 7) % MOD


def next_of(d: int, windows: list[tuple[int, ...]], vocab: int) -> int:
    h = d
    for w in windows:
        for t in w:
            h = (h * 31 + t + 1) % MOD
        h = (h * 0x9E3779B97F4A7C15) % MOD
    return h % vocab


class WindowedRunner:
    def __init__(self, groups, num_blocks: int, bs: int, vocab: int):
        self.groups, self.bs, self.vocab = groups, bs, vocab
        self.kv = np.full((num_blocks * bs, 2), -1, dtype=np.int64)  # (digest, token); one slab
        self.owner = np.full(num_blocks * bs, -1, dtype=np.int64)  # which group wrote the slot

    def run(self, plan) -> np.ndarray:
        plan.validate()
        bs, G = self.bs, len(self.groups)
        width = plan.block_tables.shape[1] // G
        assert plan.block_tables.shape[1] == G * width
        cu_q = plan.cu_seqlens_q.tolist()
        pos, toks, sm = plan.positions.tolist(), plan.input_ids.tolist(), plan.slot_mapping.tolist()
        nxt = [0] * plan.num_tokens
        for i in range(plan.num_seqs):
            tables = [plan.block_tables[i, g * width:(g + 1) * width].tolist() for g in range(G)]

            def slot(g, p):
                b = tables[g][p // bs]
                assert b >= 0, f"group {g}: position {p} has no block"
                return b * bs + p % bs

            for j in range(cu_q[i], cu_q[i + 1]):
                p = pos[j]
                prev = int(self.kv[slot(0, p - 1), 0]) if p else 0
                assert prev >= 0
                d = digest(prev, toks[j])
                if sm[j] >= 0:
                    assert sm[j] == slot(0, p)
                    for g in range(G):
                        self.kv[slot(g, p)] = (d, toks[j])
                        self.owner[slot(g, p)] = g
                else:  # a prefix-cache hit's last token, recomputed for its logits
                    assert all(tuple(self.kv[slot(g, p)]) == (d, toks[j]) for g in range(G))
                seen = []
                for g, group in enumerate(self.groups):
                    lo = 0 if group.window is None else max(0, p - group.window + 1)
                    s = slot(g, p)
                    assert self.owner[s] == g and self.kv[s, 0] == d, f"group {g}: position {p}"
                    for q in range(p, lo, -1):  # the window, checked back along the digest chain
                        s, before = slot(g, q), slot(g, q - 1)
                        assert self.owner[before] == g and \
                            digest(int(self.kv[before, 0]), int(self.kv[s, 1])) == self.kv[s, 0], \
                            f"group {g}: the key at {q - 1} read from position {p} is not this prefix's"
                    seen.append(tuple(int(self.kv[slot(g, q), 1]) for q in range(lo, p + 1)))
                nxt[j] = next_of(d, seen, self.vocab)
        return np.array([nxt[r] for r in plan.logits_indices.tolist()], dtype=np.int64)


def reference(groups, prompt, max_tokens, vocab, max_model_len, ignore_eos=False):
    toks = list(prompt)
    out = []
    while True:
        d = 0
        for t in toks:
            d = digest(d, t)
        p = len(toks) - 1
        seen = [tuple(toks[0 if g.window is None else max(0, p - g.window + 1):]) for g in groups]
        t = next_of(d, seen, vocab)
        out.append(t)
        toks.append(t)
        if (t == EOS and not ignore_eos) or len(out) >= max_tokens or len(toks) >= max_model_len:
            return out


def run_workload(layer_windows, bs, blocks, prompts, max_tokens, policy="mixed", budget=16,
                 max_num_seqs=4, prefix=True, preempt_every=0, vocab=1000, spec=None, ignore_eos=False,
                 priorities=None, arrive_every=0, tiers=None):
    """``tiers``: a function of (scheduler, runner) attaching the KV tiers to the scheduler and
    returning their worker side (``handle(meta)``), or None."""
    groups = kv_cache_groups(layer_windows)
    max_model_len = 200
    cfg = EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=max_model_len,
                       enable_prefix_caching=prefix, eos_token_ids=[EOS], scheduling_policy=policy,
                       speculative_config=spec, scheduling_order="priority" if priorities else "fcfs")
    s = Scheduler(cfg, groups)
    s.drafted = 0
    runner = WindowedRunner(groups, blocks, bs, vocab)
    worker = tiers(s, runner) if tiers is not None else None
    seqs = [Sequence(f"r{n}", list(prompt),
                     SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                     priority=priorities[n] if priorities else 0) for n, prompt in enumerate(prompts)]
    arrivals = list(seqs)
    steps = 0
    while arrivals or s.has_unfinished():
        while arrivals and (not arrive_every or steps >= arrive_every * (len(seqs) - len(arrivals))):
            s.add(arrivals.pop(0))
        s.check_integrity()
        batch = s.schedule()
        if not batch and worker is not None and s.kv_has_work():
            s.kv_results(worker.handle(s.kv_meta(wait=True) or {}))
            steps += 1
            continue
        assert batch or not s.has_unfinished(), "nothing scheduled although work is runnable"
        if not batch:
            steps += 1
            continue
        plan = s.build_plan(batch)
        results = worker.handle(plan.args.get("kv") or {}) if worker is not None else None
        toks = runner.run(plan)
        if results:
            s.kv_results(results)
        counts = None
        if batch.drafts:
            sample = s.build_sample_plan(batch, plan)
            counts = accept(toks, sample.draft_counts, sample.draft_tokens)
            toks = toks[kept_rows(sample.draft_counts, counts)]
            s.drafted += 1
        s.postprocess(batch, toks, counts)
        s.check_integrity()
        steps += 1
        if preempt_every and steps % preempt_every == 0:
            decoding = [q for q in s.running if not q.is_prefill]
            if decoding:
                s.preempt(decoding[-1])
        assert steps < 5000
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids, "a block outlived its requests"
    for seq in seqs:
        assert seq.completion_token_ids == reference(groups, seq.prompt_token_ids, max_tokens, vocab,
                                                     max_model_len, ignore_eos), seq.request_id
    return s


GEMMA_LIKE = [6, 6, None, 6, 6, None]  # 2 full layers, 4 sliding ones of window 6 -> 3 groups


@pytest.mark.parametrize("bs", [16, 1, 4])
def test_generations_longer_than_the_window(bs):
    blocks = 600 if bs == 1 else 120
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 2, [2, 7, 1, 8]]
    s = run_workload(GEMMA_LIKE, bs, blocks, prompts, 40)
    assert s.block_manager.grouped and len(s.block_manager.groups) == 3


@pytest.mark.parametrize("bs", [16, 1])
def test_forced_preemption_and_prefix_hits_after_the_window_moved(bs):
    """Repeated prompts share cached blocks; preemption readmits through the cache, whose
    sliding groups kept only the blocks of the window."""
    base = [5, 3, 2, 9, 4, 4, 1, 7] * 5
    prompts = [base, base + [6, 2], base, base + [6, 2, 8]]
    s = run_workload(GEMMA_LIKE, bs, 300 if bs == 1 else 40, prompts, 24, preempt_every=5, max_num_seqs=2)
    assert s.num_preemptions > 0 and s.prefix_cache_hit_tokens > 0


def test_all_sliding_layers_and_two_windows():
    run_workload([4, 4], 2, 200, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [4, 4, 4]], 30)
    run_workload([3, None, 9, 3, None, 9], 4, 200, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3] * 2, 30)


def test_a_tight_pool_preempts_by_the_seed_rules():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9] * 2, [9, 8, 7, 6, 5] * 3, [2, 2, 3, 3] * 4]
    s = run_workload(GEMMA_LIKE, 4, 45, prompts, 40, max_num_seqs=3)
    assert s.num_preemptions > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["mixed", "prefill-first"]),
       budget=st.integers(4, 24), prefix=st.booleans(), preempt_every=st.sampled_from([0, 3, 7]),
       prompts=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=30), min_size=1, max_size=4))
def test_random_workloads_match_the_reference(bs, policy, budget, prefix, preempt_every, prompts):
    run_workload(GEMMA_LIKE, bs, 240 // bs + 60, prompts, 12, policy=policy, budget=budget, prefix=prefix,
                 preempt_every=preempt_every, vocab=11)


def test_a_prompt_longer_than_every_groups_blocks_is_refused():
    groups = kv_cache_groups(GEMMA_LIKE)
    s = Scheduler(EngineConfig(block_size=4, num_kv_blocks=64), groups)
    with pytest.raises(Exception, match="num_kv_blocks"):  # every group's blocks count
        s.add(Sequence("big", [1] * 80, SamplingParams(max_tokens=10)))


@pytest.mark.parametrize("bs", [4, 1])
def test_speculative_decoding_over_groups(bs):
    """n-gram drafts on repetitive prompts: draft blocks are taken in every group and given back
    when the drafts are rejected; output equals the reference."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [[1, 0, 1, 1] * 6, [0, 1, 0, 0, 1] * 3]
    s = run_workload(GEMMA_LIKE, bs, 600 // bs, prompts, 40, spec=spec, vocab=2, ignore_eos=True)
    assert s.drafted > 0 and s.stats()["spec_decode_num_accepted_tokens"] > 0


def test_priority_order_over_groups():
    """Better-priority arrivals preempt worse running sequences; the victims' blocks in every
    group count (ordering.admission_victims)."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9] * 2, [9, 8, 7, 6, 5] * 3, [2, 2, 3, 3] * 4, [4, 5, 6] * 5]
    s = run_workload(GEMMA_LIKE, 4, 50, prompts, 30, max_num_seqs=3, priorities=[3, 2, 1, 0], arrive_every=4)
    assert s.num_priority_preemptions > 0
