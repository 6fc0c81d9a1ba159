"""Speculative decoding on the scheduler side: the config, the n-gram proposer, draft slots in
the block pool, draft rows in the plan, multi-token postprocess (no model; tokens are given)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence
from tpserve.scheduler.proposer import NgramProposer
from tpserve.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from tpserve.workers.rejection import accept

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


# ---- config --------------------------------------------------------------------------------

def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "method": "[ngram]",
                                        "disable_by_batch_size": None}).disable_by_batch_size is None
    cfg = EngineConfig(num_kv_blocks=4, speculative_config={"num_speculative_tokens": 2})
    assert cfg.speculative_config["prompt_lookup_max"] == 5  # normalised: workers rebuild it
    assert EngineConfig(**{k: v for k, v in cfg.to_dict().items()}).speculative == cfg.speculative


@pytest.mark.parametrize("bad, key, words", [
    ({"num_speculative_tokens": 2, "foo": 1}, "speculative_config.foo", "not a speculative_config key"),
    ({"num_speculative_tokens": 2, "model": "x"}, "speculative_config.model", "ngram method only"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method", "ngram"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens", "required"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "[1, 32]"),
    ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens", "integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min", "<= prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max", "[1, 64]"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size", ">= 1"),
    ("ngram", "speculative_config", "must be a map"),
])
def test_config_errors_name_the_key(bad, key, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(num_kv_blocks=4, speculative_config=bad)
    assert e.value.field == key and words in e.value.reason


# ---- proposer ------------------------------------------------------------------------------

def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The proposer's contract, by search: longest suffix n-gram with an earlier occurrence
    (the latest one), then the tokens after it, continued with the period."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok), lo - 1, -1):
        suffix = tokens[n_tok - n:]
        for p in range(n_tok - 1, n - 1, -1):
            if tokens[p - n:p] == suffix:
                ext = list(tokens)
                while len(ext) < p + k:
                    ext.append(ext[len(ext) - (n_tok - p)])
                return ext[p:p + k]
    return []


class Seq:  # what a proposer reads
    def __init__(self, tokens):
        self.token_ids = list(tokens)
        self.proposer_state = None


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 40), max_size=4), k=st.integers(1, 6),
       lo=st.integers(1, 3), span=st.integers(0, 2))
def test_ngram_proposer_equals_brute_force_as_tokens_grow(tokens, cuts, k, lo, span):
    hi = lo + span
    prop = NgramProposer(lo, hi)
    seq = Seq([])
    for cut in sorted(set(c for c in cuts if c < len(tokens))) + [len(tokens)]:
        seq.token_ids = tokens[:cut]  # the index extends itself with what was appended
        assert prop.propose([seq], [k]) == [brute_force(tokens[:cut], k, lo, hi)]


def test_ngram_proposer_examples():
    prop = NgramProposer(2, 3)
    assert prop.propose([Seq([1, 2, 3, 9, 1, 2])], [4]) == [[3, 9, 1, 2]]
    # The latest earlier occurrence wins; a longer match beats a shorter one.
    assert prop.propose([Seq([5, 6, 1, 5, 6, 2, 5, 6])], [2]) == [[2, 5]]
    assert prop.propose([Seq([4, 5, 6, 1, 9, 5, 6, 2, 4, 5, 6])], [2]) == [[1, 9]]
    # A loop of period 1 or 2 continues with its period.
    assert prop.propose([Seq([8, 7, 7, 7])], [5]) == [[7, 7, 7, 7, 7]]
    assert prop.propose([Seq([3, 1, 2, 1, 2])], [5]) == [[1, 2, 1, 2, 1]]
    # No match, or no drafts asked for: nothing.
    assert prop.propose([Seq([1, 2, 3, 4]), Seq([1, 2, 1, 2])], [3, 0]) == [[], []]


# ---- acceptance rule -----------------------------------------------------------------------

def test_accept_keeps_the_matching_prefix_and_one_more():
    # three sequences: 2 drafts (first matches), 0 drafts, 3 drafts (all match)
    tokens = np.array([7, 5, 9,  4,  1, 2, 3, 8])
    counts = np.array([2, 0, 3], np.int32)
    drafts = np.array([7, 6,  1, 2, 3], np.int32)
    assert accept(tokens, counts, drafts).tolist() == [2, 1, 4]
    # a row left without a token (-1) never matches
    assert accept(np.array([-1, 3]), np.array([1]), np.array([3])).tolist() == [1]


# ---- scheduler -----------------------------------------------------------------------------

def make_sched(bs=4, blocks=32, spec=NGRAM, policy="mixed", max_batched=64, **kw):
    return Scheduler(EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=8,
                                  max_num_batched_tokens=max_batched, max_model_len=256,
                                  eos_token_ids=[0], scheduling_policy=policy, max_stall_tokens=1,
                                  speculative_config=spec, **kw))


def make_seq(rid, tokens, max_tokens=20, **sp):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True, **sp))


def step_loop(s, period=3, breaker=None):
    """One step whose 'model' repeats each sequence with ``period`` (so drafts match), accepted
    as the sampling rank does (rejection.accept). ``breaker(seq, n, tok)`` may replace the token
    that follows the first n tokens (a rejected draft)."""
    batch = s.schedule()
    plan = s.build_plan(batch)
    sample = s.build_sample_plan(batch, plan)
    sampled = batch.sampled_seqs()
    drafts = batch.sample_drafts() or [[] for _ in sampled]
    rows = []
    for q, d in zip(sampled, drafts):
        for j in range(len(d) + 1):
            ext = q.token_ids + d[:j]
            tok = ext[len(ext) - period]
            if breaker is not None:
                tok = breaker(q, len(ext), tok)
            rows.append(tok)
    rows = np.array(rows)
    if sample.draft_counts is None:
        s.postprocess(batch, rows)
        counts = np.ones(len(sampled), np.int32)
    else:
        counts = accept(rows, sample.draft_counts, sample.draft_tokens)
        starts = np.cumsum(sample.draft_counts + 1) - sample.draft_counts - 1
        s.postprocess(batch, np.concatenate([rows[o:o + c] for o, c in zip(starts, counts)]), counts)
    s.check_integrity()
    return batch, plan, counts


def test_draft_rows_in_the_plan_and_reserved_slots():
    s = make_sched(bs=4, blocks=32)
    A = make_seq("A", [1, 2, 3, 1, 2, 3, 1], max_tokens=30)
    B = make_seq("B", [9, 8, 7, 6, 5], max_tokens=30)   # no repeated n-gram: no drafts
    s.add(A)
    s.add(B)
    step_loop(s)                     # prefill: A gets 2 (period 3: ..., 3, 1 -> 2), B gets 7
    assert A.token_ids[-1] == 2 and len(A) == 8 and len(B) == 6
    batch, plan, counts = step_loop(s)
    # A's suffix [1, 2] follows [3] last; k = 3 drafts [3, 1, 2]; B has none and comes first.
    assert [q.request_id for q in batch.seqs] == ["B", "A"] and batch.drafts == [[], [3, 1, 2]]
    assert plan.is_prefill and plan.has_context
    assert plan.cu_seqlens_q.tolist() == [0, 1, 5]
    assert plan.input_ids.tolist() == [7, 2, 3, 1, 2]
    assert plan.positions.tolist() == [5, 7, 8, 9, 10]
    assert plan.context_lens.tolist() == [6, 11]
    assert plan.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert batch.sample_rows["steps"].tolist() == [1, 1, 2, 3, 4]
    # A's positions 7 .. 10 lie in its block 1 (4..7) and a new block 2 (8..11).
    bt = A.block_table
    assert plan.slot_mapping[1:].tolist() == [bt[1] * 4 + 3, bt[2] * 4, bt[2] * 4 + 1, bt[2] * 4 + 2]
    assert counts.tolist() == [1, 4]                # every draft matched: 3 + the bonus
    assert A.token_ids[8:] == [3, 1, 2, 3] and len(A) == 12
    assert len(A.block_table) == 3                  # ceil(11 / 4): nothing to give back
    st = s.stats()
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"],
            st["spec_decode_num_accepted_tokens"]) == (1, 3, 3)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 1]


def test_rejected_drafts_give_back_their_blocks_and_never_reach_a_hash():
    s = make_sched(bs=2, blocks=40)
    A = make_seq("A", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=30)
    s.add(A)
    step_loop(s)                                       # prefill -> 3, len 9, blocks for 0..7
    bm = s.block_manager
    assert len(A.block_table) == 4
    # Position 8 takes block 4; the drafts [1, 2, 3] at 9 .. 11 take block 5 as well. The
    # model disagrees with the first draft.
    batch = s.schedule()
    assert batch.drafts == [[1, 2, 3]] and len(A.block_table) == 6
    plan = s.build_plan(batch)
    sample = s.build_sample_plan(batch, plan)
    rows = np.array([7, 1, 2, 3])
    counts = accept(rows, sample.draft_counts, sample.draft_tokens)
    assert counts.tolist() == [1]
    s.postprocess(batch, rows[:1], counts)
    s.check_integrity()
    assert A.token_ids[-2:] == [3, 7] and len(A) == 10
    assert len(A.block_table) == 5                     # ceil(9 / 2): the draft block is back
    assert bm.num_free_blocks == 40 - 5
    # Only full blocks of accepted tokens are hashed: positions 0 .. 8 -> 4 blocks.
    assert A.num_hashed_blocks == 4
    for i in range(4):
        assert bm.blocks[A.block_table[i]].token_ids == A.token_ids[2 * i:2 * i + 2]


def test_stop_token_and_max_tokens_cut_an_accepted_run():
    s = make_sched(bs=4, blocks=32, spec=dict(NGRAM, num_speculative_tokens=4))
    A = make_seq("A", [5, 6, 4, 5, 6, 4, 5], max_tokens=40, stop_token_ids=[4])
    B = make_seq("B", [5, 6, 4, 5, 6, 4, 5], max_tokens=4)
    s.add(A)
    s.add(B)
    step_loop(s)                                 # both get 6
    batch, _, counts = step_loop(s)              # all drafts match
    # B may generate 3 more tokens: 2 drafts at most.
    assert batch.drafts == [[4, 5, 6, 4], [4, 5]] and counts.tolist() == [5, 3]
    assert A.is_finished and A.finish_reason == "stop" and A.completion_token_ids == [6, 4]
    assert B.is_finished and B.finish_reason == "length" and len(B.completion_token_ids) == 4
    assert s.block_manager.num_free_blocks == 32


def test_drafts_never_preempt_and_seed_decisions_are_unchanged():
    """The seed's section-5 situation with speculation on: the same victim and the same block
    for A; drafts only take free blocks, so with none free they shrink to the room left in
    the blocks a sequence holds."""
    s = make_sched(bs=16, blocks=6, spec=dict(NGRAM, num_speculative_tokens=8), max_batched=4096)
    bm = s.block_manager
    rep = [100 + i % 4 for i in range(32)]
    A = make_seq("A", rep, max_tokens=40)                     # 32 tokens, then a loop
    B = make_seq("B", [200 + i % 3 for i in range(17)], max_tokens=40)
    C = make_seq("C", range(300, 317), max_tokens=40)
    for q in (A, B, C):
        s.add(q)
    batch = s.schedule()
    s.postprocess(batch, np.array([100, 202, 1003]))          # A 33 and B 18: loops go on
    assert (A.block_table, B.block_table, C.block_table) == ([0, 1], [2, 3], [4, 5])
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["A", "B"] and s.num_preemptions == 1
    assert A.block_table == [0, 1, 5] and B.block_table == [2, 3]
    assert list(bm.free_block_ids) == [4]
    # A (33 tokens) writes 32 .. 32 + 8 inside b5; B (18) 17 .. 25 inside b3: no block taken.
    assert batch.drafts == [[101, 102, 103, 100, 101, 102, 103, 100],
                            [200, 201, 202, 200, 201, 202, 200, 201]]
    assert bm.num_free_blocks == 1 and s.num_preemptions == 1

    # No free block, and a draft run that would cross a block boundary: the drafts shrink.
    s = make_sched(bs=4, blocks=4, spec=dict(NGRAM, num_speculative_tokens=8), max_batched=4096)
    D = make_seq("D", [1, 2, 1, 2, 1, 2, 1, 2, 1], max_tokens=8)   # 3 blocks
    E = make_seq("E", [7, 8, 9], max_tokens=8)                     # 1 block
    s.add(D)
    s.add(E)
    batch = s.schedule()
    s.postprocess(batch, np.array([2, 5]))
    assert s.block_manager.num_free_blocks == 0 and len(D) == 10
    batch = s.schedule()
    # D writes position 9 and drafts at 10, 11 in the 12 slots it holds; E has no guess.
    assert [q.request_id for q in batch.seqs] == ["E", "D"] and batch.drafts == [[], [1, 2]]
    assert len(D.block_table) == 3 and s.num_preemptions == 0


def test_budget_and_batch_size_limits():
    # A 5-token budget with 2 decode rows leaves 3 tokens for drafts: a takes them all.
    s = make_sched(bs=4, blocks=64, policy="prefill-first", max_batched=5)
    for r in "ab":
        s.add(make_seq(r, [1, 2, 1], max_tokens=30))
    step_loop(s, period=2)                      # a's prompt and b's first 2 tokens
    step_loop(s, period=2)                      # b's last prompt token
    batch, plan, _ = step_loop(s, period=2)
    assert batch.drafts == [[], [1, 2, 1]] and plan.num_tokens == 5
    assert [q.request_id for q in batch.seqs] == ["b", "a"]
    # More decode rows than disable_by_batch_size: no drafts at all.
    s = make_sched(bs=4, blocks=64, spec=dict(NGRAM, disable_by_batch_size=2))
    for r in "abc":
        s.add(make_seq(r, [1, 2, 3, 1, 2, 3], max_tokens=30))
    step_loop(s)
    batch, plan, _ = step_loop(s)
    assert batch.drafts is None and not plan.is_prefill
    s.abort("c")
    batch, _, _ = step_loop(s)
    assert batch.drafts and all(batch.drafts)


def test_preempt_and_abort_with_drafts_in_flight():
    s = make_sched(bs=4, blocks=32)
    A = make_seq("A", [1, 2, 3, 1, 2, 3, 1], max_tokens=30)
    B = make_seq("B", [4, 5, 6, 4, 5, 6, 4], max_tokens=30)
    s.add(A)
    s.add(B)
    step_loop(s)
    batch = s.schedule()
    assert batch.drafts == [[3, 1, 2], [6, 4, 5]]
    plan = s.build_plan(batch)
    sample = s.build_sample_plan(batch, plan)
    s.preempt(A)
    assert s.abort("B")
    rows = np.array([3, 1, 2, 3, 6, 4, 5, 6])
    counts = accept(rows, sample.draft_counts, sample.draft_tokens)
    assert s.postprocess(batch, rows, counts) == []
    s.check_integrity()
    assert s.block_manager.num_free_blocks == 32 and [q.request_id for q in s.waiting] == ["A"]


# ---- the option everywhere, and the metrics -----------------------------------------------------

def test_speculative_config_option_cli_env_and_child_argv(monkeypatch):
    import click
    from click.testing import CliRunner

    from tpserve.cli.options import config_from_options, engine_options, options_argv

    seen = {}

    @click.command()
    @engine_options
    def cmd(**kwargs):
        seen["config"] = config_from_options(kwargs, resolve=False)

    runner = CliRunner()
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert runner.invoke(cmd, ["--speculative-config", spec]).exit_code == 0
    config = seen["config"]
    assert config.speculative == SpeculativeConfig("ngram", 4, 4, 2)
    assert runner.invoke(cmd, options_argv(config)).exit_code == 0  # what `start` gives its child
    assert seen["config"].to_dict() == config.to_dict()
    assert runner.invoke(cmd, []).exit_code == 0 and seen["config"].speculative is None
    monkeypatch.setenv("TPSERVE_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 2}')
    assert runner.invoke(cmd, []).exit_code == 0 and seen["config"].speculative.num_speculative_tokens == 2
    for bad, words in (('{"num_speculative_tokens": 2, "lookup": 3}', "speculative_config.lookup"),
                       ("[1, 2]", "must be a JSON object"), ("{oops", "is not valid JSON")):
        result = runner.invoke(cmd, ["--speculative-config", bad])
        assert result.exit_code == 2 and "--speculative-config" in result.output and words in result.output


def test_spec_decode_metrics_use_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    from tpserve.server.metrics import ServingMetrics

    stats = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
             "spec_decode_num_accepted_tokens": 25, "spec_decode_num_accepted_tokens_per_pos": [9, 7, 5, 4]}
    text = ServingMetrics("m", lambda: stats).render()
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("tpserve:spec_decode_num_drafts_total", None)] == 10
    assert samples[("tpserve:spec_decode_num_draft_tokens_total", None)] == 40
    assert samples[("tpserve:spec_decode_num_accepted_tokens_total", None)] == 25
    assert [samples[("tpserve:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)] == [9, 7, 5, 4]
    assert "spec_decode" not in ServingMetrics("m", lambda: {}).render()  # off: no series


def test_decode_cuda_graphs_refuse_plans_with_draft_rows():
    """A step verifying drafts has rows with several queries over cached context: it is a
    prefill plan with context, which decode graphs never run (they run eagerly)."""
    from types import SimpleNamespace

    import torch

    from tpserve.workers.cuda_graph import DecodeGraphs
    s = make_sched(bs=16, blocks=32)
    s.add(make_seq("a", [1, 2, 3, 1, 2, 3, 1]))
    step_loop(s)
    batch = s.schedule()
    plan = s.build_plan(batch)
    assert batch.drafts and plan.is_prefill and plan.has_context and plan.max_seqlen_q == 4
    graphs = DecodeGraphs(None, SimpleNamespace(device=torch.device("cpu")),
                          SimpleNamespace(block_size=16, max_model_len=256), max_batch=8)
    assert not graphs.can_run(plan)
