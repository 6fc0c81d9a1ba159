"""gpt-oss's chat format, harmony: prompts rendered and answers parsed by OpenAI's
``openai-harmony`` package (the ``harmony`` extra).

A gpt-oss model (``GptOssForCausalLM`` in its config.json) is served in harmony unless another
``--reasoning-parser`` is named; ``--reasoning-parser openai_gptoss`` (vLLM's name) asks for it
on any model. The chat template is then not used:

* ``render``: a chat request's messages as harmony's conversation, its prompt token ids. The
  system message carries the reasoning effort (``reasoning_effort``: low, medium or high); the
  leading system / developer messages become the developer message's instructions, and the
  request's tools its ``functions`` namespace. An assistant message's ``reasoning_content`` is
  its ``analysis`` message, its tool calls ``commentary`` messages to ``functions.NAME``
  (``<|constrain|>json``), its text a ``final`` one (``commentary`` before calls); a tool
  message answers the call its ``tool_call_id`` names.
* ``HarmonyStream``: the answer's token ids through harmony's ``StreamableParser``, as chat
  deltas: the ``analysis`` channel as reasoning (``reasoning_content``), a message to a recipient
  (``to=functions.NAME``) as a tool call (its id and name once the header is read, then its
  arguments as they come), any other channel (``final``, a ``commentary`` preamble) as content.
  Tokens harmony refuses, and a header that never reached ``<|message|>`` (an answer cut by
  ``max_tokens`` inside it, or text without harmony's markers), are given back as content,
  decoded. ``parse_whole`` runs the same stream over a whole answer, so both always agree.

Tool calls are parsed, not constrained: ``tool_choice`` may be ``auto`` or ``none``.

openai-harmony loads the o200k_base vocabulary from the folder named by
``TIKTOKEN_ENCODINGS_BASE``; when that is not set, tpserve points it at the checkout's
``.cache/harmony/``, where ``scripts/fetch_harmony_vocab.sh`` (``make harmony-vocab``) puts it.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from tpserve.errors import ConfigError
from tpserve.fronts.http.openai_api import bad
from tpserve.fronts.http.reasoning import HARMONY

log = logging.getLogger("tpserve.http")

NAME = HARMONY                          # the --reasoning-parser that asks for harmony
ARCHITECTURES = ("GptOssForCausalLM",)  # the models served in harmony unless told otherwise
ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
EFFORTS = ("low", "medium", "high")
_FUNCTIONS = "functions."


def default_vocab_dir() -> Path:
    """The checkout's ``.cache/harmony`` (scripts/fetch_harmony_vocab.sh's default)."""
    return Path(__file__).resolve().parents[3] / ".cache" / "harmony"


def is_harmony_model(model_path: str | os.PathLike | None) -> bool:
    """Whether the model's config.json names a gpt-oss architecture."""
    if not model_path:
        return False
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(archs, list) and any(a in ARCHITECTURES for a in archs)


def load_encoding():
    """openai-harmony's gpt-oss encoding, its vocabulary read from ``TIKTOKEN_ENCODINGS_BASE``
    (set to ``default_vocab_dir()`` when unset). A ConfigError naming the folder when the
    package or the vocabulary file is missing."""
    base = os.environ.get(ENV) or str(default_vocab_dir())
    if not (Path(base) / VOCAB_FILE).is_file():
        raise ConfigError(ENV, f"harmony (gpt-oss's chat format) needs {VOCAB_FILE} in {base}: run "
                               "scripts/fetch_harmony_vocab.sh, or set it to a folder holding the file")
    os.environ[ENV] = base
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise ConfigError("--reasoning-parser", "harmony (gpt-oss's chat format) needs the openai-harmony "
                                                "package: pip install 'tpserve[harmony]'") from None
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def for_model(model_path, reasoning_parser: str | None):
    """The harmony encoding the HTTP front serves ``model_path`` with, or None: loaded when the
    parser is harmony's (its errors raised), or when none is named and the model is gpt-oss
    (a missing vocabulary is then logged, and the chat template serves it)."""
    if reasoning_parser == NAME:
        return load_encoding()
    if reasoning_parser is None and is_harmony_model(model_path):
        try:
            return load_encoding()
        except ConfigError as e:
            log.warning("gpt-oss is served without harmony (its answers are not parsed): %s", e)
    return None


# ---- rendering ----------------------------------------------------------------------------------
def check_tool_choice(plan, field: str = "tool_choice") -> None:
    """A 400 for a ``tool_choice`` harmony cannot honour: its calls are parsed, not constrained."""
    if plan is not None and plan.choice not in ("auto", "none"):
        raise bad(field, f"must be \"auto\" or \"none\" for this model (harmony's tool calls are parsed, "
                         f"not constrained), got {plan.choice!r}", code="unsupported_parameter")


def _effort(value):
    from openai_harmony import ReasoningEffort
    if value is None:
        return ReasoningEffort.MEDIUM
    if not isinstance(value, str) or value.lower() not in EFFORTS:
        raise bad("reasoning_effort",
                  f"must be one of {', '.join(EFFORTS)} for this model, got {value!r}"[:200])
    return {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
            "high": ReasoningEffort.HIGH}[value.lower()]


def _arguments(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def conversation(messages: list[dict], tools: list[dict] | None = None, effort: str | None = None):
    """harmony's Conversation of a chat request's messages (openai_api.parse_chat's, with
    tool_calls.message_extras' keys) and tools (OpenAI function tools)."""
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, Role, SystemContent,
                                ToolDescription)
    system = SystemContent.new().with_reasoning_effort(_effort(effort))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    k, instructions = 0, []
    while k < len(messages) and messages[k]["role"] in ("system", "developer"):
        instructions.append(messages[k]["content"])
        k += 1
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                    parameters=t["function"].get("parameters")) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    called: dict[str, str] = {}  # tool call id -> function name
    for i in range(k, len(messages)):
        m, where = messages[i], f"messages[{i}]"
        role, text = m["role"], m.get("content") or ""
        if role in ("system", "developer"):
            dev = DeveloperContent.new().with_instructions(text)
            out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, text))
        elif role == "assistant":
            thoughts = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(thoughts, str) and thoughts:
                out.append(Message.from_role_and_content(Role.ASSISTANT, thoughts).with_channel("analysis"))
            calls = m.get("tool_calls") or []
            if text:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text)
                           .with_channel("commentary" if calls else "final"))
            for c in calls:
                name = c["function"]["name"]
                if c.get("id"):
                    called[c["id"]] = name
                args = _arguments(c["function"].get("arguments"))
                out.append(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                           .with_recipient(_FUNCTIONS + name).with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = called.get(m.get("tool_call_id")) or m.get("name")
            if not name:
                raise bad(f"{where}.tool_call_id", "must name an earlier assistant message's tool call "
                                                   "(or the message its function's name)")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, _FUNCTIONS + name), text)
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise bad(f"{where}.role",
                      f"must be system, developer, user, assistant or tool, got {role!r}"[:200])
    return Conversation.from_messages(out)


def render(encoding, messages: list[dict], options: dict | None = None, tools: list[dict] | None = None
           ) -> list[int]:
    """The prompt token ids of a chat request in harmony, up to the assistant's turn
    (``options``: Job.chat_options; harmony takes only ``reasoning_effort`` of them)."""
    from openai_harmony import Role
    options = options or {}
    if options.get("chat_template"):
        raise bad("chat_template", "this model's prompts are rendered in harmony, without a chat template",
                  code="unsupported_parameter")
    if options.get("continue_final_message"):
        raise bad("continue_final_message", "is not supported by harmony's rendering",
                  code="unsupported_parameter")
    conv = conversation(messages, tools, options.get("reasoning_effort"))
    return list(encoding.render_conversation_for_completion(conv, Role.ASSISTANT))


# ---- parsing ------------------------------------------------------------------------------------
def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _merge(deltas: list[dict]) -> list[dict]:
    """Adjacent deltas of one kind as one (a Delta's tokens each give a piece)."""
    out: list[dict] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in d and "content" in last:
            last["content"] += d["content"]
        elif last is not None and "reasoning_content" in d and "reasoning_content" in last:
            last["reasoning_content"] += d["reasoning_content"]
            last["reasoning"] = last["reasoning_content"]
        elif (last is not None and "tool_calls" in d and "tool_calls" in last
              and "id" not in d["tool_calls"][0]
              and last["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
        else:
            out.append(d)
    return out


class HarmonyStream:
    """One choice's answer tokens into chat deltas (``{"reasoning_content", "reasoning"}``,
    ``{"content"}``, ``{"tool_calls": [...]}`` as chat_output.py streams them), as they come."""

    def __init__(self, encoding):
        from openai_harmony import Role, StreamableParser, StreamState
        self.encoding = encoding
        self.parser = StreamableParser(encoding, Role.ASSISTANT)
        self._content_state, self._header_state = StreamState.CONTENT, StreamState.HEADER
        self.header: list[int] = []   # the tokens of the header being read
        self.raw: list[int] | None = None  # once harmony refused a token: every token since
        self.raw_sent = 0             # characters of the raw tokens' text already given
        self.num_calls = 0
        self.in_call = False          # the message being read is a tool call (announced)
        self.reasoning_tokens = 0     # tokens of analysis messages (and their headers)

    def feed(self, token_ids) -> list[dict]:
        out: list[dict] = []
        for t in token_ids:
            if self.raw is not None:
                self.raw.append(t)
                continue
            try:
                self.parser.process(t)
            except Exception:  # harmony's HarmonyError: the answer stops being harmony here
                self.raw = self.header + [t]
                self.header = []
                continue
            out += self._after(t)
        if self.raw is not None:
            out += self._raw_text(final=False)
        return _merge(out)

    def _after(self, token: int) -> list[dict]:
        p = self.parser
        state = p.state
        if state != self._content_state:
            if state == self._header_state:
                self.header.append(token)
            else:  # a message ended
                self.header, self.in_call = [], False
            return []
        if self.header:  # the header ended with this token (<|message|>)
            if p.current_channel == "analysis" and not p.current_recipient:
                self.reasoning_tokens += len(self.header) + 1
            self.header = []
            return self._begin_call()
        recipient, delta = p.current_recipient, p.last_content_delta
        if p.current_channel == "analysis" and not recipient:
            self.reasoning_tokens += 1
        if not delta:
            return []
        if recipient:
            return [{"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": delta}}]}]
        if p.current_channel == "analysis":
            return [{"reasoning_content": delta, "reasoning": delta}]
        return [{"content": delta}]

    def _begin_call(self) -> list[dict]:
        recipient = self.parser.current_recipient
        if not recipient:
            return []
        name = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else recipient
        self.in_call = True
        self.num_calls += 1
        return [{"tool_calls": [{"index": self.num_calls - 1, "id": _call_id(), "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _raw_text(self, final: bool) -> list[dict]:
        text = self.encoding.decode(self.raw)
        if not final:  # a character still incomplete at the end waits for its other bytes
            text = text.rstrip("\ufffd")
        piece = text[self.raw_sent:]
        self.raw_sent = max(self.raw_sent, len(text))
        return [{"content": piece}] if piece else []

    def flush(self) -> list[dict]:
        """What the answer's end gives still: a header never completed (or, after harmony
        refused a token, the rest of the text) as content."""
        if self.raw is None and self.header:
            self.raw, self.header = self.header, []
        if self.raw is None:
            return []
        return self._raw_text(final=True)


def parse_whole(encoding, token_ids) -> tuple[str | None, str | None, list[dict], int]:
    """(reasoning, content, tool calls, reasoning tokens) of a whole answer: what
    ``HarmonyStream`` streams, joined (reasoning and content None when empty)."""
    stream = HarmonyStream(encoding)
    thoughts, text, calls = [], [], []
    for d in stream.feed(token_ids) + stream.flush():
        if "reasoning_content" in d:
            thoughts.append(d["reasoning_content"])
        elif "content" in d:
            text.append(d["content"])
        else:
            call = d["tool_calls"][0]
            if "id" in call:
                calls.append({"id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return "".join(thoughts) or None, "".join(text) or None, calls, stream.reasoning_tokens
