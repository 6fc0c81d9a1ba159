"""Tool parameters schemas the grammar engine cannot take whole (tpserve/fronts/http/tool_schemas.py,
ToolPlan in tpserve/fronts/http/tool_calls.py): a non-strict tool is constrained leniently and
never fails its request, the rest of its schema still holding; a strict one is a 400 naming the
tool and the keyword. The schemas are Claude Code's (2.1) as it sends them."""
from __future__ import annotations

import json

import pytest

from test_http import BUNDLED, MODEL, daemon, idle, post  # noqa: F401  (a daemon of this module's own)
from tpserve.fronts.http.openai_api import OpenAIError
from tpserve.fronts.http.tool_calls import parse_tools
from tpserve.grammar import GrammarCompiler
from tpserve.fronts.http import tool_schemas as S
from tpserve.sampling import StructuredOutputsParams
from tpserve.tokenizer import load_tokenizer

DRAFT = "https://json-schema.org/draft/2020-12/schema"
TASK_UPDATE = {"$schema": DRAFT, "type": "object", "properties": {
    "taskId": {"description": "The ID of the task to update", "type": "string"},
    "status": {"description": "New status", "anyOf": [
        {"type": "string", "enum": ["pending", "in_progress", "completed"]},
        {"type": "string", "const": "deleted"}]},
    "addBlocks": {"type": "array", "items": {"type": "string"}},
    "metadata": {"description": "Metadata keys to merge", "type": "object",
                 "propertyNames": {"type": "string"},
                 "additionalProperties": {}}},
    "required": ["taskId"], "additionalProperties": False}
READ = {"$schema": DRAFT, "type": "object", "properties": {
    "file_path": {"type": "string"}, "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
    "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991}},
    "required": ["file_path"], "additionalProperties": False}
WEB_FETCH = {"$schema": DRAFT, "type": "object", "properties": {
    "url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"}},
    "required": ["url", "prompt"], "additionalProperties": False}


def tool(name, params, strict=None):
    f = {"name": name, "description": name, "parameters": params}
    if strict is not None:
        f["strict"] = strict
    return {"type": "function", "function": f}


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(load_tokenizer(BUNDLED), 4096, [0])
    yield c
    c.shutdown()


def accepts(compiler, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole, as the engine's compiled template would."""
    m = compiler.compile(StructuredOutputsParams(grammar=grammar), "tools").result(timeout=60).deep_copy()
    ids = compiler.tokenizer().tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def call(name, args) -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'


def test_claude_code_schemas_are_constrained_leniently_and_the_rest_still_holds(compiler):
    plan = parse_tools({"tools": [tool("TaskUpdate", TASK_UPDATE), tool("Read", READ),
                                  tool("WebFetch", WEB_FETCH, strict=False)], "tool_choice": "required",
                        "parallel_tool_calls": False})
    grammar = plan.grammar()
    assert plan.loosened == []  # llguidance's lenient mode took them: propertyNames ignored, no more
    assert accepts(compiler, grammar, call("TaskUpdate", {"taskId": "1", "status": "deleted",
                                                          "metadata": {"k": 1, "j": None}}))
    assert accepts(compiler, grammar, call("Read", {"file_path": "/a", "limit": 5}))
    assert accepts(compiler, grammar, call("WebFetch", {"url": "https://x.org/a", "prompt": "p"}))
    # the rest of each schema holds: enum/const, required, types, bounds, additionalProperties
    assert not accepts(compiler, grammar, call("TaskUpdate", {"taskId": "1", "status": "done"}))
    assert not accepts(compiler, grammar, call("TaskUpdate", {"status": "deleted"}))
    assert not accepts(compiler, grammar, call("Read", {"file_path": "/a", "limit": 0}))
    assert not accepts(compiler, grammar, call("Read", {"file_path": "/a", "other": 1}))
    assert not accepts(compiler, grammar, call("Nope", {}))


@pytest.mark.parametrize("params,keyword", [
    (TASK_UPDATE, "propertyNames"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "unevaluatedProperties": False},
     "unevaluatedProperties"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"$defs": {"s": {"type": "string"}}, "type": "object",
      "properties": {"a": {"$dynamicRef": "#/$defs/s"}}},
     "$dynamicRef"),
    ({"type": "object", "properties": {"c": {"type": "string", "format": "color-hex"}}}, "color-hex"),
])
def test_a_strict_tool_with_an_unsupported_keyword_is_a_400_naming_tool_and_keyword(params, keyword):
    plan = parse_tools({"tools": [tool("ok", READ, strict=True), tool("TaskUpdate", params, strict=True)]})
    with pytest.raises(OpenAIError) as e:
        plan.grammar()
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"
    message = e.value.body()["error"]["message"]
    assert "'TaskUpdate' is strict" in message and repr(keyword) in message, message
    # the same tool, not strict: constrained leniently
    assert parse_tools({"tools": [tool("TaskUpdate", params, strict=False)]}).grammar()


def test_what_even_lenient_mode_refuses_is_loosened_then_any_object(compiler):
    odd = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^(?!tmp)[a-z]+$"},       # look-ahead: not compiled
        "n": {"type": "integer", "minimum": 1, "maximum": 3}},
        "patternProperties": {"^a": {"type": "string"}, "^ab": {"type": "integer"}},  # overlapping
        "required": ["name", "n"]}
    remote = {"$ref": "https://example.com/schemas/args.json"}
    plan = parse_tools({"tools": [tool("odd", odd), tool("remote", remote)], "tool_choice": "required",
                        "parallel_tool_calls": False})
    grammar = plan.grammar()
    assert plan.loosened == ["odd", "remote"]
    assert accepts(compiler, grammar, call("odd", {"name": "tmpx", "n": 2}))
    assert not accepts(compiler, grammar, call("odd", {"name": "x", "n": 7}))  # its bounds still hold
    assert not accepts(compiler, grammar, call("odd", {"n": 2}))                # and required
    assert accepts(compiler, grammar, call("remote", {"anything": [1, "x"]}))
    with pytest.raises(OpenAIError) as e:
        parse_tools({"tools": [tool("odd", odd, strict=True)]}).grammar()
    assert e.value.param == "tools[0].function.parameters"
    assert "not disjoint" in e.value.body()["error"]["message"]


def test_local_refs_point_into_the_parameters_schema(compiler):
    """Pydantic's tool schemas keep their models in $defs; the call's schema nests them."""
    params = {"type": "object", "$defs": {"P": {"type": "object", "properties": {
        "x": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
        "required": ["x"], "additionalProperties": False}},
        "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "additionalProperties": False}
    plan = parse_tools({"tools": [tool("tree", params, strict=True)], "tool_choice": "required"})
    grammar = plan.grammar()
    assert accepts(compiler, grammar, call("tree", {"p": {"x": 1, "kids": [{"x": 2, "kids": []}]}}))
    assert not accepts(compiler, grammar, call("tree", {"p": {"x": 1, "kids": [{"y": 2}]}}))


def test_rebase_and_loosen_touch_schema_positions_only():
    schema = {"properties": {"pattern": {"type": "string", "pattern": "^a$"}, "r": {"$ref": "#/$defs/x"},
                             "c": {"const": {"$ref": "#/kept", "pattern": "kept"}}},
              "$defs": {"x": {"oneOf": [{"type": "string", "format": "uri"}]}}}
    rebased = S.rebase_refs(schema, "#/properties/arguments")
    assert rebased["properties"]["r"] == {"$ref": "#/properties/arguments/$defs/x"}
    assert rebased["properties"]["c"] == schema["properties"]["c"]
    assert schema["properties"]["r"]["$ref"] == "#/$defs/x"  # the caller's schema is left as it was
    assert S.rebase_refs({"$id": "urn:own", "$ref": "#/a"}, "#/b") == {"$id": "urn:own", "$ref": "#/a"}
    loose = S.loosen(schema)
    assert loose["properties"]["pattern"] == {"type": "string"}  # the property named pattern stays
    assert loose["properties"]["c"] == schema["properties"]["c"]
    assert loose["$defs"]["x"] == {"anyOf": [{"type": "string"}]}


def test_strict_must_be_a_boolean():
    with pytest.raises(OpenAIError) as e:
        parse_tools({"tools": [tool("f", READ, strict="yes")]})
    assert e.value.param == "tools[0].function.strict"


def test_claude_code_tools_over_http_answer_and_a_strict_one_is_refused(daemon):
    tools = [tool("TaskUpdate", TASK_UPDATE), tool("WebFetch", WEB_FETCH)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "update task 1"}], "max_tokens": 40,
            "temperature": 1.0, "seed": 3, "tools": tools, "tool_choice": "required"}
    r = post(daemon, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")
    strict = [tool("TaskUpdate", TASK_UPDATE, strict=True)]
    r = post(daemon, "/v1/chat/completions", {**body, "tools": strict})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
    idle(daemon)
