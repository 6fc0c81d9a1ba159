"""Turning a scheduled batch into a StepPlan, from persistent per-slot numpy arrays.

Every admitted sequence owns one *slot*, a row of the :class:`SlotTable`, from admission until
it is preempted, finished or aborted. The scheduler keeps the rows current incrementally (a
block appended here, a length bumped there), so a decode plan is a handful of vectorized
gathers over the batch's slot indices -- no Python loop over sequences or tokens. Prefill
and mixed plans put the decode rows first (built the same vectorized way), then loop once over
the prefilling sequences (to slice their chunks' token ids) and compute the rest vectorized.

Row contents (``s`` a slot):

- ``block_tables[s, :num_blocks[s]]`` mirrors ``seq.block_table``; the rest is -1.
  ``tail_blocks[s]`` is its last block (where a decoding sequence writes its next KV).
  With several KV-cache groups (tpserve/kv_groups.py), ``group_tables[g - 1, s]`` mirrors
  group g's table the same way (-1 where a sliding group dropped a block), and a plan's
  ``block_tables`` holds the groups side by side: columns ``[g * W, (g + 1) * W)`` are group
  g's (the runner derives each group's KV slots from the positions and its table).
- ``seq_lens[s] == len(seq)`` and ``last_tokens[s] == seq.last_token`` while decoding (they are
  written when the prefill completes and bumped by every decode step).
- Pooling sequences (--runner pooling) are prefill rows that are never sampled; the rows
  they pool are ``batch.pool_rows`` (``_pool_rows``), read by rank 0 through the SamplePlan.
- ``prompt_lens[s]``, ``stop_lens[s]`` (the length at which the sequence finishes with
  "length"), sampling parameters, and ``stop_ids[k, s]`` for k < K: the token ids that finish
  it with "stop" (EOS unless ignore_eos, plus stop_token_ids), padded with -1. Stored one
  contiguous row per k, so the check is K vectorized compares over the batch.
"""
from __future__ import annotations

import numpy as np

from tpserve.plan import StepPlan
from tpserve.sample_plan import ROW_FIELDS
from tpserve.scheduler.sample_inputs import SlotControls


class SlotTable:
    """Per-slot arrays of the sequences that hold blocks (RUNNING ones)."""

    def __init__(self, num_slots: int, max_blocks_per_seq: int, block_size: int, num_groups: int = 1):
        self.num_slots = num_slots
        self.block_size = block_size
        self.block_tables = np.full((num_slots, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_groups = num_groups
        self.group_tables = np.full((num_groups - 1, num_slots, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_blocks = np.zeros(num_slots, dtype=np.int32)
        self.tail_blocks = np.full(num_slots, -1, dtype=np.int32)
        self.seq_lens = np.zeros(num_slots, dtype=np.int32)
        self.prompt_lens = np.zeros(num_slots, dtype=np.int32)
        self.last_tokens = np.zeros(num_slots, dtype=np.int32)
        self.stop_lens = np.zeros(num_slots, dtype=np.int32)
        self.temperatures = np.zeros(num_slots, dtype=np.float32)
        self.top_ks = np.zeros(num_slots, dtype=np.int32)
        self.top_ps = np.ones(num_slots, dtype=np.float32)
        self.seeds = np.zeros(num_slots, dtype=np.int64)
        self.stop_ids = np.full((1, num_slots), -1, dtype=np.int32)
        # Logits controls beyond temperature/top-k/top-p (sample_inputs.py).
        self.controls = SlotControls(num_slots)
        # Lowest slot first, so small batches touch few cache lines.
        self._free = list(range(num_slots - 1, -1, -1))
        # (key, its per-batch constant plan arrays): decode batches over an unchanged running
        # set pass the same key (the running queue's version), and a held slot's sampling
        # options never change, so the arrays stay valid until the key does.
        self._constant_cache: tuple[object, dict] | None = None

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def acquire(self, seq, stop_ids: list[int], stop_len: int) -> int:
        """Give ``seq`` a slot and fill its row (blocks, prompt length, sampling options)."""
        slot = self._free.pop()
        sp = seq.sampling_params
        self.prompt_lens[slot] = seq.num_prompt_tokens
        self.stop_lens[slot] = stop_len
        self.temperatures[slot] = sp.temperature
        self.top_ks[slot] = sp.top_k
        self.top_ps[slot] = sp.top_p
        self.seeds[slot] = seq.seed
        if len(stop_ids) > len(self.stop_ids):
            wider = np.full((len(stop_ids), self.num_slots), -1, dtype=np.int32)
            wider[:len(self.stop_ids)] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[:, slot] = -1
        self.stop_ids[:len(stop_ids), slot] = stop_ids
        self.set_blocks(slot, seq.block_table)
        self.controls.acquire(slot, sp)
        seq.slot = slot
        return slot

    def release(self, seq) -> None:
        slot = seq.slot
        self.block_tables[slot, :self.num_blocks[slot]] = -1
        if self.num_groups > 1:
            self.group_tables[:, slot, :self.num_blocks[slot]] = -1
        self.num_blocks[slot] = 0
        self.tail_blocks[slot] = -1
        self.controls.release(slot)
        self._free.append(slot)
        seq.slot = -1

    def set_blocks(self, slot: int, block_table: list[int]) -> None:
        n = len(block_table)
        self.block_tables[slot, n:self.num_blocks[slot]] = -1
        self.block_tables[slot, :n] = block_table
        self.num_blocks[slot] = n
        self.tail_blocks[slot] = block_table[-1] if n else -1

    def set_group_blocks(self, slot: int, tables: list[list[int]]) -> None:
        """Rewrite the slot's rows of every group from its tables (group 0's first)."""
        self.set_blocks(slot, tables[0])
        for g, table in enumerate(tables[1:]):
            self.group_tables[g, slot, :len(table)] = table

    def append_group_blocks(self, slot: int, tables: list[list[int]]) -> None:
        """Copy the last entry of groups 1..'s tables, just appended like group 0's."""
        n = self.num_blocks[slot]
        for g, table in enumerate(tables[1:]):
            self.group_tables[g, slot, n - 1] = table[n - 1]

    def plan_tables(self, idx: np.ndarray, width: int) -> np.ndarray:
        """The plan's block tables of slots ``idx``: every group's ``width`` columns in turn."""
        if self.num_groups == 1:
            return self.block_tables[idx, :width]
        return np.concatenate([self.block_tables[idx, :width], *self.group_tables[:, idx, :width]], axis=1)

    def append_block(self, slot: int, block_id: int) -> None:
        n = self.num_blocks[slot]
        self.block_tables[slot, n] = block_id
        self.num_blocks[slot] = n + 1
        self.tail_blocks[slot] = block_id

    def truncate_blocks(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` blocks of the slot's rows (BlockManager.truncate)."""
        self.block_tables[slot, n:self.num_blocks[slot]] = -1
        if self.num_groups > 1:
            self.group_tables[:, slot, n:self.num_blocks[slot]] = -1
        self.num_blocks[slot] = n
        self.tail_blocks[slot] = self.block_tables[slot, n - 1] if n else -1

    def append_blocks(self, slots: np.ndarray, block_ids: list[int]) -> None:
        """``append_block`` for several distinct slots at once."""
        self.block_tables[slots, self.num_blocks[slots]] = block_ids
        self.num_blocks[slots] += 1
        self.tail_blocks[slots] = block_ids

    def stop_hits(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Which ``tokens[i]`` is a stop token of ``slots[i]`` (bool array)."""
        rows = self.stop_ids
        hit = rows[0][slots] == tokens
        for k in range(1, len(rows)):
            hit |= rows[k][slots] == tokens
        return hit

    def constant_arrays(self, slots: np.ndarray, key=None) -> tuple[dict, dict]:
        """Arrays of a decode batch that depend only on which slots it holds (read-only;
        shared by consecutive steps over the same running set): (StepPlan arrays, the
        per-row sampling controls of ``row_controls``).

        ``key`` names the slot set: equal keys promise equal ``slots``. None: not cacheable."""
        cache = self._constant_cache
        if key is not None and cache is not None and cache[0] == key:
            return cache[1]
        n = len(slots)
        arrays = (dict(cu_seqlens_q=np.arange(n + 1, dtype=np.int32),
                       logits_indices=np.arange(n, dtype=np.int32)),
                  self.row_controls(slots))
        for part in arrays:
            for arr in part.values():
                arr.flags.writeable = False
        if key is not None:
            self._constant_cache = (key, arrays)
        return arrays

    def row_controls(self, slots: np.ndarray) -> dict:
        """temperatures, top_ks, top_ps and seeds of sample rows on ``slots`` (SamplePlan)."""
        return dict(temperatures=self.temperatures[slots], top_ks=self.top_ks[slots],
                    top_ps=self.top_ps[slots], seeds=self.seeds[slots])

    def start_decoding(self, seq) -> None:
        """The prefill of ``seq`` completed and its first (or next) token was sampled."""
        slot = seq.slot
        self.seq_lens[slot] = len(seq.token_ids)
        self.last_tokens[slot] = seq.token_ids[-1]


def build_plan(batch, block_size: int | None = None) -> StepPlan:
    """The StepPlan for ``batch`` (a ``ScheduledBatch``); an empty plan for an empty batch.

    Also records on ``batch.sample_rows`` the per-row sampling controls of its sample rows
    (temperatures, top_ks, top_ps, seeds, steps: SamplePlan's per-row arrays), which
    ``sample_inputs.build_sample_plan`` turns into the step's SamplePlan: the StepPlan, which
    every rank reads, carries none of them."""
    bs = block_size if block_size is not None else batch.table.block_size
    assert bs == batch.table.block_size, "block_size differs from the scheduler's"
    if not batch.seqs:
        batch.sample_rows = empty_sample_rows()
        return StepPlan(step_id=batch.step_id)
    if batch.is_prefill or batch.drafts:
        return _build_mixed(batch, bs)
    return _build_decode(batch, bs)


def _build_decode(batch, bs: int) -> StepPlan:
    t = batch.table
    idx = batch.slots
    n = len(idx)
    lens = t.seq_lens[idx]
    pos = lens - 1
    # A decoding sequence's next KV always goes to the last block of its table.
    slot_mapping = t.tail_blocks[idx] * bs + pos % bs
    width = int(t.num_blocks[idx].max())
    cu_k = np.zeros(n + 1, dtype=np.int32)
    np.add.accumulate(lens, out=cu_k[1:])
    const, rows = t.constant_arrays(idx, batch.slots_key)
    batch.sample_rows = dict(rows, steps=lens - t.prompt_lens[idx])
    return StepPlan(
        is_prefill=False, has_context=False, max_seqlen_q=1, max_seqlen_k=int(lens.max()),
        step_id=batch.step_id, num_decodes=n,
        input_ids=t.last_tokens[idx],
        positions=pos,
        slot_mapping=slot_mapping,
        cu_seqlens_k=cu_k,
        context_lens=lens,
        block_tables=t.plan_tables(idx, width),
        **const,
    )


def _build_mixed(batch, bs: int) -> StepPlan:
    """A plan with prefill rows or draft rows, after the plain decode rows (possibly none).

    A plain decode row is a sequence whose query is its one newest token: its rows come
    vectorized from the slot arrays, exactly as in a decode plan. A decode row with k drafts
    (speculative decoding) follows them: its query is the newest token and the drafts, all k + 1
    rows sampled. Prefill rows come last and slice their chunk's token ids from their sequences
    (one loop over the few prefilling sequences)."""
    t = batch.table
    nd = batch.num_decodes
    drafts = batch.drafts or []
    n0 = next((i for i, d in enumerate(drafts) if d), nd)
    pseqs = batch.seqs[nd:]
    idx = batch.slots
    didx, pidx = idx[:n0], idx[nd:]
    n, m = len(idx), len(pseqs)
    # Decode rows: key length = sequence length, one query at position length - 1.
    dlens = t.seq_lens[didx]
    dpos = dlens - 1
    v = _draft_rows(t, idx[n0:nd], drafts[n0:], bs)
    nv = len(v["ids"])  # draft-row tokens
    # Prefill rows: a chunk of qlens tokens starting after `starts` cached ones.
    starts = np.fromiter((s.num_cached_tokens for s in pseqs), dtype=np.int32, count=m)
    qlens = np.fromiter((s.num_scheduled_tokens for s in pseqs), dtype=np.int32, count=m)
    plens = np.fromiter((len(s.token_ids) for s in pseqs), dtype=np.int32, count=m)
    hits = np.fromiter((s.num_prefix_hit_tokens for s in pseqs), dtype=np.int32, count=m)
    ids: list[int] = []
    for s, a, q in zip(pseqs, starts.tolist(), qlens.tolist()):
        ids += s.token_ids[a:a + q]
    pends = starts + qlens
    pcu = np.zeros(m + 1, dtype=np.int32)
    np.cumsum(qlens, out=pcu[1:])
    row = np.repeat(np.arange(m), qlens)
    ppos = (np.arange(int(pcu[-1]), dtype=np.int32) - pcu[row] + starts[row]).astype(np.int32)
    pslot = t.block_tables[pidx[row], ppos // bs] * bs + ppos % bs
    # Tokens inside blocks taken from the prefix cache are only recomputed to get logits (a
    # fully cached prompt); their KV is already there and the block may be shared: skip.
    pslot[ppos < hits[row]] = -1
    # Rows together: plain decode rows first (a query length of 1 each), then draft rows.
    all_q = np.concatenate((np.ones(n0, dtype=np.int32), v["qlens"], qlens))
    cu_q = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(all_q, out=cu_q[1:])
    ends = np.concatenate((dlens, v["ends"], pends))
    cu_k = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(ends, out=cu_k[1:])
    # Which prefill rows are sampled is the scheduler's decision (batch.sampled: the chunk ends
    # its prompt); decode and draft rows always are.
    psampled = np.asarray(batch.sampled, dtype=bool)
    first = n0 + nv  # the first prefill token's row
    lp_rows = _prompt_logprob_rows(batch, pseqs, starts.tolist(), qlens.tolist(), (pcu[:-1] + first).tolist())
    if any(s.pooling is not None for s in pseqs):
        _pool_rows(batch, pseqs, starts.tolist(), qlens.tolist(), (pcu[:-1] + first).tolist())
    sidx = np.concatenate((didx, v["sample_slots"], pidx[psampled]))
    width = int(t.num_blocks[idx].max())
    batch.sample_rows = dict(
        t.row_controls(sidx),
        steps=np.concatenate((dlens - t.prompt_lens[didx], v["steps"],
                              plens[psampled] - t.prompt_lens[pidx[psampled]])).astype(np.int32, copy=False))
    return StepPlan(
        is_prefill=True, has_context=bool(nd) or bool((starts > 0).any()),
        max_seqlen_q=int(all_q.max()), max_seqlen_k=int(ends.max()),
        step_id=batch.step_id, num_decodes=n0,  # the leading rows with one query each
        input_ids=np.concatenate((t.last_tokens[didx], v["ids"], np.array(ids, dtype=np.int32))),
        positions=np.concatenate((dpos, v["positions"], ppos)),
        slot_mapping=np.concatenate((t.tail_blocks[didx] * bs + dpos % bs, v["slots"],
                                     pslot.astype(np.int32, copy=False))),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        context_lens=ends,
        block_tables=t.plan_tables(idx, width),
        logits_indices=np.concatenate((np.arange(first, dtype=np.int32),
                                       cu_q[nd + 1:][psampled] - 1)).astype(np.int32, copy=False),
        logprob_rows=lp_rows,
    )


def empty_sample_rows() -> dict:
    """``batch.sample_rows`` of a step that samples nothing."""
    return {name: np.zeros(0, dtype) for name, dtype in ROW_FIELDS.items()}


def _draft_rows(t: SlotTable, slots: np.ndarray, drafts: list[list[int]], bs: int) -> dict:
    """Rows of decode sequences verifying drafts: for a sequence of length L with k drafts,
    the query is its last token and the drafts at positions L - 1 .. L - 1 + k, written to the
    slots its blocks (reserved by the scheduler) give them, every row sampled, row j at output
    step L - prompt + j."""
    lens = t.seq_lens[slots]
    k = np.fromiter(map(len, drafts), dtype=np.int32, count=len(drafts))
    q = k + 1
    row = np.repeat(np.arange(len(slots)), q)
    offset = np.arange(int(q.sum()), dtype=np.int32) - np.repeat(np.cumsum(q) - q, q)
    pos = (lens[row] - 1 + offset).astype(np.int32, copy=False)
    ids: list[int] = []
    for last, d in zip(t.last_tokens[slots].tolist(), drafts):
        ids.append(last)
        ids += d
    return dict(ids=np.array(ids, dtype=np.int32), positions=pos,
                slots=(t.block_tables[slots[row], pos // bs] * bs + pos % bs).astype(np.int32, copy=False),
                qlens=q, ends=(lens + k).astype(np.int32, copy=False), sample_slots=slots[row],
                steps=((lens - t.prompt_lens[slots])[row] + offset).astype(np.int32, copy=False))


def _prompt_logprob_rows(batch, pseqs, starts, qlens, first_rows) -> np.ndarray:
    """Rows whose logits give prompt log-probabilities, for the prefilling sequences that ask
    for them; records on ``batch.prompt_logprobs`` (seq, first target position, count) and the
    target tokens in ``batch.prompt_logprob_targets``.

    The row at position p gives the log-probability of prompt token p + 1; targets already
    reported (before a preemption) are not computed again."""
    batch.prompt_logprobs, rows, targets = [], [], []
    for seq, a, q, row0 in zip(pseqs, starts, qlens, first_rows):
        if seq.sampling_params.prompt_logprobs is None:
            continue
        lo = max(a + 1, seq.num_prompt_logprobs_done)
        hi = min(a + q, seq.num_prompt_tokens - 1)  # last target position, inclusive
        if hi < lo:
            continue
        batch.prompt_logprobs.append((seq, lo, hi - lo + 1))
        rows.append(np.arange(row0 + lo - 1 - a, row0 + hi - a, dtype=np.int32))
        targets += seq.token_ids[lo:hi + 1]
    batch.prompt_logprob_targets = np.asarray(targets, dtype=np.int32)
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)


def _pool_rows(batch, pseqs, starts, qlens, first_rows) -> None:
    """The hidden rows each pooling sequence's chunk contributes (--runner pooling), on
    ``batch.pool_spans`` / ``batch.pool_rows``: LAST and SCORE the prompt's last row (in the
    chunk that ends it), CLS its first (in the chunk that starts it), MEAN every row of the
    chunk (rank 0 sums them; the engine adds the chunks up). Pooling rows are never sampled:
    no LM head runs for them."""
    spans, lo, hi = [], [], []
    for seq, a, q, r in zip(pseqs, starts, qlens, first_rows):
        kind = seq.pooling
        if kind is None:
            continue
        if kind == "MEAN":
            span = (r, r + q)
        elif kind == "CLS":
            if a:
                continue
            span = (r, r + 1)
        elif a + q == len(seq.token_ids):  # LAST, SCORE
            span = (r + q - 1, r + q)
        else:
            continue
        spans.append((seq, a == 0))
        lo.append(span[0])
        hi.append(span[1])
    batch.pool_spans = spans
    batch.pool_rows = (np.asarray(lo, dtype=np.int32), np.asarray(hi, dtype=np.int32)) if spans else None
