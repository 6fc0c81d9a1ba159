"""Postprocess: one step's sampled tokens applied to its sequences, under one finish rule.

``Scheduler.postprocess`` (this mixin's half of the Scheduler) advances prefill progress,
appends tokens, enters blocks that became full into the prefix cache and finishes sequences.
Every kind of row ends by the same rule (``_ends``): a constrained row's grammar decides first
("stop" once complete, "error" when it has no continuation: grammar_gate.py), then a stop token
(EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends it with "stop", then reaching its
length limit (prompt + ``max_tokens``, or ``max_model_len``) with "length". Decode rows check
it vectorized over the batch (O(batch) in numpy: lengths, last tokens and stop ids are per-slot
arrays of the SlotTable); the first token after a prefill goes through the same call; a decode
row that verified drafts keeps its run up to the first token the rule ends it at (a
constrained request never has drafts) and gives back the blocks reserved past it. A pooling
sequence (--runner pooling) gets no token: it ends "stop" once its whole prompt is computed,
its full blocks hashed into the prefix cache first (they outlive it there, evictable).

The mixin reads the scheduler's ``table``, ``block_manager``, ``block_size``, ``grammars``,
``speculator`` and ``_dropped_in_flight``, counts ``decode_tokens``, and finishes sequences
through ``_finish_many``.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from tpserve.scheduler.batch import ScheduledBatch
from tpserve.scheduler.sample_inputs import GRAMMAR
from tpserve.scheduler.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


class Postprocess:
    """The results half of Scheduler (see the module)."""

    def postprocess(self, batch: ScheduledBatch, token_ids, counts=None) -> list[Sequence]:
        """Apply one step's sampled tokens (one per sampled sequence, in batch order).

        Advances prefill progress, appends tokens, enters blocks that became full into the
        prefix cache, and finishes sequences by the finish rule (``_ends``: grammar, stop token,
        length limit; their blocks are freed). Returns the sequences that received a token,
        finished ones included. One batch is in flight at a time: call it once per
        ``schedule()``, before the next. Sequences aborted, finished or preempted while the
        batch ran are skipped.

        With drafts (``batch.drafts``), ``counts[i]`` is how many tokens the i-th sampled
        sequence keeps (its accepted drafts plus one; ``token_ids`` holds them back to back);
        a run is cut after the first token that ends it.
        """
        if not batch.seqs:
            return []
        toks = np.asarray(token_ids).reshape(-1)
        nd = batch.num_decodes
        if batch.drafts:
            return self._postprocess_speculative(batch, toks, np.asarray(counts).reshape(-1))
        assert counts is None or (np.asarray(counts) == 1).all(), "several tokens without drafts"
        assert len(toks) == batch.num_samples, \
            f"got {len(toks)} tokens for {batch.num_samples} sampled sequences"
        if not batch.is_prefill:
            return self._postprocess_decode(batch.seqs, batch.slots, toks, batch.token_lists)
        out = self._postprocess_decode(batch.seqs[:nd], batch.slots[:nd], toks[:nd],
                                       batch.token_lists) if nd else []
        return out + self._postprocess_prefill(batch.seqs[nd:], batch.sampled, toks[nd:])

    def _end_rows(self, slots: np.ndarray, toks: np.ndarray,
                  lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The finish rule without grammars, for rows of sampled tokens: ``toks[i]`` was
        appended to the sequence of ``slots[i]``, whose length is now ``lens[i]``. Returns (the
        rows that end, which rows' token is a stop token): a stop token (EOS unless ignore_eos,
        or one of stop_token_ids) ends with "stop", else reaching the length limit (prompt +
        max_tokens, or max_model_len) with "length"."""
        t = self.table
        stop = t.stop_hits(slots, toks)
        return np.flatnonzero(stop | (lens >= t.stop_lens[slots])), stop

    def _ends(self, seqs: list[Sequence], slots: np.ndarray, toks: np.ndarray,
              lens: np.ndarray) -> list[tuple[Sequence, str]]:
        """The finish rule of every kind of row (decode, the first token after a prefill): a
        constrained row's grammar decides first ("stop" once complete, "error" if it has no
        continuation: grammar_gate.py), then ``_end_rows``. (seq, reason) in row order."""
        rows, stop = self._end_rows(slots, toks, lens)
        by_grammar = None
        if self.grammars.num_seqs:
            constrained = np.flatnonzero(self.table.controls.flags[slots] & GRAMMAR).tolist()
            if constrained:
                reasons = self.grammars.advance([seqs[p] for p in constrained], toks[constrained].tolist())
                by_grammar = {p: r for p, r in zip(constrained, reasons) if r is not None}
        if not by_grammar:
            if not len(rows):
                return []
            stop_list = stop.tolist()
            return [(seqs[p], "stop" if stop_list[p] else "length") for p in rows.tolist()]
        stop_list = stop.tolist()
        return [(seqs[p], by_grammar.get(p) or ("stop" if stop_list[p] else "length"))
                for p in sorted(set(rows.tolist()) | set(by_grammar))]

    def _postprocess_decode(self, seqs: list[Sequence], slots: np.ndarray, toks: np.ndarray,
                            token_lists: list | None) -> list[Sequence]:
        if self._dropped_in_flight:
            keep = np.fromiter((s.status is RUNNING for s in seqs), dtype=bool, count=len(seqs))
            seqs = [s for s, k in zip(seqs, keep.tolist()) if k]
            slots, toks = slots[keep], toks[keep]
            token_lists = None
        if token_lists is None:
            token_lists = [s.token_ids for s in seqs]
        t, bm = self.table, self.block_manager
        toks32 = toks.astype(np.int32, copy=False)
        lens = t.seq_lens[slots] + 1
        t.seq_lens[slots] = lens
        t.last_tokens[slots] = toks32
        # Append each token to its sequence without a Python-level loop body.
        deque(map(list.append, token_lists, toks.tolist()), maxlen=0)
        self.decode_tokens += len(seqs)
        if self.grouped:  # windows move every step
            for seq in seqs:
                self._sync_rows(seq)
        elif bm.enable_prefix_caching:
            # A block became full exactly when the KV just written ended it.
            for p in np.flatnonzero((lens - 1) % self.block_size == 0).tolist():
                bm.hash_blocks(seqs[p])
        done = self._ends(seqs, slots, toks32, lens)
        if done:
            self._finish_many(done)
        return seqs

    def _postprocess_prefill(self, seqs: list[Sequence], sampled_flags: list[bool],
                             toks: np.ndarray) -> list[Sequence]:
        bm, t = self.block_manager, self.table
        out: list[Sequence] = []
        first: list[Sequence] = []  # those that got their first token
        done: list[tuple[Sequence, str]] = []
        tok_list = toks.tolist()
        ti = 0
        for seq, sampled in zip(seqs, sampled_flags):
            if sampled:
                tok = tok_list[ti]
                ti += 1
            if seq.status is not RUNNING:  # aborted while the step ran
                continue
            seq.num_cached_tokens = seq.num_cached_tokens + seq.num_scheduled_tokens
            if seq.pooling is not None:  # pooled, never sampled: done once its prompt is
                if seq.num_cached_tokens == len(seq.token_ids):
                    done.append((seq, "stop"))
                    out.append(seq)
                if self.grouped:
                    self._sync_rows(seq)
                else:
                    bm.hash_blocks(seq)
                continue
            if sampled and seq.sampling_params.max_tokens == 0:  # score the prompt only
                done.append((seq, "length"))
            elif sampled:
                seq.token_ids.append(tok)
                seq.start_decoding()
                t.start_decoding(seq)
                first.append(seq)
            if self.grouped:
                self._sync_rows(seq)
            else:
                bm.hash_blocks(seq)
            if sampled:
                out.append(seq)
        if first:  # their first token, under the one finish rule
            slots = np.fromiter((s.slot for s in first), dtype=np.intp, count=len(first))
            done += self._ends(first, slots, t.last_tokens[slots], t.seq_lens[slots])
        self._finish_many(done)
        return out

    def _postprocess_speculative(self, batch: ScheduledBatch, toks: np.ndarray,
                                 counts: np.ndarray) -> list[Sequence]:
        nd, drafts = batch.num_decodes, batch.drafts
        assert len(counts) == len(batch.sampled_seqs()) and len(toks) == counts.sum() \
            and (counts >= 1).all(), "token counts do not match the sampled sequences"
        n0 = next(i for i, d in enumerate(drafts) if d)  # rows with drafts follow those without
        assert (counts[:n0] == 1).all() and (counts[nd:] == 1).all()
        end = n0 + int(counts[n0:nd].sum())
        out = self._postprocess_decode(batch.seqs[:n0], batch.slots[:n0], toks[:n0],
                                       batch.token_lists[:n0] if batch.token_lists else None) if n0 else []
        out += self._postprocess_runs(batch.seqs[n0:nd], batch.slots[n0:nd], drafts[n0:],
                                      toks[n0:end], counts[n0:nd])
        if batch.is_prefill:
            out += self._postprocess_prefill(batch.seqs[nd:], batch.sampled, toks[end:])
        return out

    def _postprocess_runs(self, seqs: list[Sequence], slots: np.ndarray, drafts: list[list[int]],
                          toks: np.ndarray, counts: np.ndarray) -> list[Sequence]:
        """Decode rows that verified drafts: append each kept run up to its first token that
        ends it (``_end_rows``; a constrained request never has drafts), give back the blocks
        reserved past it, hash the blocks it filled."""
        bm, t, bs = self.block_manager, self.table, self.block_size
        # Every kept token as a row: its slot and the sequence's length once it is appended.
        starts = np.cumsum(counts) - counts
        offsets = np.arange(len(toks)) - np.repeat(starts, counts)
        rows, stop = self._end_rows(np.repeat(slots, counts), toks.astype(np.int32, copy=False),
                                    np.repeat(t.seq_lens[slots], counts) + 1 + offsets)
        cut = counts.tolist()  # tokens kept per run, and why it ends
        reason: list[str | None] = [None] * len(seqs)
        owner = np.repeat(np.arange(len(seqs)), counts)
        for r in rows.tolist():
            i = int(owner[r])
            if reason[i] is None:
                reason[i], cut[i] = "stop" if stop[r] else "length", int(offsets[r]) + 1
        out: list[Sequence] = []
        done: list[tuple[Sequence, str]] = []
        tok_list, start_list, slot_list = toks.tolist(), starts.tolist(), slots.tolist()
        for i, (seq, d) in enumerate(zip(seqs, drafts)):
            self.speculator.record(len(d), int(counts[i]) - 1)
            if seq.status is not RUNNING:  # aborted, finished or preempted while the step ran
                continue
            slot, tokens = slot_list[i], seq.token_ids
            tokens.extend(tok_list[start_list[i]:start_list[i] + cut[i]])
            n = len(tokens)
            self.decode_tokens += n - int(t.seq_lens[slot])
            t.seq_lens[slot], t.last_tokens[slot] = n, tokens[-1]
            keep = -(-(n - 1) // bs)
            if bm.truncate(seq, keep):
                t.truncate_blocks(slot, keep)
            if self.grouped:
                self._sync_rows(seq)
            else:
                bm.hash_blocks(seq)
            out.append(seq)
            if reason[i] is not None:
                done.append((seq, reason[i]))
        self._finish_many(done)
        return out
