"""A body of Anthropic's Messages API as the chat body it means (docs/messages.md):
``translate`` checks the Messages shapes, ``prepare`` makes the chat path's Job and prompt.

``system`` and ``role: "system"`` messages are folded into one system message first,
``tool_use`` blocks become an assistant's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, ``thinking`` blocks the assistant's ``reasoning_content``, ``tools`` / ``tool_choice``
chat's (a tool with a type, a server tool only Anthropic's service runs, is not offered and is
named in the answer's ``tools_not_offered``), ``stop_sequences`` chat's ``stop``, ``thinking`` /
``output_config.effort`` the chat template's ``enable_thinking`` / ``reasoning_effort`` where
the template reads them. openai_api.py's ``parse_chat`` and structured_api.py's ``prepare``
turn that chat body into one Request (validated once, by tpserve/request.py, with this API's
``MESSAGES`` spelling; tool calls constrained by tool_calls.py's grammar), its errors respelled
with this body's field names (``Translation.paths``) in Anthropic's format (messages_errors.py).
"""
from __future__ import annotations

from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http import structured_api
from tpserve.fronts.http.agent_common import render_prompt
from tpserve.fronts.http.messages_errors import anthropic_error, bad
from tpserve.request import REST_OF_CONTEXT, Api, make_request

#: How the Messages API spells a request: max_tokens is required (so its unset default never
#: applies), a limit over what the context has left is clamped to it (agent clients send fixed
#: large values), the stop strings are ``stop_sequences``.
MESSAGES = Api("anthropic.messages", REST_OF_CONTEXT, min_max_tokens=1, clamp_max_tokens=True,
               names={"prompt": "messages", "stop": "stop_sequences"})

# Tool types Anthropic's service runs itself, or whose schema only Claude knows: never offered to
# the model; the answer lists them (``tools_not_offered``, as the Responses API's answers do). A
# tool without a type, or "custom", is a function.
_FUNCTION_TYPES = (None, "custom")

# Block types of a message's content that tpserve cannot take (text models only; no server tools).
_NOT_TEXT = {"image": "image blocks are not supported (tpserve serves text models)",
             "document": "document blocks are not supported (tpserve serves text models)",
             "search_result": "search_result blocks are not supported",
             "container_upload": "container_upload blocks are not supported (no code execution)"}


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
    if getattr(front, "harmony", None) is not None:  # harmony's rendering takes the effort (harmony.py)
        return name == "reasoning_effort"
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
        job.harmony = getattr(front, "harmony", None) is not None
        await structured_api.prepare(job, t.chat, _build)
        for k, thoughts in t.reasoning.items():  # templates that read it put it back
            job.messages[k]["reasoning_content"] = thoughts
        ids = await render_prompt(front, job, "messages")
    except O.OpenAIError as e:
        raise anthropic_error(e, t.paths) from None
    return job, ids, t
