"""Property tests: random workloads against a fake runner with a checkable KV cache.

The fake runner executes each StepPlan on a fake KV cache that stores, per slot, a digest of
the whole token prefix up to that position (as real KV depends on the whole prefix). It reads
context only through the plan's block tables and writes only through its slot mapping, and the
next token is a pseudo-random function of the last digest. A wrong block table, slot, position,
prefix-cache hit or preemption recovery therefore changes the tokens; the outputs must equal a
plain sequential reference, whatever the block size, pool size, chunking, preemption or
scheduling policy (every test runs under both).

With speculative decoding the fake runner samples every draft row and the harness accepts as
the sampling rank does (workers/rejection.py). To make drafts match often, a runner with a
``copy_period`` mostly repeats the token ``copy_period`` positions back, which it reads from
its KV cache through the block table (so a wrong table or slot still shows in the tokens).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tpserve.config import EngineConfig
from tpserve.errors import AdmissionError
from tpserve.sampling import SamplingParams
from tpserve.sample_plan import kept_rows
from tpserve.scheduler import Scheduler, Sequence, SequenceStatus
from tpserve.workers.rejection import accept

MOD = (1 << 61) - 1
EOS = 0
POLICIES = ("prefill-first", "mixed")


def digest(prev: int, tok: int) -> int:
    return (prev * 1_000_003 + tok + 7) % MOD


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int, salt: int, copy_period: int = 0):
        self.bs = block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.kv_tokens = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.vocab = vocab
        self.salt = salt
        self.copy_period = copy_period

    def next_token(self, d: int, token_at, pos: int) -> int:
        """The token after position ``pos`` whose digest is ``d``; ``token_at(q)`` reads the
        token at an earlier position q (used by a copying runner, 3 times out of 4)."""
        h = (d * 0x9E3779B97F4A7C15 + self.salt) % MOD
        src = pos + 1 - self.copy_period
        if self.copy_period and src >= 0 and h % 4:
            return token_at(src)
        return h % self.vocab

    def run(self, plan) -> np.ndarray:
        plan.validate()
        bs = self.bs
        cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
        pos, toks, sm = plan.positions.tolist(), plan.input_ids.tolist(), plan.slot_mapping.tolist()
        row_next = [0] * plan.num_tokens
        assert cu_q[0] == 0 and cu_q[-1] == plan.num_tokens
        for i in range(plan.num_seqs):
            table = plan.block_tables[i].tolist()
            ctx = int(plan.context_lens[i])
            assert cu_k[i + 1] - cu_k[i] == ctx

            def slot_of(p):
                b = table[p // bs]
                assert b >= 0, f"position {p} has no block"
                return b * bs + p % bs

            q0, q1 = cu_q[i], cu_q[i + 1]
            assert q1 > q0
            assert pos[q0:q1] == list(range(pos[q0], pos[q0] + q1 - q0)), "positions not contiguous"
            assert pos[q1 - 1] + 1 == ctx
            if not plan.is_prefill:
                assert q1 - q0 == 1
            for j in range(q0, q1):
                p = pos[j]
                prev = int(self.kv[slot_of(p - 1)]) if p else 0
                assert prev >= 0, f"reading unwritten KV at position {p - 1}"
                d = digest(prev, toks[j])
                if sm[j] >= 0:
                    assert sm[j] == slot_of(p)
                    self.kv[sm[j]] = d
                    self.kv_tokens[sm[j]] = toks[j]
                else:
                    assert int(self.kv[slot_of(p)]) == d, "skipped write but the cache differs"

                def token_at(q):
                    t = int(self.kv_tokens[slot_of(q)])
                    assert t >= 0, f"reading an unwritten token at position {q}"
                    return t
                row_next[j] = self.next_token(d, token_at, p)
        assert plan.max_seqlen_q == (max(b - a for a, b in zip(cu_q, cu_q[1:])) if plan.num_seqs else 0)
        return np.array([row_next[r] for r in plan.logits_indices.tolist()], dtype=np.int64)


def reference(runner: FakeRunner, prompt, sp: SamplingParams, eos, max_model_len):
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
    d = 0
    for t in prompt:
        d = digest(d, t)
    out = []
    while True:
        seq = prompt + out
        t = runner.next_token(d, seq.__getitem__, len(seq) - 1)
        out.append(t)
        if t in stops:
            return out, "stop"
        if len(out) >= sp.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"
        d = digest(d, t)


class Harness:
    def __init__(self, bs, blocks, max_num_seqs, max_batched, max_model_len, prefix, vocab, salt,
                 policy, max_stall=1, spec=None, copy_period=0):
        self.cfg = EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                                enable_prefix_caching=prefix, eos_token_ids=[EOS],
                                scheduling_policy=policy, max_stall_tokens=max_stall,
                                speculative_config=spec)
        self.s = Scheduler(self.cfg)
        self.runner = FakeRunner(blocks, bs, vocab, salt, copy_period)
        self.seqs: dict[str, Sequence] = {}
        self.aborted: set[str] = set()
        self.n = 0
        self.mixed_steps = 0
        self.drafted_steps = 0
        self.accepted = 0

    def add(self, prompt, max_tokens, ignore_eos=False, stop_token_ids=()):
        rid = f"r{self.n}"
        self.n += 1
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                            stop_token_ids=list(stop_token_ids))
        seq = Sequence(rid, prompt, sp, seed=self.n)
        bs, cfg = self.cfg.block_size, self.cfg
        total = len(prompt) + max_tokens
        expect = ("max_model_len" if total > cfg.max_model_len else
                  "num_kv_blocks" if -(-(total - 1) // bs) > cfg.num_kv_blocks else None)
        try:
            self.s.add(seq)
        except AdmissionError as e:
            assert e.limit == expect, (e.limit, expect)
            return None
        assert expect is None
        self.seqs[rid] = seq
        return seq

    def step(self):
        had_work = self.s.has_unfinished()
        batch = self.s.schedule()
        assert bool(batch) == had_work, "nothing scheduled although work is runnable"
        plan = self.s.build_plan(batch)
        if plan.is_prefill:
            assert plan.has_context == any(q.num_cached_tokens > 0 for q in batch.seqs)
        # The step's token budget holds, decodes first (mixed); prefill-first never mixes.
        assert batch.num_tokens == plan.num_tokens
        nd = batch.num_decodes
        assert all(not q.is_prefill for q in batch.seqs[:nd])
        assert all(q.is_prefill for q in batch.seqs[nd:])
        self.mixed_steps += 0 < nd < len(batch)
        if self.cfg.scheduling_policy == "prefill-first":
            assert nd in (0, len(batch))
            assert nd or plan.num_tokens <= self.cfg.max_num_batched_tokens  # prefill steps
        else:
            # max(max_num_batched_tokens, max_stall_tokens // decodes), decodes alone capped
            assert nd <= self.cfg.max_num_batched_tokens
            assert plan.num_tokens <= max(self.cfg.max_num_batched_tokens,
                                          self.cfg.max_stall_tokens // max(nd, 1))
        tokens = self.runner.run(plan)
        assert len(tokens) == plan.num_samples == batch.num_samples
        sample = self.s.build_sample_plan(batch, plan)
        counts = None
        if batch.drafts:
            assert nd == len(batch.drafts) and plan.is_prefill
            n0 = next(i for i, d in enumerate(batch.drafts) if d)
            assert not any(batch.drafts[:n0]) and all(batch.drafts[n0:]), "draft rows not last"
            counts = accept(tokens, sample.draft_counts, sample.draft_tokens)
            tokens = tokens[kept_rows(sample.draft_counts, counts)]
            self.drafted_steps += 1
            self.accepted += int((counts[n0:nd] - 1).sum())
        else:
            assert sample.draft_counts is None
        out = self.s.postprocess(batch, tokens, counts)
        assert len(out) == len(batch.sampled_seqs())
        self.s.check_integrity()
        return batch

    def abort(self, k):
        live = [rid for rid, q in self.seqs.items() if not q.is_finished]
        if live:
            rid = live[k % len(live)]
            assert self.s.abort(rid)
            self.aborted.add(rid)
            self.s.check_integrity()

    def preempt(self, k):
        running = [q for q in self.s.running if not q.is_prefill]
        if running:
            self.s.preempt(running[k % len(running)])
            self.s.check_integrity()

    def run(self, ops, vocab=None):
        """Apply the drawn operations (add_st / op_st tuples); ``vocab`` folds token ids."""
        cfg = self.cfg
        for op in ops:
            if op[0] == "add":
                _, prompt, max_tokens, ignore_eos, stop_ids, clamp = op
                if vocab is not None:
                    prompt, stop_ids = [t % vocab for t in prompt], [t % vocab for t in stop_ids]
                if clamp:
                    max_tokens = min(max_tokens, cfg.max_model_len - len(prompt),
                                     cfg.num_kv_blocks * cfg.block_size + 1 - len(prompt))
                    if max_tokens < 1:
                        continue
                self.add(prompt, max_tokens, ignore_eos, stop_ids)
            elif op[0] == "step":
                self.step()
            elif op[0] == "abort":
                self.abort(op[1])
            else:
                self.preempt(op[1])

    def drain(self, limit=5000):
        for _ in range(limit):
            if not self.s.has_unfinished():
                break
            self.step()
        assert not self.s.has_unfinished(), "requests did not finish"
        bm = self.s.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids
        assert self.s.table.num_free_slots == self.s.table.num_slots
        assert not self.s.waiting and not self.s.running

    def check_outputs(self):
        for rid, q in self.seqs.items():
            assert q.status is SequenceStatus.FINISHED
            ref, reason = reference(self.runner, q.prompt_token_ids, q.sampling_params, [EOS],
                                    self.cfg.max_model_len)
            if rid in self.aborted:
                assert q.finish_reason == "abort"
                assert q.completion_token_ids == ref[:len(q.completion_token_ids)]
            else:
                assert (q.completion_token_ids, q.finish_reason) == (ref, reason), rid


# ---- hypothesis: random interleavings -------------------------------------------------------

# Prompts share prefixes of BASE often, so prefix-cache hits are common.
BASE = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 2]
prompt_st = st.builds(lambda k, tail: (BASE[:k] + tail) or BASE[:1], st.integers(0, 12),
                      st.lists(st.integers(0, 5), max_size=4))
# The last field: 0 submits max_tokens as drawn (may be rejected), else it is clamped so the
# request fits the engine's limits.
add_st = st.tuples(st.just("add"), prompt_st, st.integers(1, 12), st.booleans(),
                   st.lists(st.integers(1, 5), max_size=2), st.integers(0, 4))
op_st = st.one_of(
    add_st, add_st,
    st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 3, 4]), pool_tokens=st.integers(6, 32),
       max_num_seqs=st.sampled_from([1, 2, 3, 4, 4]), max_batched=st.integers(1, 16),
       max_model_len=st.integers(12, 40), prefix=st.booleans(), salt=st.integers(0, 1000),
       initial=st.lists(add_st, min_size=1, max_size=6), ops=st.lists(op_st, max_size=40),
       max_stall=st.sampled_from([1, 8, 24, 64]))
def test_random_interleavings_keep_invariants(policy, bs, pool_tokens, max_num_seqs, max_batched,
                                              max_model_len, prefix, salt, initial, ops, max_stall):
    blocks = -(-pool_tokens // bs)
    h = Harness(bs, blocks, max_num_seqs, max_batched, max_model_len, prefix, vocab=6, salt=salt,
                policy=policy, max_stall=max_stall)
    h.run(initial + ops)
    h.drain()
    h.check_outputs()
    st_ = h.s.stats()
    event(f"preempted: {st_['num_preemptions'] > 0}")
    event(f"prefix hit: {st_['prefix_cache_hit_tokens'] > 0}")
    event(f"finished: {sum(not q.finish_reason == 'abort' for q in h.seqs.values()) > 0}")
    event(f"{policy}, mixed steps: {h.mixed_steps > 0}")


# ---- block sizes, with preemption, chunking and prefix hits ---------------------------------

def block_size_workload(bs, policy, seed, **harness_options) -> Harness:
    """8 requests sharing prefixes, in a pool of about 1.5 of the largest (forces preemption),
    chunked prefills; run to the end and checked against the reference."""
    rng = np.random.default_rng(seed)
    scale = bs if bs > 2 else 8
    longest = 4 * scale + 4                   # prompt + max_tokens of the largest request
    blocks = -(-3 * longest // (2 * bs))      # room for about 1.5 of them: forces preemption
    h = Harness(bs, blocks, max_num_seqs=4, max_batched=3 * scale, max_model_len=4 * scale * 8,
                prefix=True, vocab=50, salt=bs, policy=policy, max_stall=12 * scale, **harness_options)
    base = rng.integers(1, 50, size=2 * scale).tolist()
    for i in range(8):
        shared = base[:int(rng.integers(scale // 2, 2 * scale))]
        tail = rng.integers(1, 50, size=int(rng.integers(1, scale))).tolist()
        h.add(shared + tail, max_tokens=int(rng.integers(scale // 2, scale + 4)), ignore_eos=True)
        if i % 4 == 3:
            h.step()
    h.drain()
    h.check_outputs()
    return h


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bs", [1, 2, 16, 256])
def test_outputs_match_reference_across_block_sizes(bs, policy):
    h = block_size_workload(bs, policy, seed=bs)
    st_ = h.s.stats()
    assert st_["prefix_cache_hit_tokens"] > 0
    assert st_["num_preemptions"] > 0
    assert all(q.finish_reason == "length" for q in h.seqs.values())
    assert (h.mixed_steps > 0) == (policy == "mixed")


# ---- speculative decoding -------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 3, 4]), pool_tokens=st.integers(6, 40),
       max_num_seqs=st.sampled_from([1, 2, 3, 4]), max_batched=st.integers(1, 16),
       max_model_len=st.integers(12, 40), prefix=st.booleans(), salt=st.integers(0, 1000),
       k=st.integers(1, 5), lookup=st.sampled_from([(1, 1), (1, 3), (2, 4)]),
       limit=st.sampled_from([None, 1, 2]), copy_period=st.sampled_from([0, 1, 2, 3]),
       vocab=st.sampled_from([2, 3, 6]), initial=st.lists(add_st, min_size=1, max_size=6),
       ops=st.lists(op_st, max_size=40), max_stall=st.sampled_from([1, 8, 64]))
def test_random_interleavings_with_drafts(policy, bs, pool_tokens, max_num_seqs, max_batched,
                                          max_model_len, prefix, salt, k, lookup, limit, copy_period,
                                          vocab, initial, ops, max_stall):
    """Everything the test above checks, with speculative decoding on: outputs equal the
    sequential reference whatever drafts were proposed, accepted, cut or preempted."""
    blocks = -(-pool_tokens // bs)
    spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lookup[0],
                prompt_lookup_max=lookup[1], disable_by_batch_size=limit)
    h = Harness(bs, blocks, max_num_seqs, max_batched, max_model_len, prefix, vocab=vocab, salt=salt,
                policy=policy, max_stall=max_stall, spec=spec, copy_period=copy_period)
    h.run(initial + ops, vocab)
    h.drain()
    h.check_outputs()
    event(f"drafted steps: {h.drafted_steps > 0}")
    event(f"accepted drafts: {h.accepted > 0}")
    event(f"preempted: {h.s.stats()['num_preemptions'] > 0}")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bs", [1, 2, 16])
def test_outputs_match_reference_with_drafts_across_block_sizes(bs, policy):
    """Long copy runs (drafts of 6 mostly accepted), preemption, prefix hits and chunking."""
    spec = dict(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=3)
    h = block_size_workload(bs, policy, seed=100 + bs, spec=spec, copy_period=3)
    st_ = h.s.stats()
    assert st_["prefix_cache_hit_tokens"] > 0 and st_["num_preemptions"] > 0
    assert h.drafted_steps > 0 and st_["spec_decode_num_accepted_tokens_per_pos"][2] > 0
    assert all(q.finish_reason == "length" for q in h.seqs.values())
