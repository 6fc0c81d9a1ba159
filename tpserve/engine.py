"""Engine: the step loop that joins the scheduler (rank 0) and the runners of every rank.

    add_request ─▶ Scheduler.add            (admission control, raises AdmissionError)
    step():  Scheduler.schedule ─▶ build_plan ─▶ executor.execute (all ranks) ─▶ tokens
             ─▶ Scheduler.postprocess ─▶ detokenize, stop strings ─▶ EngineOutputs

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
import math
import random
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from tpserve.blockpool.kv_events import KVEventSink, resync_events
from tpserve.config import EngineConfig
from tpserve.detokenizer import IncrementalDetokenizer
from tpserve.errors import (AdmissionError, InvalidFieldError, InvalidRequestError,
                            OverloadedError, StepFailedError, WorkerDiedError)
from tpserve.grammar import GrammarCompiler, RequestGrammar
from tpserve.kernels import cpu_extension
from tpserve.outputs import EngineOutput, TokenLogprobs
from tpserve.pooling import (MAX_POOLING_INPUTS, PoolingParams, finish_embedding, finish_scores,
                             is_sequence_classifier, resolve_score_tokens, wrong_runner)
from tpserve.kv_tiers.index import KVTierIndex
from tpserve.plan import Command, StepPlan
from tpserve.request import rest_of_context
from tpserve.limits import (MAX_PROMPT_TOKENS, MAX_SEED, check_priority, check_prompt_shape, check_request,
                            check_timeout, check_token_ids)
from tpserve.sample_plan import draft_row_positions, kept_rows
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence
from tpserve.tokenizer import load_tokenizer
from tpserve.workers.executor import make_executor

log = logging.getLogger("tpserve.engine")

# How long an idle step waits for a compiling grammar before it returns (the caller polls again).
_GRAMMAR_WAIT_S = 0.005


@dataclass
class _Completion:
    """The state of one completion in flight: completion ``index`` of its family's ``n``."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    family: "_Family"
    index: int = 0                       # which of the family's n completions
    sent_tokens: int = 0
    arrival: float = 0.0
    queue_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # sampled but not yet reported
    prompt_logprobs: list | None = None  # computed but not yet reported (None for position 0)
    pooled: np.ndarray | None = None     # pooling: its rows pooled so far (float32 [hidden])
    score: np.ndarray | None = None      # classify: the score head of ``pooled``


@dataclass
class _Family:
    """The ``n`` completions of one request id. Completion 0 is queued at once; the others when
    its prefill is done, so that they find the prompt's full blocks in the prefix cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    bad_words_ids: list[list[int]]
    members: list[str]                   # internal ids of the completions queued so far
    detokenize: bool = True
    unfinished: int = 0
    grammar: Future | None = None        # the compiled grammar (structured_outputs), shared
    priority: int = 0
    arrival: float = 0.0                 # time.monotonic() of its arrival
    deadline: float | None = None        # arrival + timeout: every completion ends by then
    # --runner pooling: one member per prompt (index i: prompt i), answered together
    pooling: PoolingParams | None = None
    results: list | None = None          # each prompt's embedding or [score], as it finishes
    prompt_lens: list[int] | None = None
    failed: str | None = None            # the finish reason of a member that did not finish "stop"


# Separates a request id from a completion index in the internal id of completion i > 0.
_SEP = "\x00"


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences ``bad_words`` bans, as vLLM derives them: each word's tokens
    without and with a leading space (the latter when it starts with a different token and
    has as many tokens), so a word is caught at the start of the text and inside it."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidFieldError("bad_words", f"{word!r} tokenizes to no token")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.resolve()
        self.tokenizer = load_tokenizer(config.model_path)
        self.runner = self.config.runner
        self.pooler = self.config.pooler
        self.can_classify = False
        if self.runner == "pooling":
            self._resolve_score_tokens()  # before the runners start: rank 0 reads their rows
        self.executor = make_executor(self.config)
        self.config.num_kv_blocks = self.executor.num_blocks
        # What the KV pool stores (--kv-cache-dtype, resolved by the runner: "auto" is the model's dtype).
        kv_dtype = getattr(getattr(self.executor, "runner", None), "kv_dtype", None)
        self.kv_cache_dtype = str(kv_dtype).replace("torch.", "") if kv_dtype is not None \
            else self.config.kv_cache_dtype
        # The KV-cache groups of the model's attention layers (sliding windows), as rank 0 found them.
        self.scheduler = Scheduler(self.config,
                                   getattr(getattr(self.executor, "runner", None), "kv_groups", None))
        self._attach_kv_tiers()
        self.requests: dict[str, _Completion] = {}   # by internal id (completion i > 0: id + _SEP + i)
        self.families: dict[str, _Family] = {}
        self._rng = random.Random(self.config.seed)
        self._start = time.monotonic()
        self._recent: deque[tuple[float, int, int]] = deque(maxlen=64)  # (time, sampled, computed)
        self.num_steps = 0
        self._grammars = None  # GrammarCompiler, made at the first structured request
        # TokenLogprobs.rank wanted (the offline API's vLLM Logprob.rank): one more pass over the
        # vocabulary per logprobs row, which the daemon, reporting no ranks, does not pay.
        self.logprob_ranks = False
        self.num_pooling_requests = 0       # pooling requests answered (all their prompts)
        self.num_pooling_prompts = 0
        self.pooling_prompt_tokens = 0

    def _attach_kv_tiers(self) -> None:
        """With KV tiers configured, the scheduler side (kv_tiers/index.py) sized from rank 0's
        worker side (its block bytes and disk layout; every rank's shard is the same size)."""
        cfg = self.config
        if not (cfg.kv_offload_host_gb or cfg.kv_offload_dir):
            return
        runner = self.executor.runner
        gib = 1 << 30
        index = KVTierIndex(cfg.block_size, runner.kv_tiers.block_bytes, int(cfg.kv_offload_host_gb * gib),
                            cfg.kv_offload_dir, int(cfg.kv_offload_disk_gb * gib), runner.kv_layout,
                            cfg.tensor_parallel_size)
        self.scheduler.attach_kv_tiers(index)

    def _kv_step(self, wait: bool) -> None:
        """A plan of KV-tier commands only (no tokens): saves, loads to start, polls."""
        meta = self.scheduler.kv_meta(wait)
        if meta is None:
            return
        out = self.executor.execute(StepPlan(args={"kv": meta}, step_id=self.num_steps))
        self.scheduler.kv_results(out.kv)

    # ---- requests ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids are below it), if its config states one."""
        vocab = self.config.hf_config.get("vocab_size")
        return int(vocab) if vocab else None

    def tokenize(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a text prompt (``add_special_tokens``: as the tokenizer defines them).

        Safe to call from another thread than the one stepping the engine: it touches only the
        tokenizer, never the scheduler. The daemon tokenizes long prompts off its serving loop.
        """
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token ids")
        check_prompt_shape(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def tokenizer_path(self) -> str | None:
        """The model directory ``tokenize``'s tokenizer was loaded from (None without one)."""
        return str(self.config.model_path) if self.tokenizer is not None else None

    def _check_common(self, request_id, priority, timeout, arrival) -> tuple:
        """The checks every request kind shares: its id (non-empty, no NUL, not in use), its
        priority and timeout; returns (priority, timeout, arrival)."""
        priority, timeout = check_priority(priority), check_timeout(timeout)
        if not isinstance(request_id, str) or not request_id or _SEP in request_id:
            raise InvalidFieldError("request_id", "must be a non-empty string without NUL characters")
        if request_id in self.families:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        return priority, timeout, time.monotonic() if arrival is None else arrival

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    detokenize: bool = True, *, priority: int = 0, timeout: float | None = None,
                    arrival: float | None = None) -> int:
        """Queue a request; returns its prompt length in tokens.

        Raises AdmissionError if it can never fit, OverloadedError if the waiting queue is
        full (EngineConfig.max_waiting_*; try again later), InvalidFieldError if a field is
        out of its bounds (tpserve.limits; token ids must be below the vocabulary size; a
        priority other than 0 under the fcfs order) and InvalidRequestError if it cannot be
        served otherwise (empty after tokenizing, an id in use). Nothing is queued when it raises.

        ``priority``: lower is served first (scheduling_order "priority"). ``timeout``: seconds
        after ``arrival`` (a time.monotonic() value; default now) by which every completion
        ends, with finish_reason "timeout" if it has not finished by then.

        ``params.max_tokens`` None generates up to the rest of the context (max_model_len).
        ``params.n`` > 1 generates n completions, reported with ``EngineOutput.index``.
        ``detokenize`` False skips per-step text (the offline API decodes once at the end);
        requests with stop strings are always detokenized.
        """
        if self.runner != "generate":
            raise InvalidRequestError("runner", wrong_runner(self.runner, "generation"))
        params = params or SamplingParams()
        priority, timeout, arrival = self._check_common(request_id, priority, timeout, arrival)
        prompt = check_request(prompt, params, self.vocab_size)
        if (params.stop or params.bad_words) and self.tokenizer is None:
            name = "params.stop" if params.stop else "params.bad_words"
            raise InvalidRequestError(name, "needs a tokenizer; this model has none")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if params.max_tokens is None:  # the rest of the context (tpserve/request.py: each API's default)
            params = replace(params, max_tokens=rest_of_context(self.config.max_model_len, len(ids)))
        bad = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        fam = _Family(request_id, ids, params, seed, bad, [], detokenize, priority=priority, arrival=arrival,
                      deadline=None if timeout is None else arrival + timeout)
        if params.structured_outputs is not None:
            fam.grammar = self._compile(params.structured_outputs)
        try:
            self._add_member(fam, 0)  # raises (queuing nothing) if it can never run or the queue is full
        except OverloadedError as e:
            e.retry_after = self._retry_after()
            raise
        finally:
            if fam.grammar is not None and not fam.members:  # refused: nobody waits for its grammar
                self._grammars.release(fam.grammar)
        self.families[request_id] = fam
        return len(ids)

    # ---- pooling (--runner pooling; tpserve/pooling.py) -------------------------------------
    def _resolve_score_tokens(self) -> None:
        """Find the yes/no reranker's two score tokens (``classifier_from_token``, default
        "no"/"yes") in the vocabulary, for rank 0's score head; a sequence-classification
        checkpoint has its own head. Without either, classify is refused (``task``)."""
        cfg = self.config
        if is_sequence_classifier(cfg.hf_config):
            self.can_classify = True
            return
        ids = resolve_score_tokens(self.pooler, self.tokenizer, self.vocab_size)
        if ids is not None:  # written down: spawned ranks then need no tokenizer to agree
            cfg.pooler_config = dict(cfg.pooler_config or self.pooler.to_dict(), score_token_ids=list(ids))
            self.pooler = cfg.pooler
            self.can_classify = True

    def add_pooling_request(self, request_id: str, prompts: list, params: PoolingParams | None = None, *,
                            priority: int = 0, timeout: float | None = None,
                            arrival: float | None = None) -> int:
        """Queue an embed / classify request of one or more prompts (strings, tokenized with the
        tokenizer's special tokens, or token ids), scheduled together and answered together:
        one EngineOutput whose ``pooled`` holds each prompt's embedding (or ``[score]``) once
        all of them are computed. Returns their prompt tokens in all.

        Raises as ``add_request`` does (the field named: ``prompts``, ``prompts[i]``,
        ``dimensions``, ``task``; AdmissionError for a prompt over ``max_model_len``), and
        InvalidRequestError naming ``--runner`` on a generate engine. Nothing is queued when
        it raises."""
        if self.runner != "pooling":
            raise InvalidRequestError("runner", wrong_runner(self.runner, "embed / classify"))
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidFieldError("params", f"must be a PoolingParams, got {type(params).__name__}")
        priority, timeout, arrival = self._check_common(request_id, priority, timeout, arrival)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidFieldError("prompts", "must hold at least one prompt")
        if len(prompts) > MAX_POOLING_INPUTS:
            raise InvalidFieldError("prompts", f"holds {len(prompts)} prompts; at most {MAX_POOLING_INPUTS}")
        hidden = int(self.config.hf_config.get("hidden_size") or 0)
        if params.task == "classify" and not self.can_classify:
            raise InvalidFieldError("task", "this model has no score head: classify needs a "
                                    "*ForSequenceClassification checkpoint, or score tokens in the "
                                    "vocabulary (--pooler-config classifier_from_token)")
        if params.dimensions is not None and hidden and params.dimensions > hidden:
            raise InvalidFieldError("dimensions", f"{params.dimensions} is more than the model's "
                                    f"{hidden} dimensions")
        ids_list = []
        for i, prompt in enumerate(prompts):
            name = f"prompts[{i}]"
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidRequestError(name, "this model has no tokenizer: send token ids")
                check_prompt_shape(prompt, name)
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                ids = check_token_ids(name, prompt, MAX_PROMPT_TOKENS, 1, self.vocab_size)
            if not ids:
                raise InvalidRequestError(name, "is empty after tokenization")
            ids_list.append(ids)
        kind = "SCORE" if params.task == "classify" else self.pooler.pooling
        fam = _Family(request_id, [], SamplingParams(max_tokens=0), 0, [], [], False, priority=priority,
                      arrival=arrival, deadline=None if timeout is None else arrival + timeout,
                      pooling=params, results=[None] * len(ids_list), prompt_lens=[len(x) for x in ids_list])
        try:
            for i, ids in enumerate(ids_list):
                rid = f"{request_id}{_SEP}{i}"
                seq = Sequence(rid, ids, fam.params, priority=priority, deadline=fam.deadline)
                seq.pooling = kind
                try:
                    self.scheduler.add(seq, limit_queue=i == 0)
                except AdmissionError as e:  # a prompt that can never fit: name it
                    raise InvalidFieldError(f"prompts[{i}]", f"has {len(ids)} tokens, more than {e.limit} "
                                            f"{e.allowed} allows") from None
                self.requests[rid] = _Completion(seq, None, fam, i, arrival=arrival)
                fam.members.append(rid)
                fam.unfinished += 1
        except OverloadedError as e:
            self._drop_members(fam)
            e.retry_after = self._retry_after()
            raise
        except BaseException:
            self._drop_members(fam)
            raise
        self.families[request_id] = fam
        return sum(fam.prompt_lens)

    def _drop_members(self, fam: _Family) -> None:
        for rid in fam.members:
            if self.requests.pop(rid, None) is not None:
                self.scheduler.abort(rid)

    def _keep_pooled(self, spans, pooled: np.ndarray, scores: np.ndarray | None) -> None:
        """A step's pooled spans added to their requests (a chunk that starts the prompt
        starts the sum over: a preempted request computes its prompt again)."""
        for row, (seq, starts) in enumerate(spans):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            if starts or req.pooled is None:
                req.pooled = pooled[row].copy()
                req.score = None if scores is None else scores[row].copy()
            else:
                req.pooled += pooled[row]
                if scores is not None:
                    req.score = scores[row].copy() if req.score is None else req.score + scores[row]

    def _pool_output(self, seq: Sequence) -> EngineOutput | None:
        """A pooling member finished: None until the last of its request's prompts has, then
        the request's one output (``pooled``: each prompt's embedding or [score])."""
        req = self.requests.pop(seq.request_id, None)
        if req is None:
            return None
        fam = req.family
        fam.unfinished -= 1
        reason = seq.finish_reason
        if reason == "stop" and req.pooled is not None:
            n = fam.prompt_lens[req.index]
            if fam.pooling.task == "classify":
                fam.results[req.index] = finish_scores(req.score, self.pooler)
            else:
                fam.results[req.index] = finish_embedding(req.pooled, fam.pooling, self.pooler, n)
        elif fam.failed is None:
            fam.failed = reason if reason != "stop" else "error"
        if fam.unfinished:
            return None
        self.families.pop(fam.request_id, None)
        total = sum(fam.prompt_lens)
        if fam.failed is not None:
            return EngineOutput(fam.request_id, finished=True, finish_reason=fam.failed,
                                num_prompt_tokens=total)
        self.num_pooling_requests += 1
        self.num_pooling_prompts += len(fam.results)
        self.pooling_prompt_tokens += total
        return EngineOutput(fam.request_id, finished=True, finish_reason="stop", num_prompt_tokens=total,
                            queue_time=req.queue_time, pooled=fam.results,
                            pooled_prompt_tokens=fam.prompt_lens)

    def _add_member(self, fam: _Family, index: int) -> None:
        params, seed = fam.params, fam.seed
        if index:
            # A distinct seed per completion (seed + i, as vLLM); prompt logprobs come once.
            seed = (fam.seed + index) % (MAX_SEED + 1) if params.seed is not None else self._rng.getrandbits(62)
            params = replace(params, seed=seed if params.seed is not None else None, prompt_logprobs=None)
        rid = fam.request_id if index == 0 else f"{fam.request_id}{_SEP}{index}"
        seq = Sequence(rid, fam.prompt_ids, params, seed=seed, priority=fam.priority, deadline=fam.deadline)
        seq.bad_words_ids = fam.bad_words_ids
        if fam.grammar is not None:
            seq.grammar = RequestGrammar(fam.grammar, self._grammars.release)
        self.scheduler.add(seq, limit_queue=index == 0)  # the family was admitted with completion 0
        detok = None
        if (fam.detokenize or params.stop) and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, fam.prompt_ids, params.stop,
                                           params.include_stop_str_in_output, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        self.requests[rid] = _Completion(seq, detok, fam, index, arrival=fam.arrival,
                                         logprobs=[] if params.logprobs is not None else None,
                                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        fam.members.append(rid)
        fam.unfinished += 1

    def _compile(self, so) -> Future:
        """Start compiling ``so``'s grammar (or find it cached). Nothing of the constraint is
        parsed or converted here: that runs in the grammar process, under the time budget
        ``grammar_timeout`` and a size budget (tpserve/grammar), and a refusal arrives with the
        request's output (an InvalidFieldError naming ``params.structured_outputs.<kind>``)."""
        if self.tokenizer is None:
            raise InvalidRequestError("params.structured_outputs", "needs a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size or len(self.tokenizer),
                                             self.config.eos_token_ids, timeout_s=self.config.grammar_timeout)
        return self._grammars.compile(so, f"params.structured_outputs.{so.kind}")

    def _add_siblings(self, fam: _Family) -> None:
        for j in range(len(fam.members), fam.params.n):
            self._add_member(fam, j)

    def abort_request(self, request_id: str) -> bool:
        """Abort every completion of ``request_id``; False if it is unknown or finished."""
        fam = self.families.pop(request_id, None)
        if fam is None:
            return False
        for rid in fam.members:
            if self.requests.pop(rid, None) is not None:
                self.scheduler.abort(rid)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_room(self) -> bool:
        """Fewer requests wait than one step can start (``max_num_seqs``): one added now is
        not queued behind more than a step's worth of others. Always under the "priority"
        scheduling order, whose waiting queue orders every request by its priority."""
        return self.scheduler.by_priority or len(self.scheduler.waiting) < self.config.max_num_seqs

    def check_queue_room(self, request_id: str, held: int) -> None:
        """Raise OverloadedError (with ``retry_after``) if a request arriving now behind
        ``held`` requests that the caller holds back would take the waiting queue past
        ``max_waiting_requests``. Their prompt tokens are checked when they are added."""
        s = self.scheduler
        cap, queued = s.max_waiting_requests, len(s.waiting) + held
        if cap is not None and queued >= cap:
            s.num_refused["max_waiting_requests"] += 1
            raise OverloadedError(request_id, "max_waiting_requests", queued + 1, cap, self._retry_after())

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Run one step; returns an output per request completion that advanced.

        Completions past their deadline end first: when there are any, this call only ends
        them (finish_reason "timeout", blocks freed) and returns their outputs; the next call
        runs the step.

        A step that fails while its plan is built, or while a single-process forward runs,
        raises StepFailedError after aborting that step's requests (their blocks are freed);
        the engine stays usable. WorkerDiedError, and a failed forward with tensor-parallel
        workers (they may be stuck inside a collective), propagate: the engine is unusable then.
        """
        expired = self.scheduler.expire(time.monotonic())
        if expired:
            return [o for o in map(self._output, expired) if o is not None]
        batch = self.scheduler.schedule()
        failed = self.scheduler.take_grammar_failures()
        if failed:
            failed = [self._output(seq) for seq in failed if seq.request_id in self.requests]
        if not batch:
            if self.scheduler.kv_has_work():  # KV-tier commands, or loads to wait for
                self._kv_step(wait=True)
                return failed
            if not failed:  # only grammars compiling: wait for one rather than spin
                self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
            return failed
        try:
            plan = self.scheduler.build_plan(batch)
            plan.step_id = self.num_steps
            sample = self.scheduler.build_sample_plan(batch, plan)
            sample.logprob_ranks = self.logprob_ranks
        except Exception as e:  # bad data of this batch's requests: nothing was published yet
            raise self._fail_step(batch, e) from e
        if batch.is_prefill:  # a request is first scheduled in a step with prefill rows
            now = time.monotonic()
            for seq in batch.seqs[batch.num_decodes:]:
                req = self.requests.get(seq.request_id)
                if req is not None and req.queue_time is None:
                    req.queue_time = now - req.arrival
        try:
            out = self.executor.execute(plan, sample)
        except WorkerDiedError:
            raise
        except Exception as e:
            if self.config.tensor_parallel_size > 1:
                raise
            raise self._fail_step(batch, e) from e
        if out.kv is not None:
            self.scheduler.kv_results(out.kv)
        sampled = batch.sampled_seqs()
        tokens, logprobs, counts = out.tokens, out.logprobs, out.accepted
        row_seq = None  # the sampled sequence of each kept token (None: the i-th has the i-th)
        if counts is not None:  # speculative decoding: keep each sequence's accepted rows
            keep = kept_rows(sample.draft_counts, counts)
            row_seq = draft_row_positions(sample.draft_counts)[0][keep]
            tokens = tokens[keep]
            logprobs = tuple(a[keep] for a in logprobs) if logprobs is not None else None
        if logprobs is not None:
            self._keep_logprobs(sampled, logprobs, row_seq)
        if out.prompt_logprobs is not None:
            self._keep_prompt_logprobs(batch.prompt_logprobs, out.prompt_logprobs)
        if out.pooled is not None:
            self._keep_pooled(batch.pool_spans, out.pooled, out.scores)
        dead = [sampled[p if row_seq is None else row_seq[p]] for p in np.flatnonzero(tokens < 0).tolist()]
        for seq in dead:  # no token left to sample: the request cannot go on
            log.warning("request %r: its logits controls left no token to sample", seq.request_id)
            self.scheduler.finish(seq, "error")
        self.num_steps += 1
        seqs = self.scheduler.postprocess(batch, np.maximum(tokens, 0) if dead else tokens, counts)
        self._recent.append((time.monotonic(), len(tokens), batch.num_tokens))
        outputs = [o for o in map(self._output, seqs) if o is not None]
        outputs += [self._output(seq) for seq in dead if seq.request_id in self.requests]
        return failed + outputs if failed else outputs

    def _retry_after(self) -> float:
        """Seconds until the waiting queue has likely moved on: its prompt tokens at the rate
        recent steps computed tokens, 1 to 60."""
        now = time.monotonic()
        recent = [(t, n) for t, _, n in self._recent if now - t < 10.0]
        span = now - recent[0][0] if recent else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        if rate <= 0:
            return 1.0
        return float(min(60, max(1, math.ceil(self.scheduler.num_waiting_tokens() / rate))))

    def _fail_step(self, batch, cause: Exception) -> StepFailedError:
        ids = list(dict.fromkeys(self.requests[s.request_id].family.request_id
                                 for s in batch.seqs if s.request_id in self.requests))
        log.error("a step of %d request(s) failed (%s: %s); aborting them", len(ids),
                  type(cause).__name__, cause, exc_info=cause)
        for rid in ids:
            self.abort_request(rid)
        return StepFailedError(ids, cause)

    def _keep_logprobs(self, sampled: list[Sequence], logprobs, row_seq=None) -> None:
        sampled_lp, top_ids, top_lp, ranks = logprobs
        rows = enumerate(sampled) if row_seq is None else ((r, sampled[i]) for r, i in enumerate(row_seq.tolist()))
        for row, seq in rows:
            k = seq.sampling_params.logprobs
            req = self.requests.get(seq.request_id)
            if k is None or req is None:
                continue
            top = list(zip(top_ids[row, :k].tolist(), top_lp[row, :k].tolist()))
            rank = None if ranks is None else int(ranks[row])
            req.logprobs.append(TokenLogprobs(float(sampled_lp[row]), top, rank))

    def _keep_prompt_logprobs(self, spans, arrays) -> None:
        lp, top_ids, top_lp, ranks = arrays
        row = 0
        for seq, first, count in spans:
            req = self.requests.get(seq.request_id)
            if req is not None and req.prompt_logprobs is not None:
                k = seq.sampling_params.prompt_logprobs
                for r in range(row, row + count):
                    top = list(zip(top_ids[r, :k].tolist(), top_lp[r, :k].tolist()))
                    rank = None if ranks is None else int(ranks[r])
                    req.prompt_logprobs.append(TokenLogprobs(float(lp[r]), top, rank))
                seq.num_prompt_logprobs_done = first + count
            row += count

    def _output(self, seq: Sequence) -> EngineOutput | None:
        req = self.requests.get(seq.request_id)
        if req is None or req.family.pooling is not None:
            return self._pool_output(seq)
        fam = req.family
        completion = seq.completion_token_ids
        new_ids = completion[req.sent_tokens:]
        finished, reason = seq.is_finished, seq.finish_reason
        error = seq.grammar.error if finished and seq.grammar is not None else None
        text, stop_string = "", None
        if req.detok is not None:
            if req.detok.stop:
                cut = self._find_stop_string(req, new_ids, finished)
                if cut is not None:
                    self.scheduler.finish(seq, "stop")
                    finished, reason, stop_string = True, "stop", req.detok.matched_stop
                    if cut < len(new_ids):  # tokens after it came in the same step (drafts)
                        if req.logprobs is not None:
                            del req.logprobs[len(req.logprobs) - (len(new_ids) - cut):]
                        self.scheduler.truncate_finished(seq, req.sent_tokens + cut)
                        completion = seq.completion_token_ids
                        new_ids = new_ids[:cut]
            else:
                req.detok.add(new_ids)
            if finished:
                req.detok.flush()
            text = req.detok.take_new_text(final=finished)
        req.sent_tokens = len(completion)
        logprobs = None
        if req.logprobs is not None:
            logprobs, req.logprobs = req.logprobs, []
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        if req.index == 0 and len(fam.members) < fam.params.n and error is None:
            self._add_siblings(fam)  # the prompt is computed: its blocks are in the cache
        if finished:
            del self.requests[seq.request_id]
            fam.unfinished -= 1
            if not fam.unfinished and (len(fam.members) == fam.params.n or error is not None):
                del self.families[fam.request_id]
        stop_reason = None
        if finished and reason == "stop":
            stop_reason = stop_string if stop_string is not None else self._stop_token(seq, completion)
        return EngineOutput(fam.request_id, list(new_ids), text, finished,
                            reason if finished else None, seq.num_prompt_tokens, len(completion),
                            logprobs=logprobs, queue_time=req.queue_time, index=req.index,
                            prompt_logprobs=prompt_logprobs, error=error,
                            num_cached_tokens=seq.num_cached_prompt_tokens or 0, stop_reason=stop_reason)

    def _stop_token(self, seq: Sequence, completion: list[int]) -> int | None:
        """The stop token id (SamplingParams.stop_token_ids) that ended ``seq``, None if EOS or
        anything else did (vLLM's stop_reason: an EOS that is also a stop token counts as EOS)."""
        sp = seq.sampling_params
        last = completion[-1] if completion else None
        if last is None or last not in sp.stop_token_ids:
            return None
        return None if not sp.ignore_eos and last in self.scheduler.eos_token_ids else last

    @staticmethod
    def _find_stop_string(req: _Completion, new_ids: list[int], finished: bool) -> int | None:
        """Feed ``new_ids`` to the detokenizer one by one; the number of them up to and
        including the one that completes a stop string, or None. Stop strings do not count
        before min_tokens, nor in the text of a token that already finished the request."""
        detok, min_tokens = req.detok, req.seq.sampling_params.min_tokens
        for i, tok in enumerate(new_ids):
            detok.add([tok])
            if req.sent_tokens + i + 1 < min_tokens:
                detok.ignore_stops_so_far()
            elif (i + 1 < len(new_ids) or not finished) and detok.find_stop():
                return i + 1
        return None

    # ---- health --------------------------------------------------------------------------
    def lend_cores(self, cores: int) -> None:
        """Leave ``cores`` cores of each CPU rank to other work of this machine (0: take them
        back): ModelRunner.lend_cores. The daemon lends one while it tokenizes a long prompt."""
        self.executor.control(Command.LEND_CORES, cores=int(cores))

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

    # ---- KV-cache events (routers' prefix indexes) -----------------------------------------
    def enable_kv_events(self, capacity: int = 65536) -> None:
        """Start recording prefix-cache events (blockpool/kv_events.py) for drain_kv_events."""
        self.scheduler.block_manager.kv_events = KVEventSink(capacity)

    def drain_kv_events(self, resync: bool = False) -> list:
        """The events recorded since the last call, oldest first ([] when not enabled). After
        the sink overflowed, or with ``resync``, a full resync of the cache instead."""
        bm = self.scheduler.block_manager
        sink = bm.kv_events
        if sink is None:
            return []
        events = sink.drain()
        if sink.take_overflow() or resync:
            tiers = self.scheduler.kv_tiers
            return resync_events(bm.cached_blocks(), bm.block_size,
                                 tiers.tier_blocks() if tiers is not None else (),
                                 bm.group_cached_blocks())
        return events

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
        recent = [(t, n) for t, n, _ in self._recent if now - t < 10.0]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        hits, computed = s.get("prefix_cache_hit_tokens", 0), s.get("prompt_tokens_computed", 0)
        s.update(prompt_tokens=hits + computed, generation_tokens=s.get("decode_tokens", 0),
                 prefix_cache_hit_rate=hits / (hits + computed) if hits + computed else 0.0)
        s["num_waiting_tokens"] = self.scheduler.num_waiting_tokens()  # O(waiting): not in scheduler.stats
        if "spec_decode_num_drafts" in s:
            drafts, accepted = s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]
            s["spec_decode_acceptance_rate"] = accepted / max(s["spec_decode_num_draft_tokens"], 1)
            # vLLM's mean acceptance length: tokens per verifying step of a sequence.
            s["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        s["runner"] = self.runner
        if self.runner == "pooling":
            s.update(pooling_requests=self.num_pooling_requests, pooling_prompts=self.num_pooling_prompts,
                     pooling_prompt_tokens=self.pooling_prompt_tokens)
        s.update(model=str(self.config.model_path), tensor_parallel_size=self.config.tensor_parallel_size,
                 batch_invariant=self.config.batch_invariant, kv_cache_dtype=self.kv_cache_dtype,
                 uptime_s=now - self._start, num_steps=self.num_steps,
                 tokens_per_s=(sum(n for _, n in recent[1:]) / span) if span > 0 else 0.0)
        s.update(cpu_extension.status())  # the C++ CPU operators: loaded, or why not (cpu_ops_reason)
        return s

    def shutdown(self) -> None:
        if getattr(self, "_grammars", None) is not None:
            self._grammars.shutdown()
            self._grammars = None
        ex = getattr(self, "executor", None)
        if ex is not None:
            self._flush_kv_tiers()
            ex.shutdown()
            self.executor = None

    def _flush_kv_tiers(self) -> None:
        """Before the runners stop: finish the loads in flight and put the cached pool blocks
        on disk, so that a daemon started on the same directory finds them."""
        s = getattr(self, "scheduler", None)
        if s is None or s.kv_tiers is None:
            return
        try:
            s.kv_flush()
            for _ in range(1000):
                if not s.kv_has_work():
                    break
                self._kv_step(wait=True)
        except Exception as e:  # a dead worker: the tiers are a cache, shut down anyway
            log.warning("could not flush the KV tiers (%s: %s)", type(e).__name__, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
