"""The OpenAI and vLLM spellings of structured output in an HTTP body, as StructuredOutputsParams.

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``strict`` is accepted either way: every output is valid by construction);
* vLLM's extra field ``structured_outputs``: a map of StructuredOutputsParams fields
  (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and their options).

Both at once is a 400, as are vLLM's removed ``guided_*`` fields (named with their replacement).
Errors name the HTTP field (``response_format.json_schema.schema``, ``structured_outputs.regex``).
"""
from __future__ import annotations

from dataclasses import fields as dataclass_fields, replace

from tpserve.fronts.http import tool_calls
from tpserve.fronts.http.openai_api import bad
from tpserve.errors import InvalidFieldError
from tpserve.sampling import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object",
           "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": None}


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the body field it came from) of a request body; (None, None) if none."""
    for old, new in _GUIDED.items():
        if body.get(old) is not None:
            hint = f'structured_outputs {{"{new}": ...}}' if new else "structured_outputs (one grammar engine, llguidance)"
            raise bad(old, f"was removed from vLLM's API; use {hint}")
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise bad("structured_outputs", "cannot be combined with response_format; send one of them")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "must be an object")
        return _build(so, "structured_outputs"), "structured_outputs"
    if fmt is None:
        return None, None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("response_format", 'must be an object with a "type"')
    kind = fmt["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        return _build({"json_object": True}, "response_format"), "response_format"
    if kind != "json_schema":
        raise bad("response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'[:200])
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", 'must be an object with "name" and "schema"')
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad("response_format.json_schema.name", "must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        schema = {"type": "object"}  # OpenAI allows an absent schema
    return _build({"json": schema}, "response_format.json_schema.schema"), "response_format.json_schema.schema"


def _build(fields: dict, param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams of ``fields``; a bad one is a 400 naming ``param`` (or, for
    vLLM's ``structured_outputs``, the sub-field itself)."""
    try:
        return StructuredOutputsParams(**fields)
    except TypeError:
        known = [f.name for f in dataclass_fields(StructuredOutputsParams)]
        unknown = sorted(set(fields) - set(known))
        raise bad(f"{param}.{unknown[0]}"[:128] if unknown else param,
                  f"is not supported; allowed: {', '.join(known)}") from None
    except InvalidFieldError as e:
        raise bad(e.field if param == "structured_outputs" else param, e.reason) from None


def apply(job, body: dict) -> None:
    """Set ``job.params.structured_outputs`` from the body (and, for chat, ``job.tools`` and the
    messages' tool-calling keys); ``job.structured_param`` names the field errors point at.
    tools whose tool_choice constrains the answer cannot be combined with a response format."""
    so, param = structured_outputs(body)
    if job.chat:
        plan = tool_calls.parse_tools(body)
        for i, m in enumerate(body["messages"]):
            job.messages[i].update(tool_calls.message_extras(m, f"messages[{i}]"))
        if plan is not None:
            job.tools = plan
            if plan.constrains:
                if so is not None:
                    raise bad(param, f"cannot be combined with tools when tool_choice is {plan.choice!r} "
                                     '(only with "none")')
                so, param = StructuredOutputsParams(grammar=plan.grammar()), "tools"
    if so is not None:
        job.params = replace(job.params, structured_outputs=so)
        job.structured_param = param


def daemon_field(field: str | None, origin: str | None) -> str | None:
    """The HTTP field to name for the daemon's ``structured_outputs.*`` error (a grammar the
    engine rejects): the body field the constraint came from."""
    if field is None or origin is None or not field.startswith("structured_outputs"):
        return field
    return field if origin == "structured_outputs" else origin
