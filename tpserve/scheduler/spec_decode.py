"""Speculator: draft tokens for a step's decode rows, their KV slots, and acceptance counters.

Speculative decoding verifies guessed tokens in the forward that computes the next one: a
decode row whose sequence got k drafts has the query ``[last token, d1 .. dk]`` at positions
``len - 1 .. len - 1 + k`` (a prefill-like row group over cached context), and each of its
k + 1 rows is sampled. The sampling rank keeps the drafts that equal its samples and one token
more (workers/rejection.py), so a step appends 1 .. k + 1 tokens to the sequence.

When drafts are added, per step (``Scheduler.schedule``):

1. The decode rows are scheduled exactly as without speculation: the seed's rules, block
   shortage and tail preemption included, for the one token every row needs. With
   ``num_speculative_tokens`` 0 nothing below happens, and with drafts the decisions above are
   the same ones.
2. Prefill rows are scheduled (mixed policy), so admission never waits for drafts.
3. If the step has at most ``disable_by_batch_size`` decode rows, the proposer guesses up to k
   tokens for each, capped by what the request may still generate (a draft never passes
   ``max_tokens`` or ``max_model_len``, so a sequence's KV never exceeds what admission
   checked), by the step's remaining token budget and by the free blocks. Drafts only use
   blocks that are free: a guess never preempts anyone (a victim's recomputation costs far
   more than a draft can win).
4. Decode rows without drafts stay first (the plan's plain decode rows, one query each), the
   rows with drafts follow them, then prefill rows.

After the step (``Scheduler.postprocess``) the sequence's length grows by the tokens kept;
KV written for rejected drafts is simply overwritten later, and the blocks reserved past the
kept tokens are given back (``BlockManager.truncate``), so between steps a decoding sequence
holds exactly the blocks of its tokens, as without speculation, and only accepted tokens'
KV ever enters a hashed block.

Counters (``stats``): drafts (sequence-steps with at least one draft token), draft tokens,
accepted tokens and accepted tokens per draft position, as vLLM counts them; the mean
acceptance length is ``1 + accepted / drafts``.

Grammar-constrained requests (structured output) get no drafts: verifying them would need a
token mask per draft position, each advanced over the drafts before it, and a matcher advanced
speculatively then rolled back. Their rows stay plain decode rows.
"""
from __future__ import annotations

import numpy as np

from tpserve.spec_config import SpeculativeConfig
from tpserve.scheduler.proposer import NgramProposer, Proposer
from tpserve.scheduler.sample_inputs import GRAMMAR


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else \
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def add_drafts(self, batch, budget: int, block_manager, table) -> None:
        """Propose drafts for ``batch``'s decode rows within ``budget`` tokens and the free
        blocks (module docstring, steps 3 and 4); sets ``batch.drafts`` when any is kept."""
        nd = batch.num_decodes
        if budget <= 0 or not self.config.speculates(nd):
            return
        seqs, slots = batch.seqs[:nd], batch.slots[:nd]
        room = table.stop_lens[slots] - table.seq_lens[slots] - 1
        caps = np.minimum(room, self.k)
        controls = table.controls
        if controls.num_controlled:  # no drafts for grammar-constrained requests (docstring)
            caps[(controls.flags[slots] & GRAMMAR) != 0] = 0
        if not (caps > 0).any():
            return
        bm, bs = block_manager, block_manager.block_size
        per = bm.blocks_per_append  # KV-cache groups: a block of the sequence is one per group
        drafts = self.proposer.propose(seqs, caps.tolist())
        kept: list[list[int]] = []
        for seq, slot, d in zip(seqs, slots.tolist(), drafts):
            if d:
                # Tokens the held and free blocks have slots for, from position len - 1 on.
                fits = (len(seq.block_table) + bm.num_free_blocks // per) * bs - (len(seq.token_ids) - 1)
                d = d[:max(min(budget, fits - 1), 0)]
            if d:
                before = len(seq.block_table)
                bm.may_append(seq, 1 + len(d))
                for block_id in seq.block_table[before:]:
                    table.append_block(slot, block_id)
                if per > 1:
                    table.set_group_blocks(slot, bm.tables(seq))
                budget -= len(d)
            kept.append(d or [])
        if not any(kept):
            return
        order = [i for i, d in enumerate(kept) if not d] + [i for i, d in enumerate(kept) if d]
        batch.seqs[:nd] = [seqs[i] for i in order]
        batch.slots = np.concatenate((slots[order], batch.slots[nd:]))
        if batch.token_lists is not None:
            batch.token_lists = [batch.token_lists[i] for i in order]
        batch.slots_key = None  # the slot order is not the running order any more
        batch.drafts = [kept[i] for i in order]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verification: ``num_accepted`` of its ``num_drafts`` drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
