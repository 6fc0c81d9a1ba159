"""Sequence: one request as the scheduler tracks it (tokens, KV blocks, status).

Life cycle::

    WAITING --admit (blocks allocated)--> RUNNING --finish/abort--> FINISHED
       |  ^                                  |  ^
       |  +------ preempt (blocks freed) ----+  |
       +--admit, prefix in a KV tier--> LOADING-+  (loaded: admitted; finish/abort: its
                                                    blocks freed once the load is done)

Token accounting, with ``len(seq)`` counting prompt plus sampled tokens:

- ``num_cached_tokens`` is the number of leading tokens whose KV is already in the cache: from
  prefix-cache hits and from earlier chunks of a chunked prefill. While a sequence decodes,
  every token but the last (just sampled, its KV not yet written) is cached, so the value is
  ``len(seq) - 1`` and is derived from the length rather than stored.
- ``num_scheduled_tokens`` is how many tokens the current step computes for the sequence
  (a prefill chunk, or 1 when decoding).
- A decode step needs a new block exactly when ``(len(seq) - 1) % block_size == 0``: the KV of
  the token at position ``len(seq) - 1`` starts a new block.

Invariant while RUNNING, between steps: ``len(block_table) == ceil(L / block_size)`` where L
is ``len(seq)`` during prefill and ``len(seq) - 1`` while decoding; a decode ``schedule()``
adds the block of the last token, so until ``postprocess`` it is ``ceil(len(seq) / block_size)``.
"""
from __future__ import annotations

import enum

from tpserve.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # holds its blocks while a KV tier loads some (scheduler.py)
    FINISHED = "finished"


class Sequence:
    """One request's tokens and KV-cache state. Owned and mutated by the scheduler only."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "seed",
                 "block_size", "status", "is_prefill", "num_scheduled_tokens", "block_table",
                 "_num_cached_tokens", "_cached_follows_len", "num_prefix_hit_tokens",
                 "num_hashed_blocks", "block_hashes", "finish_reason", "slot", "bad_words_ids",
                 "num_prompt_logprobs_done", "grammar", "proposer_state", "priority", "deadline",
                 "num_cached_prompt_tokens", "pooling")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, seed: int = 0, *, block_size: int = 16,
                 priority: int = 0, deadline: float | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.seed = seed
        # Set by the scheduler to its pool's block size when the sequence is added.
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.is_prefill = True
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self._num_cached_tokens = 0
        self._cached_follows_len = False
        # Tokens covered by prefix-cache blocks at admission; their KV is never rewritten.
        self.num_prefix_hit_tokens = 0
        # Prompt tokens whose KV came from the prefix cache at the first admission (None before
        # it): what a request reports as cached (OpenAI's usage.prompt_tokens_details).
        self.num_cached_prompt_tokens: int | None = None
        # Leading blocks of block_table that are registered in the prefix cache.
        self.num_hashed_blocks = 0
        # Chained hashes of this sequence's full blocks, computed once (contents never change).
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        # Row of the scheduler's per-slot arrays while RUNNING, else -1.
        self.slot = -1
        # Token ids of each tokenization of each bad word (set by the engine, which tokenizes).
        self.bad_words_ids: list[list[int]] = []
        # Prompt positions whose log-probability was computed (position 0 has none); kept
        # across preemption so that recomputing a prompt does not report a position twice.
        self.num_prompt_logprobs_done = 1
        # With structured_outputs: the request's grammar matcher (tpserve.grammar.RequestGrammar),
        # set by the engine; it has consumed every completion token so far.
        self.grammar = None
        # A draft proposer's memo over token_ids (scheduler/proposer.py); None until it is asked.
        self.proposer_state = None
        # Lower is served first under the "priority" scheduling order (scheduler/ordering.py).
        self.priority = priority
        # time.monotonic() by which the request must end (finish_reason "timeout"), or None.
        self.deadline = deadline
        # A pooling request (--runner pooling): its pooling type ("LAST", "MEAN", "CLS", or
        # "SCORE": LAST through the score head, classify). It
        # is a prefill that samples nothing: the plan pools its rows (plan_builder.py) and it
        # finishes once its prompt is computed.
        self.pooling: str | None = None

    # ---- KV accounting -------------------------------------------------------------------
    @property
    def num_cached_tokens(self) -> int:
        if self._cached_follows_len:
            return len(self.token_ids) - 1
        return self._num_cached_tokens

    @num_cached_tokens.setter
    def num_cached_tokens(self, value: int) -> None:
        self._num_cached_tokens = value
        self._cached_follows_len = False

    def start_decoding(self) -> None:
        """The prefill is complete: from now on all tokens but the last have KV."""
        self.is_prefill = False
        self.num_scheduled_tokens = 1
        self._cached_follows_len = True

    # ---- tokens --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # ---- blocks --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token of the sequence."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        assert 0 <= i < self.num_blocks, f"block {i} out of range for {self.num_blocks} blocks"
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, len={len(self)}, status={self.status.name}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
