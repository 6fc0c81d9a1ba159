"""SamplePlan: what the sampling rank does to one step's logits beyond temperature/top-k/top-p.

The scheduler side builds it with numpy next to the StepPlan (``scheduler/sample_inputs.py``);
only rank 0, which gathers the logits and samples, reads it, so it is never published to the
other ranks. Row indices refer to the step's sample rows (``StepPlan.logits_indices``); token
ids are below the vocabulary. Every part is optional: a step whose requests use no control
gets ``SamplePlan()`` and the sampler runs its plain path.

    num_logprobs        the most logprobs alternatives any sample row asks for (-1: none)
    bias_rows/tokens/values   int32/int32/float32 [N]: logits[row, token] += value
    allow_rows          int32 [A] rows that keep only an allowed set of tokens;
    allow_index/tokens  int32 [M]: (index into allow_rows, token) pairs of those sets
    ban_rows/tokens     int32 [K]: logits[row, token] = -inf (bad words, min_tokens)
    penalty_rows        int32 [P] rows with a repetition, frequency or presence penalty, and
    penalty_slots       int32 [P] the scheduler slot keying each one's token counts;
    repetition/frequency/presence  float32 [P] their penalties
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
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


def _i32(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.int32)


def _f32(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


@dataclass
class SamplePlan:
    num_logprobs: int = -1
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
    bitmask_pending: object = None  # a concurrent.futures.Future filling ``bitmask``, or None

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
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
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


@dataclass
class StepOutput:
    """What rank 0's runner returns for one step (numpy arrays).

    tokens            int64 [S] the sampled token of each sample row; -1 where the logits
                      controls left no token to sample
    logprobs          with SamplePlan.num_logprobs k >= 0: (float32 [S] the sampled tokens'
                      log-probabilities, int64 [S, k] the k best token ids, float32 [S, k] theirs)
    prompt_logprobs   with StepPlan.logprob_rows: (float32 [L] the targets' log-probabilities,
                      int64 [L, k], float32 [L, k]) with k = SamplePlan.num_prompt_logprobs
    """

    tokens: np.ndarray
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
