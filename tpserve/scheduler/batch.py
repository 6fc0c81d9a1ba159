"""ScheduledBatch: what one engine step runs, as ``Scheduler.schedule()`` chose it (decode rows
first, then prefill rows; draft tokens of speculative decoding), read by the plan builder, the
sample-plan builder and ``Scheduler.postprocess``."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tpserve.scheduler.plan_builder import SlotTable
from tpserve.scheduler.sequence import Sequence


@dataclass
class ScheduledBatch:
    """What one step runs. ``seqs`` in plan order; ``slots[i]`` is ``seqs[i].slot``.

    The first ``num_decodes`` sequences are decode rows (one new token each, always sampled);
    the rest are prefill rows, and ``sampled[j]`` says whether ``seqs[num_decodes + j]`` gets a
    token this step (only when its last prompt token is computed). ``is_prefill`` is True when
    there is any prefill row: a pure decode batch and a mixed one differ only in that.
    ``drafts`` (speculative decoding; None when the step has none) holds the draft tokens of
    each decode row, ``[]`` for rows without; rows with drafts come after those without, and a
    row with k drafts has k + 1 sample rows. Falsy when empty.
    """

    seqs: list[Sequence]
    is_prefill: bool
    slots: np.ndarray
    table: SlotTable
    step_id: int = 0
    sampled: list[bool] = field(default_factory=list)
    num_decodes: int = 0
    # Decode rows' token_ids lists, in batch order (saves a lookup each), or None.
    token_lists: list | None = None
    # Names the decode slot set for SlotTable.constant_arrays (None: not cacheable).
    slots_key: object = None
    # Prompt log-probabilities computed this step: (seq, first target position, count) in
    # StepPlan.logprob_rows order, and the target token of each row (set by build_plan).
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprob_targets: np.ndarray | None = None
    drafts: list[list[int]] | None = None
    # The per-row arrays of the step's SamplePlan (temperatures, top_ks, top_ps, seeds,
    # steps), in sample-row order (set by build_plan).
    sample_rows: dict | None = None
    # Pooling rows of this step (--runner pooling; set by build_plan): (seq, its chunk starts
    # the prompt) per span, and the spans' [start, end) hidden rows (int32 arrays).
    pool_spans: list = field(default_factory=list)
    pool_rows: tuple | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts)) if self.drafts else 0

    @property
    def num_samples(self) -> int:
        """Sample rows: one per sampled sequence, plus one per draft token."""
        return self.num_decodes + sum(self.sampled) + self.num_draft_tokens

    def sample_drafts(self) -> list[list[int]] | None:
        """The drafts of each sampled sequence (sampled_seqs order), or None without drafts."""
        if not self.drafts:
            return None
        return self.drafts + [[] for s in self.sampled if s]

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that get a token this step, in sample-row order."""
        if not self.is_prefill:
            return self.seqs
        nd = self.num_decodes  # decode rows come first and are always sampled
        return self.seqs[:nd] + [s for s, sampled in zip(self.seqs[nd:], self.sampled) if sampled]

    @property
    def num_tokens(self) -> int:
        return (self.num_decodes + self.num_draft_tokens
                + sum(s.num_scheduled_tokens for s in self.seqs[self.num_decodes:]))
