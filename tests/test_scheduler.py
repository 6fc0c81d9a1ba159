"""Scheduler: the seed's section-5 walk-through, decode outcomes, prefix cache, admission.

Every test runs under both scheduling policies and both scheduling orders (the ``policy``
fixture); where the policies batch differently the test says what each does. Every request
here has priority 0, so the "priority" order must make the seed's decisions too.
"""
from __future__ import annotations

import numpy as np
import pytest

from tpserve.blockpool import BlockManager
from tpserve.config import EngineConfig
from tpserve.errors import AdmissionError, ConfigError, InvalidFieldError, InvalidRequestError
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence, SequenceStatus

EOS = 0
POLICIES = ("prefill-first", "mixed")
ORDERS = ("fcfs", "priority")
CURRENT = {"policy": "mixed", "order": "fcfs"}


@pytest.fixture(autouse=True, params=[(p, o) for p in POLICIES for o in ORDERS],
                ids=lambda p: "-".join(p))
def policy(request, monkeypatch):
    """Runs every test of this module once per scheduling policy and order (read by
    make_sched); the tests see the policy."""
    monkeypatch.setitem(CURRENT, "policy", request.param[0])
    monkeypatch.setitem(CURRENT, "order", request.param[1])
    return request.param[0]


def make_sched(bs=16, blocks=6, max_num_seqs=16, max_batched=4096, max_model_len=1024,
               prefix=True, eos=(EOS,), policy=None):
    # max_stall_tokens=1: a fixed budget of max_batched under both policies (the seed's steps).
    return Scheduler(EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                                  enable_prefix_caching=prefix, eos_token_ids=list(eos),
                                  scheduling_policy=policy or CURRENT["policy"],
                                  scheduling_order=CURRENT["order"], max_stall_tokens=1))


def make_seq(rid, tokens, max_tokens=16, **sp):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp))


def step(s: Scheduler, tokens=None, expect_prefill=None, prefill_tokens=None):
    """One engine step with the given sampled tokens (default: non-EOS 1000, 1001, ...).

    ``prefill_tokens`` gives only the prefill rows' tokens; decode rows of a mixed step then
    get 2000, 2001, ... (not EOS)."""
    batch = s.schedule()
    assert batch, "nothing scheduled"
    if expect_prefill is not None:
        assert batch.is_prefill == expect_prefill
    plan = s.build_plan(batch)
    plan.validate()
    if prefill_tokens is not None:
        tokens = list(range(2000, 2000 + batch.num_decodes)) + list(prefill_tokens)
    if tokens is None:
        tokens = list(range(1000, 1000 + plan.num_samples))
    assert len(tokens) == plan.num_samples
    out = s.postprocess(batch, np.array(tokens, dtype=np.int64))
    s.check_integrity()
    return batch, plan, out


def ids(seqs):
    return [q.request_id for q in seqs]


def prefill_rows(batch, plan) -> dict:
    """The prefill rows of a plan (those after its decode rows), offsets made relative."""
    nd = batch.num_decodes
    t0 = int(plan.cu_seqlens_q[nd])
    return dict(seqs=ids(batch.seqs[nd:]), input_ids=plan.input_ids[t0:].tolist(),
                positions=plan.positions[t0:].tolist(), slot_mapping=plan.slot_mapping[t0:].tolist(),
                cu_seqlens_q=(plan.cu_seqlens_q[nd:] - t0).tolist(),
                context_lens=plan.context_lens[nd:].tolist(),
                block_tables=plan.block_tables[nd:].tolist(),
                logits_indices=(plan.logits_indices[nd:] - t0).tolist(),
                sample_steps=batch.sample_rows["steps"][nd:].tolist())


# ---- the seed's section 5 ------------------------------------------------------------------

def test_section5_walkthrough(policy):
    """running [A, B, C], block size 16, 6 blocks, none free; A needs a block, B does not.

    With the corrected boundary rule a sequence on a boundary holds only full blocks, so A has
    33 tokens in [b0, b1] (both full) and needs b2's successor; B has 18 tokens in [b2, b3];
    C holds b4 (full, hashed) and b5 (partial, unhashed) as in the seed's table.
    """
    s = make_sched(bs=16, blocks=6)
    bm = s.block_manager
    A = make_seq("A", range(100, 132), max_tokens=40)      # 32-token prompt
    B = make_seq("B", range(200, 217), max_tokens=40)      # 17
    C = make_seq("C", range(300, 317), max_tokens=40)      # 17
    for q in (A, B, C):
        s.add(q)
    batch, _, _ = step(s, [1001, 1002, 1003], expect_prefill=True)
    assert ids(batch.seqs) == ["A", "B", "C"]
    assert (A.block_table, B.block_table, C.block_table) == ([0, 1], [2, 3], [4, 5])
    assert (len(A), len(B), len(C)) == (33, 18, 18)
    assert list(bm.free_block_ids) == []
    assert sorted(bm.hash_to_block_id.values()) == [0, 1, 2, 4]
    assert bm.needs_block(A) and not bm.needs_block(B)
    h4 = bm.blocks[4].hash

    # Iteration 1: A cannot append -> preempt the tail C; A takes C's *unhashed* tail block b5.
    # Iteration 2: B continues in b3. Result: [A, B] scheduled, C at the front of waiting.
    batch = s.schedule()
    assert not batch.is_prefill and ids(batch.seqs) == ["A", "B"]
    assert ids(s.running) == ["A", "B"] and ids(s.waiting) == ["C"]
    assert A.block_table == [0, 1, 5] and B.block_table == [2, 3] and C.block_table == []
    assert C.status is SequenceStatus.WAITING and C.is_prefill and C.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [4]
    assert bm.blocks[4].hash == h4 and bm.hash_to_block_id[h4] == 4 and bm.blocks[4].ref_count == 0
    assert bm.blocks[5].hash == -1
    assert s.num_preemptions == 1
    plan = s.build_plan(batch)
    assert plan.positions.tolist() == [32, 17]
    assert plan.slot_mapping.tolist() == [5 * 16 + 0, 3 * 16 + 1]
    s.postprocess(batch, np.array([1004, 1005]))
    s.check_integrity()

    # C finds b4 in the cache but needs 2 blocks with 1 free: it cannot be re-admitted.
    assert bm.can_allocate(C) == -1
    batch, _, _ = step(s, expect_prefill=False)
    assert ids(batch.seqs) == ["A", "B"] and ids(s.waiting) == ["C"]

    # Once B is gone its blocks are free; C recovers b4 from the prefix cache.
    assert s.abort("B")
    assert list(bm.free_block_ids) == [3, 4, 2]
    assert bm.can_allocate(C) == 1
    hits_before = s.prefix_cache_hit_tokens
    batch, plan, _ = step(s, prefill_tokens=[1006], expect_prefill=True)
    # Mixed: A keeps decoding in the same step (it has a free slot in its block b5).
    assert ids(batch.seqs) == (["A", "C"] if policy == "mixed" else ["C"])
    assert C.block_table == [4, 3]
    assert s.prefix_cache_hit_tokens - hits_before == 16
    rows = prefill_rows(batch, plan)
    assert rows["positions"] == [16, 17]
    assert rows["input_ids"] == [316, 1003]
    assert rows["slot_mapping"] == [3 * 16 + 0, 3 * 16 + 1]
    assert plan.has_context and rows["context_lens"] == [18]
    assert rows["sample_steps"] == [1]                    # C had one completion token
    assert C.completion_token_ids == [1003, 1006]
    assert bm.blocks[4].ref_count == 1


# ---- decode outcomes -----------------------------------------------------------------------

def test_decode_without_preemption():
    s = make_sched(bs=4, blocks=16)
    for r in "abc":
        s.add(make_seq(r, range(5), max_tokens=8))
    step(s, expect_prefill=True)
    for _ in range(6):
        batch, plan, out = step(s, expect_prefill=False)
        assert ids(batch.seqs) == ["a", "b", "c"] and ids(out) == ["a", "b", "c"]
    assert s.num_preemptions == 0


def test_tail_preemption_several_victims_for_one_sequence(policy):
    """C shares its only block with B, so preempting C frees nothing; B must go too.

    Mixed: A and B decode in the step that admits C, so A starts one token shorter to reach
    its block boundary one step later, at the same state."""
    s = make_sched(bs=4, blocks=4)
    bm = s.block_manager
    mixed = policy == "mixed"
    A = make_seq("A", range(10, 18 - mixed), max_tokens=6)  # 2 blocks; len 9 on a boundary
    B = make_seq("B", [1, 2, 3, 4, 5, 6], max_tokens=6)    # 2 blocks, len 7
    s.add(A)
    s.add(B)
    step(s, [100, 101], expect_prefill=True)
    C = make_seq("C", [1, 2, 3, 4], max_tokens=5)          # fully covered by B's first block
    s.add(C)
    batch, plan, _ = step(s, prefill_tokens=[102], expect_prefill=True)
    assert ids(batch.seqs) == (["A", "B", "C"] if mixed else ["C"])
    assert C.block_table == [2] and bm.blocks[2].ref_count == 2
    rows = prefill_rows(batch, plan)
    assert rows["slot_mapping"] == [-1] and rows["positions"] == [3]
    assert (A.block_table, B.block_table) == ([0, 1], [2, 3])
    assert bm.num_free_blocks == 0 and bm.needs_block(A) and len(A) == 9

    batch = s.schedule()
    assert ids(batch.seqs) == ["A"]
    assert ids(s.waiting) == ["B", "C"]                    # C first, then B in front of it
    assert s.num_preemptions == 2
    assert A.block_table == [0, 1, 3]                      # B's unhashed tail block
    assert list(bm.free_block_ids) == [2] and bm.blocks[2].hash != -1
    s.postprocess(batch, np.array([103]))
    s.check_integrity()


def test_tail_preemption_one_victim_per_sequence():
    s = make_sched(bs=4, blocks=7)
    bm = s.block_manager
    A = make_seq("A", range(10, 18), max_tokens=4)         # len 9 after prefill: boundary
    B = make_seq("B", range(20, 28), max_tokens=4)         # boundary
    C = make_seq("C", range(30, 35), max_tokens=4)         # 2 blocks, len 6
    D = make_seq("D", range(40, 43), max_tokens=4)         # 1 block, len 4
    for q in (A, B, C, D):
        s.add(q)
    step(s, expect_prefill=True)
    assert [len(q.block_table) for q in (A, B, C, D)] == [2, 2, 2, 1]
    batch = s.schedule()
    assert ids(batch.seqs) == ["A", "B"]
    assert ids(s.waiting) == ["C", "D"] and s.num_preemptions == 2
    assert A.block_table == [0, 1, 6]                      # D's only block
    assert B.block_table == [2, 3, 5]                      # C's unhashed tail
    assert list(bm.free_block_ids) == [4] and bm.blocks[4].hash != -1
    s.postprocess(batch, np.array([7, 8]))
    s.check_integrity()


def test_self_preemption_then_next_schedules_work():
    s = make_sched(bs=4, blocks=4, max_model_len=64)
    A = make_seq("A", range(10, 16), max_tokens=6)         # 2 blocks, len 7: no boundary
    B = make_seq("B", range(20, 28), max_tokens=6)         # 2 blocks, len 9: boundary
    s.add(A)
    s.add(B)
    step(s, expect_prefill=True)
    batch = s.schedule()
    assert ids(batch.seqs) == ["A"]                        # B preempted itself
    assert ids(s.running) == ["A"] and ids(s.waiting) == ["B"]
    assert B.block_table == [] and B.status is SequenceStatus.WAITING
    assert s.num_preemptions == 1
    s.postprocess(batch, np.array([1]))
    s.check_integrity()
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < 100
    assert A.finish_reason == "length" and B.finish_reason == "length"
    assert len(A.completion_token_ids) == 6 and len(B.completion_token_ids) == 6
    assert s.block_manager.num_free_blocks == 4


def test_decode_fast_path_allocates_like_the_seed_loop():
    s = make_sched(bs=4, blocks=32)
    for r, n in zip("abcd", (4, 5, 8, 3)):
        s.add(make_seq(r, range(n), max_tokens=12))
    step(s, expect_prefill=True)
    for _ in range(10):
        lens = [len(q) for q in s.running]
        before = [list(q.block_table) for q in s.running]
        free = list(s.block_manager.free_block_ids)
        batch = s.schedule()
        expected, k = [], 0
        for q_len, tbl in zip(lens, before):
            if (q_len - 1) % 4 == 0:
                tbl = tbl + [free[k]]
                k += 1
            expected.append(tbl)
        assert [q.block_table for q in batch.seqs] == expected
        s.postprocess(batch, np.full(len(batch), 5))
        s.check_integrity()


# ---- prefix cache --------------------------------------------------------------------------

def test_shared_prefix_shares_blocks():
    s = make_sched(bs=4, blocks=16)
    bm = s.block_manager
    s.add(make_seq("a", range(10), max_tokens=4))
    step(s, expect_prefill=True)
    b = make_seq("b", list(range(8)) + [77, 78, 79], max_tokens=4)
    s.add(b)
    batch, plan, _ = step(s, expect_prefill=True)
    a = s.get("a")
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert s.prefix_cache_hit_tokens == 8
    rows = prefill_rows(batch, plan)
    assert rows["positions"] == [8, 9, 10] and plan.has_context
    assert rows["cu_seqlens_q"] == [0, 3] and rows["context_lens"] == [11]


@pytest.mark.parametrize("first_still_running", [True, False])
def test_fully_cached_prompt_computes_last_token(first_still_running):
    s = make_sched(bs=16, blocks=8)
    bm = s.block_manager
    prompt = list(range(50, 82))                           # exactly 2 blocks
    s.add(make_seq("first", prompt, max_tokens=3))
    step(s, expect_prefill=True)
    first = s.get("first")
    cached = list(first.block_table)
    if not first_still_running:
        while s.has_unfinished():
            step(s)
        assert bm.used_block_ids == set()
    again = make_seq("again", prompt, max_tokens=3)
    s.add(again)
    batch, plan, _ = step(s, prefill_tokens=[9], expect_prefill=True)
    assert again.block_table == cached
    assert again.num_prefix_hit_tokens == 32
    rows = prefill_rows(batch, plan)
    assert rows["input_ids"] == [prompt[-1]]
    assert rows["positions"] == [31]
    assert rows["slot_mapping"] == [-1]                    # KV already there, shared
    assert rows["context_lens"] == [32] and rows["logits_indices"] == [0]
    assert plan.has_context and [r[:2] for r in rows["block_tables"]] == [cached]
    assert s.prefix_cache_hit_tokens == 31
    assert again.completion_token_ids == [9]
    expect_ref = 2 if first_still_running else 1
    assert [bm.blocks[i].ref_count for i in cached] == [expect_ref, expect_ref]
    # Decoding continues into a fresh block of its own.
    batch = s.schedule()
    assert again in batch.seqs and len(again.block_table) == 3
    assert again.block_table[2] not in cached
    s.postprocess(batch, np.full(len(batch), 5))
    s.check_integrity()
    while s.has_unfinished():
        step(s)
    assert bm.num_free_blocks == 8


def test_preempted_sequence_readmitted_with_prefix_hit():
    s = make_sched(bs=4, blocks=16)
    bm = s.block_manager
    x = make_seq("x", range(10), max_tokens=10)
    s.add(x)
    step(s, [100], expect_prefill=True)
    for t in (101, 102, 103):
        step(s, [t], expect_prefill=False)
    assert len(x) == 14 and x.num_cached_tokens == 13
    hashed = x.block_table[:3]
    s.preempt(x)
    assert ids(s.waiting) == ["x"] and x.block_table == [] and x.num_cached_tokens == 0
    s.check_integrity()
    batch, plan, _ = step(s, [104], expect_prefill=True)
    assert x.block_table[:3] == hashed                     # full blocks recovered
    assert plan.positions.tolist() == [12, 13]
    assert plan.input_ids.tolist() == [102, 103]
    assert batch.sample_rows["steps"].tolist() == [4]
    assert x.completion_token_ids == [100, 101, 102, 103, 104]
    step(s, [105], expect_prefill=False)
    assert x.num_cached_tokens == 15


def test_preempted_sequence_readmitted_fully_covered_by_another():
    """Y is preempted at 16 tokens (a block's worth, its last KV unwritten); X, whose prompt
    equals Y's tokens, has cached that block, so Y's re-admission is fully covered."""
    s = make_sched(bs=16, blocks=8)
    prompt = list(range(1, 16))
    X = make_seq("X", prompt + [7], max_tokens=8)
    Y = make_seq("Y", prompt, max_tokens=8)
    s.add(X)
    s.add(Y)
    step(s, [3, 7], expect_prefill=True)                  # Y samples 7: now 16 tokens
    assert len(Y) == 16 and Y.num_cached_tokens == 15
    s.preempt(Y)
    assert ids(s.waiting) == ["Y"] and s.num_preemptions == 1
    batch, plan, _ = step(s, prefill_tokens=[8], expect_prefill=True)
    rows = prefill_rows(batch, plan)
    assert rows["seqs"] == ["Y"]
    assert Y.block_table == X.block_table[:1]
    assert s.block_manager.blocks[X.block_table[0]].ref_count == 2
    assert rows["slot_mapping"] == [-1] and rows["positions"] == [15]
    assert rows["input_ids"] == [7] and rows["sample_steps"] == [1]
    assert Y.completion_token_ids == [7, 8]
    batch = s.schedule()                                  # both decode into fresh blocks
    assert len(X.block_table) == len(Y.block_table) == 2
    assert X.block_table[1] != Y.block_table[1]
    s.postprocess(batch, np.array([4, 4]))
    s.check_integrity()
    while s.has_unfinished():
        step(s)


def test_hash_collision_does_not_share(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", classmethod(lambda cls, t, p=-1: 1))
    s = make_sched(bs=4, blocks=8)
    s.add(make_seq("a", range(8), max_tokens=3))
    step(s, expect_prefill=True)
    b = make_seq("b", range(20, 28), max_tokens=2)
    s.add(b)
    batch, plan, _ = step(s, expect_prefill=True)
    assert not set(b.block_table) & set(s.get("a").block_table)
    rows = prefill_rows(batch, plan)
    assert rows["positions"][0] == 0 and min(rows["slot_mapping"]) >= 0
    assert plan.has_context == (batch.num_decodes > 0)


def test_prefix_caching_disabled():
    s = make_sched(bs=4, blocks=8, prefix=False)
    s.add(make_seq("a", range(8), max_tokens=2))
    step(s)
    b = make_seq("b", range(8), max_tokens=2)
    s.add(b)
    batch, plan, _ = step(s, expect_prefill=True)
    assert s.prefix_cache_hit_tokens == 0 and prefill_rows(batch, plan)["positions"][0] == 0
    assert s.block_manager.hash_to_block_id == {}


def test_reset_prefix_cache():
    s = make_sched(bs=4, blocks=8)
    s.add(make_seq("a", range(8), max_tokens=1))
    step(s)
    assert not s.has_unfinished() and s.block_manager.hash_to_block_id
    assert s.reset_prefix_cache() is True
    b = make_seq("b", range(8), max_tokens=1)
    s.add(b)
    step(s)
    assert s.prefix_cache_hit_tokens == 0


# ---- chunked prefill -----------------------------------------------------------------------

def test_chunked_prefill_runs_a_prompt_longer_than_the_budget():
    s = make_sched(bs=4, blocks=16, max_batched=5)
    long = make_seq("long", range(100, 113), max_tokens=3)     # 13 tokens: 5 + 5 + 3
    s.add(long)
    chunks = []
    for _ in range(3):
        batch, plan, out = step(s, expect_prefill=True, tokens=None)
        chunks.append(plan.positions.tolist())
        assert long.is_prefill == (len(chunks) < 3)
        assert plan.num_samples == (1 if len(chunks) == 3 else 0)
        assert (out == [long]) == (len(chunks) == 3)
    assert chunks == [list(range(0, 5)), list(range(5, 10)), list(range(10, 13))]
    assert long.completion_token_ids == [1000]
    assert s.prompt_tokens_computed == 13


def test_chunk_continues_first_and_others_fill_the_budget():
    s = make_sched(bs=4, blocks=32, max_batched=8)
    a = make_seq("a", range(10), max_tokens=2)
    b = make_seq("b", range(20, 26), max_tokens=2)
    c = make_seq("c", range(30, 32), max_tokens=2)
    for q in (a, b, c):
        s.add(q)
    batch, plan, _ = step(s, expect_prefill=True)             # a: 8 of 10
    assert ids(batch.seqs) == ["a"] and plan.num_samples == 0
    batch, plan, _ = step(s, expect_prefill=True)             # a: 2, b: 6 -> both sampled
    assert ids(batch.seqs) == ["a", "b"] and plan.num_samples == 2
    assert plan.cu_seqlens_q.tolist() == [0, 2, 8]
    assert plan.logits_indices.tolist() == [1, 7]
    batch, plan, _ = step(s, expect_prefill=True)             # c (mixed: a, b decode first)
    assert ids(batch.seqs) == (["a", "b", "c"] if batch.num_decodes else ["c"])
    assert batch.num_decodes == (2 if s.policy == "mixed" else 0)


# ---- block sizes ---------------------------------------------------------------------------

@pytest.mark.parametrize("bs", [1, 2, 16, 256])
def test_block_sizes_decode_across_boundaries(bs):
    blocks = max(8, 2 * (40 // bs + 2))
    s = make_sched(bs=bs, blocks=blocks, max_model_len=4096)
    bm = s.block_manager
    seqs = [make_seq(f"r{i}", range(3 * i, 3 * i + 5 + i), max_tokens=30 + i) for i in range(3)]
    for q in seqs:
        s.add(q)
    while s.has_unfinished():
        batch, plan, _ = step(s)
        for q in batch.seqs:
            if q.status is SequenceStatus.RUNNING and not q.is_prefill:
                assert len(q.block_table) == -(-(len(q) - 1) // bs)
    assert [len(q.completion_token_ids) for q in seqs] == [30, 31, 32]
    assert bm.num_free_blocks == blocks and bm.used_block_ids == set()


def test_block_size_one_allocates_every_step():
    s = make_sched(bs=1, blocks=32)
    q = make_seq("q", [5, 6, 7], max_tokens=5)
    s.add(q)
    step(s)
    for n in range(4):
        batch = s.schedule()
        assert len(q.block_table) == 4 + n
        s.postprocess(batch, np.array([9]))
        s.check_integrity()


# ---- finishing -----------------------------------------------------------------------------

def test_finish_on_eos_stop_token_length_and_ignore_eos():
    s = make_sched(bs=4, blocks=32, eos=(0, 2))
    a = make_seq("a", range(3, 8), max_tokens=10)
    b = make_seq("b", range(3, 8), max_tokens=10, stop_token_ids=[42])
    c = make_seq("c", range(3, 8), max_tokens=2)
    d = make_seq("d", range(3, 8), max_tokens=3, ignore_eos=True)
    for q in (a, b, c, d):
        s.add(q)
    step(s, [5, 5, 5, 2])                                   # d ignores EOS 2
    _, _, out = step(s, [2, 42, 5, 0])
    assert ids(out) == ["a", "b", "c", "d"]
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("stop", "stop", "length")
    assert d.finish_reason is None and ids(s.running) == ["d"]
    step(s, [0])
    assert d.finish_reason == "length" and d.completion_token_ids == [2, 0, 0]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 32


def test_finish_on_eos_at_prefill():
    s = make_sched(bs=4, blocks=8)
    q = make_seq("q", range(3, 8), max_tokens=10)
    s.add(q)
    _, _, out = step(s, [EOS])
    assert out == [q] and q.finish_reason == "stop" and q.status is SequenceStatus.FINISHED
    assert s.block_manager.num_free_blocks == 8


def test_finish_at_max_model_len():
    s = make_sched(bs=4, blocks=8, max_model_len=12)
    q = make_seq("q", range(3, 8), max_tokens=7)            # 5 + 7 = 12: allowed
    s.add(q)
    while s.has_unfinished():
        step(s)
    assert q.finish_reason == "length" and len(q) == 12


def test_finish_by_engine_frees_blocks():
    s = make_sched(bs=4, blocks=8)
    q = make_seq("q", range(3, 8), max_tokens=10)
    s.add(q)
    step(s)
    assert s.finish(q, "stop") is True
    assert q.finish_reason == "stop" and not s.running
    assert s.finish(q, "stop") is False
    assert s.finish("nope") is False
    with pytest.raises(InvalidFieldError, match="finish_reason"):
        s.finish("q", "bogus")
    s.check_integrity()
    assert s.block_manager.num_free_blocks == 8


# ---- admission and abort -------------------------------------------------------------------

def test_admission_max_model_len():
    s = make_sched(bs=4, blocks=64, max_model_len=20)
    with pytest.raises(AdmissionError) as e:
        s.add(make_seq("long", range(15), max_tokens=8))
    err = e.value
    assert (err.limit, err.requested, err.allowed) == ("max_model_len", 23, 20)
    assert "max_model_len=23" in str(err) and "20" in str(err) and "over by 3" in str(err)
    assert not s.has_unfinished()
    s.add(make_seq("fits", range(15), max_tokens=5))


def test_admission_num_kv_blocks():
    s = make_sched(bs=4, blocks=3, max_model_len=100)
    with pytest.raises(AdmissionError) as e:
        s.add(make_seq("big", range(10), max_tokens=4))        # 13 KV tokens -> 4 blocks
    err = e.value
    assert (err.limit, err.requested, err.allowed) == ("num_kv_blocks", 4, 3)
    assert "num_kv_blocks=4" in str(err) and "over by 1" in str(err)
    s.add(make_seq("ok", range(10), max_tokens=3))             # 12 KV tokens -> 3 blocks
    while s.has_unfinished():
        step(s)


def test_admission_empty_prompt_and_duplicate_id():
    s = make_sched()
    with pytest.raises(InvalidFieldError, match="prompt_token_ids"):
        s.add(make_seq("e", []))
    s.add(make_seq("x", [1, 2]))
    with pytest.raises(InvalidRequestError, match="request_id.*already"):
        s.add(make_seq("x", [3]))
    assert ids(s.waiting) == ["x"]
    with pytest.raises(InvalidFieldError, match="request_id"):
        s.add(make_seq("", [3]))
    with pytest.raises(InvalidFieldError, match="prompt_token_ids.*>= 0"):
        s.add(make_seq("neg", [3, -1]))


def test_request_id_reusable_after_finish():
    s = make_sched()
    s.add(make_seq("x", [1, 2], max_tokens=1))
    step(s)
    assert not s.has_unfinished()
    s.add(make_seq("x", [1, 2], max_tokens=1))


def test_scheduler_requires_num_kv_blocks():
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        Scheduler(EngineConfig(block_size=16))


def test_abort_running_waiting_unknown():
    s = make_sched(bs=4, blocks=8, max_num_seqs=1)
    r = make_seq("r", range(5), max_tokens=5)
    w = make_seq("w", range(5), max_tokens=5)
    s.add(r)
    s.add(w)
    step(s)
    assert ids(s.running) == ["r"] and ids(s.waiting) == ["w"]
    assert s.abort("w") is True
    assert w.finish_reason == "abort" and not s.waiting
    assert s.abort("r") is True
    assert r.finish_reason == "abort" and r.block_table == [] and not s.running
    assert s.abort("r") is False and s.abort("unknown") is False
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 8
    batch = s.schedule()
    assert not batch and len(batch) == 0
    assert s.build_plan(batch).num_seqs == 0
    assert s.postprocess(batch, np.array([], dtype=np.int64)) == []
    s.check_integrity()


def test_abort_while_step_in_flight():
    s = make_sched(bs=4, blocks=16)
    for r in "abc":
        s.add(make_seq(r, range(5), max_tokens=5))
    step(s)
    batch = s.schedule()
    assert s.abort("b")
    out = s.postprocess(batch, np.array([7, 8, 9]))
    assert ids(out) == ["a", "c"]
    assert s.get("a").completion_token_ids[-1] == 7 and s.get("c").completion_token_ids[-1] == 9
    s.check_integrity()


def test_abort_partial_prefill_in_flight():
    s = make_sched(bs=4, blocks=16, max_batched=4)
    s.add(make_seq("p", range(10), max_tokens=2))
    batch = s.schedule()
    assert s.abort("p")
    assert s.postprocess(batch, np.array([], dtype=np.int64)) == []
    s.check_integrity()
    assert not s.has_unfinished()
    s.add(make_seq("q", range(3), max_tokens=1))
    step(s)


def test_stats_counters():
    s = make_sched(bs=4, blocks=8)
    s.add(make_seq("a", range(8), max_tokens=3))
    step(s)
    step(s)
    st = s.stats()
    assert st["prompt_tokens_computed"] == 8 and st["decode_tokens"] == 1
    assert st["kv_blocks_total"] == 8 and st["kv_blocks_used"] == 3
    assert st["num_preemptions"] == 0 and st["prefix_cache_hit_tokens"] == 0
    assert s.kv_blocks_used == 3 and s.kv_blocks_total == 8
