"""The OpenAI request and response shapes of the HTTP front: validation in, JSON maps out.

``parse_completion`` / ``parse_chat`` translate a decoded JSON body into a ``Job`` (prompts,
the SamplingParams fields in their canonical names, streaming options), and ``build_request``
makes its one Request (tpserve/request.py: validated there, once, errors spelled with the
endpoint's ``Api``), or they raise ``OpenAIError`` carrying the HTTP status and OpenAI's error
body ``{"error": {"message", "type", "param", "code"}}``. An unset ``max_tokens`` is 16 for
completions and the rest of the context for chat (the Apis below declare it). Every field OpenAI's or
vLLM's request schema defines is honoured (with vLLM's meaning where OpenAI names the same thing
differently) or refused with a 400 naming it (``_UNSUPPORTED``); fields nobody defined are
ignored, as OpenAI does. ``user`` and other caller labels are checked to be strings.

The builders below produce the response maps for ``/v1/completions`` and
``/v1/chat/completions``, whole or as stream chunks; they know nothing about HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tpserve import limits as R
from tpserve.errors import InvalidFieldError
from tpserve.request import REST_OF_CONTEXT, Api, Request, make_request
from tpserve.sampling import SamplingParams

MAX_N = R.MAX_N          # completions per prompt
MAX_PROMPTS = 64        # prompts in one /v1/completions request
MAX_CHOICES = 128       # prompts x n
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI


class OpenAIError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers  # extra response headers (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}" if param else message, param, code=code)


#: How the OpenAI endpoints spell a request (tpserve/request.py): the sampling fields keep
#: SamplingParams' (vLLM's) names at the top of the body; chat's prompt is its messages.
COMPLETIONS = Api("openai.completions", DEFAULT_MAX_TOKENS, min_max_tokens=1, min_max_tokens_why=(
    "0 generates nothing: it is only allowed with echo (to score the prompt)"))
CHAT = Api("openai.chat", REST_OF_CONTEXT, min_max_tokens=1, names={"prompt": "messages"})


@dataclass
class Job:
    """What one HTTP request asks of the daemon: its Request (``request``, made by
    ``build_request`` from ``sampling``, ``fields`` and ``names``) and the HTTP-only options."""

    prompts: list            # str (to tokenize) or list[int], per prompt
    sampling: dict = field(default_factory=dict)  # SamplingParams fields as the body gave them
    fields: dict = field(default_factory=dict)    # make_request's other arguments (priority, timeout)
    names: dict = field(default_factory=dict)     # this request's own field spellings
    score_prompt: bool = False     # completions with echo: max_tokens 0 scores the prompt
    request: Request | None = None
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    messages: list = field(default_factory=list)
    echo: bool = False             # completions: prompt text (and logprobs) before the output
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" strings
    return_token_ids: bool = False   # vLLM's: token ids in each choice (and the prompt's)
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's special tokens (BOS)
    chat_options: dict = field(default_factory=dict)  # apply_chat_template's options
    tools: object = None           # chat: a tool_calls.ToolPlan (structured_api.apply sets it)
    thinking_opened: bool = False  # chat: the rendered prompt ends inside "<think>" (reasoning.py)
    harmony: bool = False          # chat: rendered and parsed in gpt-oss's harmony format (harmony.py)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def timeout(self) -> float | None:
        return self.request.timeout


def build_request(job: Job) -> Request:
    """Validate the job once (tpserve/request.py), errors naming the body's fields; sets and
    returns ``job.request``."""
    try:
        job.request = make_request(CHAT if job.chat else COMPLETIONS, job.sampling, names=job.names,
                                   stream=job.stream, tools=job.tools, score_prompt=job.score_prompt,
                                   messages=job.messages if job.chat else None, **job.fields)
    except InvalidFieldError as e:
        raise bad(e.field, e.reason) from None
    if len(job.prompts) * job.n > MAX_CHOICES:
        raise bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(job.prompts) * job.n}")
    return job.request


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


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


# Request fields OpenAI's or vLLM's API defines that tpserve does not implement: refused with a
# 400 naming them whenever they ask for something (a value other than the one that changes
# nothing), never accepted and dropped. Fields nobody defined are ignored, as OpenAI does.
_UNSUPPORTED = {
    "suffix": "is not supported (no fill-in-the-middle)",
    "use_beam_search": "is not supported (no beam search)",
    "length_penalty": "is not supported (it only applies to beam search)",
    "logits_processors": "is not supported (no custom logits processors)",
    "cache_salt": "is not supported",
    "kv_transfer_params": "is not supported (no disaggregated prefill)",
    "vllm_xargs": "is not supported",
    "mm_processor_kwargs": "is not supported (text models only)",
    "prediction": "is not supported (no predicted outputs)",
    "audio": "is not supported (text models only)",
    "web_search_options": "is not supported",
    "functions": "is not supported; use tools",
    "function_call": "is not supported; use tool_choice",
    "documents": "is not supported",
    "guided_json": "is not supported; use response_format or structured_outputs",
    "guided_regex": "is not supported; use structured_outputs",
    "guided_choice": "is not supported; use structured_outputs",
    "guided_grammar": "is not supported; use structured_outputs",
}
# Refused only when set to something other than what tpserve does anyway.
_NEUTRAL = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
            "verbosity": ("medium",), "logprobs_mode": ("raw_logprobs",)}
# Strings that identify the caller and change no output.
_LABELS = ("user", "safety_identifier", "prompt_cache_key")


def _refused(body: dict) -> None:
    for name, why in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v is not False and v != [] and v != {}:
            raise bad(name, why, code="unsupported_parameter")
    for name, allowed in _NEUTRAL.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise bad(name, f"only {' or '.join(json.dumps(a) for a in allowed)} is supported, "
                            f"got {json.dumps(body[name])[:100]}", code="unsupported_parameter")
    if body.get("metadata") is not None:
        raise bad("metadata", "is only meaningful with store, which is not supported", code="unsupported_parameter")


def _common(body: dict, served_name: str, job: Job) -> None:
    """Checks shared by both endpoints; fills ``job.sampling`` (SamplingParams' names, values
    as given: their checks are the request model's) and ``job.fields``.

    OpenAI's names map to SamplingParams' (vLLM's); vLLM's extra fields keep their names. A body
    field that is null counts as unset.
    """
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    if model is not None and model != served_name:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{served_name}`.",
                          "model", code="model_not_found")
    for name in _LABELS:
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise bad(name, f"must be a string, got {type(v).__name__}")
    _refused(body)
    if _int(body, "best_of", 1, 1, 1) != 1:
        raise bad("best_of", "only 1 is supported")
    stop = body.get("stop")
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = [s for s in stop if s]  # OpenAI clients may send empty stop strings: they stop nothing
    elif stop is not None and not isinstance(stop, str):
        raise bad("stop", "must be a string or an array of strings")
    job.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        if not job.stream:
            raise bad("stream_options", "is only allowed when stream is true")
        job.include_usage = _bool(options, "include_usage", False)
    sampling = {"stop": stop} if stop else {}
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
        job.names["max_tokens"] = "max_completion_tokens"
    elif body.get("max_tokens") is not None:
        sampling["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
                 "allowed_token_ids", "bad_words", "stop_token_ids", "include_stop_str_in_output",
                 "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
                 "prompt_logprobs"):
        if body.get(name) is not None:
            sampling[name] = body[name]
    job.sampling = sampling
    job.fields = dict(priority=body.get("priority"), timeout=body.get("timeout"))
    job.token_ids_as_text = _bool(body, "return_tokens_as_token_ids", False)
    job.return_token_ids = _bool(body, "return_token_ids", False)


def _token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_completion(body, served_name: str) -> Job:
    """The Job of a /v1/completions body (``build_request`` validates it, once its structured
    output is known: structured_api.apply)."""
    job = Job([])
    _common(body, served_name, job)
    job.echo = _bool(body, "echo", False)
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
    job.prompts = prompts
    logprobs = body.get("logprobs")
    if logprobs is not None:
        job.sampling["logprobs"] = logprobs
    job.score_prompt = job.echo
    given = job.sampling.get("prompt_logprobs")
    if job.echo and R.is_int(logprobs) and (given is None or R.is_int(given)):
        # the prompt's tokens are reported with the same alternatives
        job.sampling["prompt_logprobs"] = logprobs if given is None else max(given, logprobs)
    job.add_special_tokens = _bool(body, "add_special_tokens", True)
    return job


_CHAT_OPTIONS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "chat_template")


def parse_chat(body, served_name: str) -> Job:
    """The Job of a /v1/chat/completions body (``build_request`` validates it)."""
    job = Job([], chat=True)
    _common(body, served_name, job)
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
    job.messages = clean
    want = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise bad("top_logprobs", "needs logprobs set to true")
    if want:
        job.sampling["logprobs"] = 0 if top is None else top
        job.names["logprobs"] = "top_logprobs"
    job.echo = _bool(body, "echo", False)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad("chat_template", "must be a string (a Jinja template)")
    add_gen = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if add_gen and cont:
        raise bad("continue_final_message", "cannot be used with add_generation_prompt true (vLLM's rule)")
    if cont and clean[-1]["role"] != "assistant":
        raise bad("continue_final_message", "needs the last message to be the assistant's")
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("reasoning_effort", f"must be a string, got {type(effort).__name__}")
    job.chat_options = dict(chat_template_kwargs=kwargs or {}, add_generation_prompt=add_gen,
                            continue_final_message=cont, chat_template=template, reasoning_effort=effort)
    job.add_special_tokens = _bool(body, "add_special_tokens", False)
    return job


# ---- responses -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries, token_text, offset: int) -> dict:
    """The legacy completions ``logprobs`` object of some tokens; ``offset``: their text offset.

    ``entries``: (token id, logprob or None, [(id, logprob), ...] or None) per token. Each
    position's ``top_logprobs`` holds the k alternatives and the token itself (up to k + 1
    entries, as OpenAI and vLLM return them); a prompt's first token has None for both."""
    tokens, offsets, tops = [], [], []
    for tok, lp, top in entries:
        offsets.append(offset)
        tokens.append(token_text(tok))
        offset += len(tokens[-1])
        if top is None:
            tops.append(None)
        else:
            d = {token_text(t): v for t, v in top}
            d.setdefault(tokens[-1], lp)
            tops.append(d)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs_obj(prompt_ids: list[int], entries, token_text) -> list:
    """vLLM's ``prompt_logprobs`` of a choice: None, then per prompt token a map of token id (as
    a string) to {"logprob", "rank" (1 = most likely; absent when outside the top k),
    "decoded_token"}, with the prompt's token and its k alternatives."""
    out: list = []
    for tok, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        lp, top = entry
        d = {str(t): {"logprob": v, "rank": r, "decoded_token": token_text(t)}
             for r, (t, v) in enumerate(top, start=1)}
        d.setdefault(str(tok), {"logprob": lp, "decoded_token": token_text(tok)})
        out.append(d)
    return out


def chat_logprobs(entries, token_text) -> dict:
    def item(tok, lp):
        s = token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in top]}
                        for tok, lp, top in entries]}
