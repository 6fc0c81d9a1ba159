"""Scheduler: prefill/decode batching and recompute preemption over the block pool.

One ``schedule()`` call fills one step's token budget, ``max_num_batched_tokens``, under one of
two policies (``EngineConfig.scheduling_policy``):

- **mixed** (default). First every running sequence past its prefill gets its one decode token
  (at most ``budget`` of them, in running order), with the seed's block-shortage handling below;
  then the remaining budget goes to prefill: the partial prefill continues, and waiting
  sequences are admitted first come, first served, the last one chunked. One step is one
  forward over one plan whose decode rows come first; running streams therefore never wait
  for a whole prefill, only for one budget's worth of it. If the decode part preempted
  anything, nobody is admitted in that step: the only sequences that could fit are the
  victims just evicted to make room. While few streams decode the budget grows: a step with
  ``d`` decode rows holds ``max(max_num_batched_tokens, max_stall_tokens // d)`` tokens
  (``step_budget``), so the product of prompt tokens and the streams stalled by them stays
  bounded (see EngineConfig); decode rows are capped by ``max_num_batched_tokens`` alone.
- **prefill-first** (the seed's policy). A step is all prefill if anything can be prefilled
  (partial prefill first, then admissions as above), else all decode.

Prefill details, both policies: admission stops at the first waiting sequence that does not fit
(``can_allocate`` is prefix-cache aware; ``max_num_seqs`` bounds all of ``running``). The first
sequence whose remaining prompt exceeds the remaining budget gets a chunk of exactly the
remaining budget and ends admission; it stays in ``running`` with ``is_prefill`` set. A sequence
is sampled only in the step that computes its last prompt token.

**At most one partial prefill exists at a time**, and it is the tail of ``running``: only the
last sequence admitted in a step can be cut, and the next step continues it before admitting
anyone. Allowing several would not help first-come-first-served latency (the earliest
arrival's first token would come later, its budget shared with later ones), and each partial
prefill holds all of its prompt's KV blocks while producing no token.

Decode and block shortage: a sequence whose next token starts a block needs a free block; on
shortage the seed's ``while ... else`` applies: preempt the tail of ``running`` (the latest
admitted; the partial prefill first, if there is one) until it fits, or preempt the sequence
itself when nothing is left behind it. A preempted sequence loses its blocks (their hash
entries survive for prefix-cache recovery), goes back to prefill and to the *front* of
``waiting``.

Speculative decoding (``EngineConfig.speculative_config``): after the decode and prefill rows
are chosen as above, small steps give decode rows draft tokens to verify (spec_decode.py);
``postprocess`` then appends several tokens to such a row, cut where the finish rule ends it.
Without it, or in steps above its batch-size limit, nothing changes.

A prompt fully covered by cached blocks still computes its last token (for logits): that
token's KV is already in a shared cached block, so its slot in the plan is -1.

Scheduling order (``EngineConfig.scheduling_order``, scheduler/ordering.py): "fcfs" is the
seed exactly; under "priority" admission goes by (priority, arrival), a better waiting request
that does not fit preempts worse running ones (``_make_room``, before anything is scheduled),
and decode victims are chosen worst priority first. The waiting queue is a ``WaitingQueue``
(waiting.py), read like the seed's deque.

Timeouts (deadlines.py): ``expire(now)``, called by the engine before each ``schedule()``,
finishes requests past their deadline with "timeout", freeing their blocks in any state.

KV tiers (tpserve/kv_tiers, ``attach_kv_tiers``: kv_tier_traffic.py): at admission, the full blocks past a
sequence's prefix-cache hit that the host or disk tier holds are loaded instead of computed.
The sequence gets all its blocks as usual, then waits in ``loading`` (status LOADING, outside
``running`` and ``waiting``, no slot) while the ranks copy the blocks in on their own threads;
other sequences keep stepping. When every rank has its blocks, the loaded blocks count as
cached tokens (hashed into the prefix cache) and the sequence moves to ``ready``, admitted
before anyone waiting (a block that did not arrive is computed instead). A sequence that ends
while loading keeps its blocks until the load is done (``_orphans``): no block is reused while
a rank may still write it. Loading sequences count against ``max_num_seqs``.

KV-cache groups (``kv_groups``, tpserve/kv_groups.py; a model with sliding-window layers):
the seed's rules apply per group (BlockManager), a decode on a block boundary takes one block
per group (draft tokens: one per group for each block they need), and after each step the
blocks that left a sliding window are freed (the block manager's ``hash_blocks`` does it, the
slot rows follow: ``_sync_rows``). With the KV tiers, a hit is planned over every group at once
(pool blocks, then tier blocks, per group: ``KVTierIndex.match_groups``) and loaded all or nothing:
a sequence whose load missed a block gives its blocks back and waits at the front again.

Admission control (admission.py) replaces the seed's ``assert scheduled_seqs``: ``add()``
refuses a request that could never run, so whenever work is runnable ``schedule()`` returns a
non-empty batch; an empty batch (falsy) only means there is nothing to do. It also applies the
waiting queue's limits (OverloadedError). A structured-output request waits in the grammar gate
(grammar_gate.py) until its grammar is compiled.

Host cost of a decode step is O(batch) in numpy: the decode fast path computes which running
sequences start a block from the per-slot length array and, when the free blocks cover them
all, allocates just for those (exactly what the per-sequence loop would do, since no
``can_append`` can fail); otherwise it runs the seed loop. Views of ``running`` (its slots,
token lists) are cached by :class:`RunningQueue` under its version number. ``postprocess``
(postprocess.py) applies the sampled tokens under one finish rule, vectorized. Counters and
invariants (``stats``, ``check_integrity``) are report.py's.
"""
from __future__ import annotations

import logging

import numpy as np

from tpserve.blockpool import BlockManager
from tpserve.config import EngineConfig
from tpserve.errors import ConfigError, InvalidFieldError
from tpserve import limits as R
from tpserve.plan import StepPlan
from tpserve.sample_plan import SamplePlan
from tpserve.scheduler import ordering
from tpserve.scheduler.admission import Admission
from tpserve.scheduler.batch import ScheduledBatch
from tpserve.scheduler.deadlines import Deadlines
from tpserve.scheduler.grammar_gate import GrammarGate
from tpserve.scheduler.plan_builder import SlotTable, build_plan
from tpserve.scheduler.kv_tier_traffic import KvTierTraffic
from tpserve.scheduler.postprocess import Postprocess
from tpserve.scheduler.report import SchedulerReport
from tpserve.scheduler.sample_inputs import build_sample_plan
from tpserve.scheduler.spec_decode import Speculator
from tpserve.scheduler.running import RunningQueue
from tpserve.scheduler.sequence import Sequence, SequenceStatus
from tpserve.scheduler.waiting import WaitingQueue

log = logging.getLogger("tpserve.scheduler")

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
LOADING = SequenceStatus.LOADING
FINISHED = SequenceStatus.FINISHED
FINISH_REASONS = R.FINISH_REASONS


class Scheduler(Postprocess, KvTierTraffic, SchedulerReport):
    """Owns the waiting/running queues, the BlockManager and the per-slot arrays."""

    def __init__(self, config: EngineConfig, kv_groups=None):
        if config.num_kv_blocks is None:
            raise ConfigError("num_kv_blocks", "must be set before the scheduler is built "
                              "(the engine fills it from the KV-cache memory budget)")
        self.config = config
        self.block_size = bs = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_stall_tokens = config.max_stall_tokens
        self.policy = config.scheduling_policy
        # None: only the pool bounds a sequence.
        self.max_model_len = config.max_model_len
        self.eos_token_ids = [int(t) for t in config.eos_token_ids]
        self.block_manager = BlockManager(config.num_kv_blocks, bs, config.enable_prefix_caching, kv_groups)
        self.grouped = self.block_manager.grouped
        max_len = self.max_model_len or config.num_kv_blocks * bs
        max_blocks = min(-(-max_len // bs), config.num_kv_blocks)
        self.table = SlotTable(self.max_num_seqs, max_blocks, bs, len(self.block_manager.groups))
        spec = config.speculative
        self.speculator = Speculator(spec) if spec is not None else None
        self.by_priority = config.scheduling_order == "priority"
        self.waiting = WaitingQueue(self.by_priority)
        self.admission = Admission(config, self.block_manager, self.waiting, self.by_priority)
        self.num_refused = self.admission.num_refused
        # Structured output: requests whose grammar compiles wait outside `waiting`.
        self.grammars = GrammarGate(self.waiting)
        self._deadlines = Deadlines()
        self.running = RunningQueue()
        self._requests: dict[str, Sequence] = {}
        self._prefilling: Sequence | None = None
        # KV tiers: sequences whose blocks are loading, loaded ones waiting for admission, and
        # ended ones whose blocks wait for their load to finish.
        self.kv_tiers = None
        self.loading: dict[Sequence, None] = {}
        self.ready: list[Sequence] = []
        self._orphans: dict[Sequence, None] = {}
        self._dropped_in_flight = False
        self._step_id = 0
        self._num_logprob_seqs = 0  # unfinished requests with logprobs set (0: skip the scan)
        self.vocab_size = int(config.hf_config.get("vocab_size") or 0)
        # Counters (see stats()).
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prompt_tokens_computed = 0
        self.decode_tokens = 0
        self.num_priority_preemptions = 0  # of num_preemptions: to admit a better priority
        self.num_timed_out = 0

    @property
    def max_waiting_requests(self) -> int | None:
        return self.admission.max_waiting_requests

    @property
    def max_waiting_tokens(self) -> int | None:
        return self.admission.max_waiting_tokens

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence, limit_queue: bool = True) -> None:
        """Queue a new request, or raise if it could never be scheduled (AdmissionError), if
        the queue is full (OverloadedError; not with ``limit_queue`` False, for the later
        completions of an admitted request), or if it has a priority under "fcfs" (admission.py).
        A request whose grammar is not compiled yet waits in the grammar gate."""
        self.admission.check(seq, self._requests, limit_queue)
        seq.block_size = self.block_size
        self._requests[seq.request_id] = seq
        if seq.deadline is not None:
            self._deadlines.add(seq)
        self._num_logprob_seqs += seq.sampling_params.logprobs is not None
        if seq.grammar is not None and self.grammars.hold(seq):
            return  # schedule() queues it once its grammar is built
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return (bool(self.waiting) or bool(self.running) or bool(self.grammars.compiling)
                or bool(self.loading) or bool(self.ready) or bool(self._orphans))

    # ---- grammars (structured output: grammar_gate.py) ------------------------------------
    def take_grammar_failures(self) -> list[Sequence]:
        """The requests finished "error" because their grammar did not compile since the last
        call (``seq.grammar.error`` says why)."""
        return self.grammars.take_failures()

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a compiling grammar is done, when nothing else
        is runnable (the caller would otherwise spin)."""
        if not (self.waiting or self.running):
            self.grammars.wait(timeout)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick the next batch under the configured policy (see the module docstring)."""
        self._step_id += 1
        self._dropped_in_flight = False
        if self.grammars.compiling:
            failed = self.grammars.queue_compiled()
            if failed:
                self._finish_many([(seq, "error") for seq in failed])
        if self.by_priority and self.waiting:
            self._make_room()
        if self.policy == "mixed":
            batch = self._schedule_mixed()
            budget = self.step_budget(batch.num_decodes)
        else:
            batch = self._schedule_prefill(self.max_num_batched_tokens, [], 0)
            if batch is None:
                batch = self._schedule_decode(self.max_num_seqs)
            budget = self.max_num_batched_tokens
        if self.speculator is not None and batch.num_decodes:
            self.speculator.add_drafts(batch, budget - batch.num_tokens, self.block_manager, self.table)
        return batch

    def step_budget(self, num_decodes: int) -> int:
        """Tokens a mixed step with ``num_decodes`` decode rows may hold (module docstring)."""
        return max(self.max_num_batched_tokens, self.max_stall_tokens // max(num_decodes, 1))

    def _schedule_mixed(self) -> ScheduledBatch:
        preempted = self.num_preemptions
        decode = self._schedule_decode(min(self.max_num_batched_tokens, self.max_num_seqs))
        nd = len(decode.seqs)
        budget = self.step_budget(nd)
        # After a preemption, admitting waiting sequences would only readmit the victims that
        # were just evicted to make room (the seed lets a step preempt or admit, not both).
        admit = self.num_preemptions == preempted
        batch = self._schedule_prefill(budget - nd, decode.seqs, nd, admit)
        if batch is None:
            return decode
        batch.token_lists, batch.slots_key = decode.token_lists, decode.slots_key
        return batch

    def _batch(self, seqs: list[Sequence], is_prefill: bool, slots=None, sampled=None,
               num_decodes=0, token_lists=None, slots_key=None) -> ScheduledBatch:
        if slots is None:
            slots = np.fromiter((s.slot for s in seqs), dtype=np.intp, count=len(seqs))
        return ScheduledBatch(seqs, is_prefill, slots, self.table, self._step_id, sampled or [],
                              num_decodes, token_lists, slots_key)

    def _schedule_prefill(self, budget: int, decodes: list[Sequence], nd: int,
                          admit: bool = True) -> ScheduledBatch | None:
        """Prefill rows into ``budget`` tokens after the ``nd`` decode rows ``decodes``: the
        partial prefill first, then waiting sequences first come, first served (if ``admit``).
        None when no prefill row fits."""
        if budget <= 0:
            return None
        total = budget
        seqs: list[Sequence] = list(decodes)
        partial = self._prefilling
        if partial is not None:
            remaining = len(partial) - partial.num_cached_tokens
            n = min(remaining, budget)
            partial.num_scheduled_tokens = n
            budget -= n
            seqs.append(partial)
            if n == remaining:
                self._prefilling = None
        bm, tiers = self.block_manager, self.kv_tiers
        # A sequence loaded from a KV tier holds its blocks already: it is admitted even in a step
        # that preempted (it is no victim, and the step may have preempted its only runner for the
        # blocks it holds, which would leave the step empty).
        while budget > 0 and (self.ready or (admit and self.waiting)) and \
                len(self.running) + len(self.loading) + len(self.ready) - bool(self.ready) \
                < self.max_num_seqs:
            if self.ready:  # loaded from a KV tier: blocks held, cached tokens known
                seq = self.ready.pop(0)
            else:
                seq = self.waiting[0]
                use_cache = self._uses_cache(seq)
                num_cached_blocks = bm.can_allocate(seq, use_cache=use_cache)
                if num_cached_blocks < 0:
                    break
                self.waiting.popleft()
                if tiers is not None and use_cache and self.grouped:
                    plan = tiers.match_groups(seq, bm)
                    if plan is not None and bm.grouped_cost(seq, plan.end, plan.hits) <= bm.num_free_blocks:
                        job = tiers.load_groups(seq, plan)  # pins, before allocate() evicts
                        bm.allocate(seq, plan.end, plan.hits)
                        tiers.start_group_load(job, bm)
                        seq.status = LOADING
                        self.loading[seq] = None
                        continue
                    sources = ()
                else:
                    sources = tiers.match(seq, num_cached_blocks) if tiers is not None and use_cache else ()
                if sources:
                    tiers.reserve(seq, num_cached_blocks, sources)  # before allocate() evicts
                bm.allocate(seq, num_cached_blocks)
                if sources:  # the next blocks are in a KV tier: load them, off this loop
                    tiers.update_state_after_alloc(seq, num_cached_blocks, len(sources), sources)
                    seq.status = LOADING
                    self.loading[seq] = None
                    continue
                if seq.num_cached_tokens == len(seq):
                    # Fully cached: recompute the last token for its logits (slot -1, see build_plan).
                    seq.num_cached_tokens = len(seq) - 1
            self.prefix_cache_hit_tokens += seq.num_cached_tokens
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = seq.num_cached_tokens
            remaining = len(seq) - seq.num_cached_tokens
            n = min(remaining, budget)
            seq.num_scheduled_tokens = n
            budget -= n
            seq.status = RUNNING
            seq.is_prefill = True
            self.table.acquire(seq, self._stop_ids(seq), self._stop_len(seq))
            if self.grouped:
                self.table.set_group_blocks(seq.slot, bm.tables(seq))
            self.running.append(seq)
            seqs.append(seq)
            if n < remaining:
                self._prefilling = seq
        if len(seqs) == nd:
            return None
        self.prompt_tokens_computed += total - budget
        sampled = [s.pooling is None and s.num_cached_tokens + s.num_scheduled_tokens == len(s)
                   for s in seqs[nd:]]
        return self._batch(seqs, True, sampled=sampled, num_decodes=nd)

    @staticmethod
    def _uses_cache(seq: Sequence) -> bool:
        """Whether admitting ``seq`` may use the prefix cache. Prompt log-probabilities need the
        logits of every prompt row, so a request that still owes some computes its whole
        prompt (its blocks still enter the cache)."""
        if seq.pooling is not None:  # MEAN and CLS pool rows that a cached block would skip
            return seq.pooling in ("LAST", "SCORE")
        return (seq.sampling_params.prompt_logprobs is None
                or seq.num_prompt_logprobs_done >= seq.num_prompt_tokens)

    def _make_room(self) -> None:
        """Under "priority": when the best waiting sequence does not fit (blocks, or a slot),
        preempt the worse-priority running sequences that make it fit (ordering.py), before
        this step schedules anyone. Under "mixed", the blocks this step's decodes take first
        are reserved."""
        head, running, bm = self.waiting[0], self.running, self.block_manager
        reserve = set()
        if self.policy == "mixed" and running:
            cap = min(self.max_num_batched_tokens, self.max_num_seqs)  # as _schedule_mixed
            decodes = [s for s in running if not s.is_prefill][:cap]
            lens = self.table.seq_lens[np.fromiter((s.slot for s in decodes), np.intp, len(decodes))]
            reserve = {id(decodes[p]) for p in np.flatnonzero((lens - 1) % self.block_size == 0).tolist()}
        free = bm.num_free_blocks - len(reserve) * bm.blocks_per_append  # one per group each
        victims = ordering.admission_victims(
            head, running, bm, self._uses_cache(head), free,
            len(running) >= self.max_num_seqs, lambda v: id(v) in reserve)
        for v in victims or ():
            self.running.remove(v)
            self._preempt(v)
        self.num_priority_preemptions += len(victims or ())

    def _schedule_decode(self, cap: int) -> ScheduledBatch:
        """Decode fast path; identical in effect to :meth:`_schedule_decode_slow`.

        Decodes at most ``cap`` of the running sequences that are past their prefill."""
        running = self.running
        if not running:
            return self._batch([], False)
        bm, t = self.block_manager, self.table
        slots = running.slots()
        token_lists = running.token_lists()
        seqs = list(running)
        if self._prefilling is not None:
            # The partial prefill is the latest admitted, hence the tail of `running`.
            assert running[-1] is self._prefilling
            slots, token_lists, seqs = slots[:-1], token_lists[:-1], seqs[:-1]
        if len(slots) > cap:
            return self._schedule_decode_slow(cap)
        need = np.flatnonzero((t.seq_lens[slots] - 1) % self.block_size == 0)
        if len(need) * bm.blocks_per_append > bm.num_free_blocks:
            return self._schedule_decode_slow(cap)
        if len(need):
            # In running order, as the seed loop would: same blocks to the same sequences.
            t.append_blocks(slots[need], bm.append_blocks([seqs[p] for p in need.tolist()]))
            if self.grouped:
                for p in need.tolist():
                    t.append_group_blocks(seqs[p].slot, bm.tables(seqs[p]))
        return self._batch(seqs, False, slots, num_decodes=len(seqs), token_lists=token_lists,
                           slots_key=(running.version, len(seqs)))

    def _schedule_decode_slow(self, cap: int) -> ScheduledBatch:
        """The seed's per-sequence decode loop with its ``while ... else`` preemption.

        A partial prefill (the tail of ``running``) is a preemption victim like any other
        sequence behind the one that needs a block, but is never decoded."""
        bm, t = self.block_manager, self.table
        running = self.running
        scheduled: list[Sequence] = []
        while running and len(scheduled) < cap and not running[0].is_prefill:
            seq = running.popleft()
            while not bm.can_append(seq):
                victim = ordering.decode_victim(running, seq, self.by_priority)  # fcfs: the tail
                if victim is not None:
                    self._preempt(victim)
                else:
                    self._preempt(seq)
                    break
            else:
                block_id = bm.may_append(seq)
                if block_id != -1:
                    t.append_block(seq.slot, block_id)
                    if self.grouped:
                        t.append_group_blocks(seq.slot, bm.tables(seq))
                scheduled.append(seq)
        running.extendleft(reversed(scheduled))
        return self._batch(scheduled, False, num_decodes=len(scheduled))

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence (removing it from ``running``)."""
        assert seq.status is RUNNING, f"preempt() of a {seq.status.name} sequence"
        self.running.remove(seq)
        self._preempt(seq)
        self._dropped_in_flight = True

    def _preempt(self, seq: Sequence) -> None:
        """The seed's four actions, for a sequence already taken out of ``running``."""
        seq.status = WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.table.release(seq)
        self.waiting.appendleft(seq)
        if self._prefilling is seq:
            self._prefilling = None
        self.num_preemptions += 1

    def _sync_rows(self, seq: Sequence) -> None:
        """With groups, after a step: hash ``seq``'s full blocks and free those that left a
        sliding window (``hash_blocks``); its slot rows follow when anything was dropped."""
        bm = self.block_manager
        if bm.hash_blocks(seq) and seq.slot != -1:
            self.table.set_group_blocks(seq.slot, bm.tables(seq))

    # ---- finishing -----------------------------------------------------------------------
    def finish(self, seq_or_request_id: Sequence | str, reason: str = "stop") -> bool:
        """Finish an unfinished request now (e.g. a stop string matched) and free its blocks.

        Returns False when the request is unknown or already finished (nothing changes).
        """
        if reason not in FINISH_REASONS:
            raise InvalidFieldError("finish_reason", f"must be one of {FINISH_REASONS}, got {reason!r}")
        if isinstance(seq_or_request_id, Sequence):
            seq = seq_or_request_id
            if self._requests.get(seq.request_id) is not seq:
                return False
        else:
            seq = self._requests.get(seq_or_request_id)
            if seq is None:
                return False
        self._dropped_in_flight = True
        self._finish_many([(seq, reason)])
        return True

    def truncate_finished(self, seq: Sequence, num_completion_tokens: int) -> None:
        """Drop the tokens of a finished sequence after its first ``num_completion_tokens``
        (a stop string completed inside a run of accepted drafts). Its blocks are already
        free; blocks it filled stay valid in the prefix cache (their KV is of accepted tokens)."""
        assert seq.is_finished, "truncate_finished() of an unfinished sequence"
        end = seq.num_prompt_tokens + num_completion_tokens
        self.decode_tokens -= max(len(seq.token_ids) - end, 0)
        del seq.token_ids[end:]

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if unknown or already finished."""
        return self.finish(request_id, "abort")

    def _finish_many(self, items: list[tuple[Sequence, str]]) -> None:
        if not items:
            return
        bm, t = self.block_manager, self.table
        left_running = 0
        for seq, reason in items:
            self._num_logprob_seqs -= seq.sampling_params.logprobs is not None
            held = seq.grammar is not None and self.grammars.finished(seq)  # compiling, or failed
            was = seq.status
            seq.status = FINISHED
            seq.finish_reason = reason
            del self._requests[seq.request_id]
            if seq.deadline is not None:
                self._deadlines.finished()
            if was is RUNNING:
                bm.deallocate(seq)
                t.release(seq)
                left_running += 1
                if self._prefilling is seq:
                    self._prefilling = None
            elif was is LOADING:
                if seq in self.loading:
                    del self.loading[seq]
                    if self.kv_tiers.request_finished(seq):
                        self._orphans[seq] = None  # freed when its load is done
                        continue
                else:
                    self.ready.remove(seq)
                bm.deallocate(seq)
            elif not held:
                self.waiting.remove(seq)
        if left_running == 1 and len(items) == 1:
            self.running.remove(items[0][0])
        elif left_running:
            self.running.replace([s for s in self.running if s.status is RUNNING])

    def expire(self, now: float) -> list[Sequence]:
        """Finish every unfinished request whose deadline is at or before ``now`` with
        "timeout" (blocks freed, whatever its state); returns them. Call between steps."""
        seqs = self._deadlines.expired(now)
        if seqs:
            self._dropped_in_flight = True
            self._finish_many([(seq, "timeout") for seq in seqs])
            self.num_timed_out += len(seqs)
        return seqs

    # ---- plans, cache ---------------------------------------------------------------------
    def build_plan(self, batch: ScheduledBatch) -> StepPlan:
        """The StepPlan of ``batch``, carrying the KV tiers' commands (args["kv"]) if any."""
        plan = build_plan(batch, self.block_size)
        if self.kv_tiers is not None:
            meta = self.kv_tiers.build_connector_meta()
            if meta:
                plan.args = {**plan.args, "kv": meta}
        return plan

    def build_sample_plan(self, batch: ScheduledBatch, plan: StepPlan) -> SamplePlan:
        """The logits controls of ``batch``'s sample rows (after ``build_plan``)."""
        seqs = batch.sampled_seqs()
        ks = [s.sampling_params.logprobs for s in seqs if s.sampling_params.logprobs is not None] \
            if self._num_logprob_seqs else ()
        sample = build_sample_plan(seqs, batch.slots[self._sample_rows(batch)], batch.sample_rows,
                                   self.table, max(ks, default=-1), self.vocab_size,
                                   batch.sample_drafts())
        if batch.pool_spans:  # pooling rows (rank 0 pools them: sample_plan.py)
            sample.pool_starts, sample.pool_ends = batch.pool_rows
            sample.pool_scores = any(seq.pooling == "SCORE" for seq, _ in batch.pool_spans)
        if batch.prompt_logprobs:
            sample.prompt_targets = batch.prompt_logprob_targets
            sample.num_prompt_logprobs = max(s.sampling_params.prompt_logprobs for s, _, _ in batch.prompt_logprobs)
        return sample

    @staticmethod
    def _sample_rows(batch: ScheduledBatch) -> np.ndarray | slice:
        """Indices into ``batch.slots`` of the sampled sequences, in sample order."""
        if not batch.is_prefill:
            return slice(None)
        nd = batch.num_decodes
        return np.concatenate((np.arange(nd), nd + np.flatnonzero(np.asarray(batch.sampled, dtype=bool))))

    def reset_prefix_cache(self) -> bool:
        """Forget the free cached blocks and the KV tiers' entries (the weights changed)."""
        if self.kv_tiers is not None:
            self.kv_tiers.clear()
        return self.block_manager.reset_prefix_cache()

    def _stop_ids(self, seq: Sequence) -> list[int]:
        sp = seq.sampling_params
        ids = [] if sp.ignore_eos else list(self.eos_token_ids)
        return ids + [t for t in sp.stop_token_ids if t not in ids]

    def _stop_len(self, seq: Sequence) -> int:
        limit = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return limit
