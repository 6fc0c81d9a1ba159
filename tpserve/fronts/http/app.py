"""The FastAPI application of the HTTP front (see front.py for the process and design).

``Front`` holds one front process's state: its AsyncClient to the daemon, the tokenizer (prompts
are tokenized and chat-templated here, off the engine loop, in one worker thread; long texts in
a tokenizer process), the served model name and context length. ``create_app`` maps the OpenAI
endpoints onto it; request validation and response shapes live in openai_api.py, the response
of one request in chat_output.py.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from types import SimpleNamespace

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tpserve.fronts.http import openai_api as O
from tpserve.client import protocol as P
from tpserve.fronts.http import harmony, structured_api
from tpserve.client.client import AsyncClient, ClientTimeout, Delta, GenerateResult, RequestError
from tpserve.fronts.http.router_api import make_router
from tpserve.fronts.http.tokenizer_api import make_tokenizer_router
from tpserve.fronts.http.messages_api import make_messages_router
from tpserve.fronts.http.messages_errors import anthropic_error, is_messages_path
from tpserve.fronts.http.responses_api import make_responses_router
from tpserve.fronts.http.embeddings_api import make_embeddings_router
from tpserve.fronts.http.rerank_api import make_rerank_router
from tpserve.fronts.http.guard import HostPolicy, RequestGuard
from tpserve.fronts.upstream import UpstreamLost
from tpserve.fronts.http.reasoning import prompt_opens_thinking
from tpserve.fronts.http.chat_output import Response, sse_event
from tpserve.errors import InvalidRequestError
from tpserve.tokenizer import load_tokenizer

log = logging.getLogger("tpserve.http")

MAX_BODY_BYTES = P.MAX_MESSAGE_BYTES
# Texts longer than this are tokenized by the daemon, off its serving loop (its threshold too).
LONG_PROMPT_CHARS = 8192
# What a tokenize request's errors name as the request (daemon_error).
_TOKENIZE_JOB = SimpleNamespace(chat=False, request=None)


class Front:
    """State of one HTTP front process: daemon client, tokenizer, names and limits."""

    def __init__(self, address: str, model_path: str, model_name: str, max_model_len: int,
                 api_key: str | None = None, server_public_key: bytes | None = None, tokenizer=None,
                 reasoning_parser: str | None = None):
        self.address = address
        self.model_path = model_path
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.server_public_key = server_public_key
        # gpt-oss's harmony format (harmony.py): its encoding renders chats and parses answers
        self.harmony = harmony.for_model(model_path, reasoning_parser)
        if reasoning_parser == harmony.NAME:
            reasoning_parser = None
        self.reasoning_parser = reasoning_parser  # reasoning.py's parser of chat answers, or None
        # Long texts are tokenized by the daemon (its tokenizer process, while the engine lends
        # it a core: server/tokenizing.py): in a thread here they would hold the GIL from the
        # event loop, and in any process of its own they would take a core from the engine.
        self._long_texts_upstream = False
        if tokenizer is None:
            tokenizer = load_tokenizer(model_path)
            self._long_texts_upstream = tokenizer is not None  # the daemon's tokenizer is this one
        self.tokenizer = tokenizer
        self.created = int(time.time())
        # One thread: tokenizers are not meant to be shared by threads, and this keeps the
        # event loop free while a prompt is encoded or a chat templated.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._client = None
        self._in_flight: dict[asyncio.Queue, float] = {}  # each request's queue -> loop time it began
        self.restarts = 0            # times the daemon restarted this front (reported by /health)
        self._daemon_info: dict | None = None  # the daemon's status when first asked (daemon_info)
        self.last_exit: str | None = None

    @property
    def client(self):
        if self._client is None:  # made inside the running loop
            self._client = AsyncClient(self.address, timeout=None, server_public_key=self.server_public_key)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        self._pool.shutdown(wait=False)

    async def daemon_info(self) -> dict:
        """The daemon's status as first asked, for what does not change while this front runs
        (its ``runner``, pooling task): a daemon started again starts a front of its own."""
        if self._daemon_info is None:
            self._daemon_info = await self.client.status(timeout=10.0)
        return self._daemon_info

    # ---- tokenizing ----------------------------------------------------------------------
    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = False, field: str = "prompt") -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` as the tokenizer defines them (a Llama
        tokenizer prepends BOS: vLLM's default for completion prompts)."""
        if self.tokenizer is None:
            raise O.bad(field, "this model has no tokenizer: send token ids")
        if len(text) > P.MAX_PROMPT_CHARS:
            raise O.bad(field, f"longer than {P.MAX_PROMPT_CHARS} characters")
        if self._long_texts_upstream and len(text) > LONG_PROMPT_CHARS:
            ids = await self._encode_upstream(text, add_special_tokens, field)
        else:
            ids = await self._in_pool(functools.partial(self.tokenizer.encode, text,
                                                        add_special_tokens=add_special_tokens))
        if not ids:
            raise O.bad(field, "is empty after tokenization")
        return ids

    async def _encode_upstream(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        """The daemon's token ids of ``text``; the upstream watch ends the wait as it ends a
        generation's (``fail_requests``)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._in_flight[queue] = asyncio.get_running_loop().time()
        call = asyncio.ensure_future(self.client.tokenize(text, add_special_tokens, timeout=None))
        call.add_done_callback(lambda done: queue.put_nowait((None, done)))
        try:
            _, got = await queue.get()
            if isinstance(got, Exception):  # the upstream watch ended the wait
                raise got
            return got.result()
        except _DAEMON_ERRORS as e:
            if isinstance(e, RequestError) and e.code == P.INVALID_REQUEST:
                raise O.bad(field, e.message) from None
            raise daemon_error(e, _TOKENIZE_JOB) from None
        finally:
            self._in_flight.pop(queue, None)
            call.cancel()

    async def chat_text(self, messages: list[dict], options: dict | None = None,
                        tools: list[dict] | None = None) -> str:
        """The chat template's rendering of ``messages`` (``options``: Job.chat_options)."""
        if self.tokenizer is None or not (getattr(self.tokenizer, "chat_template", None)
                                          or (options or {}).get("chat_template")):
            raise O.bad("messages", "this model has no chat template; use /v1/completions",
                        code="chat_template_missing")
        options = dict(options or {})
        extra = dict(options.pop("chat_template_kwargs", None) or {})
        effort = options.pop("reasoning_effort", None)
        clash = sorted(set(extra) & {"conversation", "tokenize", "add_generation_prompt",
                                     "continue_final_message", "chat_template"})
        if clash:
            raise O.bad("chat_template_kwargs", f"must not set {clash[0]!r}; it is a request field of its own")
        options.setdefault("add_generation_prompt", True)
        if options.get("chat_template") is None:
            options.pop("chat_template", None)
        source = options.get("chat_template") or self.tokenizer.chat_template
        # the reasoning switches reach only a template that reads them: elsewhere they would
        # change nothing, and the request would not get what it asked for
        if "enable_thinking" in extra and "enable_thinking" not in str(source):
            raise O.bad("chat_template_kwargs.enable_thinking", "this model's chat template does not take it",
                        code="unsupported_parameter")
        if effort is not None:
            if "reasoning_effort" not in str(source):
                raise O.bad("reasoning_effort", "this model's chat template does not take it",
                            code="unsupported_parameter")
            extra["reasoning_effort"] = effort

        def render():
            kw = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **options, **extra, **kw)
        try:
            return await self._in_pool(render)
        except Exception as e:  # the template's own checks (roles, order) raise jinja errors
            raise O.bad("messages", f"the chat template rejected them: {e}") from None

    async def chat_prompt(self, messages: list[dict], options: dict | None = None,
                          add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        if self.harmony is not None:
            return await self._harmony_prompt(messages, options, tools)
        text = await self.chat_text(messages, options, tools)
        return await self.encode(text, add_special_tokens, field="messages")

    async def chat_ids(self, job: O.Job, add_special_tokens: bool = False,
                       field: str = "messages") -> list[int]:
        """The prompt token ids of a chat Job: harmony's rendering (gpt-oss), or the chat
        template's text tokenized (``job.thinking_opened`` set: the reasoning parser's start)."""
        tools = job.tools.tools if job.tools is not None else None
        if self.harmony is not None:
            return await self._harmony_prompt(job.messages, job.chat_options, tools)
        text = await self.chat_text(job.messages, job.chat_options, tools=tools)
        job.thinking_opened = self.reasoning_parser is not None and prompt_opens_thinking(text)
        return await self.encode(text, add_special_tokens, field=field)

    async def _harmony_prompt(self, messages: list[dict], options: dict | None,
                              tools: list[dict] | None) -> list[int]:
        try:
            return await self._in_pool(harmony.render, self.harmony, messages, options, tools)
        except O.OpenAIError:
            raise
        except Exception as e:  # openai-harmony's own checks (a tool's schema, ...)
            raise O.bad("messages", f"harmony's rendering rejected them: {e}") from None

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    async def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return await self._in_pool(functools.partial(self.tokenizer.decode, ids, skip_special_tokens=False))

    # ---- running choices -----------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self._in_flight)

    def fail_requests(self, exc: Exception, before: float) -> int:
        """End every request in flight since before loop time ``before`` with ``exc``."""
        ended = [q for q, began in self._in_flight.items() if began < before]
        for q in ended:
            del self._in_flight[q]
            q.put_nowait((None, exc))
        return len(ended)

    async def choices(self, prompts: list[list[int]], request: O.Request, whole: bool = False):
        """Async generator of (choice index, Delta | GenerateResult) for every prompt x n;
        each choice ends with its GenerateResult. Closing it aborts what still runs.
        ``fail_requests`` can end it with an exception.

        Each prompt is one request to the daemon, ``n`` included: the engine runs its n
        completions (sharing the prompt's KV blocks) and reports each with its index; choice
        ``i * n + j`` is completion j of prompt i. Streamed with n > 1, a choice's end comes
        first on its last Delta (``finish_reason`` set), as soon as its completion ended; its
        GenerateResult then follows when the prompt's request is done (it only counts for the
        usage). ``whole`` (a response sent once complete): one non-streaming generate per
        prompt, each choice's output one Delta (if it has any) then its GenerateResult. The
        daemon then sends one message per request instead of one per step; at batch 1 on 2
        cores the front's work on each step's delta took ~13% of a core from the engine's
        threads."""
        n = request.n
        queue: asyncio.Queue = asyncio.Queue()
        self._in_flight[queue] = asyncio.get_running_loop().time()
        kw = dict(priority=request.priority or None, request_timeout=request.timeout)

        def finished(base: int, result: GenerateResult) -> None:
            for c in _completions(result, n):
                queue.put_nowait((base + c.index, c))

        async def one(i: int, prompt) -> None:
            # An API that clamps max_tokens (request.py) has it fitted to this prompt's length
            params = request.fit_to_context(self.max_model_len, len(prompt))
            try:
                if whole:
                    result = await self.client.generate(prompt, params, **kw)
                    for c in _completions(result, n):  # as a stream: a delta only with output
                        if c.token_ids or c.text:
                            queue.put_nowait((i * n + c.index, Delta(result.request_id, c.text, c.token_ids,
                                                                     c.logprobs, c.index, c.prompt_logprobs)))
                    finished(i * n, result)
                    return
                async with aclosing(self.client.stream(prompt, params, final=True, **kw)) as stream:
                    async for item in stream:
                        if isinstance(item, GenerateResult):
                            finished(i * n, item)
                        else:
                            queue.put_nowait((i * n + item.index, item))
            except Exception as e:
                queue.put_nowait((i * n, e))

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        remaining = len(prompts) * n
        try:
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, GenerateResult):
                    remaining -= 1
                yield index, item
        finally:
            self._in_flight.pop(queue, None)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _completions(result: GenerateResult, n: int) -> list[GenerateResult]:
    """The n completions of a request's GenerateResult, by index, each with its own output and
    finish reason; completion 0 carries the request's prompt figures (prompt log-probabilities,
    cached tokens). A request that ended before its completions were reported (aborted) ends
    each of them with its finish reason."""
    if n == 1 or not result.completions:
        return [result] + [replace(result, text="", token_ids=[], logprobs=None, prompt_logprobs=None,
                                  completion_tokens=0, cached_tokens=0, index=j) for j in range(1, n)]
    out = []
    for c in sorted(result.completions, key=lambda c: c.index):
        out.append(replace(c, prompt_tokens=result.prompt_tokens, abort_reason=result.abort_reason,
                           prompt_logprobs=result.prompt_logprobs if c.index == 0 else None,
                           cached_tokens=result.cached_tokens if c.index == 0 else 0))
    return out


# What a daemon round trip can raise: the daemon's error reply, a timeout, the client's own
# check of the message before sending it (e.g. a token id beyond the protocol's range), or the
# upstream watch ending the request (http_upstream.py).
_DAEMON_ERRORS = (RequestError, ClientTimeout, P.ProtocolError, UpstreamLost)


def too_long(job, prompts: list[list[int]], max_model_len: int) -> None:
    """A prompt longer than the whole context is refused here, as the daemon would refuse it
    (admission, max_model_len), without sending its token ids over: a huge prompt's ids would
    cost the daemon's serving loop (and every stream on it) their transfer and checks."""
    keep = job.params.truncate_prompt_tokens
    longest = max((len(p) if keep is None else min(len(p), keep) for p in prompts), default=0)
    if longest > max_model_len:
        raise O.OpenAIError(400, f"the prompt is {longest} tokens, more than the model's context "
                                 f"(max_model_len={max_model_len})", "messages" if job.chat else "prompt",
                            code="context_length_exceeded")


def daemon_error(e, job) -> O.OpenAIError:
    """An OpenAIError for the daemon's ``error`` reply (or a timeout, or a local protocol check)."""
    if isinstance(e, ClientTimeout):
        return O.OpenAIError(503, f"the tpserve daemon did not answer: {e}", type_="server_error",
                             code="daemon_unavailable")
    if isinstance(e, UpstreamLost):
        return O.OpenAIError(503, str(e), type_="server_error", code="upstream_lost")
    if e.code == P.ADMISSION:
        param = "messages" if job.chat else "prompt"
        over_context = getattr(e, "limit", None) == "max_model_len"
        request = getattr(job, "request", None)
        try:
            max_tokens = job.params.max_tokens
        except AttributeError:
            max_tokens = None
        if over_context and max_tokens is not None:
            # too_long refused a prompt longer than the context before it was sent: this prompt
            # fits, and prompt + max_tokens does not; max_tokens is what to lower
            param = (request.spell_wire("params.max_tokens") if request is not None else None) or "max_tokens"
        code = "context_length_exceeded" if over_context else "admission_limit"
        return O.OpenAIError(400, f"{e.message} (limit: {getattr(e, 'limit', None)})", param, code=code)
    if e.code == P.BAD_MESSAGE:
        # The daemon could not read the message the front built from this request: a value its
        # wire decoder refuses (tests/test_bounds.py keeps every documented bound within it).
        log.warning("the daemon refused a request's message: %s", e.message)
        return O.bad((job.request.spell_wire(e.field) if getattr(job, "request", None) is not None
                      else e.field), e.message)
    if e.code in (P.INVALID_FIELD, P.INVALID_REQUEST, P.UNKNOWN_FIELD, P.MISSING_FIELD):
        # The daemon names the field as the wire does; the request's Api spells it for the body
        # (the field itself, not an item of it: the body's arrays are the caller's).
        param = job.request.spell_wire(e.field) if job.request is not None else e.field
        if e.field == "runner":  # a daemon of the other --runner (generation on a pooling daemon)
            param = "--runner"
        return O.bad((param or "").split("[")[0] or None, e.message)
    if e.code == P.TOO_MANY_REQUESTS:
        return O.OpenAIError(429, e.message, type_="server_error", code="too_many_requests")
    if e.code == P.SHUTTING_DOWN:
        return O.OpenAIError(503, e.message, type_="server_error", code="shutting_down",
                             headers=_retry_after(e))
    if e.code == P.OVERLOADED:  # the official client raises RateLimitError
        return O.OpenAIError(429, e.message, type_="requests" if e.limit == "max_waiting_requests" else "tokens",
                             code="rate_limit_exceeded", headers=_retry_after(e))
    return O.OpenAIError(500, f"{e.code}: {e.message}", type_="server_error", code="internal")


def input_error(e: BaseException) -> O.OpenAIError | None:
    """The 400 of an exception a request's content caused, raised where no handler caught it:
    nesting deeper than Python's recursion limit (a RecursionError anywhere in its chain), or a
    typed refusal of a field (InvalidRequestError and its InvalidFieldError, a wire check's
    ProtocolError). None for anything else: that is a bug of the front, a 500."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RecursionError):
            return O.bad(None, "the request is nested too deeply to process", code="invalid_json")
        if isinstance(e, InvalidRequestError):
            return O.bad(e.field, e.reason)
        if isinstance(e, P.ProtocolError) and e.code != P.BAD_MESSAGE:
            return O.bad(e.field, e.message)
        e = e.__cause__ or e.__context__
    return None


def _retry_after(e: RequestError) -> dict:
    """The Retry-After header (whole seconds, at least 1) of a daemon's refusal."""
    seconds = getattr(e, "retry_after", None) or 1.0
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def timed_out_before_output(item, job) -> O.OpenAIError | None:
    """The 504 a request gets when its timeout passed before any choice produced a token
    (``item``: the request's first event: a choice's end, on its GenerateResult or, n > 1, on
    its last Delta); None otherwise. Once a token exists the answer is 200 with the text so far
    and finish_reason "timeout"."""
    if (isinstance(item, (GenerateResult, Delta)) and item.finish_reason == "timeout"
            and not item.completion_tokens):
        return O.OpenAIError(504, f"the request's timeout of {job.timeout:g} s passed before its first token",
                             "timeout", type_="server_error", code="timeout")
    return None


def _model_card(front: Front) -> dict:
    return {"id": front.model_name, "object": "model", "created": front.created, "owned_by": "tpserve",
            "root": front.model_name, "max_model_len": front.max_model_len}


def create_app(front: Front, hosts: HostPolicy | None = None):
    """The FastAPI application of one front; ``hosts``: the Host names it answers (None: any)."""
    key = f"Bearer {front.api_key}".encode() if front.api_key is not None else None

    def authorize(request: Request) -> None:
        if key is None:
            return
        # Header values arrive decoded as latin-1: back to their bytes, which clients send as
        # UTF-8 (so a non-ASCII key matches what they send).
        given = request.headers.get("authorization", "").encode("latin-1")
        # Anthropic's clients (Claude Code) send the key as x-api-key instead
        other = b"Bearer " + request.headers.get("x-api-key", "").encode("latin-1")
        if not (hmac.compare_digest(given, key) | hmac.compare_digest(other, key)):
            raise O.OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' "
                                "(or 'x-api-key: KEY').", code="invalid_api_key")

    app = FastAPI(title="tpserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, hosts=hosts)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def answer(request, e: O.OpenAIError) -> JSONResponse:
        """The answer of ``e``; on the Messages API's paths in Anthropic's format (messages_errors.py)."""
        if is_messages_path(request.scope.get("path", "")):
            e = anthropic_error(e)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(O.OpenAIError)
    async def openai_error(request, e: O.OpenAIError):
        return answer(request, e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return answer(request, O.bad(None, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return answer(request, O.OpenAIError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        refusal = input_error(e)
        if refusal is not None:  # the request's fault, found where no handler expected it
            log.warning("a request was refused by an unexpected check: %s: %s", type(e).__name__, e)
            return answer(request, refusal)
        log.exception("request failed")  # quiet_log keeps the first traceback, then one line per interval
        return answer(request, O.OpenAIError(500, f"internal error of the HTTP front ({type(e).__name__}); "
                                             "see the daemon's log", type_="server_error"))

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            # Connection: close -- the rest of the body is not wanted; the front half-closes the
            # connection and discards what still comes (conn.py), so the client reads this answer.
            raise O.OpenAIError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}",
                                code="request_too_large", headers={"Connection": "close"})
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > MAX_BODY_BYTES:
                    raise O.OpenAIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes",
                                        code="request_too_large")
        except ClientDisconnect:  # nobody is left to answer: one (rate-limited) line, no traceback
            log.info("HTTP client left before sending its whole request body")
            raise O.OpenAIError(499, "client disconnected", code="client_closed") from None
        return O.decode_body(bytes(data))

    async def run(request: Request, job: O.Job, prompts: list[list[int]], prompt_texts: list[str] | None = None):
        too_long(job, prompts, front.max_model_len)
        response = Response(front, job, prompts, prompt_texts)
        events = front.choices(prompts, job.request, whole=not job.stream)
        try:
            first = await anext(events)
        except _DAEMON_ERRORS as e:
            await events.aclose()
            raise daemon_error(e, job) from None
        late = timed_out_before_output(first[1], job)
        if late is not None:
            await events.aclose()
            raise late
        if job.stream:
            async def sse():
                async with aclosing(events):
                    try:
                        for chunk in response.chunks(*first):
                            yield chunk
                        async for index, item in events:
                            for chunk in response.chunks(index, item):
                                yield chunk
                    except _DAEMON_ERRORS as e:  # after the 200: report in the stream
                        yield sse_event(daemon_error(e, job).body())
                    for chunk in response.final_chunks():
                        yield chunk
            # The background task closes the events (aborting what still runs) also when the
            # client left before the body started, so sse() never ran; otherwise it is a no-op.
            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(events.aclose))

        async def collect():
            async with aclosing(events):
                response.add(*first)
                async for index, item in events:
                    response.add(index, item)

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the events: the daemon aborts the requests
                await asyncio.gather(task, return_exceptions=True)
                raise O.OpenAIError(499, "client disconnected", code="client_closed")
        try:
            task.result()
        except _DAEMON_ERRORS as e:
            raise daemon_error(e, job) from None
        return JSONResponse(response.whole())

    @v1.post("/completions")
    async def completions(request: Request):
        body = await read_json(request)
        job = O.parse_completion(body, front.model_name)
        await structured_api.prepare(job, body, O.build_request)  # a constraint: on a thread
        prompts = [await front.encode(p, job.add_special_tokens) if isinstance(p, str) else p for p in job.prompts]
        texts = None
        if job.echo:  # the prompt as sent, or its decoded token ids
            texts = [p if isinstance(p, str) else await front.decode(p) for p in job.prompts]
        return await run(request, job, prompts, texts)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        job = O.parse_chat(body, front.model_name)
        job.harmony = front.harmony is not None
        await structured_api.prepare(job, body, O.build_request)  # a constraint: on a thread
        ids = await front.chat_ids(job, job.add_special_tokens)
        last = job.messages[-1]
        texts = [last["content"] if job.echo and last["role"] == "assistant" else ""]
        return await run(request, job, [ids], texts)

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != front.model_name:
            raise O.OpenAIError(404, f"The model `{model_id}` does not exist; this server serves "
                                     f"`{front.model_name}`.", "model", code="model_not_found")
        return _model_card(front)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(front)]}

    app.include_router(v1)
    app.include_router(make_router(front, authorize))  # /health, /version, /v1/loads, ... (router_api.py)
    app.include_router(make_responses_router(  # /v1/responses, /v1/responses/{id} (responses_api.py)
        front, authorize, read_json, daemon_error=daemon_error, too_long=too_long,
        late_error=timed_out_before_output, daemon_errors=_DAEMON_ERRORS))
    app.include_router(make_tokenizer_router(front, authorize, read_json))  # /tokenize, ... (tokenizer_api.py)
    # /v1/messages, /v1/messages/count_tokens, HEAD / (messages_api.py)
    app.include_router(make_messages_router(front, authorize, read_json, daemon_error))
    # /v1/embeddings (embeddings_api.py); /rerank, /v1/rerank, /v2/rerank, /score (rerank_api.py)
    app.include_router(make_embeddings_router(front, authorize, read_json, daemon_error, _DAEMON_ERRORS))
    app.include_router(make_rerank_router(front, authorize, read_json, daemon_error, _DAEMON_ERRORS))

    @app.get("/metrics")
    async def metrics():
        try:
            text = await front.client.metrics(timeout=10.0)
        except (ClientTimeout, RequestError) as e:
            raise O.OpenAIError(503, f"the tpserve daemon does not answer: {e}", type_="server_error",
                                code="daemon_unavailable") from None
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    return app
