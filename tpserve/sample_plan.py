"""SamplePlan: every control of one step's sample rows, for the sampling rank; StepOutput.

The scheduler side builds it with numpy (``scheduler/plan_builder.py`` the per-row basics,
``scheduler/sample_inputs.py`` the rest); only rank 0, which gathers the logits and samples,
reads it, through one call: ``Sampler.sample(logits, plan)``. It is never published to the
other ranks, whose forward needs only ``StepPlan.logits_indices``. Row i is the step's sample
row i (``StepPlan.logits_indices[i]``); token ids are below the vocabulary.

Every row has (S = sample rows):

    temperatures        float32 [S] 0 = greedy
    top_ks              int32 [S]   <= 0 = disabled
    top_ps              float32 [S] 1.0 = disabled
    seeds               int64 [S]   the request's seed of the counter-based race
    steps               int32 [S]   index of the token being sampled within its request's output
                        (the race's counter; min_tokens counts it)

Every other part is optional: a step whose requests use no other control leaves them None and
the sampler runs its plain path.

    num_logprobs        the most logprobs alternatives any sample row asks for (-1: none)
    logprob_ranks       with logprobs or prompt logprobs: also each token's vocab rank (one more
                        pass over the vocabulary; the offline API asks, the daemon does not)
    bias_rows/tokens/values   int32/int32/float32 [N]: logits[row, token] += value
    allow_rows          int32 [A] rows that keep only an allowed set of tokens;
    allow_index/tokens  int32 [M]: (index into allow_rows, token) pairs of those sets
    ban_rows/tokens     int32 [K]: logits[row, token] = -inf (bad words, min_tokens)
    penalty_rows        int32 [P] rows with a repetition, frequency or presence penalty, and
    penalty_slots       int32 [P] the scheduler slot keying each one's token counts;
    repetition/frequency/presence  float32 [P] their penalties
    penalty_draft_index/tokens  int32 [E]: (index into penalty_rows, token) pairs: that row
                        counts one more output occurrence of the token (the drafts before a
                        draft position, speculative decoding); the slot's counts are unchanged
    init_slots          int32 [I] slots whose counts start over this step (a new request, or
                        one readmitted after preemption), with its tokens so far:
    init_cu             int32 [I+1] prefix sums into init_tokens
    init_prompt_lens    int32 [I] how many of them are prompt tokens (the rest are output)
    init_tokens         int32 [sum]
    min_p_rows/min_ps   int32/float32 [R]: rows with min-p filtering
    mask_rows           int32 [G] rows constrained by a token bitmask, and
    bitmask             int32 [G, ceil(V / 32)]: bit t of a row set = token t allowed; it may
                        still be filled on a thread while the forward runs: ``wait_bitmask()``
                        (the sampler's call before it reads it) returns once it is written
    prompt_targets      int32 [L] for each row of ``StepPlan.logprob_rows``, the prompt token
                        whose log-probability that row gives
    num_prompt_logprobs the most alternatives any prompt-logprobs row asks for
    draft_counts        int32 [Q] speculative decoding: per sampled sequence (in sample order),
                        its number of draft tokens k; its k + 1 sample rows are consecutive, row
                        j sampling the token after the first j drafts (row controls above are
                        per row, as if those drafts were accepted)
    draft_tokens        int32 [sum k] the drafts, sequence after sequence
    pool_starts/ends    int32 [P] --runner pooling: span p pools hidden rows [start, end)
                        (summed in float32; never sampled, no LM head), and
    pool_scores         the spans also go through the score head (classify)

The per-row arrays of a decode step over an unchanged running set may be the same read-only
arrays step after step (``SlotTable.row_controls``): read them, never write.

Speculative decoding and a token bitmask (structured output): each draft position would need
its own row of ``bitmask``, computed by advancing the grammar over the drafts before it; rows
are per sample row, so the layout holds it, but no builder produces it yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


def _i32(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.int32)


def _f32(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


# The per-row arrays every sample row has, and their dtypes.
ROW_FIELDS: dict[str, np.dtype] = {
    "temperatures": np.dtype(np.float32),
    "top_ks": np.dtype(np.int32),
    "top_ps": np.dtype(np.float32),
    "seeds": np.dtype(np.int64),
    "steps": np.dtype(np.int32),
}


@dataclass(slots=True)  # built every step: slots make its 35 fields cheaper to set
class SamplePlan:
    temperatures: np.ndarray = field(default_factory=_f32)
    top_ks: np.ndarray = field(default_factory=_i32)
    top_ps: np.ndarray = field(default_factory=_f32)
    seeds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    steps: np.ndarray = field(default_factory=_i32)
    num_logprobs: int = -1
    logprob_ranks: bool = False
    bias_rows: np.ndarray | None = None
    bias_tokens: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    allow_rows: np.ndarray | None = None
    allow_index: np.ndarray | None = None
    allow_tokens: np.ndarray | None = None
    ban_rows: np.ndarray | None = None
    ban_tokens: np.ndarray | None = None
    penalty_rows: np.ndarray | None = None
    penalty_slots: np.ndarray | None = None
    repetition: np.ndarray | None = None
    frequency: np.ndarray | None = None
    presence: np.ndarray | None = None
    init_slots: np.ndarray | None = None
    init_cu: np.ndarray | None = None
    init_prompt_lens: np.ndarray | None = None
    init_tokens: np.ndarray | None = None
    min_p_rows: np.ndarray | None = None
    min_ps: np.ndarray | None = None
    mask_rows: np.ndarray | None = None
    bitmask: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    num_prompt_logprobs: int = 0
    penalty_draft_index: np.ndarray | None = None
    penalty_draft_tokens: np.ndarray | None = None
    draft_counts: np.ndarray | None = None
    draft_tokens: np.ndarray | None = None
    pool_starts: np.ndarray | None = None
    pool_ends: np.ndarray | None = None
    pool_scores: bool = False
    bitmask_pending: object = None  # a concurrent.futures.Future filling ``bitmask``, or None

    @classmethod
    def rows(cls, temperatures, top_ks=-1, top_ps=1.0, seeds=0, steps=0, **controls) -> "SamplePlan":
        """A plan for ``len(temperatures)`` rows; the other per-row values may be scalars
        (the same for every row) or sequences; ``controls``: any other field."""
        temps = np.asarray(temperatures, dtype=np.float32).reshape(-1)
        n = len(temps)

        def col(v, name):
            return np.broadcast_to(np.asarray(v, dtype=ROW_FIELDS[name]), (n,)).copy()

        return cls(temperatures=temps, top_ks=col(top_ks, "top_ks"), top_ps=col(top_ps, "top_ps"),
                   seeds=col(seeds, "seeds"), steps=col(steps, "steps"), **controls)

    @classmethod
    def greedy(cls, n: int) -> "SamplePlan":
        """``n`` greedy rows, no other control."""
        return cls.rows(np.zeros(n, np.float32))

    @property
    def num_samples(self) -> int:
        return int(self.temperatures.shape[0])

    def wait_bitmask(self) -> None:
        """Block until ``bitmask`` is written (re-raising what its filling raised)."""
        if self.bitmask_pending is not None:
            self.bitmask_pending.result()
            self.bitmask_pending = None

    @property
    def processes_logits(self) -> bool:
        """True when the logits are changed before sampling (anything but logprobs)."""
        return (self.bias_rows is not None or self.allow_rows is not None or self.ban_rows is not None
                or self.penalty_rows is not None or self.min_p_rows is not None
                or self.mask_rows is not None)

    @property
    def can_leave_no_token(self) -> bool:
        """Only masks (allowed tokens, bans, a bitmask) can leave a row nothing to sample."""
        return self.allow_rows is not None or self.ban_rows is not None or self.mask_rows is not None

    def check(self, num_samples: int, vocab_size: int) -> None:
        """Internal consistency (shapes, rows and tokens in range); raises AssertionError."""
        for name, dtype in ROW_FIELDS.items():
            v = getattr(self, name)
            assert v.dtype == dtype and v.shape == (num_samples,), f"{name}: {v.dtype} {v.shape}"
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray) and f.name not in ROW_FIELDS:
                assert v.dtype in (np.int32, np.float32), f"{f.name}: dtype {v.dtype}"
        pairs = [("bias_rows", "bias_tokens"), ("ban_rows", "ban_tokens")]
        for rows, toks in pairs:
            r, t = getattr(self, rows), getattr(self, toks)
            if r is not None:
                assert r.shape == t.shape and (r.size == 0 or (0 <= r.min() and r.max() < num_samples))
                assert t.size == 0 or (0 <= t.min() and t.max() < vocab_size), f"{toks} out of the vocabulary"
        if self.penalty_rows is not None:
            n = len(self.penalty_rows)
            assert all(len(a) == n for a in (self.penalty_slots, self.repetition, self.frequency, self.presence))
        if self.init_slots is not None:
            assert len(self.init_cu) == len(self.init_slots) + 1 and self.init_cu[-1] == len(self.init_tokens)
        if self.mask_rows is not None:
            assert self.bitmask.shape == (len(self.mask_rows), -(-vocab_size // 32))
        if self.penalty_draft_index is not None:
            i = self.penalty_draft_index
            assert self.penalty_rows is not None and i.shape == self.penalty_draft_tokens.shape
            assert i.size == 0 or (0 <= i.min() and i.max() < len(self.penalty_rows))
        if self.draft_counts is not None:
            assert int((self.draft_counts + 1).sum()) == num_samples, "draft rows != sample rows"
            assert len(self.draft_tokens) == int(self.draft_counts.sum())


@dataclass
class StepOutput:
    """What rank 0's runner returns for one step (numpy arrays).

    tokens            int64 [S] the sampled token of each sample row; -1 where the logits
                      controls left no token to sample
    accepted          with SamplePlan.draft_counts: int32 [Q] how many of each sampled
                      sequence's rows it keeps (accepted drafts + 1): its tokens are the first
                      ``accepted[i]`` of its rows (``kept_rows``); None: one row each
    logprobs          with SamplePlan.num_logprobs k >= 0: (float32 [S] the sampled tokens'
                      log-probabilities, int64 [S, k] the k best token ids, float32 [S, k] theirs,
                      int32 [S] the sampled tokens' 1-based ranks, or None without
                      SamplePlan.logprob_ranks)
    prompt_logprobs   with StepPlan.logprob_rows: (float32 [L] the targets' log-probabilities,
                      int64 [L, k], float32 [L, k], int32 [L] the targets' ranks or None) with
                      k = SamplePlan.num_prompt_logprobs
    pooled            with SamplePlan.pool_starts: float32 [P, hidden] each span's rows summed
    scores            with SamplePlan.pool_scores: float32 [P, labels] the score head of ``pooled``
    kv                with KV-tier polls in the plan: {job id: [1/0 per block]} of the loads
                      finished on every rank (tpserve/workers/kv_transfer.py)
    """

    tokens: np.ndarray
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    accepted: np.ndarray | None = None
    pooled: np.ndarray | None = None
    scores: np.ndarray | None = None
    kv: dict | None = None


def draft_row_positions(draft_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sequences with ``draft_counts[i]`` drafts each (k + 1 consecutive sample rows):
    the sequence of every row and the row's position j within its sequence."""
    rows = np.asarray(draft_counts, dtype=np.int64) + 1
    seq = np.repeat(np.arange(len(rows)), rows)
    return seq, np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)


def kept_rows(draft_counts: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """bool [S]: the sample rows whose tokens their sequences keep."""
    seq, j = draft_row_positions(draft_counts)
    return j < np.asarray(accepted)[seq]
