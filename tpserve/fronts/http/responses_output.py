"""The answer of OpenAI's Responses API (docs/responses.md): ``Output`` builds one response from
its request's Deltas, whole or as the spec's server-sent events.

Output items: ``reasoning`` (a reasoning parser's thoughts, reasoning.py), ``message`` (the
answer's text, with logprobs when asked), ``function_call`` (constrained tool calls read back by
tool_calls.py, a namespaced one with its ``namespace``); a model served in harmony (gpt-oss) has
its answer's token ids parsed by harmony.py into the same items; usage with cached and reasoning tokens;
status ``completed`` / ``incomplete`` (cut by ``max_output_tokens`` or the timeout) /
``failed``; the request's parameters echoed, and the tools not offered. Streamed, the events
(``event:`` and ``data:`` lines, each with its ``sequence_number``: ``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ..., ``response.completed``)
come from the same ``Output`` that builds the whole response, so both always agree.
"""
from __future__ import annotations

import time

from tpserve.client.client import GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http import tool_calls
from tpserve.fronts.http.agent_common import named_event, new_id, tools_not_offered
from tpserve.fronts.http.harmony import HarmonyStream
from tpserve.fronts.http.reasoning import CLOSE as THINK_CLOSE
from tpserve.fronts.http.reasoning import CONTENT, REASONING, ReasoningStream
from tpserve.fronts.http.responses_input import Translation, text_format
from tpserve.fronts.http.responses_items import seal


class Output:
    """Builds one response's output items from the request's Deltas: thoughts (a reasoning
    parser's) as a ``reasoning`` item, text as a ``message`` item, constrained tool calls as
    ``function_call`` items; with ``stream``, ``feed`` and ``finish`` also return the
    server-sent events of what was added."""

    def __init__(self, tr: Translation, front, response_id: str, stream: bool):
        self.tr, self.front, self.id, self.stream = tr, front, response_id, stream
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the item being written
        self.pieces: list[str] = []         # its text so far (message text, thoughts, arguments)
        self.events: list[str] = []
        job = tr.job
        parser = front.reasoning_parser
        self.thoughts = ReasoningStream(parser, job.thinking_opened) if parser else None
        self.calls = tool_calls.ToolCallStream() if job.tools is not None and job.tools.constrains else None
        encoding = getattr(front, "harmony", None)
        self.harmony = HarmonyStream(encoding) if encoding is not None else None
        if self.harmony is not None:  # the token ids are parsed (harmony.py), not the text
            self.thoughts = self.calls = None
        self.token_ids: list[int] = []
        self.closed_in: tuple[int, int] | None = None  # token range of the delta that ended the thoughts
        self.lp_all: list = []              # logprobs of the message's tokens
        self.lp_pending: list = []          # not sent with a text delta yet
        self.created_at = int(time.time())

    # ---- events ------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        if self.stream:
            fields["type"] = kind
            fields["sequence_number"] = self.seq
            self.seq += 1
            self.events.append(named_event(kind, fields))

    def take(self) -> list[str]:
        out, self.events = self.events, []
        return out

    # ---- items -------------------------------------------------------------------------------
    def _begin(self, item: dict) -> None:
        self._close("completed")
        self.open, self.pieces = item, []
        self.items.append(item)
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
        kind = item["type"]
        if kind in ("message", "reasoning"):
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if kind == "message" else {"type": "reasoning_text", "text": ""})
            self.emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                      content_index=0, part=part)

    def _close(self, status: str) -> None:
        item = self.open
        if item is None:
            return
        self.open = None
        index, text = len(self.items) - 1, "".join(self.pieces)
        kind = item["type"]
        item["status"] = status
        if kind == "message":
            lps = self.lp_all
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
            item["content"] = [part]
            self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text, logprobs=lps)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            if "reasoning.encrypted_content" in self.tr.include:
                item["encrypted_content"] = seal(text)
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)
        else:
            item["arguments"] = text
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=text, name=item["name"])
        self.emit("response.output_item.done", output_index=index, item=item)

    def _text(self, text: str) -> None:
        if self.open is None or self.open["type"] != "message":
            self._begin({"id": new_id("msg_"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []})
        self.pieces.append(text)
        lps, self.lp_pending = self.lp_pending, []
        self.emit("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                  content_index=0, delta=text, logprobs=lps)

    def _thought(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._begin({"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"})
        self.pieces.append(text)
        self.emit("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                  content_index=0, delta=text)

    def _call(self, delta: dict) -> None:
        for tc in delta["tool_calls"]:
            fn = tc.get("function") or {}
            if "id" in tc:  # a call begins (its arguments may all come with it)
                name = fn.get("name", "")
                item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                        "call_id": tc["id"], "name": name, "arguments": ""}
                if name in self.tr.namespaced:
                    item["namespace"], item["name"] = self.tr.namespaced[name]
                self._begin(item)
            piece = fn.get("arguments")
            if piece and self.open is not None and self.open["type"] == "function_call":
                self.pieces.append(piece)
                self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                          output_index=len(self.items) - 1, delta=piece)

    def _answer(self, text: str) -> None:
        if self.calls is None:
            if text:
                self._text(text)
            return
        for d in self.calls.feed(text):
            self._chat_delta(d)

    def _chat_delta(self, d: dict) -> None:
        if "tool_calls" in d:
            self._call(d)
        elif d.get("content"):
            self._text(d["content"])

    def feed(self, delta) -> None:
        """Add one Delta of the request's output (streamed: its events are queued, ``take``)."""
        start = len(self.token_ids)
        self.token_ids += delta.token_ids
        if self.tr.logprobs and delta.logprobs is not None:
            entries = [(t, lp, top) for t, (lp, top) in zip(delta.token_ids, delta.logprobs)]
            got = O.chat_logprobs(entries, self.front.token_text)["content"]
            self.lp_all += got
            self.lp_pending += got
        if self.harmony is not None:
            self._harmony_deltas(self.harmony.feed(delta.token_ids))
            return
        if self.thoughts is None:
            self._answer(delta.text)
            return
        was = self.thoughts.mode
        for kind, text in self.thoughts.feed(delta.text):
            self._thought(text) if kind == REASONING else self._answer(text)
        if (self.closed_in is None and was != CONTENT and self.thoughts.mode == CONTENT
                and self.items and self.items[0]["type"] == "reasoning"):
            self.closed_in = (start, len(self.token_ids))  # this delta completed "</think>"

    def _harmony_deltas(self, deltas: list[dict]) -> None:
        for d in deltas:
            if "reasoning_content" in d:
                self._thought(d["reasoning_content"])
            else:
                self._chat_delta(d)

    def _flush(self) -> None:
        if self.harmony is not None:
            self._harmony_deltas(self.harmony.flush())
        if self.thoughts is not None:
            for kind, text in self.thoughts.flush():
                self._thought(text) if kind == REASONING else self._answer(text)
        if self.calls is not None:
            for d in self.calls.flush():
                self._chat_delta(d)

    async def reasoning_tokens(self) -> int:
        """How many of the output's tokens are the thoughts: those up to the one that completed
        ``</think>`` (found by decoding, within the delta that closed them), or all of them
        when the thoughts never closed."""
        if self.harmony is not None:
            return self.harmony.reasoning_tokens
        if not self.items or self.items[0]["type"] != "reasoning":
            return 0
        if self.closed_in is None:
            return len(self.token_ids)
        lo, hi = self.closed_in  # the close is completed by token k, lo < k <= hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if THINK_CLOSE in await self.front.decode(self.token_ids[:mid]):
                hi = mid
            else:
                lo = mid
        return hi

    async def finish(self, result: GenerateResult | None, error: O.OpenAIError | None = None) -> dict:
        """The response object once the request ended (``error``: it failed after starting);
        streamed, its last event is queued (``take``)."""
        self._flush()
        reason = result.finish_reason if result is not None else "abort"
        if error is None and reason == "abort":
            error = O.OpenAIError(500, (result.abort_reason if result is not None else None)
                                  or "the request was aborted", type_="server_error", code="aborted")
        cut = reason in ("length", "timeout")
        self._close("incomplete" if cut or error is not None else "completed")
        status = "failed" if error is not None else "incomplete" if cut else "completed"
        usage = None
        if result is not None:
            thoughts = await self.reasoning_tokens()
            usage = {"input_tokens": result.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": result.cached_tokens},
                     "output_tokens": result.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": thoughts},
                     "total_tokens": result.prompt_tokens + result.completion_tokens}
        obj = self.response(status, usage)
        if cut:
            obj["incomplete_details"] = {"reason": "max_output_tokens" if reason == "length" else "timeout"}
        if error is not None:
            obj["error"] = {"code": error.code or "server_error", "message": error.message}
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed")
        self.emit(kind, response=obj)
        return obj

    def response(self, status: str, usage: dict | None = None) -> dict:
        """The response object: the output so far and the request's parameters, as OpenAI echoes them."""
        body, job = self.tr.body, self.tr.job
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        obj = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"), "model": self.front.model_name,
            "output": list(self.items) if status != "in_progress" else [],
            "parallel_tool_calls": job.tools.parallel if job.tools is not None else
            body.get("parallel_tool_calls") is not False,
            "previous_response_id": self.tr.previous, "prompt_cache_key": body.get("prompt_cache_key"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "safety_identifier": body.get("safety_identifier"), "service_tier": "default",
            "store": self.tr.store, "temperature": job.params.temperature,
            "text": text_format(body)[2], "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": body.get("top_logprobs") or 0,
            "top_p": job.params.top_p, "truncation": "disabled", "usage": usage, "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }
        if status != "in_progress":
            obj["completed_at"] = int(time.time())
        return tools_not_offered(obj, self.tr.left_out)
