"""What the engine reports back per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One step's news for one request.

    ``new_token_ids``/``new_text`` hold only what is new since the last output of this request
    (text is detokenized incrementally; a matched stop string and anything after it is removed).
    ``finish_reason`` is "stop" (EOS, a stop token, a stop string, or a structured output's
    grammar complete), "length" (max_tokens or max_model_len), "abort" or "error", and is set
    only when ``finished``.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    logprobs: list["TokenLogprobs"] | None = None
    queue_time: float | None = None
    # Which of the request's n completions this is (SamplingParams.n).
    index: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first),
    # in the request's first output only.
    prompt_logprobs: list["TokenLogprobs | None"] | None = None
    # finish_reason "error" because the request's grammar (structured_outputs) did not
    # compile: the InvalidFieldError naming the field. Its request produced no token.
    error: Exception | None = None
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    # (0 before that, and without prefix caching).
    num_cached_tokens: int = 0


@dataclass
class TokenLogprobs:
    """The log-probability of one sampled token and the most likely tokens at its position
    (``top``: (token id, logprob) pairs, most likely first)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """The final result of one prompt in the offline API (vLLM's shape). ``logprobs``: one
    TokenLogprobs per token id when SamplingParams.logprobs was set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerateOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens whose KV came from the prefix cache (vLLM's RequestOutput.num_cached_tokens).
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
