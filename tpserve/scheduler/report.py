"""What the scheduler reports about itself: its counters (``stats``), the prompt tokens it has
admitted but not computed, and its invariants (``check_integrity``, for tests and debugging:
the block pool's, then the queues', slots' and KV-tier loads' consistency).

The Scheduler's half (a mixin) reading its queues, ``table``, ``block_manager`` and counters.
"""
from __future__ import annotations

from tpserve.scheduler.sequence import SequenceStatus

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
LOADING = SequenceStatus.LOADING


class SchedulerReport:
    """The Scheduler's counters and invariants (a mixin)."""

    @property
    def kv_blocks_used(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def kv_blocks_total(self) -> int:
        return self.block_manager.num_blocks

    def stats(self) -> dict:
        """Counters since construction. ``prompt_tokens_computed`` counts prefill tokens run
        (recomputation after preemption included); ``prefix_cache_hit_tokens`` the prompt
        tokens whose KV came from the cache at admission."""
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "decode_tokens": self.decode_tokens,
            "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_total": self.kv_blocks_total,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            **(self.speculator.stats() if self.speculator is not None else {}),
            "scheduling_order": "priority" if self.by_priority else "fcfs",
            "num_priority_preemptions": self.num_priority_preemptions,
            "num_timed_out": self.num_timed_out,
            "max_waiting_requests": self.max_waiting_requests,
            "max_waiting_tokens": self.max_waiting_tokens,
            **({"kv_offload_loading": len(self.loading), **self.kv_tiers.stats()}
               if self.kv_tiers is not None else {}),
        }

    def num_waiting_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed: the waiting queue's (prefix-cache hits
        not yet known) plus what the partial prefill has left."""
        left = self.waiting.num_tokens
        if self._prefilling is not None:
            left += len(self._prefilling.token_ids) - self._prefilling.num_cached_tokens
        return left

    def check_integrity(self) -> None:
        """Block-pool invariants plus queue/slot consistency; raises AssertionError.

        Meant for between steps (after ``postprocess``, before the next ``schedule``)."""
        bm, t, bs = self.block_manager, self.table, self.block_size
        bm.check_integrity()
        assert len(self.running) <= self.max_num_seqs, "more running sequences than max_num_seqs"
        ids = ([s.request_id for s in self.running] + [s.request_id for s in self.waiting]
               + [s.request_id for s in self.grammars.compiling]
               + [s.request_id for s in self.loading] + [s.request_id for s in self.ready])
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        assert set(ids) == set(self._requests), "queues and request index disagree"
        holders = [*self.running, *self.loading, *self.ready, *self._orphans]
        assert set(map(id, holders)) == set(map(id, bm.live_sequences())), \
            "running, loading, ready and orphaned loads != sequences holding blocks"
        assert len(self.running) + len(self.loading) + len(self.ready) <= self.max_num_seqs, \
            "more running and loading sequences than max_num_seqs"
        for s in (*self.loading, *self.ready, *self._orphans):
            assert s.slot == -1 and len(s.block_table) == s.num_blocks, f"{s!r} loading"
            assert (s.status is LOADING) != (s in self._orphans), f"{s!r}: status {s.status.name}"
        if self.kv_tiers is not None:
            loading = {id(j.seq) for j in self.kv_tiers.jobs.values()}
            assert loading == set(map(id, self.loading)) | set(map(id, self._orphans)), \
                "loading sequences differ from the loads in flight"
            self.kv_tiers.check_integrity(bm, holders)
        partial = [s for s in self.running if s.is_prefill]
        assert partial == ([self._prefilling] if self._prefilling is not None else []), \
            f"unexpected partial prefills {partial}"
        assert not partial or self.running[-1] is partial[0], "the partial prefill is not the tail"
        slots = [s.slot for s in self.running]
        assert len(set(slots)) == len(slots) and all(0 <= x < t.num_slots for x in slots)
        assert t.num_free_slots + len(slots) == t.num_slots, "slot leak"
        for s in self.running:
            assert s.status is RUNNING, f"{s!r} in running"
            # A decoding sequence gets the block for its last token when scheduled.
            lo = -(-(len(s) - (0 if s.is_prefill else 1)) // bs)
            hi = -(-len(s) // bs)
            assert lo <= len(s.block_table) <= hi, \
                f"{s!r}: {len(s.block_table)} blocks for {len(s)} tokens"
            row = t.block_tables[s.slot]
            n = t.num_blocks[s.slot]
            assert n == len(s.block_table) and row[:n].tolist() == s.block_table and (row[n:] == -1).all(), \
                f"{s!r}: slot row {row[:n + 1].tolist()} differs from its block table"
            for g, table in enumerate(bm.tables(s)[1:]):
                grow = t.group_tables[g, s.slot]
                assert grow[:n].tolist() == table and (grow[n:] == -1).all(), \
                    f"{s!r}: group {g + 1}'s slot row {grow[:n + 1].tolist()} differs from its table"
            if not s.is_prefill:
                assert t.seq_lens[s.slot] == len(s) and t.last_tokens[s.slot] == s.last_token, \
                    f"{s!r}: slot length/last token out of date"
        for s in self.waiting:
            assert s.status is WAITING and not s.block_table and s.slot == -1, f"{s!r} in waiting"
            assert s.num_cached_tokens == 0 and s.is_prefill, f"{s!r} in waiting"
        w = self.waiting
        assert w.num_tokens == sum(len(s) for s in w) and len(w) == len(list(w)), "waiting queue counts"
        if self.by_priority:
            prios = [s.priority for s in w]
            assert prios == sorted(prios), f"waiting out of priority order: {prios}"
        live = sum(s.deadline is not None for s in self._requests.values())
        assert self._deadlines.live == live, f"{self._deadlines.live} deadlines for {live} requests"
