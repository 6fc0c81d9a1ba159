"""A StructuredOutputsParams as llguidance's grammar text: JSON schema (text parsed here),
regex, choice, Lark, or GBNF converted to Lark.

Pure Python for GBNF and JSON text, and superlinear for GBNF, so it runs in the grammar process
(worker.py) under the compiler's time budget, never in the serving process. Below both
compiler.py and worker.py: neither imports the other for it.
"""
from __future__ import annotations

import copy
import json

from tpserve.errors import InvalidFieldError

#: Keywords whose sub-schemas hold object schemas (``disable_additional_properties`` walks them).
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUB_SCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties")


def _close_objects(schema):
    """A copy of ``schema`` whose object schemas without ``additionalProperties`` forbid any."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _close_objects(v) for k, v in out[key].items()}
    for key in _SUB_SCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _close_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(value):
    """The JSON schema of ``structured_outputs.json`` (its text parsed here, off the serving
    process: tpserve.limits only checks its size and that it looks like an object)."""
    if not isinstance(value, str):
        return copy.deepcopy(value)
    try:
        schema = json.loads(value)
    except RecursionError:
        raise InvalidFieldError("structured_outputs.json", "is nested too deeply to parse") from None
    except ValueError as e:
        raise InvalidFieldError("structured_outputs.json", f"is not JSON text: {e}"[:512]) from None
    if not isinstance(schema, dict):
        raise InvalidFieldError("structured_outputs.json",
                                f"must be a JSON schema object, got {type(schema).__name__}")
    return schema


def grammar_text(so) -> str:
    """llguidance's grammar text for a validated StructuredOutputsParams. Pure Python for GBNF and
    JSON text, and superlinear for GBNF: called in the grammar process (worker.py), never in the
    serving process."""
    import llguidance
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(so.json)
        if so.disable_additional_properties:
            schema = _close_objects(schema)
        options = {"whitespace_flexible": not so.disable_any_whitespace}
        if so.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise InvalidFieldError(f"structured_outputs.{kind}", f"is not a usable JSON schema: {e}"[:1024]) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:  # Lark, or GBNF converted to Lark
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise InvalidFieldError("structured_outputs.grammar", str(e)[:1024]) from None
