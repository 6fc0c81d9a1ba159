"""OpenAI's Responses API on the HTTP front: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` (docs/responses.md).

A translator onto the chat path, not a second server: the body becomes one chat ``Job``
(responses_input.py; its input items as chat messages: responses_items.py), rendered by the
model's chat template with its tools, tokenized and run by ``Front.choices`` like a chat
completion: sampling, priorities, timeouts, tool-call constraining, structured output, the
reasoning parser, 429/503 and metrics are the chat path's own. Its answer is built by
responses_output.py's ``Output``, whole or streamed. Closing a stream, or leaving before a whole
response is ready, aborts the request. ``store`` keeps the response and its conversation in the
front's ResponseStore (response_store.py) for ``previous_response_id`` and the GET routes.
"""
from __future__ import annotations

from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tpserve.client.client import GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import event_stream, new_id, render_prompt, until_answered
from tpserve.fronts.http.response_store import ResponseStore
from tpserve.fronts.http.responses_input import Translation, prepare, renamed, translate
from tpserve.fronts.http.responses_items import TemplateTraits, bad, refuse
from tpserve.fronts.http.responses_output import Output


def _stored_items(tr: Translation) -> list[dict]:
    """The conversation's input items to store, each with an id (the input_items listing's)."""
    new = []
    for item in tr.new_items:
        if isinstance(item, dict) and "id" not in item:
            prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                      "reasoning": "rs_"}.get(item.get("type", "message"), "item_")
            item = {"id": new_id(prefix), **item}
        new.append(item)
    return tr.items[:len(tr.items) - len(tr.new_items)] + new


def make_responses_router(front, authorize, read_json, *, daemon_error, too_long, late_error,
                          daemon_errors) -> APIRouter:
    """The Responses endpoints over ``front`` (app.py's Front, its chat path). app.py passes
    its helpers: ``daemon_error`` (a daemon reply as an OpenAIError), ``too_long`` (a prompt
    over the context refused before it is sent), ``late_error`` (a timeout before the first
    token), ``daemon_errors`` (what a daemon round trip raises). The store is
    ``front.responses_store`` (front.py sets it from ``--responses-store-size``)."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    store = getattr(front, "responses_store", None)
    if store is None:
        store = front.responses_store = ResponseStore()
    # harmony (gpt-oss) renders developer messages and reasoning itself (harmony.py)
    traits = (TemplateTraits(developer=True, reasoning=True) if getattr(front, "harmony", None) is not None
              else TemplateTraits.of(front.tokenizer))

    def not_found(response_id: str) -> O.OpenAIError:
        return O.OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id",
                             code="response_not_found")

    async def start(request: Request):
        body = await read_json(request)
        tr = translate(body, front, store, traits)
        await prepare(tr)
        job = tr.job
        try:
            ids = await render_prompt(front, job, "input")
            too_long(job, [ids], front.max_model_len)
        except O.OpenAIError as e:
            raise renamed(e) from None
        return tr, ids

    def keep(tr: Translation, obj: dict) -> None:
        if tr.store:
            store.put(obj["id"], obj, _stored_items(tr))

    @router.post("/responses")
    async def create(request: Request):
        tr, ids = await start(request)
        job = tr.job
        out = Output(tr, front, new_id("resp_"), job.stream)
        events = front.choices([ids], job.request, whole=not job.stream)
        try:
            first = await anext(events)
        except daemon_errors as e:
            await events.aclose()
            raise renamed(daemon_error(e, job)) from None
        late = late_error(first[1], job)
        if late is not None:
            await events.aclose()
            raise late

        async def consume(item) -> GenerateResult | None:
            if isinstance(item, GenerateResult):  # the end (its output came as Deltas)
                return item
            out.feed(item)
            return None

        if job.stream:
            async def sse():
                async with aclosing(events):
                    out.emit("response.created", response=out.response("in_progress"))
                    out.emit("response.in_progress", response=out.response("in_progress"))
                    result = error = None
                    try:
                        result = await consume(first[1])
                        for chunk in out.take():
                            yield chunk
                        async for _, item in events:
                            result = await consume(item) or result
                            for chunk in out.take():
                                yield chunk
                    except daemon_errors as e:  # after the 200: the stream says it failed
                        error = renamed(daemon_error(e, job))
                    obj = await out.finish(result, error)
                    keep(tr, obj)
                    for chunk in out.take():
                        yield chunk
            return event_stream(sse(), events)

        async def collect() -> GenerateResult | None:
            async with aclosing(events):
                result = await consume(first[1])
                async for _, item in events:
                    result = await consume(item) or result
            return result

        try:
            result = await until_answered(request, collect())
        except daemon_errors as e:
            raise renamed(daemon_error(e, job)) from None
        obj = await out.finish(result)
        keep(tr, obj)
        return JSONResponse(obj)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, stream: str | None = None):
        if stream is not None and stream.lower() not in ("false", "0"):
            raise refuse("stream", "replaying a stored response as a stream is not supported "
                                   "(only background responses can be streamed again)")
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return JSONResponse(stored.response)

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        if response_id not in store:
            raise not_found(response_id)
        raise bad(None, "only background responses can be cancelled; this server runs none "
                        "(close a stream to cancel it)")

    @router.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if not 1 <= limit <= 100:
            raise bad("limit", f"must be in [1, 100], got {limit}")
        if order not in ("asc", "desc"):
            raise bad("order", f'must be "asc" or "desc", got {order!r}'[:200])
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            at = next((k for k, it in enumerate(items) if it.get("id") == after), None)
            if at is None:
                raise bad("after", f"no item with id {after!r} in this response's input"[:200])
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    return router
