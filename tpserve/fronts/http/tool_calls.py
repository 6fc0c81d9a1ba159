"""Chat tool calling: ``tools`` + ``tool_choice`` as a grammar, and the model's calls back out.

The chat template renders the tools (Hugging Face's ``apply_chat_template(tools=...)``) and the
model answers in the Hermes/Qwen form, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolPlan.grammar`` turns the request into a Lark grammar (llguidance's dialect) that the engine
runs as ``structured_outputs.grammar``, so a call is valid by construction:

* ``required``: one or more blocks (one if ``parallel_tool_calls`` is false), each an object
  ``{"name": <one of the functions>, "arguments": <that function's parameters schema>}``;
* a named function: exactly one block of that function;
* ``auto``: free text, and once the text contains the trigger ``<tool_call>`` (a lazy lexeme:
  it ends at the trigger's first occurrence) the rest is constrained: the call's JSON, its
  closing tag, then more calls or the end. This is where tpserve differs from servers that parse
  the text afterwards and may hand back a call that does not match its schema: here a started
  call can only be completed validly (or be cut by ``max_tokens``: then it stays text);
* ``none``: no constraint and no parsing (the tools are still rendered, as vLLM does).

A tool's ``strict`` (``function.strict``) decides what happens to a parameters schema the
grammar engine cannot take whole (tool_schemas.py): a strict tool's is a 400 naming
the tool and the keyword; any other's is constrained leniently (the keywords llguidance does not
implement are ignored, the rest of the schema holds; failing that, loosened; at last any JSON
object), as agent clients send such schemas (Claude Code's ``propertyNames``) and must not be
refused. Local ``$ref`` pointers (``#/$defs/x``) keep pointing into the parameters schema.

The JSON of a call uses Qwen's separators (``", "`` and ``": "``), fixed, with no other
whitespace. ``split_calls`` and ``ToolCallStream`` read the output back into OpenAI's
``message.tool_calls`` (ids, function name, arguments as JSON text) and streamed
``delta.tool_calls`` chunks: a call's id and name as soon as its name is complete, then its
arguments as they are generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tpserve.fronts.http import tool_schemas as schemas
from tpserve.fronts.http.openai_api import bad
from tpserve.limits import MAX_GRAMMAR_CHARS

TRIGGER = "<tool_call>"
CLOSE = "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CALL = re.compile(re.escape(TRIGGER) + r"\n(.*?)\n" + re.escape(CLOSE), re.S)
# Qwen's separators; the JSON options travel inside each inline schema (x-guidance).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolPlan:
    """A chat request's tools (OpenAI's ``{"type": "function", "function": {...}}`` entries,
    ``function.strict`` optional), its ``tool_choice`` ("none", "auto", "required" or a function
    name) and whether several calls may come in one answer. ``fields``: the body field of each
    tool's parameters schema, which a strict tool's 400 names (default: chat's
    ``tools[i].function.parameters``; other APIs pass their spelling). ``loosened``: after
    ``grammar()``, the non-strict tools whose schemas the grammar engine could not take whole."""

    tools: list[dict]
    choice: str
    parallel: bool = True
    names: list[str] = field(default_factory=list)
    fields: list[str] | None = None
    loosened: list[str] = field(default_factory=list)

    @property
    def constrains(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> str:
        """The Lark grammar of the allowed answers (see the module docstring). A 400 naming
        ``tools`` when it would be over the size budget of a grammar (MAX_GRAMMAR_CHARS: 128
        tools of a few hundred properties each reach it) or its schemas nest too deeply; one
        naming a strict tool's schema that the grammar engine does not support."""
        self.loosened = []
        try:
            calls = [(i, call, json.dumps(call)) for i, call in self._calls()]
            text = self._grammar([dumped for _, _, dumped in calls])
            if len(text) > MAX_GRAMMAR_CHARS:
                raise bad("tools", f"make a grammar of {len(text)} characters, over the limit of "
                                   f"{MAX_GRAMMAR_CHARS}: send fewer tools, or smaller parameter schemas")
            fitted = [self._fit(*c) for c in calls]
            if any(a is not b for (_, _, a), b in zip(calls, fitted)):
                text = self._grammar(fitted)
        except RecursionError:
            raise bad("tools", "nest their parameters' schemas too deeply to make a grammar") from None
        return text

    def _calls(self) -> list[tuple[int, dict]]:
        """(index in tools, the JSON schema of a call) of each function the answer may call."""
        out = []
        for i, t in enumerate(self.tools):
            f = t["function"]
            if self.choice not in ("auto", "required") and f["name"] != self.choice:
                continue
            params = schemas.rebase_refs(f.get("parameters") or {"type": "object"}, "#/properties/arguments")
            out.append((i, self._call_schema(f["name"], params, lenient=f.get("strict") is not True)))
        return out

    @staticmethod
    def _call_schema(name: str, params, lenient: bool) -> dict:
        style = dict(_JSON_STYLE, lenient=True) if lenient else _JSON_STYLE
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": style}

    def _fit(self, i: int, call: dict, dumped: str) -> str:
        """The JSON text of ``call`` (``dumped``) if the grammar engine takes it; for a
        non-strict tool, that of the closest fallback it takes; for a strict one, a 400."""
        error = schemas.check(schemas.json_rule_grammar(dumped))
        if error is None:
            return dumped
        f = self.tools[i]["function"]
        if f.get("strict") is True:
            where = self.fields[i] if self.fields else f"tools[{i}].function.parameters"
            raise bad(where, f"tool {f['name']!r} is strict, and the grammar engine does not support "
                             f"this in its parameters: {schemas.unsupported(error)}; remove it, or "
                             "declare the tool non-strict to have its schema constrained leniently")
        self.loosened.append(f["name"])
        params = call["properties"]["arguments"]
        looser = json.dumps(self._call_schema(f["name"], schemas.loosen(params), lenient=True))
        if schemas.check(schemas.json_rule_grammar(looser)) is None:
            return looser
        return json.dumps(self._call_schema(f["name"], {"type": "object"}, lenient=True))

    def _grammar(self, calls: list[str]) -> str:
        """The grammar of the calls' JSON schemas (their text)."""
        rules = [f"fn{k}: %json {dumped}" for k, dumped in enumerate(calls)]
        body = "body: " + " | ".join(f"fn{k}" for k in range(len(calls)))
        call = f'"\\n" body "\\n{CLOSE}"'
        more = f'("\\n{TRIGGER}" {call})*' if self.parallel else ""
        if self.choice == "auto":
            head = [f"start: TEXT | trig {call} {more}", "TEXT: /(.|\\n)*/",
                    f'trig[lazy]: TEXT "{TRIGGER}"']
        else:
            single = self.choice != "required" or not self.parallel
            head = [f'start: "{TRIGGER}" {call} {"" if single else more}']
        return "\n".join(["%llguidance {}", *head, body, *rules]) + "\n"


def parse_tools(body: dict) -> ToolPlan | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked (400s
    name the field); None when the request has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {type(parallel).__name__}")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise bad("tools", f"must be an array of 1 to {MAX_TOOLS} tools")
    names = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad(where, 'must be {"type": "function", "function": {...}}')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"{where}.function.name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise bad(f"{where}.function.name", f"{name!r} is defined twice")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.function.parameters", "must be a JSON schema object")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad(f"{where}.function.description", "must be a string")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise bad(f"{where}.function.strict", "must be a boolean")
        names.append(name)
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad("tool_choice", 'must be "none", "auto", "required" or '
                                     '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise bad("tool_choice", f"names the function {name!r}, which is not in tools "
                                     f"({', '.join(names)})")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f'must be "none", "auto", "required" or a named function, got {choice!r}'[:200])
    tools = [{"type": "function", "function": t["function"]} for t in tools]
    return ToolPlan(tools, choice, parallel, names)


def message_extras(m: dict, where: str) -> dict:
    """The tool-calling keys of one chat message, checked, for the chat template: an
    assistant's ``tool_calls`` (arguments parsed back to objects, as templates expect) and a
    tool message's ``tool_call_id`` / ``name``."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", "must be an array, on an assistant message")
        clean = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"{where}.tool_calls[{j}]", 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad(f"{where}.tool_calls[{j}].function.arguments", "must be JSON text") from None
            clean.append({"id": c.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = clean
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise bad(f"{where}.{key}", "must be a string")
            out[key] = m[key]
    return out


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer: the complete call blocks become OpenAI tool
    calls; the text around them (stripped; None if empty) is the content. A block cut short
    (``max_tokens``) stays in the content."""
    calls, parts, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _as_call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        parts.append(text[pos:m.start()])
        pos = m.end()
    parts.append(text[pos:])
    content = "".join(parts).strip()
    return (content or None), calls


_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolCallStream:
    """Turns one choice's streamed text into chat deltas: ``{"content": ...}`` for text outside
    calls, ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}``
    for a call's start and ``{"tool_calls": [{"index", "function": {"arguments": piece}}]}``
    for its arguments as they come. Text that may be the start of the trigger is held back."""

    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.num_calls = 0
        self._named = False
        self._args_sent = 0
        self._space = ""         # whitespace-only text held until more text follows
        self._said = False       # content was sent (leading whitespace is dropped, as whole)

    def _content(self, text: str) -> list[dict]:
        """Content as ``split_calls`` has it (the text around calls, stripped at both ends):
        trailing whitespace waits until more text follows; leading whitespace is dropped."""
        text = self._space + text
        if not self._said:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        if not body:
            return []
        self._said = True
        return [{"content": body}]

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            if not self.in_call:
                at = self.buf.find(TRIGGER + "\n")
                if at < 0:
                    keep = _partial_suffix(self.buf, TRIGGER + "\n")
                    if len(self.buf) > keep:
                        out += self._content(self.buf[:len(self.buf) - keep])
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if at:
                    out += self._content(self.buf[:at])
                self.buf = self.buf[at + len(TRIGGER) + 1:]
                self.in_call, self._named, self._args_sent = True, False, 0
                continue
            end = self.buf.find("\n" + CLOSE)
            body = self.buf if end < 0 else self.buf[:end]
            out += self._call_progress(body, done=end >= 0)
            if end < 0:
                return out
            self.buf = self.buf[end + 1 + len(CLOSE):]
            self.in_call = False
            self.num_calls += 1

    def _call_progress(self, body: str, done: bool) -> list[dict]:
        index = self.num_calls
        m = _HEAD.match(body)
        out = []
        if m and not self._named:
            self._named = True
            out.append({"tool_calls": [{"index": index, "id": _call_id(), "type": "function",
                                        "function": {"name": json.loads(f'"{m.group(1)}"'), "arguments": ""}}]})
        if m:
            args = body[m.end():]
            # The arguments end where their object closes; the outer object's "}" follows.
            upto = _object_end(args)
            if upto > self._args_sent:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": args[self._args_sent:upto]}}]})
                self._args_sent = upto
        elif done:  # an unexpected key order: the whole call at once
            call = _as_call(body)
            if call is not None:
                out.append({"tool_calls": [{"index": index, **call}]})
        return out

    def flush(self) -> list[dict]:
        """What is held back at the end: a partial trigger as content; a call cut short by
        max_tokens stays content if its name was not complete, else it was announced already
        and ends with the arguments sent so far (finish_reason "length" says so)."""
        if self.in_call:
            rest, self.buf = TRIGGER + "\n" + self.buf, ""
            return self._content(rest) if not self._named else []
        rest, self.buf = self.buf, ""
        return self._content(rest) if rest else []


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _object_end(s: str) -> int:
    """Index just past the JSON object that starts ``s`` (len(s) if it is not closed)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)
