"""OpenAI's Responses API (/v1/responses) through the official `openai` client, against one
daemon on the bundled model (test_http's HttpDaemon) with the qwen3 reasoning parser and a
responses store of one response; the store alone, without a daemon."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tpserve.fronts.http.response_store import ResponseStore
from tpserve.fronts.http.responses_items import TemplateTraits, conversation_messages
from tpserve.tokenizer import load_tokenizer

from test_http import API_KEY, BUNDLED, MODEL, HttpDaemon, idle, post

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


# A keyword the grammar engine does not support: a strict tool's schema with it is refused, a
# non-strict one's constrained leniently.
UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                    "uniqueItems": True}}, "required": ["tags"]}


def chat_weather(tool: dict) -> dict:
    """A Responses function tool in chat's spelling (what the chat template is given)."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def daemon():
    # the options' environment variables
    d = HttpDaemon(env={"TPSERVE_REASONING_PARSER": "qwen3", "TPSERVE_RESPONSES_STORE_SIZE": "1"})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED)


def prompt_tokens(tok, messages, tools=None) -> int:
    kw = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return len(tok.encode(text, add_special_tokens=False))


# ---- the store alone ----------------------------------------------------------------------------
def test_store_is_a_bounded_lru():
    s = ResponseStore(2)
    s.put("a", {"output": [1]}, [0])
    s.put("b", {"output": []}, [])
    assert s.get("a").conversation == [0, 1]  # reading "a" makes "b" the least recently used
    s.put("c", {"output": []}, [])
    assert "b" not in s and "a" in s and "c" in s and s.evicted == 1
    assert s.delete("a") and not s.delete("a") and len(s) == 1
    nothing = ResponseStore(0)
    nothing.put("x", {"output": []}, [])
    assert nothing.get("x") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_items_become_chat_messages_as_the_template_reads_them():
    items = [
        {"role": "developer", "content": "Rules."}, {"role": "system", "content": "More rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "namespace": "ns", "arguments": "{"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}]
    plain = conversation_messages(items, 0, TemplateTraits())
    assert plain[0] == {"role": "system", "content": "Rules.\n\nMore rules."}
    assert plain[1] == {"role": "user", "content": "ab"}
    assert plain[2] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "ns.g", "arguments": "{"}}]}
    assert plain[3:] == [{"role": "tool", "content": "one", "tool_call_id": "c1", "name": "f"},
                         {"role": "tool", "content": "two", "tool_call_id": "c2", "name": "ns.g"}]
    # a template with a developer role and reasoning_content gets both
    rich = conversation_messages(items, 0, TemplateTraits(developer=True, reasoning=True))
    assert [m["role"] for m in rich[:2]] == ["developer", "system"]
    assert rich[3]["reasoning_content"] == "think" and len(rich[3]["tool_calls"]) == 2


# ---- through the HTTP front -------------------------------------------------------------------
def test_whole_and_streamed_answers_agree_with_chat(client):
    kw = dict(model=MODEL, input="def fibonacci(n):", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [msg] = whole.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert whole.usage.output_tokens == 8
    assert whole.usage.total_tokens == whole.usage.input_tokens + 8
    assert whole.max_output_tokens == 8 and whole.temperature == 0 and whole.store is True
    # the chat path with the same message answers the same
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "def fibonacci(n):"}])
    assert chat.choices[0].message.content == whole.output_text
    assert chat.usage.prompt_tokens == whole.usage.input_tokens

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == 8
    assert last.incomplete_details.reason == "max_output_tokens"


def test_sse_lines_name_each_event(daemon):
    with httpx.stream("POST", daemon.url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"input": "hi", "max_output_tokens": 2, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in blocks[-1]


def test_instructions_and_developer_messages_render_as_one_system_message(client, tok):
    r = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=1, input=[
        {"role": "developer", "content": "Answer in Python."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "sort a list"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "sorted(x)"}]},
        {"role": "user", "content": "and reversed?"}])
    want = prompt_tokens(tok, [{"role": "system", "content": "Be brief.\n\nAnswer in Python."},
                               {"role": "user", "content": "sort a list"},
                               {"role": "assistant", "content": "sorted(x)"},
                               {"role": "user", "content": "and reversed?"}])
    assert r.usage.input_tokens == want and r.instructions == "Be brief."


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_call_and_its_output_round_trip(client, tok, tool_choice):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=tool_choice,
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0, store=False)
    assert r.status == "completed" and r.parallel_tool_calls is False
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert set(args) == {"city"}
    # store false: the client sends the conversation back, the call's output after it
    items = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                    "arguments": call.arguments},
                   {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    back = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=3, temperature=0)
    assert back.output[0].type == "message"
    want = prompt_tokens(tok, ask + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "sunny, 21 C"}],
        tools=[chat_weather(WEATHER)])
    assert back.usage.input_tokens == want


def test_streamed_function_call_events(client):
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)["city"] is not None
    assert events[-1].response.output[0].arguments == args


def test_previous_response_id_continues_and_the_store_evicts(client):
    first = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Again.",
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the conversation, with what the continued response answered, and the new input last
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "message"]
    assert listed.data[1].role == "assistant" and listed.data[2].content[0].text == "Again."
    # the store holds one response: the first was evicted
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="x",
                                max_output_tokens=1)


def test_store_false_get_and_delete(client):
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    gone = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    assert client.responses.retrieve(kept.id).id == kept.id
    auth = {"Authorization": f"Bearer {API_KEY}"}
    replay = httpx.get(f"{client.base_url}responses/{kept.id}?stream=true", headers=auth)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(kept.id)
    client.responses.delete(kept.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(kept.id)


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A colour?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    assert json.loads(r.output_text)["colour"] in ("red", "green")
    assert r.text.format.type == "json_schema"


def test_a_large_max_output_tokens_is_clamped_not_refused(daemon):
    r = post(daemon, "/v1/responses", {"input": "hi", "max_output_tokens": 10 ** 6,
                                       "structured_outputs": {"regex": "[a-z]{1,4}"}})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed" and r.json()["max_output_tokens"] == 10 ** 6
    # an answer that runs on fills the context, and is incomplete for its (clamped) limit
    r = post(daemon, "/v1/responses", {"input": "x = 1\n" * 230, "max_output_tokens": 10 ** 6,
                                       "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["total_tokens"] == 1024 and body["usage"]["output_tokens"] > 0  # the context


def test_reasoning_items_with_the_reasoning_parser(client, daemon, tok):
    body = {"input": "hi", "max_output_tokens": 40, "temperature": 0,
            "structured_outputs": {"regex": "<think>[a-z]{3,12}</think>[a-z]{2,8}"},
            "include": ["reasoning.encrypted_content"]}
    r = post(daemon, "/v1/responses", body).json()
    thought, msg = r["output"]
    assert thought["type"] == "reasoning" and thought["summary"] == []
    text = thought["content"][0]["text"]
    assert text.isalpha() and thought["encrypted_content"]
    assert msg["type"] == "message" and msg["content"][0]["text"].isalpha()
    details = r["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < r["usage"]["output_tokens"]
    # streamed: the same thoughts as reasoning_text deltas
    with httpx.stream("POST", daemon.url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == text
    assert next(e for e in events if e["type"] == "response.reasoning_text.done")["text"] == text
    usage = events[-1]["response"]["usage"]
    assert (usage["output_tokens"], usage["output_tokens_details"]) == (r["usage"]["output_tokens"], details)
    # the item sent back: the bundled template shows no reasoning_content, so it is left out
    again = client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "user", "content": "hi"}, thought, {k: msg[k] for k in ("type", "role", "content")},
        {"role": "user", "content": "more"}])
    assert again.usage.input_tokens == prompt_tokens(tok, [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": msg["content"][0]["text"]},
        {"role": "user", "content": "more"}])


def test_hosted_tools_are_left_out_and_namespaced_functions_offered(client, tok):
    lookup = {"type": "function", "name": "lookup", "description": "Find a customer",
              "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}
    tools = [{"type": "web_search"},
             {"type": "namespace", "name": "crm", "description": "CRM", "tools": [lookup]},
             {"type": "file_search", "vector_store_ids": ["vs_1"]}]
    r = client.responses.create(model=MODEL, input="Customer 7?", tools=tools, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "lookup"}, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "lookup" and call.namespace == "crm"
    assert isinstance(json.loads(call.arguments)["id"], int)
    assert r.model_extra["tools_not_offered"] == [{"type": "web_search", "param": "tools[0]"},
                                                 {"type": "file_search", "param": "tools[2]"}]
    offered = [{"type": "function", "function": {**{k: v for k, v in lookup.items() if k != "type"},
                                                 "name": "crm.lookup"}}]
    assert r.usage.input_tokens == prompt_tokens(tok, [{"role": "user", "content": "Customer 7?"}], offered)
    # the call goes back with its namespace
    back = client.responses.create(model=MODEL, tools=tools, max_output_tokens=1, input=[
        {"role": "user", "content": "Customer 7?"},
        {"type": "function_call", "call_id": call.call_id, "name": "lookup", "namespace": "crm",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Ada"}])
    assert back.status in ("completed", "incomplete")


@pytest.mark.parametrize("body,status,param", [
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"service_tier": "flex"}, 400, "service_tier"),
    ({"text": {"verbosity": "high"}}, 400, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"include": ["everything"]}, 400, "include"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": []}, 400, "input"),
    ({"tools": [{"type": "custom", "name": "patch"}]}, 400, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function", "name": "bad name"}]}, 400, "tools[1].name"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "a b"}]}]}, 400,
     "tools[0].tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"tools": [{**WEATHER, "strict": True, "parameters": UNIQUE}], "tool_choice": "required"}, 400,
     "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400,
     "text.format"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_logprobs": 99}, 400, "top_logprobs"),
    ({"metadata": {"k": 1}}, 400, "metadata"),
    ({"model": "other"}, 404, "model"),
])
def test_refused_fields_are_named_and_the_daemon_keeps_serving(daemon, body, status, param):
    r = post(daemon, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param) or status == 404, error
    ok = post(daemon, "/v1/responses", {"input": "hi", "max_output_tokens": 1})
    assert ok.status_code == 200


def test_accepted_fields_without_effect(daemon):
    r = post(daemon, "/v1/responses", {
        "input": "hi", "max_output_tokens": 2,
        "include": ["reasoning.encrypted_content", "file_search_call.results"],
        "reasoning": {"summary": "auto"}, "prompt_cache_key": "k", "user": "u", "safety_identifier": "s",
        "metadata": {"team": "a"}, "service_tier": "auto", "truncation": "disabled", "top_logprobs": 0,
        "stream_options": None, "context_management": [{"type": "compaction"}],
        "prompt_cache_retention": "24h",
        "max_tool_calls": 3, "parallel_tool_calls": True, "some_future_field": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metadata"] == {"team": "a"} and body["prompt_cache_key"] == "k" and body["user"] == "u"
    assert body["reasoning"]["summary"] == "auto"


def test_a_non_strict_tool_with_an_unsupported_keyword_is_constrained_leniently(client):
    r = client.responses.create(model=MODEL, input="Tag it.", max_output_tokens=60, temperature=0,
                                tools=[{**WEATHER, "name": "tag", "parameters": UNIQUE}],
                                tool_choice="required", parallel_tool_calls=False)
    assert r.output[0].type == "function_call" and r.output[0].name == "tag"


def test_logprobs_of_the_output_text(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 3 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text


def test_oversized_body_is_413(daemon):
    reply = post(daemon, "/v1/responses", b'{"input": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_api_key_is_required(daemon):
    r = post(daemon, "/v1/responses", {"input": "hi"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(daemon.url + "/v1/responses/resp_x").status_code == 401


def test_closing_a_stream_aborts_its_request(daemon):
    generated = idle(daemon)["generation_tokens"]
    with httpx.stream("POST", daemon.url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"input": "hi", "max_output_tokens": 900, "stream": True,
                            "structured_outputs": {"regex": "[a-z]{900}"}}, timeout=60) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("event: response.created")
        with daemon.zmq() as c:
            assert c.status()["requests_in_flight"] == 1
    status = idle(daemon)  # the front noticed, aborted the request, and its blocks are free
    assert status["generation_tokens"] - generated < 900  # cut short, not run to the end
