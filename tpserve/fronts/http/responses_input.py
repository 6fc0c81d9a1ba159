"""A body of OpenAI's Responses API as the chat path's Job (docs/responses.md): ``translate``
checks the Responses shapes, ``prepare`` builds the Request.

The Job's Request is made by ``make_request`` with this API's ``Api`` (``RESPONSES``: its field
names, the rest of the context as the unset limit, a ``max_output_tokens`` over it clamped);
sampling, priorities and timeouts are the chat path's own, so is the tool-call constraining
(tool_calls.py) and structured output (``text.format``, vLLM's ``structured_outputs``).

The messages: the conversation of ``previous_response_id`` from the store
(response_store.py), then ``input`` (responses_items.py), with ``instructions`` as a system
message first. ``tools`` of type ``function`` and the functions of a ``namespace`` are offered
to the model (a namespaced one as ``namespaced_name`` spells it); the tools only a hosted
service runs (web search, file search, computer use, code interpreter, image generation, MCP,
shells, ...: ``HOSTED_TOOLS``) are recognised by type, not offered, and listed in the
response's ``tools_not_offered``: the one place a request's content is left out instead of
refused, since refusing them would stop the clients that always send them (Codex).

Every field of the spec is honoured, accepted where it changes nothing here (listed in
docs/responses.md), or refused with a 400 naming it; fields nobody defined are ignored. Errors
of the shared chat path name the chat body's fields: ``renamed`` names this body's instead.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

from tpserve import limits
from tpserve.config import DEFAULT_GRAMMAR_TIMEOUT
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http import tool_calls
from tpserve.fronts.http.agent_common import respelled
from tpserve.fronts.http.harmony import check_tool_choice
from tpserve.fronts.http.response_store import ResponseStore
from tpserve.fronts.http.structured_api import format_constraint
from tpserve.fronts.http.responses_items import (TemplateTraits, bad, conversation_messages, input_items,
                                                 namespaced_name, refuse)
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
        raise bad(where or name, f"must be a string, got {type(v).__name__}")
    return v


def _bool(body: dict, name: str, default: bool, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(where or name, f"must be a boolean, got {type(v).__name__}")
    return v


def _metadata(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 16:
        raise bad("metadata", "must be an object of at most 16 string pairs")
    for k, s in v.items():
        if len(k) > 64 or not isinstance(s, str) or len(s) > 512:
            raise bad("metadata", "keys must be strings of at most 64 characters, "
                                  "values strings of at most 512")
    return v


def _include(v) -> frozenset:
    if v is None:
        return frozenset()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("include", "must be an array of strings")
    for s in v:
        if s not in INCLUDABLE:
            raise bad("include", f"{s!r} is not one of {', '.join(sorted(INCLUDABLE))}"[:300])
    return frozenset(v)


def _refused(body: dict) -> None:
    for name, why in _REFUSED.items():
        v = body.get(name)
        if v is not None and v != {} and v != []:
            raise refuse(name, why)
    if body.get("background"):
        raise refuse("background", "is not supported: responses run while the request waits (or streams)")
    for name, allowed in _ONLY.items():
        v = body.get(name)
        if v is not None and v not in allowed:
            raise refuse(name, f"only {' or '.join(json.dumps(a) for a in allowed)} is supported, "
                               f"got {json.dumps(v)[:100]}")
    cache = body.get("prompt_cache_options")
    if cache is not None and (not isinstance(cache, dict) or cache.get("prewarm")):
        raise refuse("prompt_cache_options",
                     "prewarm is not supported (the prefix cache fills as requests run)")


def text_format(body: dict) -> tuple[dict | None, str | None, dict]:
    """(structured_outputs map, the field it came from, the echoed ``text``) of ``text``."""
    text = body.get("text")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise bad("text", 'must be an object: {"format": {...}}')
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        raise refuse("text.verbosity", f'only "medium" is supported, got {json.dumps(verbosity)[:100]}')
    fmt = text.get("format")
    echo = {"format": fmt if fmt is not None else {"type": "text"}, "verbosity": "medium"}
    if fmt is None:
        return None, None, echo
    so, where = format_constraint(fmt, "text.format", schema_required=True)
    return so, where, echo


def _tools(body: dict, tr: Translation) -> None:
    """The body's tools in chat's spelling (``tr.tool_body``, checked by tool_calls.parse_tools),
    the hosted ones left out (``tr.left_out``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice in (None, "none", "auto"):
            return
        tools = []
    if not isinstance(tools, list):
        raise bad("tools", "must be an array of tools")
    offered = []

    def offer(t: dict, where: str, namespace: str | None) -> None:
        name = t.get("name")
        if not isinstance(name, str):
            raise bad(f"{where}.name", "must be a string")
        if namespace is not None:
            full = namespaced_name(namespace, name)
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
                raise bad(f"{where}.name", "must be a non-empty string")
            if not isinstance(inner, list):
                raise bad(f"{where}.tools", "must be an array of function tools")
            for j, f in enumerate(inner):
                if not isinstance(f, dict) or f.get("type") != "function":
                    raise refuse(f"{where}.tools[{j}].type",
                                 "only function tools are supported in a namespace")
                offer(f, f"{where}.tools[{j}]", ns)
        elif kind in HOSTED_TOOLS:
            note = {"type": kind, "param": where}
            if kind == "mcp" and isinstance(t.get("server_label"), str):
                note["server_label"] = t["server_label"]
            tr.left_out.append(note)
        elif kind == "custom":
            raise refuse(f"{where}.type", "custom (free-form) tools are not supported; use function tools")
        else:
            raise bad(f"{where}.type" if isinstance(t, dict) else where,
                      f'must be "function", "namespace" or a hosted tool type, got {kind!r}'[:200])
    tr.tool_body = {"tools": offered or None, "tool_choice": _tool_choice(choice, offered, tr),
                    "parallel_tool_calls": body.get("parallel_tool_calls")}


def _tool_choice(choice, offered: list[dict], tr: Translation):
    """tool_choice in chat's spelling; allowed_tools narrows ``offered`` (in place)."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict):
        raise bad("tool_choice", 'must be "none", "auto", "required" or an object')
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad("tool_choice.name", "must be a string")
        if isinstance(choice.get("namespace"), str):
            name = namespaced_name(choice["namespace"], name)
        else:  # a namespaced function named alone, when no other function has its name
            same = [full for full, (_, inner) in tr.namespaced.items() if inner == name]
            if len(same) == 1 and not any(t["function"]["name"] == name for t in offered):
                name = same[0]
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required"):
            raise bad("tool_choice.mode", f'must be "auto" or "required", got {mode!r}'[:200])
        if not isinstance(allowed, list):
            raise bad("tool_choice.tools", "must be an array of tools")
        names = {t.get("name") for t in allowed if isinstance(t, dict) and t.get("type") == "function"}
        keep = [k for k, t in enumerate(offered) if t["function"]["name"] in names]
        offered[:] = [offered[k] for k in keep]
        tr.origins[:] = [tr.origins[k] for k in keep]
        return mode
    if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith("web_search")):
        raise refuse("tool_choice", f"asks for the hosted tool {kind!r}, which this server cannot run")
    raise refuse("tool_choice", f"{kind!r} is not supported; use a function tool"[:200])


def translate(body, front, store: ResponseStore, traits: TemplateTraits) -> Translation:
    """The Translation of a Responses body (the model-independent checks of the Responses
    shapes; the sampling fields are checked by make_request, the tools by tool_calls)."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
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
        raise bad("max_tool_calls", "must be an integer")
    items = input_items(body)
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
        raise bad("stream_options", "must be an object")
    if options and not job.stream:
        raise bad("stream_options", "is only allowed when stream is true")
    messages = conversation_messages(tr.items, len(before), traits)
    if instructions:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = instructions + "\n\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise bad("input", "holds no message for the model")
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

    so, where, _ = text_format(body)
    extra = body.get("structured_outputs")  # vLLM's spelling, as on chat
    if extra is not None:
        if so is not None:
            raise bad("structured_outputs", "cannot be combined with text.format; send one of them")
        if not isinstance(extra, dict):
            raise bad("structured_outputs", "must be an object")
        so, where = extra, None
    tr.constraint = (so, where) if so is not None else None

    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad("reasoning", 'must be an object: {"effort": ..., "summary": ...}')
        effort = _str(reasoning, "effort", "reasoning.effort")
        for key in ("summary", "generate_summary"):
            v = reasoning.get(key)
            if v is not None and v not in ("auto", "concise", "detailed"):
                raise bad(f"reasoning.{key}", f'must be "auto", "concise" or "detailed", got {v!r}'[:200])
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object")
    job.chat_options = dict(chat_template_kwargs=kwargs or {}, add_generation_prompt=True,
                            continue_final_message=False, chat_template=None, reasoning_effort=effort)
    job.harmony = getattr(front, "harmony", None) is not None
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
        if job.harmony:  # harmony's calls are parsed, not constrained (harmony.py)
            check_tool_choice(plan)
        elif plan.constrains:
            if so is not None:
                raise bad(where or "structured_outputs", "cannot be combined with tools when tool_choice "
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
        raise bad(e.field, e.reason) from None


async def prepare(tr: Translation) -> None:
    """``_build``, on a thread when the request carries tools or a constraint (a megabyte of
    schemas takes a while), within the grammar time budget, as chat's structured_api.prepare."""
    if not (tr.tool_body and tr.tool_body.get("tools")) and tr.constraint is None:
        _build(tr)
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(_build, tr), DEFAULT_GRAMMAR_TIMEOUT)
    except asyncio.TimeoutError:
        raise bad("tools" if tr.tool_body else "text.format",
                  f"took longer than the grammar time budget ({DEFAULT_GRAMMAR_TIMEOUT:g} s) to prepare: "
                  "send a smaller constraint") from None


# Chat's names of fields in the front's errors -> the Responses body's.
_RENAMED = {"messages": "input", "reasoning_effort": "reasoning.effort", "prompt": "input"}


def renamed(e: O.OpenAIError) -> O.OpenAIError:
    param = _RENAMED.get(e.param)
    if param is None:
        return e
    return O.OpenAIError(e.status, respelled(e.message, e.param, param), param, e.type, e.code, e.headers)
