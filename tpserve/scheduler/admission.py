"""Admission: whether a new request may join the scheduler, and the waiting queue's limits.

Admission control replaces the seed's ``assert scheduled_seqs``: a request that could never run
(longer than ``max_model_len``, or needing more KV blocks than the whole pool) is refused when it
is added (AdmissionError), so whenever work is runnable ``Scheduler.schedule()`` returns a
non-empty batch; an empty batch only means there is nothing to do. A request with a priority
other than 0 is refused under the "fcfs" order (as vLLM does), not ignored.

Queue limits: a request is refused (OverloadedError) while the waiting queue holds
``max_waiting_requests`` sequences, or when its prompt would take the queue's prompt tokens past
``max_waiting_tokens`` (a request into an empty queue is never refused for its length). The later
completions of an admitted request (``n`` > 1) are not counted against them.

Nothing here changes the scheduler's state: ``check`` raises or returns, and the scheduler then
registers the request (Scheduler.add).
"""
from __future__ import annotations

from tpserve.errors import AdmissionError, InvalidFieldError, InvalidRequestError, OverloadedError
from tpserve.scheduler.sequence import SequenceStatus


class Admission:
    """The checks of ``Scheduler.add`` over one engine's limits; counts the refusals."""

    def __init__(self, config, block_manager, waiting, by_priority: bool):
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len  # None: only the pool bounds a sequence
        self.block_manager = block_manager
        self.waiting = waiting
        self.by_priority = by_priority
        self.max_waiting_requests, self.max_waiting_tokens = config.queue_limits()
        self.num_refused = {"max_waiting_requests": 0, "max_waiting_tokens": 0}

    def check(self, seq, known, limit_queue: bool = True) -> None:
        """Raise if ``seq`` may not be added: a bad or used id (``known``: the ids of unfinished
        requests), an empty prompt or negative ids, a request that could never be scheduled
        (AdmissionError), a priority under "fcfs", or a full queue (OverloadedError; not with
        ``limit_queue`` False)."""
        rid = seq.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidFieldError("request_id", f"must be a non-empty string, got {rid!r}")
        if rid in known:
            raise InvalidRequestError("request_id", f"{rid!r} is already used by an unfinished request; "
                                      "ids must be unique among unfinished requests")
        prompt_len = seq.num_prompt_tokens
        if prompt_len == 0:
            raise InvalidFieldError("prompt_token_ids", f"request {rid!r}: must hold at least one token")
        assert seq.status is SequenceStatus.WAITING and not seq.block_table and len(seq) == prompt_len, \
            "add() takes a fresh sequence"
        max_tokens = seq.sampling_params.max_tokens
        total = prompt_len + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise AdmissionError(rid, "max_model_len", total, self.max_model_len,
                                 f"prompt of {prompt_len} tokens + max_tokens {max_tokens}")
        # The last sampled token's KV is never written, hence total - 1 (but every prompt
        # token's is, when max_tokens is 0).
        # With KV-cache groups, admission (and readmission after a preemption) gives every group a
        # block per block of the sequence.
        blocks = -(-max(total - 1, prompt_len) // self.block_size) * self.block_manager.blocks_per_append
        pool = self.block_manager.num_blocks
        if blocks > pool:
            raise AdmissionError(rid, "num_kv_blocks", blocks, pool,
                                 f"prompt of {prompt_len} tokens + max_tokens {max_tokens} needs "
                                 f"{blocks} blocks of {self.block_size} tokens; the KV pool has {pool}")
        # After the length checks: a prompt far over the context is refused without a pass over
        # its ids (a million of them: 7 ms of the serving loop).
        if min(seq.token_ids) < 0:
            raise InvalidFieldError("prompt_token_ids", f"request {rid!r}: token ids must be >= 0, "
                                    f"got {min(seq.token_ids)}")
        if seq.priority != 0 and not self.by_priority:
            raise InvalidFieldError("priority", f"is {seq.priority}, but this engine schedules first come, "
                                    "first served (scheduling_order fcfs): only 0 is accepted; start it with "
                                    "scheduling_order priority to use priorities")
        if limit_queue:
            self.check_queue_limits(seq)

    def check_queue_limits(self, seq) -> None:
        waiting, cap = self.waiting, self.max_waiting_requests
        if cap is not None and len(waiting) >= cap:
            self.num_refused["max_waiting_requests"] += 1
            raise OverloadedError(seq.request_id, "max_waiting_requests", len(waiting) + 1, cap)
        cap = self.max_waiting_tokens
        if cap is not None and waiting and waiting.num_tokens + len(seq) > cap:
            self.num_refused["max_waiting_tokens"] += 1
            raise OverloadedError(seq.request_id, "max_waiting_tokens", waiting.num_tokens + len(seq), cap)
