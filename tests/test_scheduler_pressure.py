"""The scheduler under pressure: priority order and its victims, timeouts in every state, the
waiting-queue limits. Each test runs under both scheduling policies; the seed's decisions under
equal priorities are test_scheduler.py's (run there under both orders)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tpserve.config import EngineConfig
from tpserve.errors import InvalidFieldError, OverloadedError
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence, SequenceStatus
from tpserve.scheduler.ordering import decode_victim
from tpserve.scheduler.running import RunningQueue
from tpserve.scheduler.waiting import WaitingQueue

EOS = 0
WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


@pytest.fixture(autouse=True, params=("mixed", "prefill-first"))
def policy(request):
    return request.param


def make_sched(policy, bs=4, blocks=8, max_num_seqs=16, max_batched=64, order="priority", **kw):
    return Scheduler(EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_batched, max_model_len=1024,
                                  eos_token_ids=[EOS], scheduling_policy=policy, scheduling_order=order,
                                  max_stall_tokens=1, **kw))


def seq(rid, tokens, max_tokens=8, priority=0, deadline=None):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                    priority=priority, deadline=deadline)


def step(s: Scheduler):
    batch = s.schedule()
    assert batch, "nothing scheduled"
    plan = s.build_plan(batch)
    plan.validate()
    s.postprocess(batch, np.arange(1000, 1000 + plan.num_samples))
    s.check_integrity()
    return batch


def ids(seqs):
    return [q.request_id for q in seqs]


def running_with(s, specs, max_tokens=20):
    """Admit ``(rid, prompt length, priority)`` in this order in one step, then give each its
    priority: a running sequence's priority only matters once it is running, and this fixes
    the admission order independently of the priorities."""
    out = {}
    for rid, n, _ in specs:
        start = 10 * len(out) + 1
        out[rid] = q = seq(rid, range(start, start + n), max_tokens=max_tokens)
        s.add(q)
    step(s)
    for rid, _, prio in specs:
        assert out[rid].status is RUNNING
        out[rid].priority = prio
    assert ids(s.running) == [rid for rid, _, _ in specs]
    return out


# ---- the waiting queue ------------------------------------------------------------------------
def test_waiting_queue_orders_by_priority_then_arrival_and_preempted_first():
    q = WaitingQueue(by_priority=True)
    a, b, c, d = (SimpleNamespace(priority=p, token_ids=[1] * n) for p, n in ((5, 1), (0, 2), (5, 3), (0, 4)))
    for x in (a, b, c, d):
        q.append(x)
    assert list(q) == [b, d, a, c] and q[0] is b and q.num_tokens == 10
    e = SimpleNamespace(priority=5, token_ids=[1])
    q.appendleft(e)                      # preempted: the front of its own priority
    assert list(q) == [b, d, e, a, c]
    q.remove(d)
    assert q.popleft() is b and list(q) == [e, a, c] and len(q) == 3 and q.num_tokens == 5
    fifo = WaitingQueue(by_priority=False)
    for x in (a, b, c):
        fifo.append(x)
    fifo.appendleft(e)
    assert list(fifo) == [e, a, b, c]    # fcfs: the seed's deque, priorities ignored


def test_admission_takes_the_best_priority_first(policy):
    s = make_sched(policy, blocks=8)
    running_with(s, [("big", 28, -10)], max_tokens=4)  # 7 of 8 blocks, best priority
    for rid, prio in (("low", 5), ("high", -3), ("mid", 2), ("high2", -3)):
        s.add(seq(rid, range(100, 104), max_tokens=1, priority=prio))
    assert ids(s.waiting) == ["high", "high2", "mid", "low"]
    admitted = []
    while s.has_unfinished():
        batch = step(s)
        admitted += [q.request_id for q in batch.seqs[batch.num_decodes:] if q.request_id not in admitted]
    assert admitted == ["high", "high2", "mid", "low"] and s.num_priority_preemptions == 0


# ---- priority preemption ----------------------------------------------------------------------
def test_a_better_request_preempts_the_worst_latest_admitted_first(policy):
    s = make_sched(policy, blocks=8)
    r = running_with(s, [("A", 6, 5), ("B", 6, 3), ("C", 6, 5), ("D", 6, 1)])  # 2 blocks each
    assert s.block_manager.num_free_blocks == 0
    s.add(seq("H", range(200, 206), priority=0))                           # needs 2 blocks
    batch = step(s)
    # Worst priority first (5: A and C), latest admitted among equals: C alone frees enough.
    assert r["C"].status is WAITING and s.num_priority_preemptions == 1
    assert "H" in ids(batch.seqs) and s.get("H").status is RUNNING
    assert all(r[x].status is RUNNING for x in "ABD")
    assert ids(s.waiting) == ["C"]
    s.add(seq("H2", range(300, 310), priority=0))                          # 3 blocks: A (2), then B
    step(s)
    assert r["A"].status is WAITING and r["B"].status is WAITING and r["D"].status is RUNNING
    assert s.num_priority_preemptions == 3
    assert ids(s.waiting) == ["B", "A", "C"]   # by priority; the preempted at the front of theirs


def test_equal_or_better_running_requests_are_never_preempted(policy):
    s = make_sched(policy, blocks=4)
    r = running_with(s, [("A", 5, 2), ("B", 5, 0)], max_tokens=3)  # 2 blocks each: the pool
    s.add(seq("H", range(200, 206), priority=2))       # as good as A: waits, as under the seed
    step(s)
    assert r["A"].status is RUNNING and r["B"].status is RUNNING and s.get("H").status is WAITING
    assert s.num_priority_preemptions == 0 == s.num_preemptions


def test_nobody_is_preempted_when_even_all_victims_would_not_make_room(policy):
    s = make_sched(policy, bs=4, blocks=3)
    r = running_with(s, [("V", 6, 5), ("X", 3, 0)], max_tokens=3)  # V: 2 blocks (b0 full), X: 1
    # H shares V's first block, then 8 tokens of its own: 3 blocks, the block it shares with V
    # costing nothing while V holds it. Preempting V frees 2 blocks, but then that shared block
    # sits in the free list and costs one too: 3 > 2, so preempting V would not admit H.
    s.add(seq("H", r["V"].token_ids[:4] + list(range(500, 508)), max_tokens=1, priority=1))
    step(s)
    assert r["V"].status is RUNNING and s.num_priority_preemptions == 0 and s.get("H").status is WAITING


def test_a_cached_block_the_victim_shares_is_shared_not_freed(policy):
    s = make_sched(policy, bs=4, blocks=5)
    r = running_with(s, [("V", 6, 5), ("W", 10, 5)], max_tokens=4)  # V: 2 blocks, W: 3; pool full
    # H shares V's first (cached) block and needs one more: preempting W (the latest admitted
    # among the worst) is enough, and H shares V's block instead of taking it.
    s.add(seq("H", r["V"].token_ids[:4] + [600, 601], max_tokens=4, priority=0))
    step(s)
    assert r["W"].status is WAITING and r["V"].status is RUNNING
    h = s.get("H")
    assert h.status is RUNNING and h.block_table[0] == r["V"].block_table[0]
    assert s.block_manager.blocks[h.block_table[0]].ref_count == 2


def test_a_full_batch_of_slots_preempts_one_worse_request(policy):
    s = make_sched(policy, blocks=64, max_num_seqs=2)
    r = running_with(s, [("A", 4, 1), ("B", 4, 1)])
    s.add(seq("H", range(200, 204), priority=0))
    batch = step(s)
    assert r["B"].status is WAITING and r["A"].status is RUNNING and "H" in ids(batch.seqs)


def test_a_high_priority_request_gets_its_first_token_behind_many_long_streams(policy):
    s = make_sched(policy, bs=4, blocks=40, max_num_seqs=40, max_batched=64)
    low = [seq(f"low{i}", range(100 + i, 104 + i), max_tokens=40, priority=10) for i in range(32)]
    for q in low:
        s.add(q)
    for _ in range(12):                                   # they fill the pool and keep decoding
        step(s)
    high = seq("high", range(900, 907), max_tokens=3, priority=0)
    assert not any(q.is_finished for q in low) and s.block_manager.num_free_blocks < high.num_blocks
    s.add(high)
    steps = 0
    while not high.completion_token_ids:
        step(s)
        steps += 1
        assert steps <= 2
    assert not any(q.is_finished for q in low)
    while s.has_unfinished():
        step(s)
    assert all(q.finish_reason == "length" and len(q.completion_token_ids) == 40 for q in low)
    assert high.finish_reason == "length" and s.num_priority_preemptions > 0


class _Seq(SimpleNamespace):
    pass


def test_decode_victims_by_priority():
    def queue(*prios):
        q = RunningQueue()
        for i, p in enumerate(prios):
            q.append(_Seq(priority=p, name=f"s{i}"))
        return q

    me = _Seq(priority=3)
    rest = queue(1, 5, 2, 5, 3)
    v = decode_victim(rest, me, by_priority=True)
    assert v.name == "s3" and [x.name for x in rest] == ["s0", "s1", "s2", "s4"]  # worst, latest
    rest = queue(1, 2)
    assert decode_victim(rest, me, by_priority=True) is None and len(rest) == 2   # all better: itself
    rest = queue(1, 3)
    assert decode_victim(rest, me, by_priority=True).name == "s1"                 # equal: the tail
    rest = queue(9, 1)
    assert decode_victim(rest, me, by_priority=False).name == "s1"                # fcfs: the tail
    assert decode_victim(RunningQueue(), me, by_priority=True) is None


def test_a_decode_short_of_a_block_preempts_the_worst_behind_it(policy):
    s = make_sched(policy, bs=4, blocks=6)
    r = running_with(s, [("A", 4, 0), ("B", 4, 7), ("C", 4, 2), ("D", 12, 1)], max_tokens=8)
    assert s.block_manager.num_free_blocks == 0   # 1 + 1 + 1 + 3; every next decode needs a block
    batch = step(s)
    # A: the worst behind it is B (7), preempted. C: everyone behind it (D) is better, so C
    # preempts itself. D gets C's block. (The seed would preempt D, the tail, for A.)
    assert ids(batch.seqs) == ["A", "D"]
    assert r["B"].status is WAITING and r["C"].status is WAITING
    assert ids(s.waiting) == ["C", "B"] and s.num_preemptions == 2 and s.num_priority_preemptions == 0


# ---- timeouts ---------------------------------------------------------------------------------
def test_timeouts_free_blocks_in_every_state(policy):
    s = make_sched(policy, bs=4, blocks=8, max_batched=6)
    dec = seq("decoding", range(1, 5), max_tokens=8, deadline=10.0)
    s.add(dec)
    step(s)
    step(s)
    part = seq("prefilling", range(20, 40), max_tokens=4, deadline=10.0)  # chunks of the budget
    s.add(part)
    step(s)
    assert part.status is RUNNING and part.is_prefill and part.block_table
    wait = seq("waiting", range(50, 70), max_tokens=4, deadline=10.0)    # 5 blocks: no room
    later = seq("later", range(80, 84), max_tokens=4, deadline=20.0)
    s.add(wait)
    s.add(later)
    step(s)
    assert wait.status is WAITING and not dec.is_prefill and dec.status is RUNNING
    assert s.expire(9.99) == []
    gone = s.expire(10.0)
    assert sorted(ids(gone)) == ["decoding", "prefilling", "waiting"]
    assert all(q.finish_reason == "timeout" and q.status is FINISHED for q in gone)
    assert s.num_timed_out == 3 and dec.completion_token_ids  # what it generated stays with it
    s.check_integrity()
    assert s.block_manager.num_used_blocks == 0 and ids(s.waiting) == ["later"]
    while s.has_unfinished():
        step(s)
    assert later.finish_reason == "length" and s.expire(30.0) == []
    assert s.block_manager.num_used_blocks == 0


def test_deadlines_of_finished_requests_are_forgotten(policy):
    s = make_sched(policy, blocks=64)
    for i in range(200):
        s.add(seq(f"r{i}", [1, 2, 3], max_tokens=1, deadline=1e9))
        s.abort(f"r{i}")
    assert s._deadlines.live == 0 and len(s._deadlines) <= 130
    s.check_integrity()


# ---- queue limits -----------------------------------------------------------------------------
def test_queue_limits_refuse_new_requests_and_count_them(policy):
    s = make_sched(policy, blocks=16, max_waiting_requests=2, max_waiting_tokens=30)
    s.add(seq("run", range(1, 61), max_tokens=4))
    step(s)                                              # 15 of 16 blocks
    s.add(seq("w1", range(100, 104), max_tokens=1))      # queued: nothing is scheduled meanwhile
    s.add(seq("w2", range(200, 204), max_tokens=1))
    with pytest.raises(OverloadedError) as e:
        s.add(seq("w3", range(300, 304), max_tokens=1))
    assert (e.value.limit, e.value.requested, e.value.allowed) == ("max_waiting_requests", 3, 2)
    assert s.get("w3") is None and len(s.waiting) == 2
    s.add(seq("w3", range(300, 304), max_tokens=1), limit_queue=False)  # a later completion
    s.abort("w3")
    s.abort("w2")
    with pytest.raises(OverloadedError) as e:
        s.add(seq("big", range(400, 427), max_tokens=1))  # 4 queued + 27 > 30
    assert (e.value.limit, e.value.requested, e.value.allowed) == ("max_waiting_tokens", 31, 30)
    assert s.num_refused == {"max_waiting_requests": 1, "max_waiting_tokens": 1}
    s.abort("w1")
    s.add(seq("big", range(400, 440), max_tokens=1))     # 40 > 30, but into an empty queue
    s.check_integrity()
    while s.has_unfinished():
        step(s)


def test_auto_queue_limits_come_from_the_pool(policy):
    s = make_sched(policy, bs=4, blocks=50, max_num_seqs=16, max_waiting_requests="auto",
                   max_waiting_tokens="auto")
    assert (s.max_waiting_requests, s.max_waiting_tokens) == (16, 200)
    s = make_sched(policy, bs=4, blocks=5, max_num_seqs=16, max_waiting_requests="auto")
    assert (s.max_waiting_requests, s.max_waiting_tokens) == (5, None)


def test_fcfs_refuses_a_priority_instead_of_ignoring_it(policy):
    s = make_sched(policy, order="fcfs")
    with pytest.raises(InvalidFieldError) as e:
        s.add(seq("p", [1, 2], priority=1))
    assert e.value.field == "priority" and "fcfs" in e.value.reason and s.get("p") is None
    s.add(seq("zero", [1, 2], priority=0))
