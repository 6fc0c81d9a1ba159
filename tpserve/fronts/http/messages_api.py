"""Anthropic's Messages API on the HTTP front: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A translator onto the chat path, not a second one: a Messages body becomes the chat body it
means (``system`` and ``role: "system"`` messages folded into one system message, ``tool_use``
blocks into an assistant's ``tool_calls``, ``tool_result`` blocks into ``tool`` messages,
``thinking`` blocks into the assistant's ``reasoning_content``, ``tools`` / ``tool_choice`` into
chat's, ``stop_sequences`` into ``stop``, ``thinking`` / ``output_config.effort`` into the chat
template's ``enable_thinking`` / ``reasoning_effort`` where the template reads them), which
openai_api.py's ``parse_chat`` and structured_api.py's ``prepare`` turn into one Request
(validated once, by tpserve/request.py, with this API's ``MESSAGES`` spelling; tool calls
constrained by tool_calls.py's grammar). It is rendered by the model's chat template, run through
``Front.choices`` (priorities, timeouts, 429/503 and metrics as chat's), and its output read back
with chat's parsers (reasoning.py, tool_calls.py) into Anthropic's content blocks (``thinking``,
``text``, ``tool_use``), whole or as Anthropic's server-sent events.

Errors on these routes are Anthropic's ``{"type": "error", "error": {"type", "message"}}``
(``AnthropicError``, a subclass of OpenAIError whose body is Anthropic's, so app.py's handler
answers it), with Anthropic's statuses: a full waiting queue or an unavailable daemon is 529
``overloaded_error``. What is accepted without effect, and each decision, is in docs/messages.md.

Usage: ``input_tokens`` counts the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those read from it, ``cache_creation_input_tokens`` is 0 (tpserve
caches every prompt without being asked); their sum is the prompt's length, which is what
``count_tokens`` returns for the same body (the same rendering).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as PlainResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpserve.client import protocol as P
from tpserve.client.client import ClientTimeout, Delta, GenerateResult, RequestError
from tpserve.errors import InvalidFieldError, InvalidRequestError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http import structured_api
from tpserve.fronts.http.reasoning import (CONTENT, REASONING, ReasoningStream, prompt_opens_thinking,
                                           split_reasoning)
from tpserve.fronts.http.tool_calls import ToolCallStream, split_calls
from tpserve.fronts.upstream import UpstreamLost
from tpserve.request import REST_OF_CONTEXT, Api, make_request

log = logging.getLogger("tpserve.http")

#: How the Messages API spells a request: max_tokens is required (so its unset default never
#: applies), a limit over what the context has left is clamped to it (agent clients send fixed
#: large values), the stop strings are ``stop_sequences``.
MESSAGES = Api("anthropic.messages", REST_OF_CONTEXT, min_max_tokens=1, clamp_max_tokens=True,
               names={"prompt": "messages", "stop": "stop_sequences"})

_DAEMON_ERRORS = (RequestError, ClientTimeout, P.ProtocolError, UpstreamLost)

# Anthropic's error type of each status it uses.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          504: "timeout_error", 529: "overloaded_error"}

# Tool types Anthropic's service runs itself, or whose schema only Claude knows: never offered to
# the model; the answer lists them (``tools_not_offered``, as the Responses API's answers do). A
# tool without a type, or "custom", is a function.
_FUNCTION_TYPES = (None, "custom")

# Block types of a message's content that tpserve cannot take (text models only; no server tools).
_NOT_TEXT = {"image": "image blocks are not supported (tpserve serves text models)",
             "document": "document blocks are not supported (tpserve serves text models)",
             "search_result": "search_result blocks are not supported",
             "container_upload": "container_upload blocks are not supported (no code execution)"}

_STOP_REASONS = {"length": "max_tokens", "timeout": "max_tokens"}


class AnthropicError(O.OpenAIError):
    """An error answered with ``status`` and Anthropic's error body."""

    def body(self) -> dict:
        kind = _TYPES.get(self.status) or ("api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def anthropic_error(e: O.OpenAIError, paths: dict | None = None) -> AnthropicError:
    """The Anthropic error of an OpenAIError raised by the shared chat path: its field respelled
    with ``paths`` (the chat body's field -> this body's), its status Anthropic's (a full queue
    and an unavailable daemon are 529 overloaded_error, as Anthropic's own overload)."""
    if isinstance(e, AnthropicError):
        return e
    param, message = e.param, e.message
    if param and paths:
        spelled = _respell(param, paths)
        if spelled != param:
            message = spelled + message[len(param):] if message.startswith(param) else message
            param = spelled
    status = e.status
    if status == 503 or (status == 429 and e.code == "rate_limit_exceeded"):
        status = 529
    return AnthropicError(status, message, param, code=e.code, headers=e.headers)


def _respell(param: str, paths: dict) -> str:
    best = None
    for key in paths:
        if (param == key or param.startswith(key + ".") or param.startswith(key + "[")) and (
                best is None or len(key) > len(best)):
            best = key
    return param if best is None else paths[best] + param[len(best):]


def bad(param: str | None, message: str) -> AnthropicError:
    return AnthropicError(400, f"{param}: {message}" if param else message, param)


# ---- the body -------------------------------------------------------------------------------
class Translation:
    """A Messages body as the chat body it means (``chat``), with what the chat path does not
    carry: the chat field -> Messages field map of error names (``paths``), each chat message's
    reasoning (``reasoning``: index -> thoughts of an assistant turn), the tools left out."""

    def __init__(self):
        self.chat: dict = {}
        self.paths: dict = {"stop": "stop_sequences",
                            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                            "response_format.json_schema.schema": "output_config.format.schema",
                            "response_format": "output_config.format"}
        self.reasoning: dict[int, str] = {}
        self.left_out: list[str] = []       # the names of the tools not offered
        self.not_offered: list[dict] = []   # and each as the answer lists it
        self.stops: list[str] = []


def _text_blocks(value, where: str) -> str:
    """A string, or an array of text blocks (``cache_control`` and ``citations`` accepted), as text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, "must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _NOT_TEXT:
            raise bad(f"{where}[{j}]", _NOT_TEXT[kind])
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}[{j}]", 'must be a text block {"type": "text", "text": ...}')
        texts.append(block["text"])
    return "\n\n".join(texts)


def _tool_result(block: dict, where: str) -> str:
    content = block.get("content")
    text = "" if content is None else _text_blocks(content, f"{where}.content")
    error = block.get("is_error")
    if error is not None and not isinstance(error, bool):
        raise bad(f"{where}.is_error", "must be a boolean")
    return f"Error: {text}" if error else text


def _messages(body: dict, t: Translation) -> list[dict]:
    """The chat messages of ``system`` and ``messages`` (system first)."""
    system = body.get("system")
    system_text = [] if system is None else [_text_blocks(system, "system")]
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the tool results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, 'must be an object {"role", "content"}')
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", f'must be "user" or "assistant", got {str(role)[:40]!r}')
        if role == "system":  # Claude Code sends these: part of the system prompt
            system_text.append(_text_blocks(content, f"{where}.content"))
            continue
        if isinstance(content, str):
            t.paths[f"messages[{len(out)}]"] = where
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", "must be a string or an array of content blocks")
        texts, calls, thoughts = [], [], []

        def flush_text():
            if texts:
                t.paths[f"messages[{len(out)}]"] = where
                out.append({"role": role, "content": "".join(texts)})
                texts.clear()
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad(f"{at}.text", "must be a string")
                texts.append(block["text"])
            elif kind in _NOT_TEXT:
                raise bad(at, _NOT_TEXT[kind])
            elif kind == "tool_use" and role == "assistant":
                name, ident, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(ident, str):
                    raise bad(at, 'must be {"type": "tool_use", "id", "name", "input"} with string id '
                                  'and name')
                if not isinstance(args, dict):
                    raise bad(f"{at}.input", "must be an object")
                names[ident] = name
                calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": args}})
            elif kind == "tool_result" and role == "user":
                ident = block.get("tool_use_id")
                if not isinstance(ident, str):
                    raise bad(f"{at}.tool_use_id", "must be a string")
                flush_text()
                t.paths[f"messages[{len(out)}]"] = at
                tool = {"role": "tool", "tool_call_id": ident, "content": _tool_result(block, at)}
                if ident in names:
                    tool["name"] = names[ident]
                out.append(tool)
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise bad(f"{at}.thinking", "must be a string")
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by Anthropic's service: nothing tpserve can read
            else:
                allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
                raise bad(at, f"a {role} message cannot hold a {str(kind)[:40]!r} block ({allowed})")
        if role == "assistant":
            t.paths[f"messages[{len(out)}]"] = where
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                t.reasoning[len(out)] = "".join(thoughts)
            out.append(msg)
        else:
            flush_text()
    if system_text:
        t.paths = {f"messages[{int(k[9:-1]) + 1}]" if k.startswith("messages[") else k: v
                   for k, v in t.paths.items()}
        t.reasoning = {k + 1: v for k, v in t.reasoning.items()}
        t.paths["messages[0]"] = "system"
        out.insert(0, {"role": "system", "content": "\n\n".join(system_text)})
    if not out:
        raise bad("messages", "hold no user or assistant turn")
    return out


def _tools(body: dict, t: Translation, chat: dict) -> None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    offered = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be an array of tools")
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise bad(where, 'must be an object {"name", "description", "input_schema"}')
            kind = tool.get("type")
            if kind not in _FUNCTION_TYPES:
                t.left_out.append(str(tool.get("name") or kind)[:64])
                t.not_offered.append({"type": str(kind)[:64], "name": t.left_out[-1], "param": where})
                continue
            if tool.get("input_schema") is None:
                raise bad(f"{where}.input_schema", "is required (a JSON schema of the tool's input)")
            fn = {"name": tool.get("name")}  # chat's key order: the template renders the same text
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            fn["parameters"] = tool["input_schema"]
            if tool.get("strict") is not None:
                fn["strict"] = tool["strict"]
            k = len(offered)
            t.paths.update({f"tools[{k}].function.parameters": f"{where}.input_schema",
                            f"tools[{k}].function": where, f"tools[{k}]": where})
            offered.append({"type": "function", "function": fn})
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice", 'must be {"type": "auto" | "any" | "tool" | "none"}')
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
            chat["parallel_tool_calls"] = not parallel
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str):
                raise bad("tool_choice.name", "must be a string naming one of tools")
            if name in t.left_out:
                raise bad("tool_choice.name", f"names {name!r}, a tool tpserve does not offer to the model "
                                              "(a server tool)")
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif kind == "any" and not offered and t.left_out:
            raise bad("tool_choice", '"any" needs a tool tpserve can offer; left out: '
                                     + ", ".join(t.left_out))
        elif kind != "none" or offered:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if offered:
        chat["tools"] = offered
    elif chat.get("tool_choice") == "auto":
        del chat["tool_choice"]  # only server tools: nothing to choose from


def _template_reads(front, name: str) -> bool:
    source = getattr(front.tokenizer, "chat_template", None) if front.tokenizer is not None else None
    return name in str(source or "")


def _reasoning(body: dict, front, chat: dict) -> None:
    """``thinking`` and ``output_config.effort`` as the chat template's options (where it reads them)."""
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad("thinking", 'must be {"type": "enabled", "budget_tokens": N}, {"type": "disabled"} '
                                  'or {"type": "adaptive"}')
        budget = thinking.get("budget_tokens")
        if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise bad("thinking.budget_tokens", "must be a positive integer")
        if kind != "adaptive" and _template_reads(front, "enable_thinking"):
            kwargs["enable_thinking"] = kind == "enabled"
    config = body.get("output_config")
    fmt = body.get("output_format")
    if config is not None:
        if not isinstance(config, dict):
            raise bad("output_config", "must be an object")
        effort = config.get("effort")
        if effort is not None:
            if not isinstance(effort, str):
                raise bad("output_config.effort", "must be a string")
            if _template_reads(front, "reasoning_effort"):
                chat["reasoning_effort"] = effort
        if config.get("format") is not None:
            fmt = config["format"]
    if fmt is not None:
        inside = config is not None and config.get("format") is not None
        where = "output_config.format" if inside else "output_format"
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                and isinstance(fmt.get("schema"), dict)):
            raise bad(where, 'must be {"type": "json_schema", "schema": {...}}')
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if kwargs:
        chat["chat_template_kwargs"] = kwargs


def translate(body, front, count_only: bool = False) -> Translation:
    """The chat body of a Messages body (``count_only``: /count_tokens, no max_tokens)."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    t = Translation()
    if body.get("model") is None:
        raise bad("model", "is required")
    chat = t.chat = {"model": body["model"]}
    chat["messages"] = _messages(body, t)
    if chat["messages"][-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    _tools(body, t, chat)
    _reasoning(body, front, chat)
    servers = body.get("mcp_servers")
    if servers is not None and servers != []:
        raise bad("mcp_servers", "are not supported: tpserve connects to no MCP server (run them in the "
                                 "client)")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad("metadata", "must be an object")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            raise bad("metadata.user_id", "must be a string")
    if count_only:
        return t
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required")
    chat["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "top_k", "stream", "priority", "timeout"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences", "must be an array of strings")
        t.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        if t.stops:
            # kept in the output so that the answer can say which one matched; cut here
            chat["stop"], chat["include_stop_str_in_output"] = t.stops, True
    return t


def _build(job: O.Job):
    """make_request with this API's spelling (structured_api.prepare's ``build``)."""
    try:
        job.request = make_request(MESSAGES, job.sampling, names=job.names, stream=job.stream,
                                   tools=job.tools,
                                   messages=job.messages, **job.fields)
    except InvalidFieldError as e:
        raise O.bad(e.field, e.reason) from None
    return job.request


async def prepare(front, body, count_only: bool = False):
    """(job, prompt token ids, translation) of a Messages body: the chat path's Job and
    rendering, errors in Anthropic's format naming this body's fields."""
    t = translate(body, front, count_only)
    try:
        job = O.parse_chat(t.chat, front.model_name)
        await structured_api.prepare(job, t.chat, _build)
        for k, thoughts in t.reasoning.items():  # templates that read it put it back
            job.messages[k]["reasoning_content"] = thoughts
        text = await front.chat_text(job.messages, job.chat_options,
                                     tools=job.tools.tools if job.tools is not None else None)
        job.thinking_opened = front.reasoning_parser is not None and prompt_opens_thinking(text)
        ids = await front.encode(text, False, field="messages")
    except O.OpenAIError as e:
        raise anthropic_error(e, t.paths) from None
    return job, ids, t


# ---- the answer -------------------------------------------------------------------------------
def _sse(kind: str, obj: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _usage(result: GenerateResult | None, prompt_tokens: int) -> dict:
    total = result.prompt_tokens if result is not None else prompt_tokens
    cached = result.cached_tokens if result is not None else 0
    output = result.completion_tokens if result is not None else 0
    return {"input_tokens": total - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


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
        self.id = "msg_" + uuid.uuid4().hex[:24]
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

    def _head(self) -> dict:
        head = {"id": self.id, "type": "message", "role": "assistant", "model": self.front.model_name}
        return head

    def _tail(self, out: dict) -> dict:
        if self.t.not_offered:
            out["tools_not_offered"] = list(self.t.not_offered)
        return out

    def stop_reason(self, finish: str, matched: str | None) -> str:
        if matched is not None:
            return "stop_sequence"
        if finish == "stop" and self.num_calls:
            return "tool_use"
        return _STOP_REASONS.get(finish, "end_turn")

    # ---- whole ----
    def whole(self, text: str, result: GenerateResult) -> dict:
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
                           "stop_sequence": matched, "usage": _usage(result, self.prompt_tokens)})

    # ---- streamed ----
    def start(self) -> list[str]:
        message = self._tail({**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                              "usage": _usage(None, self.prompt_tokens)})
        return [_sse("message_start", {"type": "message_start", "message": message}),
                _sse("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _begin(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _sse("content_block_delta",
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

    def events(self, text: str) -> list[str]:
        return self._route(self.hold.feed(text), final=False) if text else []

    def end(self, result: GenerateResult) -> list[str]:
        rest, matched = self.hold.finish(result.finish_reason)
        out = self._route(rest, final=True) + self._close()
        usage = _usage(result, self.prompt_tokens)
        reason = self.stop_reason(result.finish_reason, matched)
        out.append(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": matched},
                                          "usage": usage}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out


# ---- the routes -------------------------------------------------------------------------------
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
        except _DAEMON_ERRORS as e:
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
                        for chunk in reply.start():
                            yield chunk
                        item = first
                        while True:
                            if isinstance(item, GenerateResult):
                                result = item
                                break
                            for chunk in reply.events(item.text):
                                yield chunk
                            _, item = await anext(events)
                    except _DAEMON_ERRORS as e:  # after the 200: an error event
                        yield _sse("error", anthropic_error(daemon_error(e, job), t.paths).body())
                        return
                    except Exception as e:  # a bug of the front: said in the stream, not a cut connection
                        yield _sse("error", _unexpected(e).body())
                        return
                    for chunk in reply.end(result):
                        yield chunk
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(events.aclose))

        texts, done = [], []

        async def collect():
            async with aclosing(events):
                item = first
                while True:
                    if isinstance(item, Delta):
                        texts.append(item.text)
                    else:
                        done.append(item)
                        return
                    _, item = await anext(events)

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the events: the daemon aborts the request
                await asyncio.gather(task, return_exceptions=True)
                raise AnthropicError(499, "client disconnected")
        try:
            task.result()
        except _DAEMON_ERRORS as e:
            raise anthropic_error(daemon_error(e, job), t.paths) from None
        return JSONResponse(reply.whole("".join(texts), done[0]))

    @router.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unknown(rest: str):
        raise AnthropicError(404, f"/v1/messages/{rest[:100]} is not served here; tpserve serves POST "
                                  "/v1/messages and POST /v1/messages/count_tokens")

    outer.include_router(router)
    return outer
