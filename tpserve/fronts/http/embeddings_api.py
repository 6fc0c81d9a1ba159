"""OpenAI's embeddings endpoint on the HTTP front: ``POST /v1/embeddings`` (docs/embeddings.md).

A translator, like openai_api.py is for completions: the body's fields become the pooling
request of the daemon (``Client.embed``: token ids, ``dimensions``, ``normalize``, priority),
the results OpenAI's response. It is answered only by a daemon started with ``--runner
pooling``; a generate daemon's front refuses it with a 400 naming ``--runner`` (as app.py
refuses generation on a pooling daemon).

The body (OpenAI's fields, then vLLM's extra ones):

* ``input``: a string, an array of strings, an array of token ids, or an array of token-id
  arrays; none empty, at most ``MAX_INPUTS`` (OpenAI's limit), each within ``max_model_len``
  (after ``truncate_prompt_tokens``). All inputs of a request are one batch on the daemon.
* ``model`` (the served name, else 404), ``user`` (a string label, changes nothing);
* ``encoding_format``: ``"float"`` (arrays of numbers) or ``"base64"`` (the little-endian
  float32 bytes, base64-encoded: what OpenAI's Python client asks for by default and decodes
  with ``numpy.frombuffer(..., "float32")``); vLLM's ``"bytes"`` forms are refused;
* ``dimensions``: Matryoshka truncation (the daemon refuses it for a model that does not
  support it, or more than the model's size);
* vLLM's: ``truncate_prompt_tokens`` (-1: max_model_len) with ``truncation_side`` (``left``,
  the default, keeps the last tokens: the last-token pooling of a decoder reads the end),
  ``add_special_tokens`` (default true), ``priority``, ``request_id`` (the response's id),
  ``normalize`` and ``use_activation`` (the same thing for an embedding: L2 normalisation, on
  unless the pooler config turns it off), ``embed_dtype`` (only ``float32``), ``endianness``
  (``native``, ``little``, ``big``), ``padding`` (only ``do_not_pad``); the chat form
  ``messages`` with ``add_generation_prompt`` (default false), ``continue_final_message``,
  ``chat_template``, ``chat_template_kwargs``, rendered by the model's chat template.

Any other field is refused with a 400 naming it (a typo would otherwise change nothing
silently); fields that only another server implements (``cache_salt``,
``mm_processor_kwargs``) are refused naming them too.

What this module shares with rerank_api.py: the runner check, the daemon call (ended by the
upstream watch, aborted when the HTTP client leaves, the daemon's errors spelled with the
body's names) and the prompt helpers.
"""
from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tpserve.client import protocol as P
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import new_id
from tpserve.pooling import MAX_POOLING_INPUTS
from tpserve.request import REST_OF_CONTEXT, Api, PoolingRequest, make_pooling_request

MAX_INPUTS = MAX_POOLING_INPUTS  # inputs of one /v1/embeddings request (OpenAI's limit, the daemon's)
ENCODINGS = ("float", "base64")
# What app.daemon_error reads of a job, for the errors it answers here (timeouts, overload).
_NO_JOB = SimpleNamespace(chat=False, request=None)
ENDIANNESS = ("native", "little", "big")
TRUNCATION_SIDES = ("left", "right")
BATCH_TEXT_CHARS = 8192  # texts up to this long are tokenized together, in one call

# Fields every pooling endpoint reads (vLLM's PoolingBasicRequestMixin); each endpoint adds its own.
COMMON_FIELDS = ("model", "user", "priority", "request_id", "truncate_prompt_tokens", "truncation_side",
                 "padding")
# Fields only another server implements: refused naming them whenever they ask for something.
REFUSED = {
    "cache_salt": "is not supported",
    "mm_processor_kwargs": "is not supported (text models only)",
}
#: How /v1/embeddings spells a pooling request (tpserve/request.py): its prompts are ``input``.
EMBEDDINGS = Api("openai.embeddings", REST_OF_CONTEXT, names={"prompt": "input"})

_EMBED_FIELDS = COMMON_FIELDS + (
    "input", "messages", "encoding_format", "dimensions", "normalize", "use_activation", "embed_dtype",
    "endianness", "add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs")


@dataclass
class PoolJob:
    """What one pooling request asks of the daemon, read from its body (errors name its fields).

    ``inputs``: per prompt, a text to tokenize or token ids. ``pooling``: the pooling
    parameters as the body gave them (vLLM's names: ``dimensions``, ``normalize``), checked by
    the request model (``build``). ``names``: the body's name for the canonical ``prompt`` and
    each pooling parameter, for the errors."""

    inputs: list
    api: Api = EMBEDDINGS
    request: PoolingRequest | None = None
    pooling: dict = field(default_factory=dict)
    priority: object = None
    truncate: int | None = None          # truncate_prompt_tokens, -1 resolved later
    truncation_side: str = "left"
    add_special_tokens: bool = True
    request_id: str | None = None
    names: dict = field(default_factory=dict)
    # /v1/embeddings only
    encoding_format: str = "float"
    endianness: str = "native"
    messages: list | None = None
    chat_options: dict | None = None

    def spell(self, name: str | None) -> str | None:
        """The body's name of a field the daemon or the request model named, whole (an item of
        the prompts is the body's prompt field)."""
        if not name:
            return name
        for prefix in ("params.", "pooling."):  # how the wire nests a request's parameters
            name = name.removeprefix(prefix)
        head = name.split("[")[0].split(".")[0]
        if head in ("prompts", "prompt_token_ids"):
            head = "prompt"
        if head == "runner":  # the daemon's option, not a body field
            return "--runner"
        return self.api.spell(head, self.names)

    def build(self, prompts: list) -> PoolingRequest:
        """The one validation (tpserve/request.py) of this job with ``prompts`` (the body's
        texts or token ids); sets and returns ``request``; a 400 naming the body's field."""
        try:
            self.request = make_pooling_request(self.api, self.pooling, prompts, priority=self.priority,
                                                names=self.names)
        except InvalidFieldError as e:
            raise O.bad(self.spell(e.field), e.reason) from None
        return self.request


# ---- the body -------------------------------------------------------------------------------
def check_body(body, served_name: str, allowed: tuple[str, ...]) -> dict:
    """The body as a JSON object for the served model, with no field outside ``allowed``."""
    if not isinstance(body, dict):
        raise O.bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    for name, why in REFUSED.items():
        v = body.get(name)
        if v is not None and v != {}:
            raise O.bad(name, why, code="unsupported_parameter")
    unknown = [k for k in body if k not in allowed and k not in REFUSED]
    if unknown:
        raise O.bad(str(unknown[0])[:128], "is not a field of this endpoint; its fields: "
                    + ", ".join(sorted(allowed)), code="unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise O.bad("model", f"must be a string, got {type(model).__name__}")
    if model is not None and model != served_name:
        raise O.OpenAIError(404, f"The model `{model}` does not exist; this server serves `{served_name}`.",
                            "model", code="model_not_found")
    for name in ("user", "request_id"):
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise O.bad(name, f"must be a string, got {type(v).__name__}")
    if body.get("request_id") is not None and not 1 <= len(body["request_id"]) <= 128:
        raise O.bad("request_id", "must be 1 to 128 characters")
    return body


def read_common(body: dict, job: PoolJob) -> PoolJob:
    """The fields every pooling endpoint shares (vLLM's), into ``job``."""
    job.priority = body.get("priority")
    job.request_id = body.get("request_id")
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < -1 or keep == 0):
        raise O.bad("truncate_prompt_tokens",
                    f"must be -1 (max_model_len) or a positive integer, got {keep!r}")
    job.truncate = keep
    side = body.get("truncation_side")
    if side is not None:
        if side not in TRUNCATION_SIDES:
            raise O.bad("truncation_side", f"must be one of {', '.join(TRUNCATION_SIDES)}, got {side!r}")
        job.truncation_side = side
    padding = body.get("padding")
    if padding is not None and padding != "do_not_pad":
        raise O.bad("padding", "only \"do_not_pad\" is supported: prompts are never padded",
                    code="unsupported_parameter")
    return job


def _token_ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_embeddings(body, served_name: str) -> PoolJob:
    """The PoolJob of a /v1/embeddings body."""
    body = check_body(body, served_name, _EMBED_FIELDS)
    job = read_common(body, PoolJob([], names={"prompt": "input"}))
    given = body.get("input")
    if body.get("messages") is not None:
        if given is not None:
            raise O.bad("messages", "send either input or messages, not both")
        _read_messages(body, served_name, job)
    elif given is None:
        raise O.bad("input", "is required", code="missing_required_parameter")
    elif isinstance(given, str) or (_token_ids(given) and given):
        job.inputs = [given]
    elif isinstance(given, list) and given and (all(isinstance(p, str) for p in given)
                                                or all(_token_ids(p) for p in given)):
        job.inputs = list(given)
    elif given == []:
        raise O.bad("input", "must not be empty")
    else:
        raise O.bad("input", "must be a string, an array of strings, an array of token ids or an array "
                             "of token-id arrays")
    if any(not p for p in job.inputs):
        i = next(i for i, p in enumerate(job.inputs) if not p)
        raise O.bad("input", f"input[{i}] is empty")
    fmt = body.get("encoding_format")
    if fmt is not None:
        if fmt not in ENCODINGS:
            raise O.bad("encoding_format", f"must be \"float\" or \"base64\", got {json.dumps(fmt)[:64]}",
                        code="unsupported_parameter" if isinstance(fmt, str) else "invalid_value")
        job.encoding_format = fmt
    dtype = body.get("embed_dtype")
    if dtype is not None and dtype != "float32":
        raise O.bad("embed_dtype", f"only \"float32\" is supported, got {json.dumps(dtype)[:64]}",
                    code="unsupported_parameter")
    endian = body.get("endianness")
    if endian is not None:
        if endian not in ENDIANNESS:
            raise O.bad("endianness",
                        f"must be one of {', '.join(ENDIANNESS)}, got {json.dumps(endian)[:64]}")
        job.endianness = endian
    job.add_special_tokens = O._bool(body, "add_special_tokens", job.messages is None)
    if body.get("dimensions") is not None:
        job.pooling["dimensions"] = body["dimensions"]
    # vLLM's two names of one switch: for an embedding the "activation" is the normalisation
    norm, act = body.get("normalize"), body.get("use_activation")
    if norm is not None and act is not None and norm != act:
        raise O.bad("use_activation", "contradicts normalize (for an embedding they are the same switch)")
    if norm is not None or act is not None:
        job.pooling["normalize"] = norm if norm is not None else act
        job.names["normalize"] = "normalize" if norm is not None else "use_activation"
    return job


def _read_messages(body: dict, served_name: str, job: PoolJob) -> None:
    """vLLM's chat form of an embedding request: the messages rendered by the chat template."""
    chat = {"messages": body["messages"], "add_generation_prompt": body.get("add_generation_prompt", False)}
    for name in ("continue_final_message", "chat_template", "chat_template_kwargs"):
        if body.get(name) is not None:
            chat[name] = body[name]
    parsed = O.parse_chat(chat, served_name)
    job.messages = parsed.messages
    job.chat_options = parsed.chat_options
    job.names["prompt"] = "messages"


# ---- prompts --------------------------------------------------------------------------------
async def tokenize(front, texts: list, add_special_tokens: bool, field: str) -> list[list[int]]:
    """Token ids of each text (token-id inputs kept): short texts in one batch call of the
    front's tokenizer thread, long ones each through ``Front.encode`` (which has the longest
    tokenized by the daemon)."""
    out: list = [p if not isinstance(p, str) else None for p in texts]
    short = [i for i, p in enumerate(texts) if isinstance(p, str) and len(p) <= BATCH_TEXT_CHARS]
    if short and front.tokenizer is None:
        raise O.bad(field, "this model has no tokenizer: send token ids")
    if short:
        tok = front.tokenizer
        batch = [texts[i] for i in short]

        def encode():
            return tok(batch, add_special_tokens=add_special_tokens)["input_ids"]
        for i, ids in zip(short, await front._in_pool(encode)):
            out[i] = list(ids)
    for i, p in enumerate(texts):
        if out[i] is None:
            out[i] = await front.encode(p, add_special_tokens, field=field)
    for i, ids in enumerate(out):
        if not ids:
            raise O.bad(field, f"{field}[{i}] is empty after tokenization" if len(out) > 1
                        else "is empty after tokenization")
    return out


def truncated(job: PoolJob, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """``truncate_prompt_tokens`` applied (-1: max_model_len), from ``job.truncation_side``."""
    keep = job.truncate
    if keep is None:
        return prompts
    keep = max_model_len if keep == -1 else keep
    if job.truncation_side == "left":
        return [p[-keep:] if len(p) > keep else p for p in prompts]
    return [p[:keep] for p in prompts]


def too_long(job: PoolJob, prompts: list[list[int]], max_model_len: int) -> None:
    """An input longer than the context is refused here, as the daemon's admission would refuse
    it, without sending its token ids over (app.py's too_long, for pooling)."""
    for i, p in enumerate(prompts):
        if len(p) > max_model_len:
            where = job.names.get("prompt", "input")
            raise O.OpenAIError(400, f"{where}: input {i} is {len(p)} tokens, more than the model's context "
                                     f"(max_model_len={max_model_len}); truncate_prompt_tokens shortens it",
                                where, code="context_length_exceeded")


# ---- the daemon ------------------------------------------------------------------------------
async def require_pooling(front, endpoint: str, daemon_error, daemon_errors) -> dict:
    """The daemon's static facts (Front.daemon_info); a 400 naming ``--runner`` unless it pools."""
    try:
        info = await front.daemon_info()
    except tuple(daemon_errors) as e:
        raise daemon_error(e, _NO_JOB) from None
    runner = info.get("runner") or "generate"
    if runner != "pooling":
        raise O.OpenAIError(400, f"--runner: {endpoint} needs a daemon started with `--runner pooling`; this "
                                 f"one runs `--runner {runner}` (start another daemon for an embedding or "
                                 "reranking model)", "--runner", code="wrong_runner")
    return info


def pooling_error(e, job: PoolJob, daemon_error) -> O.OpenAIError:
    """The 400 (or the daemon error's own status) of a failed pooling call, naming the body's field."""
    if isinstance(e, InvalidFieldError):
        return O.bad(job.spell(e.field), e.reason)
    code = getattr(e, "code", None)
    if code in (P.INVALID_FIELD, P.INVALID_REQUEST, P.UNKNOWN_FIELD, P.MISSING_FIELD, P.BAD_MESSAGE):
        return O.bad(job.spell(getattr(e, "field", None)), e.message)
    if code == P.ADMISSION:
        where = job.names.get("prompt", "input")
        over = getattr(e, "limit", None) == "max_model_len"
        return O.OpenAIError(400, f"{where}: {e.message}", where,
                             code="context_length_exceeded" if over else "admission_limit")
    if isinstance(e, P.ProtocolError):
        return O.bad(job.spell(e.field), e.message)
    return daemon_error(e, _NO_JOB)


async def call_daemon(front, request: Request, job: PoolJob, call, daemon_error, daemon_errors):
    """The result of the daemon call ``call`` (a coroutine), ended with the upstream watch's
    error (``Front.fail_requests``), cancelled (the daemon aborts it) when the HTTP client
    leaves; the daemon's refusals as 400s naming the body's fields."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    front._in_flight[queue] = loop.time()
    task = asyncio.ensure_future(call)
    task.add_done_callback(lambda done: queue.put_nowait((None, done)))
    try:
        while True:
            try:
                _, got = await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise O.OpenAIError(499, "client disconnected", code="client_closed") from None
                continue
            if isinstance(got, Exception):  # the upstream watch ended the wait
                raise got
            return got.result()
    except (InvalidFieldError,) + tuple(daemon_errors) as e:
        raise pooling_error(e, job, daemon_error) from None
    finally:
        front._in_flight.pop(queue, None)
        task.cancel()


def embed_call(front, job: PoolJob, prompts: list[list[int]]):
    """The coroutine of the daemon's embed call of ``job`` (built) on ``prompts``."""
    req = job.request
    return front.client.embed(prompts, dimensions=req.params.dimensions, normalize=req.params.normalize,
                              priority=req.priority)


def classify_call(front, job: PoolJob, prompts: list[list[int]]):
    """The coroutine of the daemon's classify call of ``job`` (built) on ``prompts``."""
    return front.client.classify(prompts, priority=job.request.priority)


# ---- the response ---------------------------------------------------------------------------
def encode_vector(values, encoding: str, endianness: str = "native"):
    """One embedding as the response carries it: a list of floats, or base64 of its float32
    bytes (little-endian unless ``endianness`` says big; "native" is the machine's)."""
    if encoding == "float":
        return list(values)
    buf = array("f", values)
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder:
        buf.byteswap()
    return base64.b64encode(buf.tobytes()).decode("ascii")


def usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def embeddings_response(job: PoolJob, results, model: str) -> dict:
    """OpenAI's embeddings response (vLLM's ``id`` and ``created`` too) of the daemon's results."""
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(r.data, job.encoding_format,
                                                                            job.endianness)}
            for i, r in enumerate(results)]
    return {"id": f"embd-{job.request_id}" if job.request_id else new_id("embd-"), "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": usage(sum(r.prompt_tokens for r in results))}


# ---- the route -------------------------------------------------------------------------------
def make_embeddings_router(front, authorize, read_json, daemon_error, daemon_errors) -> APIRouter:
    """``POST /v1/embeddings`` of one front (app.Front); ``authorize``: its API-key check."""
    router = APIRouter(dependencies=[Depends(authorize)])

    @router.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_json(request)
        job = parse_embeddings(body, front.model_name)
        if job.messages is None:
            job.build(job.inputs)  # before anything is tokenized or sent
        await require_pooling(front, "/v1/embeddings", daemon_error, daemon_errors)
        if job.messages is not None:
            prompts = [await front.chat_prompt(job.messages, job.chat_options, job.add_special_tokens)]
            job.build(prompts)
        else:
            prompts = await tokenize(front, job.inputs, job.add_special_tokens, "input")
        prompts = truncated(job, prompts, front.max_model_len)
        too_long(job, prompts, front.max_model_len)
        results = await call_daemon(front, request, job, embed_call(front, job, prompts),
                                    daemon_error, daemon_errors)
        return JSONResponse(embeddings_response(job, results, front.model_name))

    return router

