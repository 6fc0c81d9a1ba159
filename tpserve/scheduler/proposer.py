"""Draft proposers for speculative decoding, on the scheduler side (no torch).

A proposer guesses the next tokens of running sequences from what the scheduler has: their
token ids. The interface is one method, so a suffix-tree or draft-model proposer can take the
n-gram one's place::

    propose(seqs, max_drafts) -> list of draft token lists (at most max_drafts[i] each)

Drafts only decide how much a step may verify, never what is generated: the sampler keeps a
draft only when it equals the token it samples at that position (workers/rejection.py), so a
bad guess costs compute, not correctness.

``NgramProposer`` (prompt lookup): the longest suffix of the sequence of ``n`` tokens,
``prompt_lookup_max >= n >= prompt_lookup_min``, that occurred earlier in the sequence (prompt
and output alike); the drafts are the tokens that followed its most recent earlier occurrence.
When that continuation runs into the suffix itself (the text repeats with a short period), it
continues with the period, so a loop of period p yields k drafts, not just p.

Cost: each sequence keeps an index (``seq.proposer_state``) from every n-gram to the position
after its latest occurrence, extended by the tokens appended since the last call. A call costs
O(n_max - n_min + 1) dict operations per new token plus O(n_max^2 + k) per sequence; a sequence
that was not asked for drafts for a while pays its backlog once. Tokens only ever grow while a
request lives (preemption keeps them), so the index never has to be rebuilt.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq


class Proposer(Protocol):
    def propose(self, seqs: Seq, max_drafts: Seq[int]) -> list[list[int]]:
        """Draft tokens for each sequence of ``seqs`` (``token_ids`` read only), at most
        ``max_drafts[i]`` for ``seqs[i]``; an empty list where it has no guess."""
        ...


class _NgramIndex:
    """n-gram -> the position right after its latest occurrence, for positions < ``upto``."""

    __slots__ = ("ends", "upto")

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before positions 1 .. upto - 1 are indexed


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        assert 1 <= lookup_min <= lookup_max
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, seqs: Seq, max_drafts: Seq[int]) -> list[list[int]]:
        return [self.propose_one(s, int(k)) if k > 0 else [] for s, k in zip(seqs, max_drafts)]

    def propose_one(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids
        n_tok = len(tokens)
        index = seq.proposer_state
        if index is None:
            index = seq.proposer_state = _NgramIndex()
        lo, hi = self.lookup_min, self.lookup_max
        ends = index.ends
        # Index every n-gram followed by at least one token: those ending before n_tok - 1.
        # (The suffix itself is indexed once a token follows it, so a lookup never finds it.)
        for p in range(max(index.upto, 1), n_tok):
            for n in range(lo, min(hi, p) + 1):
                ends[tuple(tokens[p - n:p])] = p
        index.upto = max(index.upto, n_tok)
        for n in range(min(hi, n_tok), lo - 1, -1):
            p = ends.get(tuple(tokens[n_tok - n:]))
            if p is None:
                continue
            drafts = tokens[p:p + k]
            period = n_tok - p
            while len(drafts) < k:  # the continuation reached the end: repeat with the period
                drafts.append(drafts[len(drafts) - period])
            return drafts
        return []
