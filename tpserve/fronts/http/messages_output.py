"""The answer of Anthropic's Messages API (docs/messages.md): ``Message`` reads one request's
output back with chat's parsers (reasoning.py's thoughts, tool_calls.py's calls) into content
blocks (``thinking``, ``text``, ``tool_use``), whole or as Anthropic's server-sent events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``). A model served in harmony (gpt-oss) has its answer's
token ids parsed by harmony.py into the same blocks (stop sequences are then the daemon's alone).

``stop_reason``: ``end_turn``, ``max_tokens`` (the length limit or the timeout),
``stop_sequence`` (the sequence cut from the text and named; streamed, a tail that may begin
one is held back until it is known not to: ``_StopHold``) or ``tool_use``.

Usage: ``input_tokens`` counts the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those read from it, ``cache_creation_input_tokens`` is 0 (tpserve
caches every prompt without being asked); their sum is the prompt's length, which is what
``count_tokens`` returns for the same body (the same rendering). Streamed, ``message_start``
already has this split (the daemon's first delta carries the counts), as the last
``message_delta`` has.
"""
from __future__ import annotations

import json

from tpserve.client.client import Delta, GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import named_event, new_id, tools_not_offered
from tpserve.fronts.http.harmony import HarmonyStream, parse_whole
from tpserve.fronts.http.messages_input import Translation
from tpserve.fronts.http.reasoning import CONTENT, REASONING, ReasoningStream, split_reasoning
from tpserve.fronts.http.tool_calls import ToolCallStream, split_calls

_STOP_REASONS = {"length": "max_tokens", "timeout": "max_tokens"}


def _tool_id() -> str:
    return new_id("toolu_", 24)


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _final_usage(result: GenerateResult) -> dict:
    return _usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)


def _cut_stop(text: str, stops: list[str], finish: str) -> tuple[str, str | None]:
    """(text without the stop sequence it ends with, that sequence) when the answer ended on one."""
    if finish == "stop":
        for s in stops:  # longest first
            if text.endswith(s):
                return text[:len(text) - len(s)], s
    return text, None


class _StopHold:
    """Holds back a streamed tail that may be (the start of) a stop sequence, so that the one the
    answer ends on is never sent."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf = stops, ""

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.buf += text
        keep = 0
        for s in self.stops:
            for k in range(min(len(s), len(self.buf)), keep, -1):
                if s.startswith(self.buf[-k:]):
                    keep = k
                    break
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def finish(self, finish: str) -> tuple[str, str | None]:
        rest, self.buf = self.buf, ""
        return _cut_stop(rest, self.stops, finish)


class Message:
    """Anthropic's answer to one request: whole (``whole``) or as events (``events``, ``end``)."""

    def __init__(self, front, job: O.Job, t: Translation, prompt_tokens: int):
        self.front, self.job, self.t = front, job, t
        self.id = new_id("msg_", 24)
        self.prompt_tokens = prompt_tokens
        self.parser = front.reasoning_parser
        self.tools = job.tools is not None and job.tools.constrains
        # streaming state
        self.hold = _StopHold(t.stops)
        self.reasoning = ReasoningStream(self.parser, job.thinking_opened) if self.parser else None
        self.calls = ToolCallStream() if self.tools else None
        self.index, self.open = -1, None
        self.thought = False       # a thinking block was sent: the answer's leading blanks are dropped
        self.answered = False
        self.num_calls = 0
        self.harmony = getattr(front, "harmony", None)
        self.harmony_stream = HarmonyStream(self.harmony) if self.harmony is not None else None

    def _head(self) -> dict:
        head = {"id": self.id, "type": "message", "role": "assistant", "model": self.front.model_name}
        return head

    def _tail(self, out: dict) -> dict:
        return tools_not_offered(out, self.t.not_offered)

    def stop_reason(self, finish: str, matched: str | None) -> str:
        if matched is not None:
            return "stop_sequence"
        if finish == "stop" and self.num_calls:
            return "tool_use"
        return _STOP_REASONS.get(finish, "end_turn")

    # ---- whole ----
    def whole(self, text: str, result: GenerateResult, token_ids: list[int] | None = None) -> dict:
        if self.harmony is not None:
            return self._harmony_whole(token_ids or [], result)
        text, matched = _cut_stop(text, self.t.stops, result.finish_reason)
        thoughts, answer = (split_reasoning(text, self.parser, self.job.thinking_opened) if self.parser
                            else (None, text))
        answer = answer or ""
        if thoughts:
            answer = answer.lstrip()
        content = []
        if thoughts:
            content.append({"type": "thinking", "thinking": thoughts, "signature": ""})
        calls = []
        if self.tools:
            answer, calls = split_calls(answer)
        if answer:
            content.append({"type": "text", "text": answer})
        for c in calls:
            content.append({"type": "tool_use", "id": _tool_id(), "name": c["function"]["name"],
                            "input": json.loads(c["function"]["arguments"])})
        self.num_calls = len(calls)
        return self._tail({**self._head(), "content": content,
                           "stop_reason": self.stop_reason(result.finish_reason, matched),
                           "stop_sequence": matched, "usage": _final_usage(result)})

    def _harmony_whole(self, token_ids: list[int], result: GenerateResult) -> dict:
        """The whole answer of a model served in harmony (its calls' arguments that are not a JSON
        object, cut short, stay text)."""
        thoughts, answer, calls, _ = parse_whole(self.harmony, token_ids)
        content = []
        if thoughts:
            content.append({"type": "thinking", "thinking": thoughts, "signature": ""})
        texts = [answer] if answer else []
        uses = []
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"] or "{}")
            except ValueError:
                args = None
            if isinstance(args, dict):
                uses.append({"type": "tool_use", "id": _tool_id(), "name": c["function"]["name"],
                             "input": args})
            else:
                texts.append(c["function"]["arguments"])
        if texts:
            content.append({"type": "text", "text": "".join(texts)})
        content += uses
        self.num_calls = len(uses)
        return self._tail({**self._head(), "content": content,
                           "stop_reason": self.stop_reason(result.finish_reason, None),
                           "stop_sequence": None, "usage": _final_usage(result)})

    # ---- streamed ----
    def start(self, first: Delta | GenerateResult) -> list[str]:
        """``message_start`` and a ping. ``first``: the request's first Delta (or its result),
        which carries the prompt's counts, so that the usage here splits the prompt into
        uncached and cached tokens as the last ``message_delta`` does."""
        cached = first.cached_tokens or 0
        prompt = first.prompt_tokens or self.prompt_tokens
        message = self._tail({**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                              "usage": _usage(prompt, cached, 0)})
        return [named_event("message_start", {"type": "message_start", "message": message}),
                named_event("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _begin(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [named_event("content_block_start", {"type": "content_block_start",
                                                          "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return named_event("content_block_delta",
                           {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _thinking(self, text: str) -> list[str]:
        block = {"type": "thinking", "thinking": "", "signature": ""}
        out = [] if self.open == "thinking" else self._begin(block)
        self.thought = True
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[str]:
        if self.thought and not self.answered:
            text = text.lstrip()
        if not text:
            return []
        self.answered = True
        out = [] if self.open == "text" else self._begin({"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def _chat_delta(self, d: dict) -> list[str]:
        """One of ToolCallStream's chat deltas as Anthropic events."""
        if "content" in d:
            return self._text(d["content"])
        (call,) = d["tool_calls"]
        out = []
        if "id" in call:  # a call starts
            self.num_calls += 1
            self.answered = True
            out += self._begin({"type": "tool_use", "id": _tool_id(), "name": call["function"]["name"],
                                "input": {}})
        args = call["function"].get("arguments")
        if args:
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def _route(self, text: str, final: bool) -> list[str]:
        pieces = [(CONTENT, text)] if self.reasoning is None else self.reasoning.feed(text)
        if final and self.reasoning is not None:
            pieces += self.reasoning.flush()
        out = []
        for kind, piece in pieces:
            if kind == REASONING:
                out += self._thinking(piece)
            elif self.calls is not None:
                for d in self.calls.feed(piece):
                    out += self._chat_delta(d)
            else:
                out += self._text(piece)
        if final and self.calls is not None:
            for d in self.calls.flush():
                out += self._chat_delta(d)
        return out

    def _harmony_events(self, deltas: list[dict]) -> list[str]:
        out = []
        for d in deltas:
            out += self._thinking(d["reasoning_content"]) if "reasoning_content" in d else self._chat_delta(d)
        return out

    def events(self, text: str, token_ids: list[int] | None = None) -> list[str]:
        if self.harmony_stream is not None:
            return self._harmony_events(self.harmony_stream.feed(token_ids or []))
        return self._route(self.hold.feed(text), final=False) if text else []

    def end(self, result: GenerateResult) -> list[str]:
        if self.harmony_stream is not None:
            matched = None
            out = self._harmony_events(self.harmony_stream.flush()) + self._close()
        else:
            rest, matched = self.hold.finish(result.finish_reason)
            out = self._route(rest, final=True) + self._close()
        usage = _final_usage(result)
        reason = self.stop_reason(result.finish_reason, matched)
        out.append(named_event("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reason, "stop_sequence": matched},
                                                 "usage": usage}))
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return out

