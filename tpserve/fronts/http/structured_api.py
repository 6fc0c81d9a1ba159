"""The OpenAI and vLLM spellings of structured output in an HTTP body, as StructuredOutputsParams fields.

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``strict`` is accepted either way: every output is valid by construction);
* vLLM's extra field ``structured_outputs``: a map of StructuredOutputsParams fields
  (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and their options).

Both at once is a 400, as are vLLM's removed ``guided_*`` fields (named with their replacement).
Errors name the HTTP field (``response_format.json_schema.schema``, ``structured_outputs.regex``).
"""
from __future__ import annotations

import asyncio

from tpserve.config import DEFAULT_GRAMMAR_TIMEOUT
from tpserve.fronts.http import tool_calls
from tpserve.fronts.http.harmony import check_tool_choice
from tpserve.fronts.http.openai_api import bad

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object",
           "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": None}


def structured_outputs(body: dict) -> tuple[dict | None, str | None]:
    """(the constraint as a map of StructuredOutputsParams fields, the body field errors in it
    name) of a request body; (None, None) if none. The map is validated with the rest of the
    request (tpserve/request.py); None as the field: vLLM's ``structured_outputs``, whose
    sub-fields errors name themselves (``structured_outputs.regex``)."""
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
        return so, None
    if fmt is None:
        return None, None
    return format_constraint(fmt, "response_format", "json_schema")


def format_constraint(fmt, field: str, spec_key: str | None = None, schema_required: bool = False
                      ) -> tuple[dict | None, str | None]:
    """OpenAI's output format object (chat's ``response_format``, the Responses API's
    ``text.format``) -> ``(structured_outputs map or None, the field its errors name)``.

    ``spec_key``: the key holding ``name``/``schema``/``strict`` (chat's ``json_schema``), or
    None where they sit in the format itself (Responses). Chat allows an absent schema (any
    object); ``schema_required`` refuses it."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad(field, 'must be an object with a "type"')
    kind = fmt["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"json_object": True}, field
    if kind != "json_schema":
        raise bad(f"{field}.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'[:200])
    spec, where = fmt, field
    if spec_key is not None:
        spec, where = fmt.get(spec_key), f"{field}.{spec_key}"
        if not isinstance(spec, dict):
            raise bad(where, 'must be an object with "name" and "schema"')
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name", "must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad(f"{where}.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema_required and not isinstance(schema, dict):
        raise bad(f"{where}.schema", "must be a JSON schema object")
    if schema is None:
        schema = {"type": "object"}  # OpenAI's chat allows an absent schema
    return {"json": schema}, f"{where}.schema"


#: Body fields whose constraint can take the front's CPU for a while (a megabyte of tools or
#: schema turned into a grammar, dumped to check its size): prepared on a thread.
_HEAVY = ("tools", "structured_outputs", "response_format")


async def prepare(job, body: dict, build) -> None:
    """``apply`` then ``build(job)`` (the request's validation), on a thread when the body carries
    a constraint, so the front's event loop keeps serving its other connections meanwhile; a 400
    naming the field when that takes longer than the grammar time budget (the daemon's default:
    what the grammar process then gets for the same grammar). Without one, inline."""
    if not any(body.get(key) is not None for key in _HEAVY):
        apply(job, body)
        build(job)
        return

    def work():
        apply(job, body)
        build(job)
    try:
        await asyncio.wait_for(asyncio.to_thread(work), DEFAULT_GRAMMAR_TIMEOUT)
    except asyncio.TimeoutError:
        field = "tools" if body.get("tools") is not None else \
            "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
        raise bad(field, f"took longer than the grammar time budget ({DEFAULT_GRAMMAR_TIMEOUT:g} s) to "
                         "prepare: send a smaller constraint") from None


def apply(job, body: dict) -> None:
    """Put the body's structured output into ``job.sampling`` (and, for chat, set ``job.tools``
    and the messages' tool-calling keys); ``job.names`` then spells ``structured_outputs`` as
    the body field it came from. tools whose tool_choice constrains the answer cannot be
    combined with a response format."""
    so, param = structured_outputs(body)
    given = "structured_outputs" if so is not None and param is None else param
    if job.chat:
        plan = tool_calls.parse_tools(body)
        for i, m in enumerate(body["messages"]):
            job.messages[i].update(tool_calls.message_extras(m, f"messages[{i}]"))
        if plan is not None:
            job.tools = plan
            if job.harmony:  # harmony's calls are parsed, not constrained (harmony.py)
                check_tool_choice(plan)
            elif plan.constrains:
                if so is not None:
                    raise bad(given, f"cannot be combined with tools when tool_choice is {plan.choice!r} "
                                     '(only with "none")')
                so, param = {"grammar": plan.grammar()}, "tools"
    if so is not None:
        job.sampling["structured_outputs"] = so
        if param is not None:
            job.names["structured_outputs"] = param
