"""SamplingParams: per-request decoding options, named and meant as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dataclass_fields
from typing import Any

from tpserve.errors import InvalidFieldError
from tpserve.limits import MAX_LOGPROBS, MAX_SEED, check_sampling, check_structured  # noqa: F401  (re-exported)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar, as vLLM spells it: exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text); ``json_object`` True: any JSON object;
    * ``regex``: the output fully matches the regular expression (Rust ``regex`` syntax);
    * ``choice``: the output is one of these strings;
    * ``grammar``: a Lark grammar (llguidance's dialect) or a GBNF/EBNF one.

    Options of the JSON grammars: ``disable_any_whitespace`` True (tpserve's default; vLLM's is
    False) allows no whitespace outside strings -- compact ``,`` and ``:`` separators -- and False
    allows any JSON whitespace between tokens (a weak model can then emit whitespace until
    max_tokens); ``whitespace_pattern`` (a regex) replaces the whitespace allowed when it is
    flexible; ``disable_additional_properties`` adds ``additionalProperties: false`` to every
    object schema that does not say. ``disable_fallback`` is accepted for vLLM clients: tpserve
    has one grammar engine and never falls back.

    The output is valid by construction: every sampled token keeps it a prefix of a string the
    grammar accepts, and the request finishes with "stop" when the grammar is complete. A
    request cut by ``max_tokens`` finishes with "length" and its text may not parse.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False

    def __post_init__(self):
        check_structured(self)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            if getattr(self, name) is not None:
                return name
        raise AssertionError("a validated StructuredOutputsParams sets one constraint")


@dataclass
class SamplingParams:
    """How to pick each next token of one request (vLLM's names and meanings).

    temperature 0 means greedy. ``top_k`` <= 0 (or -1, vLLM's spelling) disables top-k;
    ``top_p`` 1.0 and ``min_p`` 0.0 disable nucleus and min-p filtering. With ``seed`` set, the
    sampled tokens depend only on the seed, the model and the prompt -- not on which other
    requests share the batch.

    Logits processing, in the order the sampling rank applies it (docs/structure.md):

    * ``logit_bias`` {token id: bias in [-100, 100]} is added to the logits;
      ``allowed_token_ids`` keeps only those tokens; ``bad_words`` bans the last token of every
      tokenization of each word (with and without a leading space) where it would complete
      the word; before ``min_tokens`` completion tokens, EOS and ``stop_token_ids`` are banned
      (and stop strings do not end the request).
    * ``repetition_penalty`` (1 = off) divides positive and multiplies negative logits of every
      token seen in the prompt or the output; ``frequency_penalty`` subtracts its value times a
      token's count in the output, ``presence_penalty`` its value once for any output token
      (OpenAI's formula; 0 = off).
    * then temperature, min-p, top-k, top-p, and sampling (or greedy argmax).

    ``n`` completions are generated per prompt; they share the prompt's KV blocks and, when
    ``seed`` is set, completion i uses ``seed + i``.
    ``max_tokens`` None generates up to the rest of the context (``max_model_len`` minus the
    prompt's tokens, resolved once the prompt is tokenized, as vLLM does); 0 computes the
    prompt and generates nothing (with ``prompt_logprobs`` that
    scores a text). ``logprobs`` None reports no log-probabilities; k >= 0 reports each sampled
    token's log-probability and the k most likely tokens with theirs; ``prompt_logprobs`` k
    does the same for every prompt token after the first. Both are taken from the model's own
    distribution (log-softmax of the raw logits, before any processing above), as vLLM reports
    them by default.
    ``include_stop_str_in_output`` keeps a matched stop string in the text;
    ``skip_special_tokens`` / ``spaces_between_special_tokens`` shape the detokenized text;
    ``truncate_prompt_tokens`` k keeps only the last k prompt tokens.
    ``structured_outputs`` (a StructuredOutputsParams, or a map of its fields) constrains the
    output to a JSON schema, regex, choice or grammar: its token mask is applied with the
    allowed/banned tokens, before penalties and temperature.

    Every field is checked at construction against the bounds of ``tpserve.limits``; a bad
    value raises ``InvalidFieldError`` naming the field (``stop_token_ids[2]``, ...).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        if self.bad_words is None:
            self.bad_words = []
        self.structured_outputs = structured_outputs_of(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when the repetition, frequency or presence penalty is on."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def masks_tokens(self) -> bool:
        """True when some tokens may be biased, allowed only or banned at a step."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.min_tokens)


STRUCTURED_FIELDS = tuple(f.name for f in dataclass_fields(StructuredOutputsParams))


def structured_outputs_of(value: Any) -> StructuredOutputsParams | None:
    """``structured_outputs`` as given to SamplingParams: a StructuredOutputsParams, or a map of
    its fields (the wire's and the HTTP body's form), or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise InvalidFieldError("structured_outputs", f"must be a map of constraints, got {type(value).__name__}")
    for key in value:
        if key not in STRUCTURED_FIELDS:
            raise InvalidFieldError(f"structured_outputs.{str(key)[:64]}",
                                    f"is not supported; allowed: {', '.join(STRUCTURED_FIELDS)}")
    return StructuredOutputsParams(**value)
