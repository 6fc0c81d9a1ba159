"""What the agent APIs share: OpenAI's Responses API (responses_*.py) and Anthropic's Messages
API (messages_*.py) are both translators onto the chat path, and do the same few things around
it the same way.

* ``render_prompt``: a translated Job's messages through the model's chat template with its
  tools (harmony's rendering for gpt-oss: harmony.py), whether that prompt opened a ``<think>``
  (the reasoning parser's start), its token ids.
* ``named_event``: one server-sent event with an ``event:`` line (both specs name their events;
  chat's chunks have only ``data:`` lines, chat_output.py), and ``event_stream``, the streamed
  answer that closes the request's events (aborting it) however the stream ends.
* ``until_answered``: a whole (non-streamed) answer collected while the client is polled; a
  client that leaves cancels it (the daemon aborts the request) and gets a 499.
* ``tools_not_offered``: the tools a request sent that the model is not offered (a hosted or
  server tool only the API's own service runs), named in the answer instead of refused.
* ``respelled``: an error message that starts with the chat body's field name, made to start
  with this body's.
* ``DAEMON_ERRORS``: what a round trip to the daemon raises; ``new_id``: the answers' ids.
"""
from __future__ import annotations

import asyncio
import json
import uuid

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from tpserve.client import protocol as P
from tpserve.client.client import ClientTimeout, RequestError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.upstream import UpstreamLost

#: What a daemon round trip raises (app.py's daemon_error maps each to its answer).
DAEMON_ERRORS = (RequestError, ClientTimeout, P.ProtocolError, UpstreamLost)

#: The answer's key listing the tools left out.
TOOLS_NOT_OFFERED = "tools_not_offered"


def new_id(prefix: str, digits: int = 32) -> str:
    return prefix + uuid.uuid4().hex[:digits]


def named_event(kind: str, obj: dict) -> str:
    """One server-sent event: ``event: kind`` and ``obj`` as compact JSON."""
    return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def event_stream(chunks, events) -> StreamingResponse:
    """The streamed answer of ``chunks`` (an async generator of events); ``events`` (the
    request's, from ``Front.choices``) are closed once it ends, also when the client left before
    the body started and ``chunks`` never ran."""
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(events.aclose))


async def render_prompt(front, job: O.Job, field: str) -> list[int]:
    """The prompt's token ids of a translated chat Job (``field``: the body's field that errors
    of the tokenization name); sets ``job.thinking_opened``."""
    return await front.chat_ids(job, False, field=field)


async def until_answered(request, work):
    """The result of ``work`` (a coroutine collecting a whole answer), the client polled every
    half second meanwhile: one that left cancels it (closing its events: the daemon aborts the
    request) and gets a 499."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise O.OpenAIError(499, "client disconnected", code="client_closed")
    return task.result()


def tools_not_offered(answer: dict, notes: list[dict]) -> dict:
    """``answer`` with the tools left out listed (nothing added when none was)."""
    if notes:
        answer[TOOLS_NOT_OFFERED] = list(notes)
    return answer


def respelled(message: str, old: str, new: str) -> str:
    """``message`` with its leading field name ``old`` (errors start with the field) as ``new``."""
    return new + message[len(old):] if message.startswith(old) else message
