"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client, against a daemon on the bundled model (its free text is near-random: tool
calls come from the constraint of tool_choice), and one with a reasoning parser for thinking
blocks. Errors in Anthropic's format, each with its status; the daemon keeps serving."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from test_http import API_KEY, BUNDLED, MODEL, HttpDaemon, idle, post
from tpserve.tokenizer import load_tokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                             "days": {"type": "integer", "minimum": 1,
                                                                      "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                         "required": ["zone"], "additionalProperties": False}}
SCHEMAS = {"get_weather": WEATHER["input_schema"], "get_time": TIME["input_schema"]}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0}  # the client has no temperature argument any more: sent as an extra field


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key=API_KEY, max_retries=0, timeout=120)


def messages(daemon, body, headers=None, key=API_KEY, path="/v1/messages"):
    """A raw POST with Anthropic's headers (x-api-key, anthropic-version)."""
    return httpx.post(daemon.url + path, content=json.dumps(body), timeout=120,
                      headers={"Content-Type": "application/json", "x-api-key": key,
                               "anthropic-version": "2023-06-01", **(headers or {})})


def raw(kw: dict, **more) -> dict:
    """The JSON body of a client call's keywords."""
    return {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw.get("extra_body", {}), **more}


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def blocks(message) -> list[dict]:
    """A message's content blocks as maps (the stream's blocks are the client's Parsed* types)."""
    return [{k: v for k, v in b.model_dump().items() if k != "parsed_output"} for b in message.content]


def total_input(usage) -> int:
    return (usage.input_tokens + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0))


# ---- answers ----------------------------------------------------------------------------------
def test_create_answers_as_chat_does_with_anthropics_shape(daemon, client):
    msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == MODEL and msg.stop_reason in ("end_turn", "max_tokens")
    chat = post(daemon, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                 "temperature": 0}).json()
    text = chat["choices"][0]["message"]["content"]
    assert [b.type for b in msg.content] == (["text"] if text else [])
    assert "".join(b.text for b in msg.content) == text
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert total_input(msg.usage) == chat["usage"]["prompt_tokens"]
    assert msg.usage.cache_creation_input_tokens == 0
    length = chat["choices"][0]["finish_reason"] == "length"
    assert msg.stop_reason == ("max_tokens" if length else "end_turn")


def test_stream_events_and_final_message_match_the_whole_answer(daemon, client):
    kw = dict(model=MODEL, max_tokens=10, extra_body=GREEDY,
              messages=[{"role": "user", "content": "def f(x):"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content)
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert total_input(final.usage) == total_input(whole.usage)
    sent = messages(daemon, raw(kw, stream=True))
    assert sent.status_code == 200 and sent.headers["content-type"].startswith("text/event-stream")
    names = [e for e, _ in sse_events(sent.text)]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    if text:
        assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
        assert set(names[3:-3]) == {"content_block_delta"}


def test_max_tokens_ends_with_max_tokens_and_a_huge_one_is_clamped(client):
    msg = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "def fibonacci(n):"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2
    long = [{"role": "user", "content": "x = 1\n" * 230}]
    prompt = client.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert 800 < prompt < 1000
    big = client.messages.create(model=MODEL, max_tokens=32000, extra_body=GREEDY, messages=long)
    assert big.usage.output_tokens <= 1024 - prompt
    assert big.stop_reason in ("max_tokens", "end_turn")


def test_stop_sequences_end_with_stop_sequence_whole_and_streamed(client):
    kw = dict(model=MODEL, extra_body=GREEDY, messages=[{"role": "user", "content": "def fibonacci(n):"}])
    free = "".join(b.text for b in client.messages.create(max_tokens=16, **kw).content)
    at = next(i for i in range(1, len(free)) if free.find(free[i]) == i)  # a character seen first there
    stop = free[at]
    cut = client.messages.create(max_tokens=16, stop_sequences=[stop, "never appears"], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == free[:at]
    with client.messages.stream(max_tokens=16, stop_sequences=[stop], **kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == free[:at] and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


# ---- tools ------------------------------------------------------------------------------------
def check_tool_uses(content, names):
    uses = [b for b in content if b.type == "tool_use"]
    assert uses
    for b in uses:
        assert b.id.startswith("toolu_") and b.name in names
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


def test_tool_choice_tool_and_any_answer_tool_use(client):
    named = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "tool", "name": "get_time"})
    assert named.stop_reason == "tool_use"
    assert [b.name for b in check_tool_uses(named.content, {"get_time"})] == ["get_time"]
    one = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER, TIME],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert one.stop_reason == "tool_use"
    assert len(check_tool_uses(one.content, {"get_weather", "get_time"})) == 1


def test_streamed_tool_use_joins_to_the_whole_answer(daemon, client):
    kw = dict(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in check_tool_uses(final.content, {"get_weather"})] == \
        [(b.name, b.input) for b in check_tool_uses(whole.content, {"get_weather"})]
    events = sse_events(messages(daemon, raw(kw, stream=True)).text)
    starts = [d["content_block"] for e, d in events if e == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    deltas = [d["delta"] for e, d in events if e == "content_block_delta"]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)


def test_a_tool_result_round_trip_renders_through_the_template(daemon, client):
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    msg = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=history,
                                 tools=[WEATHER],
                                 tool_choice={"type": "none"})
    assert all(b.type == "text" for b in msg.content)
    chat = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
            {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    tok = load_tokenizer(BUNDLED)
    rendered = tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert "Let me look.\n<tool_call>" in rendered
    count = len(tok.encode(rendered, add_special_tokens=False))
    assert total_input(msg.usage) == count
    assert client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens == count
    # an error result is marked as one
    failed = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                          "content": "no such city", "is_error": True}]}]
    assert client.messages.count_tokens(model=MODEL, messages=failed, tools=[WEATHER]).input_tokens > \
        client.messages.count_tokens(model=MODEL, messages=[*history[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city"}]}],
            tools=[WEATHER]).input_tokens


def test_server_tools_are_left_out_and_named(daemon, client):
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, WEATHER,
             {"type": "bash_20250124", "name": "bash"}]
    r = messages(daemon, {"model": MODEL, "max_tokens": 3, "messages": ASK, "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["tools_not_offered"] == [
        {"type": "web_search_20250305", "name": "web_search", "param": "tools[0]"},
        {"type": "bash_20250124", "name": "bash", "param": "tools[2]"}]
    events = sse_events(messages(daemon, {"model": MODEL, "max_tokens": 3, "messages": ASK, "tools": tools,
                                          "stream": True}).text)
    assert events[0][1]["message"]["tools_not_offered"] == r.json()["tools_not_offered"]
    alone = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=ASK, tools=tools).input_tokens == alone
    assert total_input(anthropic.types.Usage(**r.json()["usage"])) == alone
    refused = messages(daemon, {"model": MODEL, "max_tokens": 3, "messages": ASK, "tools": tools,
                                "tool_choice": {"type": "tool", "name": "web_search"}})
    assert refused.status_code == 400 and "tool_choice.name" in refused.json()["error"]["message"]


# ---- counting, caching, system ----------------------------------------------------------------
def test_count_tokens_is_the_prompt_messages_reports_and_the_prefix_cache_answers(client):
    system = [{"type": "text", "text": "zq count probe. " + "You are a careful assistant. " * 8,
               "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in Python."}]
    body = dict(model=MODEL, system=system, tools=[WEATHER, TIME],
                messages=[{"role": "user", "content": "add two numbers"}])
    counted = client.messages.count_tokens(**body).input_tokens
    first = client.messages.create(max_tokens=2, extra_body=GREEDY, **body)
    again = client.messages.create(max_tokens=2, extra_body=GREEDY, **body)
    assert total_input(first.usage) == total_input(again.usage) == counted
    assert first.usage.cache_read_input_tokens < again.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= counted - 4 and again.usage.cache_read_input_tokens > 0
    with client.messages.stream(max_tokens=2, extra_body=GREEDY, **body) as stream:
        final = stream.get_final_message()
    assert total_input(final.usage) == counted and final.usage.cache_read_input_tokens > 0


def test_a_streams_start_splits_the_prompt_as_its_end_does(daemon):
    """message_start's usage has the uncached / cached split of the final message_delta: the
    second identical request reads its prompt from the prefix cache, and says so from the start."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True, "messages": ASK,
            "system": "zq stream cache probe. " + "Keep each answer short and plain. " * 12}
    usages = []
    for _ in range(2):
        events = sse_events(messages(daemon, body).text)
        start = events[0][1]["message"]["usage"]
        end = next(d for e, d in events if e == "message_delta")["usage"]
        keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        assert {k: start[k] for k in keys} == {k: end[k] for k in keys}, (start, end)
        usages.append(end)
    first, again = usages
    assert total_input(anthropic.types.Usage(**first)) == total_input(anthropic.types.Usage(**again)) > 64
    assert again["cache_read_input_tokens"] > first["cache_read_input_tokens"]
    assert again["cache_read_input_tokens"] >= total_input(anthropic.types.Usage(**again)) - 16


def test_the_first_delta_of_a_stream_carries_the_prompts_counts():
    """The daemon's side of message_start's usage (client_requests.py): a stream's first delta
    carries the prompt and cached token counts, later ones do not."""
    from tpserve.client import protocol as P
    from tpserve.outputs import EngineOutput
    from tpserve.server.client_requests import ClientRequest

    req = ClientRequest(peer=None, client_id="r", engine_id="c:r", stream=True, prompt_tokens=0)
    first = req.take(EngineOutput("c:r", [5], "a", num_prompt_tokens=40, num_completion_tokens=1,
                                  num_cached_tokens=32))
    assert (first.prompt_tokens, first.cached_tokens, first.finish_reason) == (40, 32, None)
    assert P.decode(P.encode(first), "reply") == first
    later = req.take(EngineOutput("c:r", [6], "b", num_prompt_tokens=40, num_completion_tokens=2,
                                  num_cached_tokens=32))
    assert (later.prompt_tokens, later.cached_tokens) == (None, None)


def test_system_blocks_and_system_messages_fold_into_one_system_prompt(daemon, client):
    folded = client.messages.count_tokens(
        model=MODEL, system=[{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}],
        messages=[{"role": "system", "content": "Rule three."}, *ASK]).input_tokens
    chat = [{"role": "system", "content": "Rule one.\n\nRule two.\n\nRule three."}, *ASK]
    assert folded == post(daemon, "/tokenize", {"model": MODEL, "messages": chat}).json()["count"]
    msg = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system="Rule one.",
                                 messages=[{"role": "system",
                                            "content": [{"type": "text", "text": "Rule two."}]}, *ASK])
    assert total_input(msg.usage) == post(daemon, "/tokenize", {"model": MODEL, "messages": [
        {"role": "system", "content": "Rule one.\n\nRule two."}, *ASK]}).json()["count"]


def test_claude_code_fields_headers_and_probe_are_accepted(daemon):
    assert httpx.head(daemon.url + "/", timeout=30).status_code == 200
    body = {"model": MODEL, "max_tokens": 3, "messages": ASK, "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "metadata": {"user_id": "user_abc"}, "service_tier": "auto", "mcp_servers": [],
            "some_future_beta_field": {"x": 1}}
    r = messages(daemon, body, headers={"anthropic-beta": "interleaved-thinking-2025-05-14,future-beta",
                                        "anthropic-version": "2099-01-01"}, path="/v1/messages?beta=true")
    assert r.status_code == 200, r.text
    assert [e for e, _ in sse_events(r.text)][-1] == "message_stop"
    bearer = httpx.post(daemon.url + "/v1/messages", json={**body, "stream": False}, timeout=120,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_an_assistant_prefill_is_continued(daemon, client):
    msg = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY,
                                 messages=[*ASK, {"role": "assistant", "content": "The weather"}])
    chat = post(daemon, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [*ASK, {"role": "assistant", "content": "The weather"}]}).json()
    assert "".join(b.text for b in msg.content) == (chat["choices"][0]["message"]["content"] or "")


# ---- errors -----------------------------------------------------------------------------------
GOOD = {"model": MODEL, "max_tokens": 2, "messages": ASK}


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"system": 5}, "system"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences"),
    ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com/mcp", "name": "x"}]}, "mcp_servers"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"model": None}, "model"),
])
def test_bad_requests_are_invalid_request_errors_naming_the_field(daemon, change, field):
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    r = messages(daemon, body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["message"].startswith(field + ":"), error
    assert messages(daemon, GOOD).status_code == 200  # still serving


def test_typed_errors_through_the_client(daemon, client):
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    for wrong in (anthropic.Anthropic(base_url=daemon.url, api_key="nope", max_retries=0),
                  anthropic.Anthropic(base_url=daemon.url, auth_token="nope", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=daemon.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).type == "message"
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    for path in ("/v1/messages/batches", "/v1/messages/nope/deeper"):
        r = messages(daemon, GOOD, path=path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    missing = messages(daemon, GOOD, key="")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    huge = httpx.post(daemon.url + "/v1/messages", timeout=120,
                      content=b'{"model": "' + b"x" * (9 << 20) + b'"}',
                      headers={"Content-Type": "application/json", "x-api-key": API_KEY})
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    bad_json = httpx.post(daemon.url + "/v1/messages", content=b"{nope", timeout=120,
                          headers={"Content-Type": "application/json", "x-api-key": API_KEY})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    long = [{"role": "user", "content": "x = 1\n" * 2000}]
    r = messages(daemon, {**GOOD, "messages": long})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long"), r.text
    idle(daemon)
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).type == "message"


def test_errors_before_the_routes_are_anthropics_on_messages_paths(daemon):
    """The request guard's refusals (Content-Type 415, Host 400) and the app's own answers (a
    method a path does not serve) come in Anthropic's format on /v1/messages*, and stay
    OpenAI's elsewhere."""
    def anthropic(r, status, kind):
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
        assert "param" not in body["error"]

    text = {"Content-Type": "text/plain", "x-api-key": API_KEY}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(daemon.url + path, content=json.dumps(GOOD), headers=text, timeout=60)
        anthropic(r, 415, "invalid_request_error")
        assert "Content-Type" in r.json()["error"]["message"]
        anthropic(messages(daemon, GOOD, path=path, headers={"Host": "evil.example"}), 400,
                  "invalid_request_error")
    anthropic(httpx.get(daemon.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=60), 405,
              "invalid_request_error")
    anthropic(httpx.get(daemon.url + "/v1/messages", timeout=60), 405, "invalid_request_error")
    chat = httpx.post(daemon.url + "/v1/chat/completions", content=b"{}", headers=text, timeout=60)
    assert chat.status_code == 415 and chat.json()["error"]["code"] == "unsupported_media_type"
    assert messages(daemon, GOOD).status_code == 200


def test_daemon_refusals_map_to_anthropics_statuses():
    """A full waiting queue and an unavailable daemon are 529 overloaded_error (Anthropic's
    overload, which its clients retry), too many requests 429 rate_limit_error, with Retry-After."""
    from tpserve.client import protocol as P
    from tpserve.client.client import ClientTimeout, RequestError
    from tpserve.fronts.http.app import daemon_error
    from tpserve.fronts.http.messages_errors import anthropic_error

    class Job:
        chat, request = True, None

    full = RequestError(P.OVERLOADED, "the waiting queue is full")
    full.limit, full.retry_after = "max_waiting_requests", 2.5
    cases = [(full, 529, "overloaded_error"),
             (RequestError(P.TOO_MANY_REQUESTS, "too many"), 429, "rate_limit_error"),
             (RequestError(P.SHUTTING_DOWN, "draining"), 529, "overloaded_error"),
             (ClientTimeout("ipc:///x", 1.0), 529, "overloaded_error"),
             (RequestError("internal", "boom"), 500, "api_error")]
    for exc, status, kind in cases:
        e = anthropic_error(daemon_error(exc, Job()))
        assert (e.status, e.body()["error"]["type"]) == (status, kind), exc
        assert e.body()["type"] == "error" and e.body()["error"]["message"]
    assert anthropic_error(daemon_error(full, Job())).headers == {"Retry-After": "3"}


# ---- thinking ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker():
    # the output is thoughts until </think>
    d = HttpDaemon(num_kv_blocks=120, env={"TPSERVE_REASONING_PARSER": "deepseek_r1"})
    yield d
    d.stop()


def test_thinking_blocks_with_a_reasoning_parser_whole_and_streamed(thinker):
    client = anthropic.Anthropic(base_url=thinker.url, api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=ASK,
              thinking={"type": "enabled", "budget_tokens": 1024})
    whole = client.messages.create(**kw)
    thought = whole.content[0]
    assert thought.type == "thinking" and thought.thinking and thought.signature == ""
    assert whole.stop_reason == "max_tokens"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole)
    events = sse_events(messages(thinker, raw(kw, stream=True)).text)
    kinds = {d["delta"]["type"] for e, d in events if e == "content_block_delta"}
    assert kinds == {"thinking_delta"}
    # thoughts sent back in the history are accepted (and redacted ones dropped)
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}]
    assert client.messages.create(model=MODEL, max_tokens=2, messages=history).type == "message"
