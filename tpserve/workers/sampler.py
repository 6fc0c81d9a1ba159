"""Sampler: turns a batch of logits into one token per row, on the logits' device.

Every row has its own temperature, top-k, top-p and seed. Random draws come from a
counter-based generator: the uniform number for (seed, step, token) is a hash of those three
integers. A seeded request therefore samples the same tokens whatever else shares the batch,
and the whole batch is sampled in a few tensor ops with no per-row Python.

Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) draws i with
probability p_i, so no cumulative sums or multinomial calls are needed.

Memory: everything over the vocabulary is float32 (a float64 [256, 151936] tensor is 311 MB,
and the race needs several). Uniforms carry 23 random bits, so ``k + 0.5`` is exact in float32
and ``u`` stays strictly inside (0, 1): ``log(-log(u))`` is always finite. A batch whose rows
are all greedy does one argmax over the logits as they come (in the model's dtype), nothing
else over the vocabulary.
The runner's warm-up samples ``max_num_seqs`` rows so that the KV sizing sees this peak.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from tpserve.kernels import cpu_extension
from tpserve.sample_plan import SamplePlan, kept_rows
from tpserve.workers.penalties import PenaltyState
from tpserve.workers.rejection import accept

_MASK = (1 << 64) - 1


def _signed(c: int) -> int:
    c &= _MASK
    return c - (1 << 64) if c >= 1 << 63 else c


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit finalizer (splitmix64's); int64 multiplication wraps like uint64."""
    x = x ^ _shr(x, 30)
    x = x * _C1
    x = x ^ _shr(x, 27)
    x = x * _C2
    return x ^ _shr(x, 31)


_UNIFORM_BITS = 23


def uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 of shape [S, vocab], a pure function of (seed, step, index)."""
    base = mix64(mix64(seeds.long() * _GOLDEN + steps.long()) + 1)          # [S]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = mix64(base[:, None] ^ idx[None, :])
    return (_shr(bits, 64 - _UNIFORM_BITS).float() + 0.5) * (1.0 / (1 << _UNIFORM_BITS))


# Top-p reads the tokens of each row in descending order until their mass reaches top_p. A full
# sort of the vocabulary costs 14-18 ms for one row of 151,936 logits on 2 CPU threads (112 ms for
# 16 rows), more than a 0.6B model's decode step; the TOP_CANDIDATES largest (torch.topk: ~2 ms)
# hold the nucleus of any but a flat distribution. A row whose candidates hold less than its
# top_p tries 8 times as many, then the full sort.
TOP_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits: [S, V] float32.

    The nucleus is the shortest run of the row's most likely tokens (within its top-k, whose
    softmax it is measured in) whose mass reaches top_p; the top token always survives; top_p 1
    filters nothing."""
    vocab = logits.shape[1]
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab)).long()
    limited = k < vocab
    need_k = bool(limited.any())
    need_p = bool((top_ps < 1.0).any())
    if not (need_k or need_p):
        return logits
    c = min(vocab, max(TOP_CANDIDATES, int(k[limited].max()) if need_k else 0))
    if 2 * c > vocab:
        return _top_k_top_p_sorted(logits, k, top_ps, need_p)
    out, spill = _top_k_top_p_candidates(logits, k, top_ps, c, need_p)
    rows = spill.nonzero().squeeze(1)  # rows whose nucleus reaches past their candidates
    while rows.numel():
        c *= 8
        if 2 * c > vocab:
            out[rows] = _top_k_top_p_sorted(logits[rows], k[rows], top_ps[rows], need_p)
            break
        out[rows], spill = _top_k_top_p_candidates(logits[rows], k[rows], top_ps[rows], c, need_p)
        rows = rows[spill]
    return out


def _top_k_top_p_candidates(logits: torch.Tensor, k: torch.Tensor, top_ps: torch.Tensor, c: int,
                            need_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p from each row's c largest logits (c >= every k below the vocabulary),
    and which rows' nucleus reaches past them (their result is not final)."""
    vocab = logits.shape[1]
    limited = k < vocab
    vals, idx = logits.topk(c, dim=-1)  # descending, like the sort's first c
    drop = torch.arange(c, device=logits.device)[None, :] >= k[:, None]
    unfiltered = ~limited & (top_ps >= 1.0)  # rows kept whole
    spill = torch.zeros_like(limited)
    if need_p:
        masked = vals.masked_fill(drop, float("-inf"))
        # The softmax's denominator: a top-k row's survivors (all among its candidates), or the
        # row's whole vocabulary.
        lse = masked.logsumexp(dim=-1)
        if not bool(limited.all()):
            lse = torch.where(limited, lse, logits.logsumexp(dim=-1))
        probs = (masked - lse[:, None]).exp()
        mass = probs.cumsum(dim=-1)
        drop |= ((mass - probs) >= top_ps[:, None].to(probs.dtype)) & (top_ps < 1.0)[:, None]
        spill = ~limited & ~unfiltered & (mass[:, -1] < top_ps.to(probs.dtype))
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))
    if bool(unfiltered.any()):
        out[unfiltered] = logits[unfiltered]
    return out, spill


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, top_ps: torch.Tensor,
                        need_p: bool) -> torch.Tensor:
    """apply_top_k_top_p over a full sort of each row (k: each row's top-k, vocab for none)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep a token if the mass before it is below top_p: the top token always survives. A
        # row with top_p 1 filters nothing (its tail's mass can round up to 1), whatever its
        # neighbours ask.
        before = probs.cumsum(dim=-1) - probs
        drop |= (before >= top_ps[:, None].to(probs.dtype)) & (top_ps < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _argmax_ops(x: torch.Tensor):
    """``torch.ops.tpserve_cpu`` if its argmax operators can read ``x``, else None."""
    ops = cpu_extension.ops_for(x)
    if (ops is None or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1
            or x.dtype not in (torch.float32, torch.bfloat16)):
        return None
    return ops


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, int64 [S], as ``x.argmax(dim=-1)``. On CPU the C++ operator
    reads fp32/bf16 rows as they are: torch widens a bf16 row first and reduces it one lane at a
    time (measured at 64 rows x 32k bf16: 0.14 ms against 0.99 ms; 0.63 against 17.5 ms at 152k)."""
    ops = _argmax_ops(x)
    if ops is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    ops.argmax_rows(out, x)
    return out


def apply_min_p(x: torch.Tensor, rows: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Mask (to -inf) the tokens of rows ``rows`` whose probability is below ``min_p`` times
    their row's most likely token's (x: temperature-scaled float32 logits, in place)."""
    xs = x[rows]
    probs = xs.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    x[rows] = xs.masked_fill(probs < top * min_ps[:, None], float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [G, vocab]: bit t % 32 of word t // 32 of each row (int32 [G, ceil(vocab / 32)])."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf the tokens of rows ``rows`` of the float32 logits ``x`` that the int32
    ``bitmask`` rows (one per entry of ``rows``) do not allow, in place. On CPU one C++ pass per
    row (the torch version below, the reference, builds [G, V] int32 and bool tensors and
    gathers and scatters the rows: measured at 64 rows x 32k, it was most of a constrained
    step's sampling time)."""
    ops = cpu_extension.ops_for(x)
    if ops is not None and hasattr(ops, "apply_token_bitmask") and x.dim() == 2 and x.stride(1) == 1:
        ops.apply_token_bitmask(x, rows.contiguous(), bitmask.contiguous())
        return
    allowed = unpack_bitmask(bitmask, x.shape[1])
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))


def race(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Sample each row of the float32 logits ``x`` (temperature, masks applied): the index of
    max(x - log(-log u)), u the counter-based uniform of (seed, step, index).

    Equals sampling from softmax(x) (the exponential race: x - log E with E = -log u); the row's
    log-normaliser is the same for every index, so no log-softmax is needed. On CPU a C++
    operator draws, transforms and compares in one pass over each row; the torch version below
    (the reference) makes ~20 passes over [S, V] int64 and float32 tensors."""
    ops = cpu_extension.ops_for(x)
    if ops is not None and hasattr(ops, "race_argmax") and x.dim() == 2 and x.stride(1) == 1:
        out = torch.empty(x.shape[0], dtype=torch.long)
        ops.race_argmax(out, x, seeds.long().contiguous(), steps.long().contiguous())
        return out
    if x.is_cuda:
        from tpserve.kernels.sample_race import race_argmax
        return race_argmax(x, seeds, steps)
    return race_reference(x, seeds, steps)


def race_reference(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    noise = uniform(seeds, steps, x.shape[1]).log_().neg_().log_()
    return (x - noise).argmax(dim=-1)


def _filtered_race_ops(x: torch.Tensor, temps: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor):
    """``torch.ops.tpserve_cpu`` if its ``filtered_race`` can sample ``x`` (float32 [S, V] on
    CPU, the controls in the dtypes the plan stages), else None.

    It samples what ``race(apply_top_k_top_p(x / temps, ...))`` samples without building the
    masked [S, V] logits: each row's survivors are found from a histogram of the logits' distance
    below its maximum, and only they are sorted and raced (see sampling_ops.cpp). A sampler call
    on 16 rows of 151,936 logits at temperature 0.8, top-p 0.9 (scripts/bench_sampler.py) took
    29 ms through apply_top_k_top_p and race, 8.7 ms this way. Rows with min-p take the torch
    path (min-p masks between temperature and top-k).
    """
    ops = cpu_extension.ops_for(x)
    if (ops is None or not hasattr(ops, "filtered_race") or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or temps.dtype != torch.float32 or top_ks.dtype != torch.int32
            or top_ps.dtype != torch.float32):
        return None
    return ops


def _all_greedy(temperatures: torch.Tensor) -> bool:
    """Whether every row is greedy (temperature <= 0)."""
    return bool((temperatures <= 0).all())


def _greedy_argmax(x: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(argmax_rows(x), _all_greedy(temperatures))``; on CPU one C++ call. Right after a
    decode step, whose weights have just gone through the caches, the Python and torch work of
    the two (measured on the 40M model at batch 1: ~100 us) cost more than the argmax."""
    ops = _argmax_ops(x)
    if ops is not None and temperatures.device.type == "cpu" and temperatures.dtype == torch.float32:
        out = torch.empty(x.shape[0], dtype=torch.long)
        return out, ops.argmax_rows_greedy(out, x, temperatures.contiguous())
    return argmax_rows(x), _all_greedy(temperatures)


# SamplePlan's per-row arrays packed for one host-to-device copy: (name, dtype, torch dtype), the
# 8-byte seeds first so that every array starts aligned to its own size.
_PACKED_ROWS = (("seeds", np.int64, torch.int64), ("temperatures", np.float32, torch.float32),
                ("top_ps", np.float32, torch.float32), ("top_ks", np.int32, torch.int32),
                ("steps", np.int32, torch.int32))
_PACKED_ROW_BYTES = sum(np.dtype(d).itemsize for _, d, _ in _PACKED_ROWS)


def pack_rows(plan: SamplePlan) -> np.ndarray:
    """uint8 [S * 24]: the per-row arrays of ``plan`` one after the other (``_PACKED_ROWS``)."""
    n = plan.num_samples
    buf = np.empty(n * _PACKED_ROW_BYTES, dtype=np.uint8)
    pos = 0
    for name, dtype, _ in _PACKED_ROWS:
        size = n * np.dtype(dtype).itemsize
        buf[pos:pos + size].view(dtype)[...] = getattr(plan, name)
        pos += size
    return buf


def unpack_rows(buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """Typed views of ``pack_rows``'s buffer of ``n`` rows (uint8, on any device)."""
    out, pos = {}, 0
    for name, dtype, tdtype in _PACKED_ROWS:
        size = n * np.dtype(dtype).itemsize
        # torch refuses to reinterpret an empty byte tensor (its stride is 0)
        out[name] = buf[pos:pos + size].view(tdtype) if n else buf.new_empty(0, dtype=tdtype)
        pos += size
    return out


class Sampler:
    """The sampling rank's logits pipeline: one token per sample row, from one SamplePlan.

    ``sample(logits, plan)`` is the one call; ``plan`` (tpserve/sample_plan.py, built with numpy
    on the scheduler side) carries every control of every row. The pipeline, in this order:

    1. logit bias, then allowed tokens and bans (bad words, min_tokens' stop ids);
    2. the grammar bitmask (structured output);
    3. repetition, frequency and presence penalties (counts in ``penalties``);
    4. temperature: a row at temperature 0 is greedy, the argmax of the logits after 1-3;
    5. min-p, then top-k and top-p;
    6. the counter-based race of (seed, step) for every other row;
    7. with draft tokens (``SamplePlan.draft_counts``), speculative acceptance (rejection.py).

    A row left with no allowed token gets token -1; only the rows a sequence keeps count towards
    its penalties. A plan without controls beyond the per-row arrays takes the plain path
    (nothing over the vocabulary beyond what temperature/top-k/top-p need; an all-greedy batch
    is one argmax over the logits as the LM head wrote them).
    """

    def __init__(self, vocab_size: int | None = None, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._penalties: PenaltyState | None = None
        self._buf: torch.Tensor | None = None  # float32 scratch for processed logits
        # name -> (array, its tensor): the read-only per-row arrays seen last (see _row)
        self._rows: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        self._staged: tuple[SamplePlan | None, dict] = (None, {})  # off the CPU: (plan, tensors)

    def penalties(self, vocab: int) -> PenaltyState:
        if self._penalties is None or self._penalties.vocab_size != vocab:
            self._penalties = PenaltyState(vocab, self.device)
        return self._penalties

    def __call__(self, logits: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
        """One token per row (a plan without drafts)."""
        assert plan.draft_counts is None, "drafts need sample()"
        return self.sample(logits, plan)[0]

    def sample(self, logits: torch.Tensor, plan: SamplePlan) -> tuple[torch.Tensor, np.ndarray | None]:
        """The token of every row of ``logits`` [S, V] under ``plan`` (S rows), and with drafts
        how many rows each sequence keeps (StepOutput.accepted; None without drafts)."""
        processed = plan.processes_logits
        temperatures = self._row(plan, "temperatures")
        if not processed:
            # Upcasting bf16/fp16 to float32 is exact, so argmax before or after it agrees.
            greedy_tokens, all_greedy = _greedy_argmax(logits, temperatures)
            if all_greedy:
                return greedy_tokens, self._accept(greedy_tokens, plan)
            x = logits.float()
        else:
            all_greedy = _all_greedy(temperatures)
            x = self._scratch(logits)
            self._process(x, plan)
            greedy_tokens = argmax_rows(x)
        greedy = temperatures <= 0
        if all_greedy:
            tokens = greedy_tokens
        else:
            top_ks, top_ps = self._row(plan, "top_ks"), self._row(plan, "top_ps")
            seeds, steps = self._row(plan, "seeds"), self._row(plan, "steps")
            temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
            ops = _filtered_race_ops(x, temps, top_ks, top_ps)
            if ops is not None and plan.min_p_rows is None:
                sampled = torch.empty(x.shape[0], dtype=torch.long)
                ops.filtered_race(sampled, x, temps, top_ks.contiguous(), top_ps.contiguous(),
                                  seeds.long().contiguous(), steps.long().contiguous())
            else:
                x = x.div_(temps[:, None]) if processed else x / temps[:, None]
                if plan.min_p_rows is not None:
                    apply_min_p(x, self._t(plan.min_p_rows), self._t(plan.min_ps))
                sampled = race(apply_top_k_top_p(x, top_ks, top_ps), seeds, steps)
            tokens = torch.where(greedy, greedy_tokens, sampled)
        if processed and plan.can_leave_no_token:
            dead = torch.isneginf(x.amax(dim=-1)) if x.shape[1] else torch.ones_like(greedy)
            if bool(dead.any()):
                tokens = torch.where(dead, torch.full_like(tokens, -1), tokens)
        accepted = self._accept(tokens, plan)
        if plan.penalty_rows is not None:
            prow = self._t(plan.penalty_rows).long()
            live = tokens[prow] >= 0
            if accepted is not None:  # rows past a rejected draft generate nothing
                keep = kept_rows(plan.draft_counts, accepted)[plan.penalty_rows]
                live &= torch.from_numpy(keep).to(live.device)
            self._penalties.count(self._t(plan.penalty_slots)[live], tokens[prow][live])
        return tokens, accepted

    @staticmethod
    def _accept(tokens: torch.Tensor, plan: SamplePlan) -> np.ndarray | None:
        if plan.draft_counts is None:
            return None
        return accept(tokens.cpu().numpy(), plan.draft_counts, plan.draft_tokens)

    def _row(self, plan: SamplePlan, name: str) -> torch.Tensor:
        """The plan's per-row array ``name`` (ROW_FIELDS) as a tensor on the sampler's device.

        On the CPU it is the array's own memory (``torch.from_numpy``, no copy), made only when
        needed (an all-greedy step reads only the temperatures). A decode step over an unchanged
        running set passes the same read-only arrays again (``SlotTable.constant_arrays``):
        their tensors are kept, and torch's one-time warning about read-only arrays (the sampler
        never writes them) is not raised. On a device the five arrays go in one host buffer and
        one copy (``pack_rows``), once per plan."""
        if self.device.type != "cpu":
            if self._staged[0] is not plan:
                packed = torch.from_numpy(pack_rows(plan)).to(self.device, non_blocking=True)
                self._staged = (plan, unpack_rows(packed, plan.num_samples))
            return self._staged[1][name]
        a = getattr(plan, name)
        hit = self._rows.get(name)
        if hit is not None and hit[0] is a:
            return hit[1]
        if a.flags.writeable:
            return torch.from_numpy(a)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        self._rows[name] = (a, t)
        return t

    def _scratch(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` in a buffer kept between steps: a fresh [S, V] tensor
        each step costs its page faults (measured: 4 ms for 64 x 32k on one CPU thread, more
        than the controls themselves)."""
        n = logits.numel()
        buf = self._buf
        if buf is None or buf.numel() < n or buf.device != logits.device:
            buf = self._buf = torch.empty(n, dtype=torch.float32, device=logits.device)
        x = buf[:n].view(logits.shape)
        x.copy_(logits)
        return x

    def _t(self, a) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _process(self, x: torch.Tensor, p: SamplePlan) -> None:
        """Every change to the logits before temperature, in pipeline order (in place)."""
        inf = float("-inf")
        if p.bias_rows is not None:
            x.index_put_((self._t(p.bias_rows).long(), self._t(p.bias_tokens).long()),
                         self._t(p.bias_values), accumulate=True)
        if p.allow_rows is not None:
            keep = torch.zeros((len(p.allow_rows), x.shape[1]), dtype=torch.bool, device=x.device)
            keep[self._t(p.allow_index).long(), self._t(p.allow_tokens).long()] = True
            rows = self._t(p.allow_rows).long()
            x[rows] = x[rows].masked_fill(~keep, inf)
        if p.ban_rows is not None:
            x[self._t(p.ban_rows).long(), self._t(p.ban_tokens).long()] = inf
        if p.mask_rows is not None:
            p.wait_bitmask()
            apply_token_bitmask(x, self._t(p.mask_rows).long(), self._t(p.bitmask))
        if p.penalty_rows is not None:
            self._penalize(x, p)

    def _penalize(self, x: torch.Tensor, p: SamplePlan) -> None:
        state = self.penalties(x.shape[1])
        if p.init_slots is not None:
            state.start(p.init_slots, p.init_cu, p.init_prompt_lens, p.init_tokens)

        def apply(st: PenaltyState, sel, slots) -> None:
            st.apply(x, self._t(p.penalty_rows[sel]), self._t(slots), self._t(p.repetition[sel]),
                     self._t(p.frequency[sel]), self._t(p.presence[sel]))

        if p.penalty_draft_index is None:
            apply(state, slice(None), p.penalty_slots)
            return
        # Rows after draft tokens see counts that include those drafts (SamplePlan): a scratch
        # state for them, the slots' own counts for the other rows.
        drafted = np.zeros(len(p.penalty_rows), dtype=bool)
        drafted[p.penalty_draft_index] = True
        if not drafted.all():
            apply(state, ~drafted, p.penalty_slots[~drafted])
        local = (np.cumsum(drafted) - 1)[p.penalty_draft_index].astype(np.int32)
        view = state.with_drafts(self._t(p.penalty_slots[drafted]), self._t(local),
                                 self._t(p.penalty_draft_tokens))
        apply(view, drafted, np.arange(int(drafted.sum()), dtype=np.int32))


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int, ranks: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of the sampled tokens and of each row's ``num_top`` best tokens.

    They are taken from the model's own distribution (log_softmax of the raw logits, before
    temperature, top-k and top-p), as the OpenAI API and vLLM report them, so a logprob does
    not change with the sampling settings. Returns float32 [S] (sampled token), int64
    [S, num_top] (best token ids, most likely first), float32 [S, num_top] and, with
    ``ranks``, int32 [S] the sampled token's 1-based rank (the number of tokens at least as
    likely, itself included, as vLLM counts it), else None. The ranks cost a pass over the
    vocabulary that rivals the log_softmax on a CPU: only the offline API asks for them.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    sampled = logp.gather(1, tokens.long()[:, None])[:, 0]
    rank = (logp >= sampled[:, None]).view(torch.uint8).sum(dim=-1, dtype=torch.int32) if ranks else None
    top_lp, top_ids = logp.topk(min(num_top, logp.shape[1]), dim=-1) if num_top > 0 else \
        (logp.new_empty((logp.shape[0], 0)), torch.empty((logp.shape[0], 0), dtype=torch.long,
                                                         device=logp.device))
    return sampled, top_ids, top_lp, rank
