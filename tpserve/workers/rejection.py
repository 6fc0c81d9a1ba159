"""Speculative acceptance: which draft tokens a sequence keeps, the last stage of the sampler.

A sequence with drafts d_1 .. d_k has k + 1 sample rows; row j holds the target distribution
p_j of the token after d_1 .. d_j (its logits processed as if they were accepted, see
scheduler/sample_inputs.py), and the sampler draws a token t_j from every row with the
counter-based race of (seed, step + j), exactly as it would draw that step's token without
speculation. The rule: keep t_0; while d_{j+1} == t_j keep t_{j+1}; stop at the first
mismatch. So a sequence keeps m + 1 tokens, m its accepted drafts, t_m being the correction
(after a rejection) or the bonus token (all k accepted).

Why this is the rejection rule for a one-hot draft (accept d with probability p(d), else sample
from p with d removed and renormalised), and so leaves the output distribution unchanged: the
race draws t_j = d with probability p_j(d), so "d accepted" has probability p_j(d); given
t_j != d, t_j = x with probability p_j(x) / (1 - p_j(d)), which is p_j with d removed and
renormalised. Accept decision and residual draw are one race, a deterministic function of
(seed, step index of that position, token): reproducible and independent of the batch. It is
also the standard rule's maximal coupling with the non-speculative run: for a given seed a
request generates exactly the tokens it generates without speculation (greedy rows being the
case of a race of one), so "exact" can be tested token for token.
"""
from __future__ import annotations

import numpy as np


def accept(tokens: np.ndarray, draft_counts: np.ndarray, draft_tokens: np.ndarray) -> np.ndarray:
    """int32 [Q]: tokens each sequence keeps (accepted drafts + 1), from the sampled tokens of
    its ``draft_counts[i] + 1`` consecutive rows in ``tokens`` and its drafts in ``draft_tokens``
    (laid out as in SamplePlan). A row left without a token (-1) never matches a draft."""
    out = np.ones(len(draft_counts), dtype=np.int32)
    row = draft = 0
    for i, k in enumerate(np.asarray(draft_counts).tolist()):
        m = 0
        while m < k and tokens[row + m] == draft_tokens[draft + m]:
            m += 1
        out[i] = m + 1
        row += k + 1
        draft += k
    return out
