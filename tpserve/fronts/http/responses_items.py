"""The input items of OpenAI's Responses API as chat messages (docs/responses.md).

``conversation_messages`` turns a conversation's items (``message`` with text parts and roles
user / assistant / system / developer, ``function_call``, ``function_call_output``,
``reasoning``) into the chat messages the model's chat template renders: an assistant's text
and the calls after it are one assistant message, a call's output a ``tool`` message, a
reasoning item's text the next assistant turn's ``reasoning_content`` (where the template reads
it: ``TemplateTraits``), developer messages system ones where the template knows no developer
role. A reasoning item's ``encrypted_content`` is tpserve's own (``seal``: the thoughts' text
encoded, not encrypted), so thoughts sent back are read back. ``input_items`` reads ``input``
(a string is one user message). Also here: the Responses API's 400s (``bad``, ``refuse``: the
field named, OpenAI's error body) and how a namespaced function is named (``namespaced_name``).
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from tpserve.fronts.http import openai_api as O

_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_SEALED = "tpserve:"  # reasoning's encrypted_content: not encrypted, the thoughts' text encoded


def bad(param, message, code="invalid_value"):
    return O.bad(param, message, code=code)


def refuse(param, message):
    return O.bad(param, message, code="unsupported_parameter")


def seal(text: str) -> str:
    return _SEALED + base64.b64encode(text.encode()).decode()


def unseal(value) -> str | None:
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


def namespaced_name(namespace: str, name: str) -> str:
    """The name a namespace's function is offered as: ``<namespace>.<name>``, or
    ``<namespace><name>`` when the namespace ends in ``_`` or ``.``."""
    return namespace + name if namespace.endswith(("_", ".")) else f"{namespace}.{name}"


def _content_text(content, where: str) -> str:
    """The text of a message's (or a tool output's) content: a string or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise refuse(f"{w}.type", f"{kind} is not supported: this server serves text models")
        else:
            raise bad(f"{w}.type" if isinstance(part, dict) else w,
                      f'must be "input_text" or "output_text", got {kind!r}'[:200])
        if not isinstance(text, str):
            raise bad(f"{w}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    sealed = unseal(item.get("encrypted_content"))
    if sealed is not None:
        return sealed
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") in kinds
                                                      and isinstance(p.get("text"), str) for p in parts):
                raise bad(f"{where}.{key}", f"must be an array of {kinds[0]} parts")
            return "\n\n".join(p["text"] for p in parts)
    return ""


def conversation_messages(items: list[dict], count_before: int, traits: TemplateTraits,
                          namespaced_name=namespaced_name) -> list[dict]:
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
            raise bad(where, "must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role",
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
                    raise bad(f"{where}.{key}", "must be a string")
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
                raise bad(f"{where}.call_id", "must be a string")
            if call_id not in call_names:
                raise bad(f"{where}.call_id",
                          f"no function_call with call_id {call_id!r} comes before it"[:200])
            messages.append({"role": "tool", "content": _content_text(item.get("output"), f"{where}.output"),
                             "tool_call_id": call_id, "name": call_names[call_id]})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if traits.reasoning and text:
                thoughts = text if thoughts is None else thoughts + "\n\n" + text
        elif kind == "item_reference":
            raise refuse(f"{where}.type", "item_reference is not supported: send the item itself")
        else:
            raise refuse(f"{where}.type", f"must be one of {', '.join(_ITEM_KINDS)}, got {kind!r} "
                                          "(items of hosted tools never come from this server)"[:300])
    return messages


def input_items(body: dict) -> list[dict]:
    value = body.get("input")
    if value is None:
        raise bad("input", "is required", code="missing_required_parameter")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise bad("input", "must be a string or a non-empty array of input items")
    if len(value) > O.MAX_MESSAGES * 4:
        raise bad("input", f"at most {O.MAX_MESSAGES * 4} items, got {len(value)}")
    return value

