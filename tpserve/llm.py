"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, named as in vLLM.

With ``runner="pooling"``, ``embed``, ``classify`` and ``score`` return vLLM's pooling shapes
(EmbeddingRequestOutput, ClassificationRequestOutput, ScoringRequestOutput).

``generate`` returns vLLM's shapes (``tpserve.outputs``: RequestOutput, CompletionOutput,
Logprob). The engine reports compact ``EngineOutput``/``TokenLogprobs`` records step by step,
the same ones the daemon's server loop reads; this module collects them per completion and
converts them once, when a call returns, into vLLM's per-token dicts with ranks and decoded
tokens. The daemon never pays for that conversion (see ``tpserve/outputs.py``).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from tpserve.config import (OFFLINE_MAX_NUM_BATCHED_TOKENS, OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS,
                            EngineConfig)
from tpserve.engine import Engine
from tpserve.errors import ConfigError
from tpserve.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                             EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                             ScoringRequestOutput, TokenLogprobs, to_logprob_dict)
from tpserve.pooling import PoolingParams
from tpserve.sampling import SamplingParams


class LLM:
    """Runs the serving engine in this process (TP workers, if any, as child processes).

    Keyword options are those of :class:`tpserve.config.EngineConfig`
    (``tensor_parallel_size``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``kv_cache_memory_gb``, ``num_kv_blocks``, ``dtype``,
    ``scheduling_policy``, ...). ``max_num_batched_tokens`` defaults to the offline budget
    (``OFFLINE_MAX_NUM_BATCHED_TOKENS``; ``OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS`` for
    ``runner="pooling"``): throughput matters here, not inter-token latency.
    """

    def __init__(self, model: str | None = None, **options):
        unknown = set(options) - set(EngineConfig.option_names())
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not an engine option; known: "
                              + ", ".join(EngineConfig.option_names()))
        pooling = options.get("runner") == "pooling"
        options.setdefault("max_num_batched_tokens", OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS if pooling
                           else OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.engine = Engine(EngineConfig(model=None if model is None else str(model), **options))
        self.engine.logprob_ranks = True  # vLLM's Logprob.rank
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 timeout: float | Seq[float | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one vLLM ``RequestOutput`` per prompt, in input order.

        ``prompts`` is a string, a list of token ids, or a list of either. ``sampling_params``
        is one SamplingParams for all, or one per prompt. Each output holds ``n`` completions
        (``outputs``, vLLM's CompletionOutput with ``index``), and ``prompt_logprobs`` when
        asked for; log-probabilities come as vLLM's ``list[dict[int, Logprob]]``.

        A structured output whose grammar the engine rejects (``structured_outputs``: a bad
        regex, an unsupported JSON-schema keyword, ...) raises InvalidFieldError naming the
        field; the call's other requests are aborted and the engine is left as it was.

        ``priority``: one integer per prompt, lower first, as vLLM's (needs the engine option
        ``scheduling_order="priority"``). ``timeout``: seconds from this call, for all prompts
        or one per prompt (None: no limit); a completion still running then ends with
        finish_reason "timeout".
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("sampling_params", f"got {len(params)} for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ConfigError("priority", f"got {len(priorities)} for {len(prompts)} prompts")
        timeouts = list(timeout) if isinstance(timeout, (list, tuple)) else [timeout] * len(prompts)
        if len(timeouts) != len(prompts):
            raise ConfigError("timeout", f"got {len(timeouts)} for {len(prompts)} prompts")

        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        results: dict[str, _Collected] = {}
        try:
            now = time.monotonic()
            for rid, prompt, sp, prio, limit in zip(ids, prompts, params, priorities, timeouts):
                engine.add_request(rid, prompt, sp, detokenize=False, priority=prio, timeout=limit, arrival=now)
                token_ids = engine.families[rid].prompt_ids
                results[rid] = _Collected(prompt if isinstance(prompt, str) else None, list(token_ids), sp)
        except BaseException:
            for rid in results:
                engine.abort_request(rid)
            raise
        bar = _progress(len(prompts)) if use_tqdm else None
        start = engine.scheduler.stats()
        t0 = time.perf_counter()
        remaining = sum(sp.n for sp in params)
        try:
            while remaining:
                outs = engine.step()
                if not outs and not engine.has_unfinished():
                    break
                for out in outs:
                    if out.error is not None:  # a grammar the engine rejects: aborted below
                        raise out.error
                    res = results[out.request_id]
                    res.take(out)
                    if out.finished:
                        remaining -= 1
                        if bar is not None and all(c.finish_reason for c in res.completions):
                            bar.update(1)
                if bar is not None:
                    st = engine.scheduler.stats()
                    dt = max(time.perf_counter() - t0, 1e-9)
                    prefill = st["prompt_tokens_computed"] - start["prompt_tokens_computed"]
                    decode = st["decode_tokens"] - start["decode_tokens"]
                    bar.set_postfix_str(f"prefill {prefill / dt:.0f} tok/s, decode {decode / dt:.0f} tok/s",
                                        refresh=False)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        if not engine.has_unfinished():
            engine.check_integrity()
        tok = self.tokenizer
        for rid, sp in zip(ids, params):
            if sp.stop or tok is None:
                continue
            kw = {} if sp.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
            for comp in results[rid].completions:
                comp.text = tok.decode(comp.token_ids, skip_special_tokens=sp.skip_special_tokens, **kw)
        decode = _token_decoder(tok)
        return [results[rid].request_output(rid, decode) for rid in ids]

    # ---- pooling (LLM(..., runner="pooling")) ----------------------------------------------
    def embed(self, prompts, pooling_params: PoolingParams | None = None, *, use_tqdm: bool = False,
              dimensions: int | None = None, normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """One vLLM ``EmbeddingRequestOutput`` per prompt (a string, token ids, or a list of
        either), in input order: ``outputs.embedding``, pooled as the engine's pooler config
        says (LAST unless configured), cut to ``dimensions``, L2-normalised unless ``normalize``
        is false. Needs ``runner="pooling"``. ``use_tqdm`` is accepted for vLLM's signature."""
        if pooling_params is None:
            pooling_params = PoolingParams("embed", dimensions=dimensions, normalize=normalize)
        elif pooling_params.task != "embed":
            raise ConfigError("pooling_params", "embed takes task 'embed'")
        ids, vectors = self._pool(_as_list(prompts), pooling_params)
        return [EmbeddingRequestOutput(f"embed-{i}", EmbeddingOutput(v), t)
                for i, (t, v) in enumerate(zip(ids, vectors))]

    def classify(self, prompts, *, use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
        """One vLLM ``ClassificationRequestOutput`` per prompt: ``outputs.probs`` = [score], the
        score head's sigmoid (a sequence-classification checkpoint, or a yes/no reranker)."""
        ids, vectors = self._pool(_as_list(prompts), PoolingParams("classify"))
        return [ClassificationRequestOutput(f"classify-{i}", ClassificationOutput(v), t)
                for i, (t, v) in enumerate(zip(ids, vectors))]

    def score(self, data_1, data_2, *, use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one ``ScoringRequestOutput`` per pair, ``outputs.score`` the
        classify score of ``data_1``'s text followed by ``data_2``'s (one against many, or
        pairwise); strings are tokenized as a pair (the tokenizer's pair template, if any),
        token-id lists concatenated. The model's own prompt format (Qwen3-Reranker's
        instruction) is the caller's to apply."""
        first, second = _as_list(data_1), _as_list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ConfigError("data_1", f"got {len(first)} items for {len(second)} in data_2 "
                                        "(one, or as many)")
        pairs = []
        for a, b in zip(first, second):
            if isinstance(a, str) and isinstance(b, str):
                if self.tokenizer is None:
                    raise ConfigError("data_1", "this model has no tokenizer: send token ids")
                pairs.append(list(self.tokenizer(a, b)["input_ids"]))
            elif isinstance(a, str) or isinstance(b, str):
                raise ConfigError("data_2", "pairs a string with token ids; give both as the same kind")
            else:
                pairs.append(list(a) + list(b))
        ids, vectors = self._pool(pairs, PoolingParams("classify"))
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(v[0]), t)
                for i, (t, v) in enumerate(zip(ids, vectors))]

    def _pool(self, prompts: list, params: PoolingParams) -> tuple[list[list[int]], list[list[float]]]:
        engine = self.engine
        rid = f"offline-{next(self._ids)}"
        engine.add_pooling_request(rid, prompts, params)
        tokens = [list(engine.requests[m].seq.prompt_token_ids) for m in engine.families[rid].members]
        result = None
        try:
            while result is None:
                outs = engine.step()
                if not outs and not engine.has_unfinished():
                    break
                result = next((o for o in outs if o.request_id == rid), None)
        except BaseException:
            engine.abort_request(rid)
            raise
        if not engine.has_unfinished():
            engine.check_integrity()
        if result is None or result.pooled is None:
            raise RuntimeError(f"pooling request ended with {getattr(result, 'finish_reason', None)!r}")
        return tokens, result.pooled

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


@dataclass
class _Completion:
    """One completion while it runs: what its EngineOutputs brought so far."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Collected:
    """One prompt's completions while they run, then its vLLM RequestOutput."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0

    def __post_init__(self):
        self.completions = [_Completion() for _ in range(self.params.n)]

    def take(self, out) -> None:
        comp = self.completions[out.index]
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.index == 0 and out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        comp.token_ids.extend(out.new_token_ids)
        comp.text += out.new_text
        if out.logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs = []
            comp.logprobs.extend(out.logprobs)
        if out.finished:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason

    def request_output(self, request_id: str, decode) -> RequestOutput:
        """vLLM's RequestOutput: per-token dicts of Logprob (rank, decoded token) built here."""
        sp = self.params
        outputs = []
        for i, c in enumerate(self.completions):
            logprobs = cumulative = None
            if sp.logprobs is not None:
                entries = c.logprobs or []
                logprobs = [to_logprob_dict(t, e, decode) for t, e in zip(c.token_ids, entries)]
                cumulative = float(sum(e.logprob for e in entries))
            outputs.append(CompletionOutput(i, c.text, c.token_ids, cumulative, logprobs,
                                            c.finish_reason, c.stop_reason))
        prompt_lps = None
        if sp.prompt_logprobs is not None and self.prompt_logprobs is not None:
            prompt_lps = [None if e is None else to_logprob_dict(t, e, decode)
                          for t, e in zip(self.prompt_token_ids, self.prompt_logprobs)]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, prompt_lps, outputs,
                             finished=all(c.finish_reason is not None for c in self.completions),
                             num_cached_tokens=self.num_cached_tokens)


def _as_list(prompts) -> list:
    """A prompt (a string or token ids) or a list of prompts, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _token_decoder(tokenizer):
    """Each token's text decoded alone, as vLLM's Logprob.decoded_token (``decode([id])``, the
    tokenizer's default special-token handling), cached per call; None without a tokenizer."""
    if tokenizer is None:
        return lambda token_id: None
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text
    return decode


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="Generating", dynamic_ncols=True)
