"""Anthropic's Messages API on the HTTP front: ``POST /v1/messages``,
``/v1/messages/count_tokens`` and ``HEAD /`` (Claude Code's probe) (docs/messages.md).

A translator onto the chat path, not a second one: the body becomes the chat body it means and
one Request (messages_input.py), rendered by the model's chat template, run through
``Front.choices`` (priorities, timeouts, 429/503 and metrics as chat's), and its output read
back into Anthropic's content blocks, whole or as Anthropic's server-sent events
(messages_output.py). ``count_tokens`` renders the same prompt and counts it.

Errors on these routes are Anthropic's (messages_errors.py), whichever part of the route raised
them (the auth dependency, the body, the handler: ``_AnthropicRoute``); a full waiting queue or
an unavailable daemon is 529 ``overloaded_error``. What is accepted without effect, and each
decision, is in docs/messages.md.
"""
from __future__ import annotations

import logging
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as PlainResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpserve.client.client import Delta, GenerateResult
from tpserve.errors import InvalidRequestError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import DAEMON_ERRORS, event_stream, named_event, until_answered
from tpserve.fronts.http.messages_errors import AnthropicError, anthropic_error, bad
from tpserve.fronts.http.messages_input import prepare
from tpserve.fronts.http.messages_output import Message

log = logging.getLogger("tpserve.http")


def _unexpected(e: BaseException) -> AnthropicError:
    """The answer to an exception no handler expected: a 400 when the request's content caused
    it (a typed refusal somewhere in its chain, nesting too deep), else a 500."""
    seen = set()
    cause = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, RecursionError):
            return bad(None, "the request is nested too deeply to process")
        if isinstance(cause, InvalidRequestError):
            return bad(cause.field, cause.reason)
        cause = cause.__cause__ or cause.__context__
    log.exception("request failed")
    return AnthropicError(500, f"internal error of the HTTP front ({type(e).__name__}); see the daemon's log")


class _AnthropicRoute(APIRoute):
    """A route whose every error (the auth dependency's, the body's, the handler's) is answered
    in Anthropic's format."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except O.OpenAIError as e:
                raise anthropic_error(e) from None
            except RequestValidationError as e:
                raise bad(None, str(e)) from None
            except StarletteHTTPException as e:
                raise AnthropicError(e.status_code, str(e.detail)) from None
            except Exception as e:
                raise _unexpected(e) from None
        return guarded


def make_messages_router(front, authorize, read_json, daemon_error) -> APIRouter:
    """``/v1/messages``, ``/v1/messages/count_tokens`` (behind ``authorize``) and ``HEAD /``
    (Claude Code's probe). ``daemon_error``: app.py's mapping of a daemon's refusal to an
    OpenAIError (made Anthropic's here)."""
    outer = APIRouter()
    router = APIRouter(dependencies=[Depends(authorize)], route_class=_AnthropicRoute)

    @outer.head("/")
    async def probe():
        return PlainResponse(status_code=200)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await read_json(request)
        _, ids, _ = await prepare(front, body, count_only=True)
        return {"input_tokens": len(ids)}

    @router.post("/v1/messages")
    async def messages(request: Request):
        body = await read_json(request)
        job, ids, t = await prepare(front, body)
        if len(ids) >= front.max_model_len:  # Anthropic's wording: clients look for "prompt is too long"
            raise AnthropicError(400, f"prompt is too long: {len(ids)} tokens, and the context holds "
                                      f"{front.max_model_len} (max_model_len) with one for the answer",
                                 "messages")
        reply = Message(front, job, t, len(ids))
        events = front.choices([ids], job.request, whole=not job.stream)
        try:
            _, first = await anext(events)
        except DAEMON_ERRORS as e:
            await events.aclose()
            raise anthropic_error(daemon_error(e, job), t.paths) from None
        if (isinstance(first, GenerateResult) and first.finish_reason == "timeout"
                and not first.completion_tokens):
            await events.aclose()
            limit = "" if job.timeout is None else f" of {job.timeout:g} s"
            raise AnthropicError(504, f"the request's timeout{limit} passed before its first token")
        if job.stream:
            async def sse():
                async with aclosing(events):
                    result = None
                    try:
                        for chunk in reply.start(first):
                            yield chunk
                        item = first
                        while True:
                            if isinstance(item, GenerateResult):
                                result = item
                                break
                            for chunk in reply.events(item.text, item.token_ids):
                                yield chunk
                            _, item = await anext(events)
                    except DAEMON_ERRORS as e:  # after the 200: an error event
                        yield named_event("error", anthropic_error(daemon_error(e, job), t.paths).body())
                        return
                    except Exception as e:  # a bug of the front: said in the stream, not a cut connection
                        yield named_event("error", _unexpected(e).body())
                        return
                    for chunk in reply.end(result):
                        yield chunk
            return event_stream(sse(), events)

        texts, ids, done = [], [], []

        async def collect():
            async with aclosing(events):
                item = first
                while True:
                    if isinstance(item, Delta):
                        texts.append(item.text)
                        ids.extend(item.token_ids)
                    else:
                        done.append(item)
                        return
                    _, item = await anext(events)

        try:
            await until_answered(request, collect())
        except DAEMON_ERRORS as e:
            raise anthropic_error(daemon_error(e, job), t.paths) from None
        return JSONResponse(reply.whole("".join(texts), done[0], ids))

    @router.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unknown(rest: str):
        raise AnthropicError(404, f"/v1/messages/{rest[:100]} is not served here; tpserve serves POST "
                                  "/v1/messages and POST /v1/messages/count_tokens")

    outer.include_router(router)
    return outer
