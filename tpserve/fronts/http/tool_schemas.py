"""A tool's parameters schema made fit for the grammar engine: nested in its call's schema,
checked, and loosened when the tool allows it.

Tool calls are constrained by one Lark grammar whose rules embed each tool's parameters schema
inside the call's own object schema (tpserve/fronts/http/tool_calls.py). Two things follow:

* a parameters schema's local references (``#/$defs/x``, ``#``) point into the parameters
  schema, not into the call's: ``rebase_refs`` rewrites them below the call's pointer to it;
* llguidance does not implement every JSON-schema keyword (``propertyNames``, ``if``/``then``,
  ``not``, ``dependentSchemas``, ``unevaluatedProperties``, ``$dynamicRef``, unknown
  ``format`` values, look-around regexes, overlapping ``patternProperties``...). Agent clients
  send such schemas (Claude Code's tools use ``propertyNames``) with tools that are not strict:
  their calls are constrained by what the engine supports (llguidance's ``lenient`` option
  ignores the keywords it does not implement; the rest of the schema still holds), and a
  schema even that refuses is loosened (``loosen``), then at last any JSON object, so a
  non-strict tool never fails its request. A strict tool gets no such leniency: the front
  answers 400 naming the tool and what is unsupported (``unsupported``).

``check`` compiles a grammar text without a tokenizer (about a millisecond per tool schema) and
caches the answer by text: agents send the same tools every turn.
"""
from __future__ import annotations

import functools
import json
import re

#: Keywords holding a map of sub-schemas, one sub-schema, or a list of sub-schemas.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems", "contentSchema")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: What ``loosen`` drops: keywords whose values the grammar engine may refuse even leniently
#: (regexes it cannot compile, overlapping patterns, formats, references it cannot resolve).
_LOOSE = ("pattern", "patternProperties", "propertyNames", "format", "$dynamicRef", "$dynamicAnchor")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_FORMAT = re.compile(r"Unknown format: (\S+)")


def _walk(schema, fn, enter=lambda s: True):
    """``schema`` with ``fn`` applied to every sub-schema (a dict) at a schema position, bottom up;
    values of other keywords (``const``, ``enum``, ``default``...) are left as they are, and so
    is a sub-schema ``enter`` declines, with all below it."""
    if not isinstance(schema, dict) or not enter(schema):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _walk(v, fn, enter) for k, v in out[key].items()}
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _walk(out[key], fn, enter)
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, fn, enter) for s in out[key]]
    return fn(out)


def rebase_refs(schema, base: str):
    """``schema`` (a document's root) with its local JSON-pointer references (``#``, ``#/...``)
    rewritten to point below ``base`` (``#/properties/arguments``), where it is nested. A
    sub-schema with an ``$id`` starts a resource of its own: references below it are left
    alone (so is everything when the root has one)."""
    def fn(s):
        ref = s.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            s["$ref"] = base + ref[1:]
        return s
    return _walk(schema, fn, lambda s: not isinstance(s.get("$id"), str))


def loosen(schema):
    """``schema`` without the keywords the grammar engine may refuse even leniently (``_LOOSE``),
    references other than local pointers, and with ``oneOf`` read as ``anyOf``: looser, never
    stricter, than the schema."""
    def fn(s):
        for key in _LOOSE:
            s.pop(key, None)
        ref = s.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            del s["$ref"]
        if isinstance(s.get("oneOf"), list) and "anyOf" not in s:
            s["anyOf"] = s.pop("oneOf")
        return s
    return _walk(schema, fn)


@functools.lru_cache(maxsize=2048)
def check(grammar: str) -> str | None:
    """The grammar engine's error for a Lark grammar text (its JSON schemas compiled as they will
    be, no tokenizer needed), or None when it builds."""
    import llguidance
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(grammar))
    except Exception as e:  # noqa: BLE001  whatever the engine raises refuses the grammar
        return f"{type(e).__name__}: {e}"
    return messages[0] if is_error and messages else ("refused" if is_error else None)


def json_rule_grammar(schema: dict | str) -> str:
    """A grammar of the one JSON schema ``schema`` (or its JSON text), as tool_calls.py embeds
    each call's schema."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return "%llguidance {}\nstart: %json " + text + "\n"


def unsupported(error: str) -> str:
    """What in a schema the grammar engine's ``error`` says it does not support, in words: the
    keywords it does not implement, an unknown format, or the error's first line."""
    m = _UNIMPLEMENTED.search(error)
    if m:
        try:
            keys = json.loads(m.group(1))
        except ValueError:
            keys = [m.group(1)]
        return ("the keyword " if len(keys) == 1 else "the keywords ") + ", ".join(repr(k) for k in keys)
    m = _FORMAT.search(error)
    if m:
        return f"the format {m.group(1)!r}"
    lines = [line.strip() for line in error.strip().splitlines()]
    if not lines:
        return "something (no reason given)"
    said = lines[0].split("failed to compile JSON schema: ", 1)[-1]
    detail = [line for line in lines[1:] if line.startswith("error:")]  # a regex's parse error
    return (said + (" " + detail[0] if detail else ""))[:300]
