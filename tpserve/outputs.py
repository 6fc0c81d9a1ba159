"""What the engine reports per step, and the offline API's results in vLLM's shapes.

Two representations of log-probabilities, on purpose:

- **Engine side** (``EngineOutput``, ``TokenLogprobs``): what ``Engine.step()`` hands its two
  callers, the daemon's server loop and the offline ``LLM``. One compact record per token:
  its logprob, its rank and the top (token id, logprob) pairs. The server turns these into
  wire lists directly (``tpserve/server/server.py``), and the HTTP front formats OpenAI
  logprobs from the wire with the text it decodes anyway, so the daemon's hot path builds no
  per-token dict, no ``Logprob`` object and no decoded string that nobody reads.
- **Offline side** (``RequestOutput``, ``CompletionOutput``, ``Logprob``): vLLM's classes of
  the same names and fields (``vllm.outputs``, ``vllm.logprobs``), built once per request by
  ``tpserve.llm`` when ``generate()`` returns, so that vLLM code such as
  ``outs[0].outputs[0].logprobs[i][token_id].logprob`` runs unchanged.
  ``to_logprob_dict`` is the one conversion between the two.

The pooling runner's results come in vLLM's shapes too: ``EmbeddingRequestOutput`` (``.outputs
.embedding``), ``ClassificationRequestOutput`` (``.outputs.probs``) and ``ScoringRequestOutput``
(``.outputs.score``), built by ``LLM.embed`` / ``classify`` / ``score`` from the engine's
``EngineOutput.pooled``.

Importing this module costs nothing (no torch, no numpy): ``tpserve.RequestOutput`` and the
others are importable from a light ``import tpserve``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


# ---- engine side -------------------------------------------------------------------------
@dataclass
class TokenLogprobs:
    """The log-probability of one token (a sampled token, or a prompt token given the tokens
    before it), its 1-based rank in the model's distribution at that position (1 + the number
    of tokens at least as likely, as vLLM counts it; None where unknown), and the most likely
    tokens there (``top``: (token id, logprob) pairs, most likely first, so the pair at index
    i has rank i + 1)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class EngineOutput:
    """One step's news for one completion of a request (what ``Engine.step()`` returns).

    ``new_token_ids``/``new_text`` hold only what is new since the last output of this
    completion (text is detokenized incrementally; a matched stop string and anything after
    it is removed). ``finish_reason`` is "stop" (EOS, a stop token, a stop string, or a
    structured output's grammar complete), "length" (max_tokens or max_model_len), "timeout",
    "abort" or "error", and is set only when ``finished``; ``stop_reason`` then names the stop
    string or stop token id that ended it (vLLM's ``CompletionOutput.stop_reason``; None for
    EOS and every other reason).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    queue_time: float | None = None
    # Which of the request's n completions this is (SamplingParams.n).
    index: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first),
    # in the request's first output only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # finish_reason "error" because the request's grammar (structured_outputs) did not
    # compile: the InvalidFieldError naming the field. Its request produced no token.
    error: Exception | None = None
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    # (0 before that, and without prefix caching).
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    # --runner pooling: the request's one output (finished, "stop") holds each prompt's
    # embedding, or [score] for classify, and each prompt's token count.
    pooled: list[list[float]] | None = None
    pooled_prompt_tokens: list[int] | None = None


# ---- offline side: vLLM's shapes ---------------------------------------------------------
@dataclass
class Logprob:
    """vLLM's ``Logprob``: the log-probability of one token at one position, its 1-based rank
    in the model's distribution there (1: the most likely), and its text decoded alone
    (``tokenizer.decode([token_id])``; None for a model without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (vLLM's SampleLogprobs).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, None for the first (vLLM's PromptLogprobs).
PromptLogprobs = list[dict[int, Logprob] | None]


def to_logprob_dict(token_id: int, entry: TokenLogprobs,
                    decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """vLLM's dict for one position: the token that is there (sampled, or the prompt's) first,
    with its own rank, then the top tokens with ranks 1..k. A token in both appears once, with
    its top entry (the same logprob). ``decode(token_id)``: the token's text, or None."""
    out = {token_id: Logprob(entry.logprob, entry.rank, decode(token_id))}
    for rank, (tok, lp) in enumerate(entry.top, 1):
        out[tok] = Logprob(lp, rank, decode(tok))
    return out


@dataclass
class CompletionOutput:
    """vLLM's ``CompletionOutput``: one of a request's ``n`` completions.

    ``index``: its place among them (0..n-1). ``cumulative_logprob``: the sum of its tokens'
    logprobs when ``SamplingParams.logprobs`` was set, else None. ``logprobs``: with
    ``SamplingParams.logprobs`` = k, one dict per token id: the top k tokens (ranks 1..k) and
    always the sampled token (so k or k + 1 entries; with k = 0 the sampled token only).
    ``finish_reason``: "stop", "length" or "timeout" (tpserve's; vLLM has no timeout).
    ``stop_reason``: the stop string or stop token id that ended it, None for EOS and every
    other reason. ``lora_request`` and ``kv_transfer_params`` are always None (tpserve has
    neither LoRA nor KV transfer).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None
    kv_transfer_params: dict[str, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    """vLLM's ``RequestOutput``: the result of one prompt of ``LLM.generate``.

    ``prompt``: the prompt string, None when the prompt was given as token ids.
    ``prompt_token_ids``: the tokens the engine ran (after ``truncate_prompt_tokens``).
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs`` = k, one entry per prompt
    token: None for the first (nothing predicts it), then a dict of the top k tokens and always
    the prompt's own token; None when not asked for. ``outputs``: the ``n`` completions, in
    index order. ``finished``: True (``generate`` returns finished requests only).
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache.

    ``metrics`` is None: tpserve keeps no per-request timing record in the offline API
    (``LLM.stats()`` has the engine's counters). ``lora_request``, ``encoder_prompt`` and
    ``encoder_prompt_token_ids`` are None: no LoRA, decoder-only models.

    Beyond vLLM: ``text``, ``token_ids`` and ``finish_reason`` are those of ``outputs[0]``.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput],
                 finished: bool, metrics: Any = None, lora_request: Any = None,
                 encoder_prompt: str | None = None, encoder_prompt_token_ids: list[int] | None = None,
                 num_cached_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens

    @property
    def kv_transfer_params(self) -> None:
        return None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
                f"outputs={self.outputs}, finished={self.finished}, "
                f"num_cached_tokens={self.num_cached_tokens})")


# ---- offline side: vLLM's pooling shapes (LLM.embed / classify / score) -------------------
@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: one prompt's class probabilities (one label: [score])."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """vLLM's ``ScoringOutput``: the score of one (text_1, text_2) pair."""

    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput``: the result of one prompt of a pooling call; the
    subclasses name what ``outputs`` holds. ``finished`` is always True."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``outputs``: an EmbeddingOutput (``LLM.embed``)."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """``outputs``: a ClassificationOutput (``LLM.classify``)."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``outputs``: a ScoringOutput (``LLM.score``)."""
