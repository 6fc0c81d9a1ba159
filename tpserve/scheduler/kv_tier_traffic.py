"""KV tiers' traffic through the scheduler (tpserve/kv_tiers): the Scheduler's half that attaches
the tiers, hands each plan their commands and applies rank 0's answers.

Finished loads make their sequences ``ready`` (admitted before anyone waiting), their loaded
blocks counted as cached tokens and hashed into the prefix cache; with KV-cache groups a load
is all or nothing, and a sequence whose load missed a block gives its blocks back and waits at
the front again. A load whose sequence ended meanwhile (an orphan) frees its blocks when it is
done. The mixin reads the scheduler's ``block_manager``, ``block_size``, ``loading``, ``ready``,
``waiting`` and ``_orphans``.
"""
from __future__ import annotations

from tpserve.scheduler.sequence import SequenceStatus

WAITING = SequenceStatus.WAITING


class KvTierTraffic:
    """The Scheduler's KV-tier methods (a mixin; the scheduler sets ``kv_tiers``, None without
    tiers)."""

    def attach_kv_tiers(self, tiers) -> None:
        """Serve prefix misses from ``tiers`` (a KVTierIndex) and save evicted blocks to it."""
        bm = self.block_manager
        tiers.block_manager = bm
        tiers.hash_fn = bm.compute_hash
        bm.offload = tiers
        self.kv_tiers = tiers

    def kv_meta(self, wait: bool = False) -> dict | None:
        """The KV-tier commands for the next plan (None: none); ``wait``: the ranks wait for
        the loads in flight (nothing else is runnable)."""
        return self.kv_tiers.build_connector_meta(wait) if self.kv_tiers is not None else None

    def kv_has_work(self) -> bool:
        return self.kv_tiers is not None and self.kv_tiers.has_work()

    def kv_results(self, results: dict | None) -> None:
        """Apply rank 0's answer to a plan's polls: finished loads make their sequences ready."""
        if self.kv_tiers is None or not results:
            return
        bs = self.block_size
        for job, good in self.kv_tiers.update_connector_output(results):
            seq = job.seq
            if job.orphan:
                self._orphans.pop(seq, None)
                self.block_manager.deallocate(seq)
                continue
            self.loading.pop(seq, None)
            if job.where is not None:  # KV-cache groups: all or nothing (kv_tiers/index.py)
                if good < len(job.items):
                    seq.status = WAITING
                    self.block_manager.deallocate(seq)
                    self.waiting.appendleft(seq)  # admitted again: the blocks missing now miss
                    continue
                good = job.end - job.first
            cached = (job.first + good) * bs
            self.kv_tiers.hit_tokens += good * bs
            seq.num_cached_tokens = cached
            self.block_manager.hash_blocks(seq)
            seq.num_prefix_hit_tokens = cached
            if cached == len(seq):
                cached = len(seq) - 1  # recompute the last token for its logits (as admission)
            seq.num_cached_tokens = cached
            self.ready.append(seq)

    def kv_flush(self) -> None:
        """Before a shutdown: queue the writes that put the cached pool blocks on disk."""
        if self.kv_tiers is not None:
            self.kv_tiers.flush(self.block_manager)
