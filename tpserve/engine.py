"""Engine: the step loop that joins the scheduler (rank 0) and the runners of every rank.

    add_request ─▶ Scheduler.add            (admission control, raises AdmissionError)
    step():  Scheduler.schedule ─▶ build_plan ─▶ executor.execute (all ranks) ─▶ tokens
             ─▶ Scheduler.postprocess ─▶ detokenize, stop strings ─▶ RequestOutputs

One step is one forward over one plan. Under the default "mixed" scheduling policy a step may
hold decode rows (one token each, every running stream) and prefill chunks together, so
requests added between two ``step()`` calls join the next step beside the running ones;
``postprocess`` appends the decode rows' tokens and advances the prefill rows, which are
sampled only when their last prompt token is computed.

The engine is used in-process by the offline ``LLM`` API and by the daemon's server loop.
With ``tensor_parallel_size`` > 1 the executor publishes each plan to worker processes.
"""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from tpserve.config import EngineConfig
from tpserve.detokenizer import IncrementalDetokenizer
from tpserve.errors import InvalidRequestError, StepFailedError, WorkerDiedError
from tpserve.outputs import RequestOutput, TokenLogprobs
from tpserve.plan import Command
from tpserve.requests import check_prompt_shape, check_request
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence
from tpserve.tokenizer import load_tokenizer
from tpserve.workers.executor import make_executor

log = logging.getLogger("tpserve.engine")


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    sent_tokens: int = 0
    arrival: float = 0.0
    queue_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # sampled but not yet reported


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.resolve()
        self.tokenizer = load_tokenizer(config.model_path)
        self.executor = make_executor(self.config)
        self.config.num_kv_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(self.config)
        self.requests: dict[str, _Request] = {}
        self._rng = random.Random(self.config.seed)
        self._start = time.monotonic()
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)
        self.num_steps = 0
        self._num_logprob_requests = 0  # requests in flight with logprobs set (0: skip the scan)

    # ---- requests ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids are below it), if its config states one."""
        vocab = self.config.hf_config.get("vocab_size")
        return int(vocab) if vocab else None

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (no special tokens added).

        Safe to call from another thread than the one stepping the engine: it touches only the
        tokenizer, never the scheduler. The daemon tokenizes long prompts off its serving loop.
        """
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token ids")
        check_prompt_shape(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def tokenizer_path(self) -> str | None:
        """The model directory ``tokenize``'s tokenizer was loaded from (None without one)."""
        return str(self.config.model_path) if self.tokenizer is not None else None

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    detokenize: bool = True) -> int:
        """Queue a request; returns its prompt length in tokens.

        Raises AdmissionError if it can never fit, InvalidFieldError if a field is out of its
        bounds (tpserve.requests; token ids must be below the vocabulary size) and
        InvalidRequestError if it cannot be served otherwise (empty after tokenizing, an id in
        use). Nothing is queued when it raises.

        ``detokenize`` False skips per-step text (the offline API decodes once at the end);
        requests with stop strings are always detokenized.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt = check_request(prompt, params, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("params.stop", "stop strings need a tokenizer; this model has none")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq = Sequence(request_id, ids, params, seed=seed)
        self.scheduler.add(seq)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop) \
            if (detokenize or params.stop) and self.tokenizer is not None else None
        self.requests[request_id] = _Request(seq, detok, arrival=time.monotonic(),
                                             logprobs=[] if params.logprobs is not None else None)
        self._num_logprob_requests += params.logprobs is not None
        return len(ids)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._num_logprob_requests -= req.logprobs is not None
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_room(self) -> bool:
        """Fewer requests wait than one step can start (``max_num_seqs``): one added now is
        not queued behind more than a step's worth of others."""
        return len(self.scheduler.waiting) < self.config.max_num_seqs

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output per request that advanced.

        A step that fails while its plan is built, or while a single-process forward runs,
        raises StepFailedError after aborting that step's requests (their blocks are freed);
        the engine stays usable. WorkerDiedError, and a failed forward with tensor-parallel
        workers (they may be stuck inside a collective), propagate: the engine is unusable then.
        """
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            plan = self.scheduler.build_plan(batch)
            plan.step_id = self.num_steps
        except Exception as e:  # bad data of this batch's requests: nothing was published yet
            raise self._fail_step(batch, e) from e
        if batch.is_prefill:  # a request is first scheduled in a step with prefill rows
            now = time.monotonic()
            for seq in batch.seqs[batch.num_decodes:]:
                req = self.requests.get(seq.request_id)
                if req is not None and req.queue_time is None:
                    req.queue_time = now - req.arrival
        num_logprobs = self._num_logprobs(batch)
        try:
            if num_logprobs < 0:
                tokens = self.executor.execute(plan)
            else:
                tokens, logprobs = self.executor.execute(plan, num_logprobs)
        except WorkerDiedError:
            raise
        except Exception as e:
            if self.config.tensor_parallel_size > 1:
                raise
            raise self._fail_step(batch, e) from e
        if num_logprobs >= 0:
            self._keep_logprobs(batch, logprobs)
        self.num_steps += 1
        seqs = self.scheduler.postprocess(batch, tokens)
        self._recent.append((time.monotonic(), len(tokens)))
        return [self._output(seq) for seq in seqs]

    def _fail_step(self, batch, cause: Exception) -> StepFailedError:
        ids = [seq.request_id for seq in batch.seqs]
        log.error("a step of %d request(s) failed (%s: %s); aborting them", len(ids),
                  type(cause).__name__, cause, exc_info=cause)
        for rid in ids:
            self.abort_request(rid)
        return StepFailedError(ids, cause)

    @staticmethod
    def _sampled(batch) -> list[Sequence]:
        """The sequences that get a token this step, in sample-row order."""
        if not batch.is_prefill:
            return batch.seqs
        nd = batch.num_decodes  # decode rows come first and are always sampled
        return batch.seqs[:nd] + [s for s, sampled in zip(batch.seqs[nd:], batch.sampled) if sampled]

    def _num_logprobs(self, batch) -> int:
        """The most alternatives any sampled sequence asks for; -1 when none wants logprobs."""
        if not self._num_logprob_requests:
            return -1
        ks = [s.sampling_params.logprobs for s in self._sampled(batch)
              if s.sampling_params.logprobs is not None]
        return max(ks, default=-1)

    def _keep_logprobs(self, batch, logprobs) -> None:
        sampled_lp, top_ids, top_lp = logprobs
        for row, seq in enumerate(self._sampled(batch)):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            top = list(zip(top_ids[row, :k].tolist(), top_lp[row, :k].tolist()))
            self.requests[seq.request_id].logprobs.append(TokenLogprobs(float(sampled_lp[row]), top))

    def _output(self, seq: Sequence) -> RequestOutput:
        req = self.requests[seq.request_id]
        completion = seq.completion_token_ids
        new_ids = completion[req.sent_tokens:]
        finished, reason = seq.is_finished, seq.finish_reason
        text = ""
        if req.detok is not None:
            req.detok.add(new_ids)
            if not finished and req.detok.find_stop():
                self.scheduler.finish(seq, "stop")
                finished, reason = True, "stop"
            elif finished:
                req.detok.flush()
            text = req.detok.take_new_text(final=finished)
        req.sent_tokens = len(completion)
        logprobs = None
        if req.logprobs is not None:
            logprobs, req.logprobs = req.logprobs, []
        if finished:
            del self.requests[seq.request_id]
            self._num_logprob_requests -= logprobs is not None
        return RequestOutput(seq.request_id, list(new_ids), text, finished,
                             reason if finished else None, seq.num_prompt_tokens, len(completion),
                             logprobs=logprobs, queue_time=req.queue_time)

    # ---- health --------------------------------------------------------------------------
    def health_fd(self) -> int | None:
        """A file descriptor that becomes readable when the engine can no longer run steps
        (a tensor-parallel worker died), so an idle caller can ``poll`` on it; None if no such
        failure can happen (TP 1) or be observed (torchrun)."""
        return self.executor.health_fd() if self.executor is not None else None

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker has died."""
        if self.executor is not None:
            self.executor.check_health()

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the block pool, the queues
        and, when nothing is unfinished, of an idle engine (every KV block free, no request
        state left). O(number of blocks): for an idle engine, not for every step."""
        self.scheduler.check_integrity()
        if not self.scheduler.has_unfinished():
            used = self.scheduler.block_manager.used_block_ids
            assert not used, f"an idle engine still holds {len(used)} KV block(s): {sorted(used)[:16]}"
            assert not self.requests, f"an idle engine still tracks requests {sorted(self.requests)[:16]}"

    # ---- control -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start the torch profiler on every rank (steps keep running)."""
        self.executor.control(Command.PROFILE_START)

    def stop_profile(self, path: str) -> list[str]:
        """Stop the profiler on every rank; each writes ``{path}.rank{r}.json``. Returns the paths."""
        self.executor.control(Command.PROFILE_STOP, path=path)
        return [f"{path}.rank{r}.json" for r in range(self.config.tensor_parallel_size)]

    def stats(self) -> dict:
        s = dict(self.scheduler.stats())
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t < 10.0]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        hits, computed = s.get("prefix_cache_hit_tokens", 0), s.get("prompt_tokens_computed", 0)
        s.update(prompt_tokens=hits + computed, generation_tokens=s.get("decode_tokens", 0),
                 prefix_cache_hit_rate=hits / (hits + computed) if hits + computed else 0.0)
        s.update(model=str(self.config.model_path), tensor_parallel_size=self.config.tensor_parallel_size,
                 uptime_s=now - self._start, num_steps=self.num_steps,
                 tokens_per_s=(sum(n for _, n in recent[1:]) / span) if span > 0 else 0.0)
        return s

    def shutdown(self) -> None:
        ex = getattr(self, "executor", None)
        if ex is not None:
            ex.shutdown()
            self.executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
