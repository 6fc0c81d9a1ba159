"""PenaltyState: per-request token counts on the sampling rank, for the repetition, frequency
and presence penalties.

The counts live where the logits are (rank 0), keyed by the scheduler's slot of each request,
so a step touches only the rows it samples: O(1) work per sampled token to keep them current,
never a rebuild from a request's whole history. A slot's counts start over when the scheduler
says so (``SamplePlan.init_slots``: a request that just got its slot, whether new or readmitted
after a preemption, with every token it holds so far).

    output[s, t]  int32  how often token t occurs in the output of slot s's request
    prompt[s, t]  bool   whether token t occurs in its prompt
    seen[s, :seen_len[s]]  int32  with the C++ operators (CPU): every token of the prompt or
                  the output, once each, so that a step penalizes the tokens a request has seen
                  (hundreds) rather than its whole row (the vocabulary); same bits as the dense pass

Rows are allocated on first use and grow to the highest slot seen (slots are handed out lowest
first), so an engine that never sees a penalty allocates nothing.

Formulas (vLLM's, which follow OpenAI's for frequency/presence): a token seen in the prompt or
the output has its logit multiplied by 1/r when positive and by r otherwise (repetition r);
then ``logit -= f * count + p * (count > 0)`` over output counts.
"""
from __future__ import annotations

import numpy as np
import torch

from tpserve.kernels import cpu_extension


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        ops = cpu_extension.ops() if self.device.type == "cpu" and cpu_extension.available() else None
        self._ops = ops if ops is not None and hasattr(ops, "apply_penalties_seen") else None
        self.seen = self.seen_len = None
        if self._ops is not None:
            self.seen = torch.zeros((0, vocab_size), dtype=torch.int32)
            self.seen_len = torch.zeros(0, dtype=torch.int32)

    @property
    def num_rows(self) -> int:
        return int(self.output.shape[0])

    def _reserve(self, max_slot: int) -> None:
        n = self.num_rows
        if max_slot < n:
            return
        rows = max(max_slot + 1, 2 * n, 4)
        extra = rows - n
        v, dev = self.vocab_size, self.device
        self.output = torch.cat([self.output, torch.zeros((extra, v), dtype=torch.int32, device=dev)])
        self.prompt = torch.cat([self.prompt, torch.zeros((extra, v), dtype=torch.bool, device=dev)])
        if self.seen is not None:
            self.seen = torch.cat([self.seen, torch.zeros((extra, v), dtype=torch.int32)])
            self.seen_len = torch.cat([self.seen_len, torch.zeros(extra, dtype=torch.int32)])

    def start(self, slots: np.ndarray, cu: np.ndarray, prompt_lens: np.ndarray, tokens: np.ndarray) -> None:
        """Reset the rows of ``slots`` to the tokens given for each (see SamplePlan.init_*)."""
        if len(slots) == 0:
            return
        self._reserve(int(slots.max()))
        toks = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        for i, slot in enumerate(slots.tolist()):
            a, b = int(cu[i]), int(cu[i + 1])
            p = a + int(prompt_lens[i])
            self.output[slot].zero_()
            self.prompt[slot].zero_()
            self.prompt[slot, toks[a:p]] = True
            if b > p:
                self.output[slot].index_add_(0, toks[p:b], torch.ones(b - p, dtype=torch.int32,
                                                                      device=self.device))
            if self.seen is not None:
                unique = torch.unique(toks[a:b]).to(torch.int32)
                self.seen[slot, :len(unique)] = unique
                self.seen_len[slot] = len(unique)

    def with_drafts(self, slots: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> "PenaltyState":
        """A scratch state whose row i holds the counts of ``slots[i]`` plus one output
        occurrence of ``tokens[e]`` for each e with ``index[e] == i``: a request's counts as
        they would be after the draft tokens before a draft position. The state is unchanged."""
        view = PenaltyState.__new__(PenaltyState)
        view.vocab_size, view.device = self.vocab_size, self.device
        view._ops, view.seen, view.seen_len = None, None, None  # a scratch view: the dense pass
        slots = slots.long()
        view.output = self.output[slots]
        view.prompt = self.prompt[slots]
        view.output.index_put_((index.long(), tokens.long()),
                               torch.ones(index.shape[0], dtype=torch.int32, device=self.device),
                               accumulate=True)
        return view

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one occurrence of ``tokens[i]`` to the output counts of ``slots[i]``."""
        if slots.numel() and self.seen is not None:
            self._ops.count_tokens(self.output, self.prompt, self.seen, self.seen_len,
                                   slots.long().contiguous(), tokens.long().contiguous())
        elif slots.numel():
            self.output.index_put_((slots.long(), tokens.long()),
                                   torch.ones(slots.shape[0], dtype=torch.int32, device=self.device),
                                   accumulate=True)

    def apply(self, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> None:
        """Penalize rows ``rows`` of the float32 logits ``x`` [S, V] in place (one C++ pass per
        row on CPU; the torch expressions below elsewhere, and as its reference)."""
        slots = slots.long()
        rows = rows.long()
        if self.seen is not None and x.device.type == "cpu" and x.stride(1) == 1:
            self._ops.apply_penalties_seen(x, rows.contiguous(), slots.contiguous(), self.output, self.seen,
                                           self.seen_len, repetition.float().contiguous(),
                                           frequency.float().contiguous(), presence.float().contiguous())
            return
        ops = cpu_extension.ops_for(x)
        if ops is not None and hasattr(ops, "apply_penalties") and x.stride(1) == 1:
            ops.apply_penalties(x, rows.contiguous(), slots.contiguous(), self.output, self.prompt,
                                repetition.float().contiguous(), frequency.float().contiguous(),
                                presence.float().contiguous())
            return
        self.apply_reference(x, rows, slots, repetition, frequency, presence)

    def apply_reference(self, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
        slots = slots.long()
        rows = rows.long()
        counts = self.output[slots]
        seen_out = counts > 0
        xs = x[rows]
        if bool((repetition != 1.0).any()):
            seen = self.prompt[slots] | seen_out
            pen = torch.where(seen, repetition[:, None], torch.ones((), device=x.device))
            xs *= torch.where(xs > 0, 1.0 / pen, pen)
        if bool((frequency != 0.0).any()):
            xs -= frequency[:, None] * counts
        if bool((presence != 0.0).any()):
            xs -= presence[:, None] * seen_out
        x[rows] = xs
