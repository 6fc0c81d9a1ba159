"""Building a step's SamplePlan (every control of its sample rows) on the scheduler side.

The per-row basics (temperature, top-k, top-p, seed, output step) come from the plan builder
(``batch.sample_rows``, gathered from the SlotTable with the StepPlan); this module adds the
rest.

``SlotControls`` keeps, per slot of the ``SlotTable``, the numeric controls of the request that
holds it (min-p, penalties, min_tokens), its logit bias as arrays, and flags saying which sparse
controls it uses (allowed tokens, bad words, whose data stays on the request's SamplingParams
and Sequence). A step's plan is then a gather over the sample rows' slots, plus one short loop
over the rows with allowed tokens or bad words. When no running request uses any control,
building the plan is O(1): the per-row arrays and nothing else.

Rules that belong to the request rather than to the sampler are applied here:

* before ``min_tokens`` completion tokens, the row bans the request's stop ids (EOS unless
  ignore_eos, and stop_token_ids), as vLLM does;
* a bad word of n tokens bans its last token when the request's last n - 1 output tokens are
  its first n - 1 (vLLM's rule: a word is matched within the output);
* a request with ``structured_outputs`` gets its grammar's bitmask of the next allowed tokens
  (``tpserve.grammar``; one batched llguidance call fills every such row, on a thread, while
  the step's forward runs: the sampler waits for it);
* a request's penalty counts start over at its first sampled step after it got its slot
  (``init_*``: its prompt and the output so far, which is what makes preemption exact);
* with draft tokens (speculative decoding) a sequence has a sample row per draft position, and
  each row is controlled as if the drafts before it were accepted: its min_tokens step counts
  them, bad words are matched against the output with them, and penalties count them
  (``penalty_draft_*``, for that row only). A sampled row then gets the token it would get
  without drafts, whenever those drafts are what was generated.
"""
from __future__ import annotations

import numpy as np

from itertools import chain

from tpserve.grammar.matcher import fill_bitmask_async
from tpserve.sample_plan import SamplePlan, draft_row_positions

# Flags of SlotControls.flags.
PENALTY, MIN_P, BIAS, ALLOWED, BAD_WORDS, MIN_TOKENS, GRAMMAR = (1 << i for i in range(7))


def _flags(sp) -> int:
    f = 0
    if sp.has_penalties:
        f |= PENALTY
    if sp.min_p > 0.0:
        f |= MIN_P
    if sp.logit_bias:
        f |= BIAS
    if sp.allowed_token_ids is not None:
        f |= ALLOWED
    if sp.bad_words:
        f |= BAD_WORDS
    if sp.min_tokens > 0:
        f |= MIN_TOKENS
    if sp.structured_outputs is not None:
        f |= GRAMMAR
    return f


class SlotControls:
    def __init__(self, num_slots: int):
        self.flags = np.zeros(num_slots, dtype=np.int32)
        self.min_ps = np.zeros(num_slots, dtype=np.float32)
        self.repetition = np.ones(num_slots, dtype=np.float32)
        self.frequency = np.zeros(num_slots, dtype=np.float32)
        self.presence = np.zeros(num_slots, dtype=np.float32)
        self.min_tokens = np.zeros(num_slots, dtype=np.int32)
        # True until the slot's penalty counts were sent to the sampling rank.
        self.fresh = np.zeros(num_slots, dtype=bool)
        # logit_bias as arrays (token ids, biases), made once when the slot is acquired.
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * num_slots
        self.num_controlled = 0  # held slots with any flag set

    def acquire(self, slot: int, sp) -> None:
        f = _flags(sp)
        self.flags[slot] = f
        self.min_ps[slot] = sp.min_p
        self.repetition[slot] = sp.repetition_penalty
        self.frequency[slot] = sp.frequency_penalty
        self.presence[slot] = sp.presence_penalty
        self.min_tokens[slot] = sp.min_tokens
        self.fresh[slot] = bool(f & PENALTY)
        self.bias[slot] = (_ids(list(sp.logit_bias)), np.asarray(list(sp.logit_bias.values()), np.float32)) \
            if f & BIAS else None
        self.num_controlled += f != 0

    def release(self, slot: int) -> None:
        self.num_controlled -= self.flags[slot] != 0
        self.flags[slot] = 0
        self.fresh[slot] = False
        self.bias[slot] = None


def _ids(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def build_sample_plan(seqs: list, slots: np.ndarray, row_arrays: dict, table, num_logprobs: int,
                      vocab_size: int = 0, drafts: list[list[int]] | None = None) -> SamplePlan:
    """The SamplePlan of one step's sample rows: ``seqs[i]`` holds slot ``slots[i]``;
    ``row_arrays`` (``batch.sample_rows`` of ``plan_builder.build_plan``) are SamplePlan's
    per-row arrays (temperatures, top_ks, top_ps, seeds, steps), ``steps`` giving each sample
    row's completion tokens so far. ``vocab_size`` (the logits' width) sizes the grammar
    bitmask rows.

    ``drafts[i]`` (speculative decoding; None: none) are the draft tokens of ``seqs[i]``,
    which then has ``len(drafts[i]) + 1`` consecutive sample rows (module docstring). A
    sequence with a grammar never has drafts (the scheduler proposes none for it), so its
    mask row is its one sample row."""
    c: SlotControls = table.controls
    plan = SamplePlan(**row_arrays, num_logprobs=num_logprobs)
    steps = plan.steps
    rows_of = _Rows(seqs, drafts)
    if rows_of.spec:
        plan.draft_counts = rows_of.counts
        plan.draft_tokens = np.fromiter(chain.from_iterable(drafts), dtype=np.int32,
                                        count=int(rows_of.counts.sum()))
        slots = slots[rows_of.seq]
    if not c.num_controlled or not len(slots):
        return plan
    flags = c.flags[slots]
    if not flags.any():
        return plan
    rows = np.flatnonzero(flags & MIN_P)
    if len(rows):
        plan.min_p_rows, plan.min_ps = rows.astype(np.int32), c.min_ps[slots[rows]]
    rows = np.flatnonzero(flags & PENALTY)
    if len(rows):
        _penalties(plan, rows_of, slots, rows, c)
    rows = np.flatnonzero(flags & GRAMMAR)
    if len(rows):
        plan.mask_rows = rows.astype(np.int32)
        plan.bitmask, plan.bitmask_pending = fill_bitmask_async(
            [rows_of.seq_of(r).grammar for r in rows.tolist()], -(-vocab_size // 32))
    bans_r: list[np.ndarray] = []
    bans_t: list[np.ndarray] = []
    rows = np.flatnonzero((flags & MIN_TOKENS) != 0)
    if len(rows):
        rows = rows[steps[rows] < c.min_tokens[slots[rows]]]
        if len(rows):  # every stop id of those rows (table.stop_ids is [K, slots], -1 padded)
            stop = table.stop_ids[:, slots[rows]]
            k, j = np.nonzero(stop >= 0)
            bans_r.append(rows[j].astype(np.int32))
            bans_t.append(stop[k, j].astype(np.int32))
    rows = np.flatnonzero(flags & BIAS)
    if len(rows):  # one gather of the slots' bias arrays
        biases = [c.bias[s] for s in slots[rows].tolist()]
        plan.bias_rows = np.repeat(rows.astype(np.int32), [len(b[0]) for b in biases])
        plan.bias_tokens = np.concatenate([b[0] for b in biases])
        plan.bias_values = np.concatenate([b[1] for b in biases])
    for r in np.flatnonzero(flags & (ALLOWED | BAD_WORDS)).tolist():
        seq, f = rows_of.seq_of(r), int(flags[r])
        sp = seq.sampling_params
        if f & ALLOWED:
            n = 0 if plan.allow_rows is None else len(plan.allow_rows)
            plan.allow_rows = _cat(plan.allow_rows, np.array([r], np.int32))
            plan.allow_index = _cat(plan.allow_index, np.full(len(sp.allowed_token_ids), n, np.int32))
            plan.allow_tokens = _cat(plan.allow_tokens, _ids(sp.allowed_token_ids))
        if f & BAD_WORDS:
            before = rows_of.drafts_before(r)
            banned = bad_word_bans(seq.bad_words_ids, seq.token_ids + before if before else seq.token_ids,
                                   seq.num_prompt_tokens)
            if banned:
                bans_r.append(np.full(len(banned), r, np.int32))
                bans_t.append(_ids(banned))
    if bans_r:
        plan.ban_rows, plan.ban_tokens = np.concatenate(bans_r), np.concatenate(bans_t)
    return plan


class _Rows:
    """Which sequence, and which drafts before it, each sample row has."""

    def __init__(self, seqs: list, drafts: list[list[int]] | None):
        self.seqs, self.drafts = seqs, drafts
        self.spec = drafts is not None and any(drafts)
        if self.spec:
            self.counts = np.fromiter(map(len, drafts), dtype=np.int32, count=len(drafts))
            self.seq, self.pos = draft_row_positions(self.counts)

    def seq_of(self, r: int):
        return self.seqs[int(self.seq[r])] if self.spec else self.seqs[r]

    def drafts_before(self, r: int) -> list[int]:
        return self.drafts[int(self.seq[r])][:int(self.pos[r])] if self.spec else []


def _cat(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else np.concatenate((a, b))


def bad_word_bans(words: list[list[int]], tokens: list[int], num_prompt: int) -> list[int]:
    """The last token of every bad word whose other tokens end the output ``tokens[num_prompt:]``."""
    out = len(tokens) - num_prompt
    banned = []
    for w in words:
        n = len(w) - 1
        if n > out:
            continue
        if n == 0 or tokens[len(tokens) - n:] == w[:-1]:
            banned.append(w[-1])
    return banned


def _penalties(plan: SamplePlan, rows_of: _Rows, slots: np.ndarray, rows: np.ndarray, c: SlotControls) -> None:
    ps = slots[rows]
    plan.penalty_rows = rows.astype(np.int32)
    plan.penalty_slots = ps.astype(np.int32)
    plan.repetition, plan.frequency, plan.presence = c.repetition[ps], c.frequency[ps], c.presence[ps]
    if rows_of.spec:
        index, toks = [], []
        for i, r in enumerate(rows.tolist()):
            before = rows_of.drafts_before(r)
            index += [i] * len(before)
            toks += before
        if index:
            plan.penalty_draft_index = np.asarray(index, np.int32)
            plan.penalty_draft_tokens = np.asarray(toks, np.int32)
    fresh = np.flatnonzero(c.fresh[ps])
    if not len(fresh):
        return
    # A sequence with drafts has several rows on its slot: its counts start over once.
    fresh = fresh[np.unique(ps[fresh], return_index=True)[1]]
    init_slots, lens, plens, toks = [], [], [], []
    for i in fresh.tolist():
        seq = rows_of.seq_of(int(rows[i]))
        init_slots.append(int(ps[i]))
        lens.append(len(seq.token_ids))
        plens.append(seq.num_prompt_tokens)
        toks.append(seq.token_ids)
    c.fresh[ps[fresh]] = False
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    plan.init_slots = np.asarray(init_slots, np.int32)
    plan.init_cu = cu
    plan.init_prompt_lens = np.asarray(plens, np.int32)
    plan.init_tokens = np.fromiter((t for ts in toks for t in ts), dtype=np.int32, count=int(cu[-1]))
