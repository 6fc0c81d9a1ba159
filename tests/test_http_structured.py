"""Structured output and tool calling through the OpenAI HTTP front, driven by the official
`openai` client against one daemon on the bundled model (its free text is near-random: only
the constraint makes an answer valid)."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from test_http import MODEL, client, daemon, idle, post  # noqa: F401  (module-scoped fixtures: a daemon of this module's own)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=9)
    color: Literal["red", "blue"]


def test_parse_with_a_pydantic_model_sets_parsed(client):
    for seed in range(3):
        done = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Item,
                                             max_tokens=80, temperature=1.0, seed=seed)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Item) and msg.parsed == Item.model_validate_json(msg.content)


def test_json_object_and_json_schema_on_completions_and_streamed(client):
    out = client.completions.create(model=MODEL, prompt="x = ", max_tokens=60, temperature=0.7, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 500}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=2,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_vllm_structured_outputs_regex_and_choice(client):
    out = client.completions.create(model=MODEL, prompt="id: ", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", out.choices[0].text)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=1.0, seed=4,
                                          n=2, extra_body={"structured_outputs": {"choice": ["sunny", "rain"]}})
    assert [c.message.content in ("sunny", "rain") for c in chat.choices] == [True, True]


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_choice_required_and_named(client, seed):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          max_tokens=120, temperature=1.0, seed=seed)
    choice = done.choices[0]
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    # This model may keep opening calls until max_tokens: the complete ones are returned and
    # the one cut short stays text.
    if choice.finish_reason == "length":
        rest = choice.message.content
        assert "<tool_call>\n{".startswith(rest) or rest.startswith("<tool_call>\n{"), rest
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         temperature=1.0, seed=seed)
    calls = one.choices[0].message.tool_calls
    assert one.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_calls(calls, {"get_time"})
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
    assert single.choices[0].finish_reason == "tool_calls" and single.choices[0].message.content is None
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_join_to_the_whole_answer(client, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=300,
              temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reasons, content = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        content.append(delta.content or "")  # only a call cut short by max_tokens
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == whole.finish_reason
    assert "".join(content) == (whole.message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_none_and_auto_answer_text(client):
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    streamed_none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                   max_tokens=8, temperature=0, stream=True)
    chunks = [c for c in streamed_none if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == none.choices[0].message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0)
    # auto: this model's free text opens no call, so the text comes back as content.
    msg = plain.choices[0].message
    if msg.tool_calls:
        check_calls(msg.tool_calls, {"get_weather"})
    else:
        assert msg.content and plain.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                              max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (msg.content or "")


def test_tool_results_render_back_through_the_template(daemon, client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4, temperature=0)
    from tpserve.tokenizer import load_tokenizer
    from test_http import BUNDLED
    tok = load_tokenizer(BUNDLED)
    rendered = tok.apply_chat_template(
        ASK + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 3}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered and '"get_weather"' in rendered
    assert done.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_structured_requests_are_400_naming_the_field(daemon, body, param):
    r = post(daemon, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    idle(daemon)
    ok = post(daemon, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_auto_constrains_a_call_once_the_model_opens_it():
    """auto: free text is free, and after the trigger every allowed continuation is a valid call."""
    import numpy as np

    from test_http import BUNDLED
    from tpserve.fronts.http.tool_calls import parse_tools, split_calls
    from tpserve.grammar import GrammarCompiler, RequestGrammar, fill_bitmask
    from tpserve.sampling import StructuredOutputsParams
    from tpserve.tokenizer import load_tokenizer
    tok = load_tokenizer(BUNDLED)
    plan = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "auto"})
    compiler = GrammarCompiler(tok, 4096, [0])
    try:
        template = compiler.compile(StructuredOutputsParams(grammar=plan.grammar()), "tools")
        template.result(timeout=60)  # compiled on the compiler's thread
        rng = np.random.default_rng(0)
        for trial in range(3):
            g = RequestGrammar(template)
            assert g.ready() and g.error is None
            out = tok.encode("Let me check. <tool_call>", add_special_tokens=False)
            assert all(g.accept(t) for t in out)  # free text, then the trigger
            while not g.is_complete and len(out) < 300:
                mask = fill_bitmask([g], 128)[0]
                allowed = np.flatnonzero((mask[np.arange(4096) // 32] >> (np.arange(4096) % 32)) & 1)
                t = int(rng.choice(allowed))
                assert g.accept(t)
                out.append(t)
                if t == 0:
                    break
            text = tok.decode([t for t in out if t != 0])
            content, calls = split_calls(text)
            assert content == "Let me check." and calls, text
            for c in calls:
                jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    finally:
        compiler.shutdown()


def test_tool_call_stream_reassembles_any_chunking():
    import random

    from tpserve.fronts.http.tool_calls import ToolCallStream, split_calls
    text = ('Sure <tool_ here.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "U}TC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"{b", "days": 2}}\n</tool_call>')
    want_content, want_calls = split_calls(text)
    rng = random.Random(1)
    for _ in range(20):
        s, deltas, i = ToolCallStream(), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            deltas += s.feed(text[i:i + n])
            i += n
        deltas += s.flush()
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                c = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                c["name"] = tc["function"].get("name") or c["name"]
                c["arguments"] += tc["function"].get("arguments", "")
        assert content == want_content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
