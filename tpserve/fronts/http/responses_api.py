"""OpenAI's Responses API on the HTTP front: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` (docs/responses.md).

A translator onto the chat path, not a second server: the body becomes one chat ``Job`` whose
Request is made by ``make_request`` with this API's ``Api`` (``RESPONSES``: its field names,
the rest of the context as the unset limit, a ``max_output_tokens`` over it clamped), rendered
by the model's chat template with its tools, tokenized and run by ``Front.choices`` like a chat
completion: sampling, priorities, timeouts, tool-call constraining (tool_calls.py), structured
output, the reasoning parser (reasoning.py), 429/503 and metrics are the chat path's own.

In: ``input`` (a string, or items: ``message`` with text parts and roles user / assistant /
system / developer, ``function_call``, ``function_call_output``, ``reasoning``), the
``instructions`` (a system message first), the conversation of ``previous_response_id`` from
the store (response_store.py) before the input. ``tools`` of type ``function`` and the
functions of a ``namespace`` are offered to the model (a namespaced one as
``<namespace>.<name>``, or ``<namespace><name>`` when the namespace ends in ``_`` or ``.``);
the tools only a hosted service runs (web search, file search, computer use, code interpreter,
image generation, MCP, shells, ...) are recognised by type, not offered, and listed in the
response's ``tools_not_offered``: the one place a request's content is left out instead of
refused, since refusing them would stop the clients that always send them (Codex).

Out: the response object with ``reasoning`` (a reasoning parser's thoughts), ``message`` and
``function_call`` output items, usage, status ``completed`` / ``incomplete`` (cut by
``max_output_tokens``) / ``failed``, and the request's parameters echoed; streamed, the spec's
server-sent events (``event:`` and ``data:`` lines, each with its ``sequence_number``), built by
the same ``Output`` that builds a whole response, so both always agree. Closing a stream, or
leaving before a whole response is ready, aborts the request.

Every field of the spec is honoured, accepted where it changes nothing here (listed in
docs/responses.md), or refused with a 400 naming it; fields nobody defined are ignored.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from tpserve.client.client import GenerateResult
from tpserve.config import DEFAULT_GRAMMAR_TIMEOUT
from tpserve import limits
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http import tool_calls
from tpserve.fronts.http.reasoning import CLOSE as THINK_CLOSE
from tpserve.fronts.http.reasoning import CONTENT, REASONING, ReasoningStream, prompt_opens_thinking
from tpserve.fronts.http.response_store import ResponseStore
from tpserve.request import REST_OF_CONTEXT, Api, make_request

#: How the Responses API spells a request (tpserve/request.py). A max_output_tokens larger than
#: the rest of the context is lowered to it: agent clients send fixed large limits.
RESPONSES = Api("openai.responses", REST_OF_CONTEXT, min_max_tokens=1, clamp_max_tokens=True,
                names={"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"})

#: Tool types only OpenAI's hosted service (or a client's built-in) runs: recognised, not offered.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
    "image_generation", "local_shell", "shell", "apply_patch", "mcp", "tool_search",
    "programmatic_tool_calling"})
INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"})
# vLLM's and tpserve's extra sampling fields, as on chat (SamplingParams' names).
_EXTRA_SAMPLING = ("seed", "top_k", "min_p", "stop", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias",
                   "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens")
_LABELS = ("user", "safety_identifier", "prompt_cache_key")
# Refused whenever set (not null): what they ask for does not exist here.
_REFUSED = {
    "conversation": "is not supported (no Conversations API): send previous_response_id, or the items",
    "prompt": "is not supported (no stored prompt templates): send instructions and input",
    "moderation": "is not supported (no moderation model)",
    "background_options": "is only meaningful with background, which is not supported",
}
# Refused when set to anything but these values (None: unset).
_ONLY = {"truncation": ("disabled",), "service_tier": ("auto", "default")}
_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_SEALED = "tpserve:"  # reasoning's encrypted_content: not encrypted, the thoughts' text encoded


def _bad(param, message, code="invalid_value"):
    return O.bad(param, message, code=code)


def _refuse(param, message):
    return O.bad(param, message, code="unsupported_parameter")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _seal(text: str) -> str:
    return _SEALED + base64.b64encode(text.encode()).decode()


def _unseal(value) -> str | None:
    if not isinstance(value, str) or not value.startswith(_SEALED):
        return None
    try:
        return base64.b64decode(value[len(_SEALED):], validate=True).decode()
    except (binascii.Error, ValueError):
        return None


@dataclass
class TemplateTraits:
    """What the model's chat template reads: a ``developer`` role (else developer messages are
    rendered as system ones), an assistant's ``reasoning_content`` (else reasoning items of the
    input are dropped: the template would not show them)."""

    developer: bool = False
    reasoning: bool = False

    @classmethod
    def of(cls, tokenizer) -> "TemplateTraits":
        source = str(getattr(tokenizer, "chat_template", None) or "")
        return cls(developer="developer" in source, reasoning="reasoning_content" in source)


@dataclass
class Translation:
    """A Responses body as the chat path's Job, and what the response echoes."""

    job: O.Job
    body: dict
    store: bool
    items: list[dict]                # the conversation's input items (stored for continuations)
    new_items: list[dict]            # this request's own input items
    previous: str | None
    include: frozenset = frozenset()
    left_out: list[dict] = field(default_factory=list)  # hosted tools not offered
    namespaced: dict = field(default_factory=dict)      # offered name -> (namespace, name)
    tool_body: dict | None = None    # the tools in chat's spelling, for tool_calls.parse_tools
    origins: list[str] = field(default_factory=list)    # body path of each offered tool
    constraint: tuple | None = None  # (structured_outputs map, the field it came from)

    @property
    def logprobs(self) -> bool:
        return self.job.sampling.get("logprobs") is not None


# ---- the request ------------------------------------------------------------------------------
def _str(body: dict, name: str, where: str | None = None):
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise _bad(where or name, f"must be a string, got {type(v).__name__}")
    return v


def _bool(body: dict, name: str, default: bool, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(where or name, f"must be a boolean, got {type(v).__name__}")
    return v


def _metadata(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 16:
        raise _bad("metadata", "must be an object of at most 16 string pairs")
    for k, s in v.items():
        if len(k) > 64 or not isinstance(s, str) or len(s) > 512:
            raise _bad("metadata", "keys must be strings of at most 64 characters, "
                                   "values strings of at most 512")
    return v


def _include(v) -> frozenset:
    if v is None:
        return frozenset()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("include", "must be an array of strings")
    for s in v:
        if s not in INCLUDABLE:
            raise _bad("include", f"{s!r} is not one of {', '.join(sorted(INCLUDABLE))}"[:300])
    return frozenset(v)


def _refused(body: dict) -> None:
    for name, why in _REFUSED.items():
        v = body.get(name)
        if v is not None and v != {} and v != []:
            raise _refuse(name, why)
    if body.get("background"):
        raise _refuse("background", "is not supported: responses run while the request waits (or streams)")
    for name, allowed in _ONLY.items():
        v = body.get(name)
        if v is not None and v not in allowed:
            raise _refuse(name, f"only {' or '.join(json.dumps(a) for a in allowed)} is supported, "
                                f"got {json.dumps(v)[:100]}")
    cache = body.get("prompt_cache_options")
    if cache is not None and (not isinstance(cache, dict) or cache.get("prewarm")):
        raise _refuse("prompt_cache_options",
                      "prewarm is not supported (the prefix cache fills as requests run)")


def _text_format(body: dict) -> tuple[dict | None, str | None, dict]:
    """(structured_outputs map, the field it came from, the echoed ``text``) of ``text``."""
    text = body.get("text")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise _bad("text", 'must be an object: {"format": {...}}')
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        raise _refuse("text.verbosity", f'only "medium" is supported, got {json.dumps(verbosity)[:100]}')
    fmt = text.get("format")
    echo = {"format": fmt if fmt is not None else {"type": "text"}, "verbosity": "medium"}
    if fmt is None:
        return None, None, echo
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("text.format", 'must be an object with a "type"')
    kind = fmt["type"]
    if kind == "text":
        return None, None, echo
    if kind == "json_object":
        return {"json_object": True}, "text.format", echo
    if kind != "json_schema":
        raise _bad("text.format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'[:200])
    name = fmt.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("text.format.name", "must be a non-empty string")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise _bad("text.format.strict", "must be a boolean")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise _bad("text.format.schema", "must be a JSON schema object")
    return {"json": schema}, "text.format.schema", echo


def _namespaced_name(namespace: str, name: str) -> str:
    return namespace + name if namespace.endswith(("_", ".")) else f"{namespace}.{name}"


def _tools(body: dict, tr: Translation) -> None:
    """The body's tools in chat's spelling (``tr.tool_body``, checked by tool_calls.parse_tools),
    the hosted ones left out (``tr.left_out``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice in (None, "none", "auto"):
            return
        tools = []
    if not isinstance(tools, list):
        raise _bad("tools", "must be an array of tools")
    offered = []

    def offer(t: dict, where: str, namespace: str | None) -> None:
        name = t.get("name")
        if not isinstance(name, str):
            raise _bad(f"{where}.name", "must be a string")
        if namespace is not None:
            full = _namespaced_name(namespace, name)
            tr.namespaced[full] = (namespace, name)
            name = full
        fn = {"name": name}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        offered.append({"type": "function", "function": fn})
        tr.origins.append(where)

    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            offer(t, where, None)
        elif kind == "namespace":
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns:
                raise _bad(f"{where}.name", "must be a non-empty string")
            if not isinstance(inner, list):
                raise _bad(f"{where}.tools", "must be an array of function tools")
            for j, f in enumerate(inner):
                if not isinstance(f, dict) or f.get("type") != "function":
                    raise _refuse(f"{where}.tools[{j}].type",
                                  "only function tools are supported in a namespace")
                offer(f, f"{where}.tools[{j}]", ns)
        elif kind in HOSTED_TOOLS:
            note = {"type": kind, "param": where}
            if kind == "mcp" and isinstance(t.get("server_label"), str):
                note["server_label"] = t["server_label"]
            tr.left_out.append(note)
        elif kind == "custom":
            raise _refuse(f"{where}.type", "custom (free-form) tools are not supported; use function tools")
        else:
            raise _bad(f"{where}.type" if isinstance(t, dict) else where,
                       f'must be "function", "namespace" or a hosted tool type, got {kind!r}'[:200])
    tr.tool_body = {"tools": offered or None, "tool_choice": _tool_choice(choice, offered, tr),
                    "parallel_tool_calls": body.get("parallel_tool_calls")}


def _tool_choice(choice, offered: list[dict], tr: Translation):
    """tool_choice in chat's spelling; allowed_tools narrows ``offered`` (in place)."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict):
        raise _bad("tool_choice", 'must be "none", "auto", "required" or an object')
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name", "must be a string")
        if isinstance(choice.get("namespace"), str):
            name = _namespaced_name(choice["namespace"], name)
        else:  # a namespaced function named alone, when no other function has its name
            same = [full for full, (_, inner) in tr.namespaced.items() if inner == name]
            if len(same) == 1 and not any(t["function"]["name"] == name for t in offered):
                name = same[0]
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required"):
            raise _bad("tool_choice.mode", f'must be "auto" or "required", got {mode!r}'[:200])
        if not isinstance(allowed, list):
            raise _bad("tool_choice.tools", "must be an array of tools")
        names = {t.get("name") for t in allowed if isinstance(t, dict) and t.get("type") == "function"}
        keep = [k for k, t in enumerate(offered) if t["function"]["name"] in names]
        offered[:] = [offered[k] for k in keep]
        tr.origins[:] = [tr.origins[k] for k in keep]
        return mode
    if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith("web_search")):
        raise _refuse("tool_choice", f"asks for the hosted tool {kind!r}, which this server cannot run")
    raise _refuse("tool_choice", f"{kind!r} is not supported; use a function tool"[:200])


def _content_text(content, where: str) -> str:
    """The text of a message's (or a tool output's) content: a string or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _refuse(f"{w}.type", f"{kind} is not supported: this server serves text models")
        else:
            raise _bad(f"{w}.type" if isinstance(part, dict) else w,
                       f'must be "input_text" or "output_text", got {kind!r}'[:200])
        if not isinstance(text, str):
            raise _bad(f"{w}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    sealed = _unseal(item.get("encrypted_content"))
    if sealed is not None:
        return sealed
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") in kinds
                                                      and isinstance(p.get("text"), str) for p in parts):
                raise _bad(f"{where}.{key}", f"must be an array of {kinds[0]} parts")
            return "\n\n".join(p["text"] for p in parts)
    return ""


def conversation_messages(items: list[dict], count_before: int, traits: TemplateTraits,
                          namespaced_name=_namespaced_name) -> list[dict]:
    """The chat messages of a conversation's items (``count_before``: how many come from a
    continued response: their errors cannot happen, the rest are named ``input[i]``).

    An assistant's text and the function calls after it are one assistant message (as chat
    templates expect); a function call's output is a ``tool`` message; a reasoning item's text
    goes to the next assistant message's ``reasoning_content`` where the template reads it.
    Consecutive system messages (instructions, developer messages) are joined into one."""
    messages: list[dict] = []
    call_names: dict[str, str] = {}
    thoughts = None
    for i, item in enumerate(items):
        where = f"input[{i - count_before}]" if i >= count_before else "previous_response_id"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role",
                           f'must be "user", "assistant", "system" or "developer", got {role!r}'[:200])
            if role == "developer" and not traits.developer:
                role = "system"
            text = _content_text(item.get("content"), f"{where}.content")
            if role == "system" and messages and messages[-1]["role"] == "system":
                messages[-1]["content"] += "\n\n" + text
                continue
            m = {"role": role, "content": text}
            if role == "assistant" and thoughts is not None:
                m["reasoning_content"] = thoughts
            thoughts = None  # thoughts belong to the assistant turn right after them
            messages.append(m)
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            for key, v in (("call_id", call_id), ("name", name), ("arguments", args)):
                if not isinstance(v, str):
                    raise _bad(f"{where}.{key}", "must be a string")
            if isinstance(item.get("namespace"), str):
                name = namespaced_name(item["namespace"], name)
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:  # a call cut short (max_output_tokens): rendered as it was written
                parsed = args
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            call_names[call_id] = name
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if thoughts is not None and "reasoning_content" not in last:
                    last["reasoning_content"], thoughts = thoughts, None
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thoughts is not None:
                    m["reasoning_content"], thoughts = thoughts, None
                messages.append(m)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id", "must be a string")
            if call_id not in call_names:
                raise _bad(f"{where}.call_id",
                           f"no function_call with call_id {call_id!r} comes before it"[:200])
            messages.append({"role": "tool", "content": _content_text(item.get("output"), f"{where}.output"),
                             "tool_call_id": call_id, "name": call_names[call_id]})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if traits.reasoning and text:
                thoughts = text if thoughts is None else thoughts + "\n\n" + text
        elif kind == "item_reference":
            raise _refuse(f"{where}.type", "item_reference is not supported: send the item itself")
        else:
            raise _refuse(f"{where}.type", f"must be one of {', '.join(_ITEM_KINDS)}, got {kind!r} "
                                           "(items of hosted tools never come from this server)"[:300])
    return messages


def _input_items(body: dict) -> list[dict]:
    value = body.get("input")
    if value is None:
        raise _bad("input", "is required", code="missing_required_parameter")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty array of input items")
    if len(value) > O.MAX_MESSAGES * 4:
        raise _bad("input", f"at most {O.MAX_MESSAGES * 4} items, got {len(value)}")
    return value


def translate(body, front, store: ResponseStore, traits: TemplateTraits) -> Translation:
    """The Translation of a Responses body (the model-independent checks of the Responses
    shapes; the sampling fields are checked by make_request, the tools by tool_calls)."""
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {type(model).__name__}")
    if model is not None and model != front.model_name:
        raise O.OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                 f"`{front.model_name}`.", "model", code="model_not_found")
    _refused(body)
    for name in _LABELS:
        _str(body, name)
    instructions = _str(body, "instructions")
    previous = _str(body, "previous_response_id")
    _metadata(body.get("metadata"))
    if body.get("max_tool_calls") is not None and not limits.is_int(body["max_tool_calls"]):
        raise _bad("max_tool_calls", "must be an integer")
    items = _input_items(body)
    before = []
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise O.OpenAIError(404, f"Previous response with id '{previous}' not found.",
                                "previous_response_id", code="previous_response_not_found")
        before = stored.conversation
    job = O.Job([], chat=True)
    tr = Translation(job, body, _bool(body, "store", True), before + items, items, previous,
                     _include(body.get("include")))
    job.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    if options and not job.stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    messages = conversation_messages(tr.items, len(before), traits)
    if instructions:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = instructions + "\n\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise _bad("input", "holds no message for the model")
    job.messages = messages

    sampling = {}
    if body.get("max_output_tokens") is not None:
        sampling["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", *_EXTRA_SAMPLING):
        if body.get(name) is not None:
            sampling[name] = body[name]
    if isinstance(sampling.get("stop"), list):  # clients send empty stop strings: they stop nothing
        sampling["stop"] = [s for s in sampling["stop"] if s != ""] or None
        if sampling["stop"] is None:
            del sampling["stop"]
    top = body.get("top_logprobs")
    if "message.output_text.logprobs" in tr.include or top is not None:
        sampling["logprobs"] = 0 if top is None else top
    job.sampling = sampling
    job.fields = dict(priority=body.get("priority"), timeout=body.get("timeout"))

    so, where, _ = _text_format(body)
    extra = body.get("structured_outputs")  # vLLM's spelling, as on chat
    if extra is not None:
        if so is not None:
            raise _bad("structured_outputs", "cannot be combined with text.format; send one of them")
        if not isinstance(extra, dict):
            raise _bad("structured_outputs", "must be an object")
        so, where = extra, None
    tr.constraint = (so, where) if so is not None else None

    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("reasoning", 'must be an object: {"effort": ..., "summary": ...}')
        effort = _str(reasoning, "effort", "reasoning.effort")
        for key in ("summary", "generate_summary"):
            v = reasoning.get(key)
            if v is not None and v not in ("auto", "concise", "detailed"):
                raise _bad(f"reasoning.{key}", f'must be "auto", "concise" or "detailed", got {v!r}'[:200])
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    job.chat_options = dict(chat_template_kwargs=kwargs or {}, add_generation_prompt=True,
                            continue_final_message=False, chat_template=None, reasoning_effort=effort)
    job.add_special_tokens = False
    _tools(body, tr)
    return tr


_TOOL_PARAM = re.compile(r"^tools\[(\d+)\](?:\.function)?")


def _tool_error(e: O.OpenAIError, tr: Translation) -> O.OpenAIError:
    """tool_calls' error about a translated tool, naming the body's field instead."""
    m = _TOOL_PARAM.match(e.param or "")
    if m is None or int(m.group(1)) >= len(tr.origins):
        return e
    param = tr.origins[int(m.group(1))] + e.param[m.end():]
    message = e.message[len(e.param):] if e.message.startswith(e.param) else ": " + e.message
    return O.OpenAIError(e.status, param + message, param, e.type, e.code, e.headers)


def _build(tr: Translation) -> None:
    """The tool plan and grammar, the constraint and the Request (make_request: the one
    validation of the sampling fields, errors in this API's names)."""
    job = tr.job
    plan = None
    if tr.tool_body is not None:
        try:
            plan = tool_calls.parse_tools(tr.tool_body)
        except O.OpenAIError as e:
            raise _tool_error(e, tr) from None
    so, where = tr.constraint or (None, None)
    if plan is not None:
        plan.fields = [f"{where}.parameters" for where in tr.origins]  # a strict tool's 400 names it
        job.tools = plan
        if plan.constrains:
            if so is not None:
                raise _bad(where or "structured_outputs", "cannot be combined with tools when tool_choice "
                                                          f'is {plan.choice!r} (only with "none")')
            try:
                so, where = {"grammar": plan.grammar()}, "tools"
            except O.OpenAIError as e:
                raise _tool_error(e, tr) from None
    if so is not None:
        job.sampling["structured_outputs"] = so
        if where is not None:
            job.names["structured_outputs"] = where
    try:
        job.request = make_request(RESPONSES, job.sampling, names=job.names, stream=job.stream,
                                   tools=job.tools, messages=job.messages, **job.fields)
    except InvalidFieldError as e:
        raise _bad(e.field, e.reason) from None


async def prepare(tr: Translation) -> None:
    """``_build``, on a thread when the request carries tools or a constraint (a megabyte of
    schemas takes a while), within the grammar time budget, as chat's structured_api.prepare."""
    if not (tr.tool_body and tr.tool_body.get("tools")) and tr.constraint is None:
        _build(tr)
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(_build, tr), DEFAULT_GRAMMAR_TIMEOUT)
    except asyncio.TimeoutError:
        raise _bad("tools" if tr.tool_body else "text.format",
                   f"took longer than the grammar time budget ({DEFAULT_GRAMMAR_TIMEOUT:g} s) to prepare: "
                   "send a smaller constraint") from None


# Chat's names of fields in the front's errors -> the Responses body's.
_RENAMED = {"messages": "input", "reasoning_effort": "reasoning.effort", "prompt": "input"}


def renamed(e: O.OpenAIError) -> O.OpenAIError:
    param = _RENAMED.get(e.param)
    if param is None:
        return e
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return O.OpenAIError(e.status, message, param, e.type, e.code, e.headers)


# ---- the response -----------------------------------------------------------------------------
def _sse(kind: str, obj: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


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
            self.events.append(_sse(kind, fields))

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
                item["encrypted_content"] = _seal(text)
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
            self._begin({"id": _new_id("msg_"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []})
        self.pieces.append(text)
        lps, self.lp_pending = self.lp_pending, []
        self.emit("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                  content_index=0, delta=text, logprobs=lps)

    def _thought(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._begin({"id": _new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"})
        self.pieces.append(text)
        self.emit("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                  content_index=0, delta=text)

    def _call(self, delta: dict) -> None:
        for tc in delta["tool_calls"]:
            fn = tc.get("function") or {}
            if "id" in tc:  # a call begins (its arguments may all come with it)
                name = fn.get("name", "")
                item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress",
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
        if self.thoughts is None:
            self._answer(delta.text)
            return
        was = self.thoughts.mode
        for kind, text in self.thoughts.feed(delta.text):
            self._thought(text) if kind == REASONING else self._answer(text)
        if (self.closed_in is None and was != CONTENT and self.thoughts.mode == CONTENT
                and self.items and self.items[0]["type"] == "reasoning"):
            self.closed_in = (start, len(self.token_ids))  # this delta completed "</think>"

    def _flush(self) -> None:
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
            "text": _text_format(body)[2], "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": body.get("top_logprobs") or 0,
            "top_p": job.params.top_p, "truncation": "disabled", "usage": usage, "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }
        if status != "in_progress":
            obj["completed_at"] = int(time.time())
        if self.tr.left_out:
            obj["tools_not_offered"] = self.tr.left_out
        return obj


# ---- the endpoints ----------------------------------------------------------------------------
def _stored_items(tr: Translation) -> list[dict]:
    """The conversation's input items to store, each with an id (the input_items listing's)."""
    new = []
    for item in tr.new_items:
        if isinstance(item, dict) and "id" not in item:
            prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                      "reasoning": "rs_"}.get(item.get("type", "message"), "item_")
            item = {"id": _new_id(prefix), **item}
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
    traits = TemplateTraits.of(front.tokenizer)

    def not_found(response_id: str) -> O.OpenAIError:
        return O.OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id",
                             code="response_not_found")

    async def start(request: Request):
        body = await read_json(request)
        tr = translate(body, front, store, traits)
        await prepare(tr)
        job = tr.job
        try:
            text = await front.chat_text(job.messages, job.chat_options,
                                         tools=job.tools.tools if job.tools is not None else None)
            job.thinking_opened = front.reasoning_parser is not None and prompt_opens_thinking(text)
            ids = await front.encode(text, False, field="input")
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
        out = Output(tr, front, _new_id("resp_"), job.stream)
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
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(events.aclose))

        async def collect() -> GenerateResult | None:
            async with aclosing(events):
                result = await consume(first[1])
                async for _, item in events:
                    result = await consume(item) or result
            return result

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the events: the daemon aborts the request
                await asyncio.gather(task, return_exceptions=True)
                raise O.OpenAIError(499, "client disconnected", code="client_closed")
        try:
            result = task.result()
        except daemon_errors as e:
            raise renamed(daemon_error(e, job)) from None
        obj = await out.finish(result)
        keep(tr, obj)
        return JSONResponse(obj)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, stream: str | None = None):
        if stream is not None and stream.lower() not in ("false", "0"):
            raise _refuse("stream", "replaying a stored response as a stream is not supported "
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
        raise _bad(None, "only background responses can be cancelled; this server runs none "
                         "(close a stream to cancel it)")

    @router.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if not 1 <= limit <= 100:
            raise _bad("limit", f"must be in [1, 100], got {limit}")
        if order not in ("asc", "desc"):
            raise _bad("order", f'must be "asc" or "desc", got {order!r}'[:200])
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            at = next((k for k, it in enumerate(items) if it.get("id") == after), None)
            if at is None:
                raise _bad("after", f"no item with id {after!r} in this response's input"[:200])
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    return router
