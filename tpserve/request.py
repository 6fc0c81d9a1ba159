"""One request model: what every API's request becomes, validated once, here.

tpserve is asked for completions in several spellings: OpenAI's completions and chat bodies with
vLLM's extra fields (tpserve/fronts/http/openai_api.py), the daemon's ZMQ wire messages
(tpserve/client/protocol.py), vLLM's gRPC service (tpserve/fronts/grpc/api.py) and the offline
API (tpserve/llm.py, ``Engine.add_request``). Each of them is a translator: it maps its fields
onto ``make_request``'s arguments (SamplingParams' names and meanings) and declares, once, an
``Api``: what an unset ``max_tokens`` means there, the least ``max_tokens`` it allows, and how it
names the fields. ``make_request`` is the one validation -- shapes and bounds of
``tpserve.limits`` through SamplingParams, the prompt's shape, priority, timeout -- and a bad
field is reported with the caller's name for it (``Api.spell``), never mapped back from an
error's text. A new front adds an ``Api`` and a translator; it does not touch this module.

What depends on the model is checked by the engine when the request is added: token ids below
the vocabulary size, prompt + max_tokens within ``max_model_len`` (admission), a grammar that
compiles. Those errors name the field as the wire does (``params.stop_token_ids``); a front
spells them for its caller with the same ``Api`` (``Api.spell_wire``).

``max_tokens`` left unset, per API (documented in docs/protocol.md):

==================  =====================================================================
OpenAI completions  16 (OpenAI's default)
OpenAI chat         the rest of the context: ``max_model_len`` minus the prompt's tokens
gRPC                the rest of the context (vLLM's gRPC servicer passes None, which vLLM
                    resolves to the rest of the context)
ZMQ                 16 when the ``params`` map leaves it out (SamplingParams' default); nil
                    asks for the rest of the context
offline             SamplingParams' default, 16; None asks for the rest of the context
==================  =====================================================================

"The rest of the context" is ``max_tokens`` None in SamplingParams (vLLM's meaning); the
engine resolves it with ``rest_of_context`` once the prompt is tokenized (and truncated), the
only place that knows the prompt's length for every API.

A ``max_tokens`` larger than the rest of the context is refused by admission (vLLM's behaviour,
kept by OpenAI's completions and chat), unless the API declares ``clamp_max_tokens``: agent
clients send fixed large limits (Claude Code 32000) whatever the context, and the Responses and
Messages APIs clamp such a limit to the rest of the context (``Request.fit_to_context``), the
answer then ending by length (``incomplete`` / ``max_tokens``). The HTTP front applies it to each
prompt's token ids before sending them, against the context it serves (max_model_len, or less when
the KV pool is smaller), so the clamped request is admitted.

``n`` (SamplingParams.n) is handled by the engine for every API: one request, n completions
sharing the prompt's KV blocks, reported with their index.

Pooling (``--runner pooling``: embeddings, scores) has its one request model too:
``make_pooling_request`` checks a call's prompts (one batch, at most ``MAX_POOLING_INPUTS``),
its PoolingParams (tpserve/pooling.py) and priority, errors spelled with the caller's ``Api``
(the HTTP front's embeddings and rerank translators declare theirs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields as dataclass_fields, replace
from typing import Any, Mapping

from tpserve.errors import InvalidFieldError
from tpserve.limits import check_priority, check_prompt_shape, check_timeout
from tpserve.pooling import MAX_POOLING_INPUTS, PoolingParams
from tpserve.sampling import SamplingParams

#: ``Api.default_max_tokens`` of an API whose unset max_tokens is the rest of the context.
REST_OF_CONTEXT = None

SAMPLING_FIELDS = tuple(f.name for f in dataclass_fields(SamplingParams))
_HEAD = re.compile(r"[.\[]")


def rest_of_context(max_model_len: int, prompt_tokens: int) -> int:
    """``max_tokens`` for "the rest of the context": at least 1, so that a prompt that fills the
    context is refused by admission (prompt + max_tokens > max_model_len) naming the prompt."""
    return max(1, int(max_model_len) - int(prompt_tokens))


@dataclass(frozen=True, eq=False)
class Api:
    """How one API spells a request: declared once by its translator.

    ``default_max_tokens``: max_tokens when the request leaves it unset (an int, or
    REST_OF_CONTEXT). ``min_max_tokens``: the least max_tokens it accepts (0 scores the prompt
    only; ``min_max_tokens_why`` says why 0 is refused). ``params_prefix``: how the API nests
    sampling fields (``params.`` on the wire). ``names``: canonical field -> the API's name
    for it; an error inside a mapped field names the API's field. ``clamp_max_tokens``: a
    max_tokens over the rest of the context is lowered to it (``Request.fit_to_context``)
    instead of refused by admission.
    """

    name: str
    default_max_tokens: int | None
    min_max_tokens: int = 0
    min_max_tokens_why: str = ""
    params_prefix: str = ""
    names: Mapping[str, str] = field(default_factory=dict)
    clamp_max_tokens: bool = False

    def spell(self, name: str | None, names: Mapping[str, str] | None = None) -> str | None:
        """The caller's name of the canonical field ``name`` (a SamplingParams field path such
        as ``stop[1]`` or ``structured_outputs.regex``, or ``prompt``, ``priority``,
        ``timeout``); ``names``: one request's own spellings, over the API's."""
        if name is None:
            return None
        table = {**self.names, **names} if names else self.names
        best = None
        for key in table:
            if (name == key or name.startswith(key + ".") or name.startswith(key + "[")) and (
                    best is None or len(key) > len(best)):
                best = key
        if best is not None:
            return table[best]
        return self.params_prefix + name if _HEAD.split(name, 1)[0] in SAMPLING_FIELDS else name

    def spell_wire(self, name: str | None, names: Mapping[str, str] | None = None) -> str | None:
        """The caller's name of a field the daemon named (the wire's spelling: ``params.x``)."""
        if name is None:
            return None
        return self.spell(name.removeprefix(ZMQ_PARAMS_PREFIX), names)


#: The wire's nesting of sampling fields (tpserve/client/protocol.py).
ZMQ_PARAMS_PREFIX = "params."

#: The offline API (LLM.generate, Engine.add_request): SamplingParams' own names and defaults.
OFFLINE = Api("offline", SamplingParams.max_tokens)


@dataclass
class Request:
    """One request, whatever API it came from.

    ``prompt``: text or token ids (None while a front still has to render ``messages`` and
    tokenize them). ``params``: how to sample, ``n`` completions included. ``names``: this
    request's own field spellings (e.g. the body field its structured output came from).
    """

    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    request_id: str | None = None
    priority: int = 0
    timeout: float | None = None     # seconds from arrival; None: the daemon's default
    stream: bool = False
    tools: Any = None                # chat: the front's tool plan
    api: Api = OFFLINE
    names: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.params.n

    def spell(self, name: str | None) -> str | None:
        """The caller's name of canonical field ``name``."""
        return self.api.spell(name, self.names)

    def spell_wire(self, name: str | None) -> str | None:
        """The caller's name of a field the daemon's error names."""
        return self.api.spell_wire(name, self.names)

    def fit_to_context(self, context: int, prompt_tokens: int) -> SamplingParams:
        """``params`` for one prompt of ``prompt_tokens`` tokens (before ``truncate_prompt_tokens``)
        in a context of ``context`` tokens: with ``api.clamp_max_tokens``, a max_tokens over the
        rest of the context (or None: the rest of the context) is set to it, min_tokens lowered
        with it; otherwise the params themselves."""
        return clamp_max_tokens(self.api, self.params, context, prompt_tokens)


def clamp_max_tokens(api: Api, params: SamplingParams, context: int,
                     prompt_tokens: int) -> SamplingParams:
    """``params`` with max_tokens at most the rest of ``context`` after a prompt of
    ``prompt_tokens`` tokens, for an API that declares ``clamp_max_tokens`` (Request.fit_to_context).
    max_tokens None is resolved here too, against ``context`` (which may be smaller than
    max_model_len, by which the engine would resolve it). A prompt that fills the context keeps 1
    token (``rest_of_context``): admission then refuses it. Never raises: min_tokens is lowered
    with max_tokens."""
    if not api.clamp_max_tokens or params.max_tokens == 0:
        return params
    keep = params.truncate_prompt_tokens
    rest = rest_of_context(context, prompt_tokens if keep is None else min(prompt_tokens, keep))
    if params.max_tokens is not None and params.max_tokens <= rest:
        return params
    return replace(params, max_tokens=rest, min_tokens=min(params.min_tokens, rest))


def sampling_params(api: Api, sampling: Mapping[str, Any] | SamplingParams | None,
                    score_prompt: bool = False, names: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams of ``sampling`` (a map of SamplingParams fields, or one already built),
    ``max_tokens`` resolved for ``api`` when the map leaves it out; errors spelled for ``api``.

    ``score_prompt``: the request may ask for no token at all (max_tokens 0) whatever the API's
    least max_tokens, because it scores its prompt (OpenAI completions with ``echo``)."""
    try:
        if isinstance(sampling, SamplingParams):
            params = sampling  # validated when it was constructed
        else:
            kw = dict(sampling or {})
            unknown = [k for k in kw if k not in SAMPLING_FIELDS]
            if unknown:
                raise InvalidFieldError(str(unknown[0])[:128], "is not a sampling parameter; allowed: "
                                        + ", ".join(SAMPLING_FIELDS))
            if "max_tokens" not in kw:
                kw["max_tokens"] = api.default_max_tokens
            params = SamplingParams(**kw)
        floor = 0 if score_prompt else api.min_max_tokens
        if params.max_tokens is not None and params.max_tokens < floor:
            raise InvalidFieldError("max_tokens", f"must be at least {floor}, got {params.max_tokens}"
                                    + (f": {api.min_max_tokens_why}" if api.min_max_tokens_why else ""))
    except InvalidFieldError as e:
        raise InvalidFieldError(api.spell(e.field, names), e.reason) from None
    return params


def make_request(api: Api, sampling: Mapping[str, Any] | SamplingParams | None = None, *,
                 prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 request_id: str | None = None, priority: Any = None, timeout: Any = None,
                 stream: bool = False, tools: Any = None, names: Mapping[str, str] | None = None,
                 score_prompt: bool = False) -> Request:
    """The Request of one API call: every model-independent check, in one place.

    ``sampling`` is a map of SamplingParams fields in their canonical names (a field the caller
    left unset is left out: ``max_tokens`` then takes ``api.default_max_tokens``) or a
    SamplingParams. ``priority`` None is 0; ``timeout`` None is no timeout of the request's own.
    Raises InvalidFieldError naming the field as the caller spells it.
    """
    names = dict(names or {})
    params = sampling_params(api, sampling, score_prompt, names)
    try:
        if prompt is not None:
            prompt = check_prompt_shape(prompt)
        priority = check_priority(0 if priority is None else priority)
        timeout = check_timeout(timeout)
    except InvalidFieldError as e:
        raise InvalidFieldError(api.spell(e.field, names), e.reason) from None
    return Request(params, prompt, messages, request_id, priority, timeout, stream, tools, api, names)


@dataclass
class PoolingRequest:
    """One embed / classify call, whatever API it came from: its prompts are one batch."""

    params: PoolingParams
    prompts: list
    priority: int = 0
    api: Api = OFFLINE
    names: dict[str, str] = field(default_factory=dict)

    def spell(self, name: str | None) -> str | None:
        return self.api.spell(name, self.names)

    def spell_wire(self, name: str | None) -> str | None:
        return self.api.spell_wire(name, self.names)


def make_pooling_request(api: Api, pooling: Mapping[str, Any] | PoolingParams | None, prompts: Any, *,
                         priority: Any = None, names: Mapping[str, str] | None = None) -> PoolingRequest:
    """The PoolingRequest of one API call: ``pooling`` is a map of PoolingParams fields (vLLM's
    names) or one already built; ``prompts`` a non-empty list of texts or token-id lists.
    Raises InvalidFieldError naming the field as the caller spells it (``prompt`` for the
    prompts, ``prompt[i]`` for one)."""
    names = dict(names or {})
    try:
        params = pooling if isinstance(pooling, PoolingParams) else PoolingParams(**dict(pooling or {}))
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidFieldError("prompt", "must be a non-empty list of prompts")
        if len(prompts) > MAX_POOLING_INPUTS:
            raise InvalidFieldError("prompt",
                                    f"at most {MAX_POOLING_INPUTS} prompts in one call, got {len(prompts)}")
        checked = [check_prompt_shape(p, f"prompt[{i}]") for i, p in enumerate(prompts)]
        priority = check_priority(0 if priority is None else priority)
    except TypeError as e:  # a field PoolingParams does not have
        raise InvalidFieldError(None, str(e)) from None
    except InvalidFieldError as e:
        raise InvalidFieldError(api.spell(e.field, names), e.reason) from None
    return PoolingRequest(params, checked, priority, api, names)
