"""The OpenAI request and response shapes of the HTTP front: validation in, JSON maps out.

``parse_completion`` / ``parse_chat`` turn a decoded JSON body into a ``Job`` (prompts, one
SamplingParams, ``n``, streaming options) or raise ``OpenAIError`` carrying the HTTP status and
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``. Fields the OpenAI API
defines but tpserve does not implement in a way that changes the output (``echo``, ``suffix``,
``best_of`` > 1) are refused rather than silently ignored; fields nobody defined are ignored, as
OpenAI does. ``user`` is checked to be a string and otherwise unused.

The builders below produce the response maps for ``/v1/completions`` and
``/v1/chat/completions``, whole or as stream chunks; they know nothing about HTTP.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from tpserve.errors import ConfigError, InvalidRequestError
from tpserve.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16              # completions per prompt
MAX_PROMPTS = 64        # prompts in one /v1/completions request
MAX_CHOICES = 128       # prompts x n
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI


class OpenAIError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}" if param else message, param, code=code)


@dataclass
class Job:
    """What one HTTP request asks of the daemon."""

    prompts: list            # str (to tokenize) or list[int], per prompt
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    messages: list = field(default_factory=list)
    max_tokens_given: bool = True  # False: chat's default, the rest of the context
    tools: object = None           # chat: a tool_calls.ToolPlan (structured_api.apply sets it)
    structured_param: str | None = None  # the body field params.structured_outputs came from


# ---- the body -------------------------------------------------------------------------------
# A JSON string can hold an escaped UTF-16 surrogate (\ud800-\udfff). In pairs they decode to one
# character; alone they decode to a code point that no UTF-8 text can carry, which tokenizers,
# msgpack and the JSON encoder of the answer all refuse. Only bodies with such an escape are walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_body(data: bytes):
    """The request body as JSON, or a 400 naming what is wrong (syntax, nesting, lone surrogates)."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise bad(None, "the body is not acceptable JSON: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(None, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(data):
        where = _lone_surrogate(body)
        if where is not None:
            raise bad(where or None, f"{'' if where else 'the body '}contains a lone UTF-16 surrogate (an "
                                     "unpaired \\ud800-\\udfff escape), which is not text", code="invalid_json")
    return body


def _lone_surrogate(body) -> str | None:
    """The path ("messages[0].content") of the first string not encodable as UTF-8 (of the object
    holding it, for a key; "" at the top level), else None."""
    stack = [(body, "")]
    while stack:  # iterative: the nesting json.loads accepts can exceed Python's recursion limit
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else k
                if not _is_text(k):
                    return path
                stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value) if isinstance(v, (str, list, dict)))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# ---- field checks ----------------------------------------------------------------------------
def _int(body: dict, name: str, lo: int, hi: int, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"must be a finite number, got {v!r}"[:200])
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


def _common(body: dict, served_name: str) -> dict:
    """Checks shared by both endpoints; returns SamplingParams keyword arguments and options."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    if model is not None and model != served_name:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{served_name}`.",
                          "model", code="model_not_found")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"must be a string, got {type(user).__name__}")
    if body.get("suffix") is not None:
        raise bad("suffix", "is not supported")
    if _int(body, "best_of", 1, 1, 1) != 1:
        raise bad("best_of", "only 1 is supported")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop", "must be a string or an array of strings")
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        include_usage = _bool(options, "include_usage", False)
    top_k = body.get("top_k")
    kw = dict(temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
              top_k=-1 if top_k is None else top_k, seed=body.get("seed"),
              stop=[s for s in stop if s], ignore_eos=_bool(body, "ignore_eos", False))
    return dict(kw=kw, max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                n=_int(body, "n", 1, MAX_N, 1))


def _params(kw: dict) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except (ConfigError, InvalidRequestError) as e:
        raise bad(e.field, e.reason) from None


def _token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_completion(body, served_name: str) -> Job:
    c = _common(body, served_name)
    if _bool(body, "echo", False):
        raise bad("echo", "is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    elif prompt is None:
        raise bad("prompt", "is required", code="missing_required_parameter")
    else:
        raise bad("prompt", "must be a string, an array of strings, an array of token ids or an array "
                            "of token-id arrays, none empty")
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad("prompt", "must not be empty")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    if len(prompts) * c["n"] > MAX_CHOICES:
        raise bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts) * c['n']}")
    c["kw"]["logprobs"] = _int(body, "logprobs", 0, MAX_LOGPROBS)
    c["kw"]["max_tokens"] = c["max_tokens"] or DEFAULT_MAX_TOKENS
    return Job(prompts, _params(c["kw"]), c["n"], c["stream"], c["include_usage"])


def parse_chat(body, served_name: str) -> Job:
    c = _common(body, served_name)
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(where, "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or an array of text parts")
        clean.append({"role": m["role"], "content": content})
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "needs logprobs set to true")
    c["kw"]["logprobs"] = (top or 0) if want else None
    c["kw"]["max_tokens"] = c["max_tokens"] or 1  # replaced by the rest of the context once tokenized
    return Job([], _params(c["kw"]), c["n"], c["stream"], c["include_usage"], chat=True,
               messages=clean, max_tokens_given=c["max_tokens"] is not None)


# ---- responses -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries, token_text, offset: int) -> dict:
    """The legacy completions ``logprobs`` object of some tokens; ``offset``: their text offset."""
    tokens, offsets = [], []
    for tok, _, _ in entries:
        offsets.append(offset)
        tokens.append(token_text(tok))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(t): v for t, v in top} for _, _, top in entries],
            "text_offset": offsets}


def chat_logprobs(entries, token_text) -> dict:
    def item(tok, lp):
        s = token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in top]}
                        for tok, lp, top in entries]}
