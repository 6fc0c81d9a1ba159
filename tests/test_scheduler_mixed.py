"""Mixed scheduling: one token budget per step, every running decode first, then prefill chunks."""
from __future__ import annotations

import numpy as np

from tpserve.config import EngineConfig
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence, SequenceStatus

EOS = 0


def make_sched(bs=4, blocks=64, max_num_seqs=16, max_batched=8, max_stall=1):
    """A mixed scheduler; the default ``max_stall`` keeps the budget fixed at ``max_batched``."""
    return Scheduler(EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_batched, max_model_len=256,
                                  eos_token_ids=[EOS], scheduling_policy="mixed",
                                  max_stall_tokens=max_stall))


def make_seq(rid, tokens, max_tokens=32):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def ids(seqs):
    return [q.request_id for q in seqs]


def run(s: Scheduler, batch):
    """Build and check the plan, then apply non-EOS tokens; returns the plan."""
    plan = s.build_plan(batch)
    plan.validate()
    assert plan.num_tokens == batch.num_tokens
    s.postprocess(batch, np.arange(1000, 1000 + plan.num_samples))
    s.check_integrity()
    return plan


def test_decodes_first_then_chunks_fill_the_budget_exactly():
    s = make_sched(max_batched=8)
    for r in "abc":
        s.add(make_seq(r, range(1, 3)))
    run(s, s.schedule())                                   # a, b, c prefilled together
    long = make_seq("long", range(100, 120))               # 20 tokens
    short = make_seq("short", range(200, 203))             # 3 tokens
    s.add(long)
    s.add(short)
    chunks = []
    for _ in range(4):
        batch = s.schedule()
        assert ids(batch.seqs) == ["a", "b", "c", "long"] and batch.num_decodes == 3
        assert batch.num_tokens == 8                       # 3 decodes + a 5-token chunk
        plan = run(s, batch)
        chunks.append(plan.positions[3:].tolist())
    # Chunk boundaries: 5 + 5 + 5 + 5, sampled only with the last prompt token.
    assert chunks == [list(range(k, k + 5)) for k in (0, 5, 10, 15)]
    assert len(long.completion_token_ids) == 1 and not long.is_prefill
    assert ids(s.waiting) == ["short"]                     # the budget was used up exactly
    batch = s.schedule()                                   # four decodes, then short whole
    assert ids(batch.seqs) == ["a", "b", "c", "long", "short"] and batch.num_decodes == 4
    assert batch.num_tokens == 7 and batch.sampled == [True]
    run(s, batch)


def test_few_decoding_streams_let_a_step_grow_to_the_stall_budget():
    """A step with d decode rows holds max(budget, max_stall_tokens // d) tokens: a long prompt
    goes in large chunks while few streams wait on it, in budget-sized ones under load."""
    assert [make_sched(max_batched=8, max_stall=48).step_budget(d)
            for d in (0, 1, 2, 4, 6, 7, 100)] == [48, 48, 24, 12, 8, 8, 8]
    for d, first_chunk in ((0, 48), (1, 47), (2, 22), (4, 8), (6, 2)):
        s = make_sched(blocks=256, max_batched=8, max_stall=48)
        for i in range(d):
            s.add(make_seq(f"d{i}", [i + 1]))
        if d:
            run(s, s.schedule())                           # the streams' one-token prefills
        s.add(make_seq("long", range(1, 101)))
        batch = s.schedule()
        assert ids(batch.seqs) == [f"d{i}" for i in range(d)] + ["long"]
        assert batch.num_decodes == d
        assert batch.num_tokens == s.step_budget(d)        # exactly the budget: decodes + chunk
        assert batch.seqs[-1].num_scheduled_tokens == first_chunk
        run(s, batch)
        if d == 1:                                         # the next chunk: the same budget
            assert s.schedule().seqs[-1].num_scheduled_tokens == 47


def test_last_admitted_is_chunked_and_continues_before_admissions():
    s = make_sched(max_batched=8)
    s.add(make_seq("d", [1, 2]))
    run(s, s.schedule())
    for r, n in (("x", 3), ("y", 9), ("z", 2)):
        s.add(make_seq(r, range(10, 10 + n)))
    batch = s.schedule()                                   # d, x whole (3), y chunk of 4
    assert ids(batch.seqs) == ["d", "x", "y"] and batch.sampled == [True, False]
    assert [q.num_scheduled_tokens for q in batch.seqs[1:]] == [3, 4]
    assert s._prefilling is s.get("y") and ids(s.waiting) == ["z"]
    run(s, batch)
    batch = s.schedule()                                   # d, x decode; y's last 5; z: 1
    assert ids(batch.seqs) == ["d", "x", "y", "z"] and batch.num_decodes == 2
    assert [q.num_scheduled_tokens for q in batch.seqs[2:]] == [5, 1]
    assert batch.sampled == [True, False] and s._prefilling is s.get("z")
    run(s, batch)
    batch = s.schedule()
    assert ids(batch.seqs) == ["d", "x", "y", "z"] and batch.num_decodes == 3
    assert batch.sampled == [True] and batch.num_tokens == 4
    run(s, batch)


def test_decodes_beyond_the_budget_wait_in_running_order():
    s = make_sched(max_batched=3)
    for r in "abc":
        s.add(make_seq(r, [5], max_tokens=3))
    run(s, s.schedule())
    s.max_num_batched_tokens = 2                           # fewer tokens than decodes
    s.add(make_seq("w", [7, 8]))
    for _ in range(2):
        batch = s.schedule()
        assert ids(batch.seqs) == ["a", "b"] and not batch.is_prefill and batch.num_tokens == 2
        assert ids(s.running) == ["a", "b", "c"] and ids(s.waiting) == ["w"]
        run(s, batch)
    assert len(s.get("c")) == 2                            # c kept its place, unchanged
    batch = s.schedule()                                   # a and b finished: c, then w
    assert ids(batch.seqs) == ["c", "w"] and batch.num_decodes == 1
    run(s, batch)


def test_preemption_inside_a_mixed_step_takes_the_partial_prefill_first():
    """A needs a block while P, the partial prefill, holds the rest of the pool: P is the
    tail of running, so it is the victim; it goes to the front of waiting and is not
    re-admitted in the same step. Later it recovers its hashed first block from the cache."""
    s = make_sched(bs=4, blocks=5, max_batched=6)
    bm = s.block_manager
    A = make_seq("A", [1, 2, 3], max_tokens=4)
    s.add(A)
    run(s, s.schedule())                                   # A: 4 tokens in block 0
    P = make_seq("P", range(100, 116), max_tokens=4)       # 16 tokens: 4 blocks
    s.add(P)
    batch = s.schedule()                                   # A decodes, P's first 5 tokens
    assert ids(batch.seqs) == ["A", "P"] and P.num_scheduled_tokens == 5
    assert bm.num_free_blocks == 0
    run(s, batch)
    assert P.num_hashed_blocks == 1 and s._prefilling is P and bm.needs_block(A)
    p_blocks = list(P.block_table)

    batch = s.schedule()
    assert ids(batch.seqs) == ["A"] and not batch.is_prefill
    assert s.num_preemptions == 1 and ids(s.waiting) == ["P"]
    assert P.status is SequenceStatus.WAITING and P.block_table == [] and s._prefilling is None
    assert A.block_table[1] in p_blocks[1:]               # an unhashed block of P
    run(s, batch)
    while A.status is not SequenceStatus.FINISHED:
        batch = s.schedule()
        assert ids(batch.seqs) == ["A"]                    # P does not fit beside A
        run(s, batch)
    batch = s.schedule()
    assert ids(batch.seqs) == ["P"] and P.num_prefix_hit_tokens == 4
    assert P.block_table[0] == p_blocks[0]                 # recovered from the prefix cache
    run(s, batch)


def test_abort_of_a_partially_prefilled_request():
    s = make_sched(max_batched=6)
    s.add(make_seq("d", [1, 2]))
    run(s, s.schedule())
    s.add(make_seq("p", range(10, 30)))
    s.add(make_seq("w", [3, 4]))
    run(s, s.schedule())                                   # d decodes, p gets 5 of 20
    assert s._prefilling is s.get("p")
    free = s.block_manager.num_free_blocks
    assert s.abort("p")
    assert s._prefilling is None and s.block_manager.num_free_blocks == free + 5
    s.check_integrity()
    batch = s.schedule()                                   # w is admitted right away
    assert ids(batch.seqs) == ["d", "w"]
    run(s, batch)

    # Aborted while its chunk is in flight: postprocess skips it, the decode row still lands.
    s.add(make_seq("q", range(40, 60)))
    batch = s.schedule()
    assert ids(batch.seqs) == ["d", "w", "q"] and batch.sampled == [False]
    plan = s.build_plan(batch)
    assert s.abort("q")
    before = len(s.get("d"))
    out = s.postprocess(batch, np.arange(1000, 1000 + plan.num_samples))
    assert ids(out) == ["d", "w"] and len(s.get("d")) == before + 1
    s.check_integrity()
    assert s._prefilling is None and "q" not in ids(s.running)


def test_running_views_follow_every_change_of_running():
    s = make_sched(max_batched=64)
    for r in "abcd":
        s.add(make_seq(r, [1, 2, 3]))
    run(s, s.schedule())
    v = s.running.version
    assert s.running.slots().tolist() == [q.slot for q in s.running]
    b1 = s.schedule()
    run(s, b1)
    b2 = s.schedule()
    assert s.running.version == v and b1.slots_key == b2.slots_key
    # Decode plans over an unchanged running set share their constant arrays (and their
    # sample rows' controls).
    assert s.build_plan(b2).logits_indices is s.build_plan(b1).logits_indices
    assert b2.sample_rows["temperatures"] is b1.sample_rows["temperatures"]
    run(s, b2)
    s.abort("b")
    assert s.running.version != v
    assert s.running.slots().tolist() == [q.slot for q in s.running]
    b3 = s.schedule()
    assert b3.slots_key != b2.slots_key and ids(b3.seqs) == ["a", "c", "d"]
    s.build_plan(b3)
    assert b3.sample_rows["seeds"].tolist() == [q.seed for q in b3.seqs]
    run(s, b3)


# ---- choosing the policy -----------------------------------------------------------------------

def test_policy_is_validated_and_selectable_everywhere(monkeypatch):
    import click
    import pytest
    from click.testing import CliRunner

    from tpserve import LLM
    from tpserve.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, SERVING_MAX_NUM_BATCHED_TOKENS
    from tpserve.cli.options import config_from_options, engine_options, options_argv
    from tpserve.errors import ConfigError

    assert EngineConfig().scheduling_policy == "mixed"
    assert EngineConfig().max_num_batched_tokens == SERVING_MAX_NUM_BATCHED_TOKENS
    with pytest.raises(ConfigError, match="scheduling_policy: must be one of mixed, prefill-first"):
        EngineConfig(scheduling_policy="fifo")

    seen = {}

    @click.command()
    @engine_options
    def cmd(**kwargs):
        seen["config"] = config_from_options(kwargs, resolve=False)

    runner = CliRunner()
    assert runner.invoke(cmd, ["--scheduling-policy", "prefill-first"]).exit_code == 0
    assert seen["config"].scheduling_policy == "prefill-first"
    assert "--scheduling-policy" in options_argv(seen["config"])
    monkeypatch.setenv("TPSERVE_SCHEDULING_POLICY", "prefill-first")
    assert runner.invoke(cmd, []).exit_code == 0
    assert seen["config"].scheduling_policy == "prefill-first"
    bad = runner.invoke(cmd, ["--scheduling-policy", "fifo"])
    assert bad.exit_code == 2 and "'fifo' is not one of 'mixed', 'prefill-first'" in bad.output

    with LLM(scheduling_policy="prefill-first", num_kv_blocks=64) as llm:
        assert llm.engine.scheduler.policy == "prefill-first"
        assert llm.engine.scheduler.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
