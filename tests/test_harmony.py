"""gpt-oss's harmony format (tpserve/fronts/http/harmony.py): prompts rendered as openai-harmony
renders them, answers parsed from token ids that openai-harmony itself encodes, through the
HTTP front's chat completions, Responses and Messages APIs (a front whose daemon is scripted:
it answers each request with the given tokens)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tpserve.client.client import Delta, GenerateResult
from tpserve.errors import ConfigError
from tpserve.fronts.http import harmony
from tpserve.fronts.http.app import Front, create_app

ROOT = Path(__file__).resolve().parent.parent


def _vocab_ready() -> None:
    """The o200k_base vocabulary: `make test` fetched it; fetched here the same way if not."""
    base = os.environ.get(harmony.ENV) or str(harmony.default_vocab_dir())
    if not (Path(base) / harmony.VOCAB_FILE).is_file():
        script = ROOT / "scripts" / "fetch_harmony_vocab.sh"
        subprocess.run(["bash", str(script), base], check=True, timeout=600)


_vocab_ready()
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort,  # noqa: E402
                            Role, SystemContent, ToolDescription)

ENC = harmony.load_encoding()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}}]


def toks(text: str) -> list[int]:
    return ENC.encode(text, allowed_special="all")


THINK_ANSWER = toks("<|channel|>analysis<|message|>The user greets. Reply é.<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>Hello, é!<|return|>")
CALL = toks("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")


class Tokenizer:
    """The encoding as the front's tokenizer (token texts, decoding)."""
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return toks(text)

    def decode(self, ids, skip_special_tokens=False):
        return ENC.decode(ids)


class ScriptedFront(Front):
    """A front whose daemon answers every request with ``self.answer`` (token ids), one Delta per
    token when streamed; ``self.prompts`` records the prompts it was sent."""

    def __init__(self, model_path="unused", reasoning_parser=harmony.NAME):
        super().__init__("ipc:///nonexistent/tpserve.sock", model_path, "gpt-oss-tiny", 4096,
                         tokenizer=Tokenizer(), reasoning_parser=reasoning_parser)
        self.answer: list[int] = []
        self.finish = "stop"
        self.prompts: list[list[int]] = []

    async def choices(self, prompts, request, whole=False):
        self.prompts.append(list(prompts[0]))
        ids = self.answer
        pieces = [ids] if whole else [[t] for t in ids]
        for i, piece in enumerate(pieces):
            if piece:
                first = i == 0
                yield 0, Delta("r", ENC.decode(piece), piece, cached_tokens=0 if first else None,
                               prompt_tokens=len(prompts[0]) if first else None)
        yield 0, GenerateResult("r", ENC.decode(ids), list(ids), self.finish, len(prompts[0]), len(ids))


@pytest.fixture
def front():
    return ScriptedFront()


@pytest.fixture
def http(front):
    with TestClient(create_app(front)) as c:
        yield c


def chat(http, front, answer, finish="stop", **body):
    front.answer, front.finish = answer, finish
    body = {"model": "gpt-oss-tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return http.post("/v1/chat/completions", json=body)


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def expected_prompt(effort=ReasoningEffort.MEDIUM, instructions=None, tools=None, rest=()) -> list[int]:
    msgs = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort))]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools(tools)
        msgs.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    conv = Conversation.from_messages(msgs + list(rest))
    return list(ENC.render_conversation_for_completion(conv, Role.ASSISTANT))


# ---- rendering ----------------------------------------------------------------------------------
def test_rendering_is_openai_harmonys():
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sunny\": true}"},
    ]
    got = harmony.render(ENC, messages, {"reasoning_effort": "high"}, TOOLS)
    want = expected_prompt(
        ReasoningEffort.HIGH, "Answer briefly.",
        [ToolDescription.new("get_weather", "Weather of a city", parameters=WEATHER)],
        [Message.from_role_and_content(Role.USER, "Weather in Paris?"),
         Message.from_role_and_content(Role.ASSISTANT, "Call the tool.").with_channel("analysis"),
         Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
         .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
         Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"sunny": true}')
         .with_channel("commentary").with_recipient("assistant")])
    assert got == want
    assert ENC.decode(got).endswith("<|start|>assistant")


def test_http_prompt_is_the_harmony_rendering(http, front):
    r = chat(http, front, THINK_ANSWER, reasoning_effort="low",
             messages=[{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "hi"}])
    assert r.status_code == 200, r.text
    assert front.prompts[-1] == expected_prompt(ReasoningEffort.LOW, "Be kind.", None,
                                                [Message.from_role_and_content(Role.USER, "hi")])


def test_bad_effort_and_constrained_tool_choice_are_refused(http, front):
    r = chat(http, front, THINK_ANSWER, reasoning_effort="extreme")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = chat(http, front, CALL, tools=TOOLS, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = chat(http, front, THINK_ANSWER, messages=[{"role": "user", "content": "hi"},
                                                  {"role": "tool", "tool_call_id": "nope", "content": "x"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_call_id"


# ---- parsing ------------------------------------------------------------------------------------
def test_stream_and_whole_parse_agree():
    thoughts, answer, calls, n = harmony.parse_whole(ENC, THINK_ANSWER)
    assert (thoughts, answer, calls) == ("The user greets. Reply é.", "Hello, é!", [])
    assert 0 < n < len(THINK_ANSWER)
    s = harmony.HarmonyStream(ENC)
    deltas = [d for t in CALL for d in s.feed([t])] + s.flush()
    first = deltas[[("tool_calls" in d) for d in deltas].index(True)]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert json.loads(args) == {"city": "Paris"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert not any("content" in d for d in deltas)


@pytest.mark.parametrize("text, content", [
    # cut by max_tokens inside the second message's header: what the header said is content
    ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>fin",
     "<|start|>assistant<|channel|>fin"),
    ("plain text, no harmony", "plain text, no harmony"),                 # never a header's end
    ("<|channel|>final<|message|>ok<|return|>more text", "okmore text"),  # a token harmony refuses
])
def test_malformed_answers_give_content(text, content):
    _, answer, calls, _ = harmony.parse_whole(ENC, toks(text))
    assert answer == content and calls == []
    s = harmony.HarmonyStream(ENC)
    streamed = [d for t in toks(text) for d in s.feed([t])] + s.flush()
    assert "".join(d.get("content", "") for d in streamed) == content


# ---- through the HTTP front ---------------------------------------------------------------------
def test_chat_whole_reasoning_and_content(http, front):
    r = chat(http, front, THINK_ANSWER)
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "The user greets. Reply é."
    assert msg["content"] == "Hello, é!" and "tool_calls" not in msg
    assert choice["finish_reason"] == "stop"


def test_chat_whole_and_streamed_tool_call(http, front):
    r = chat(http, front, CALL, tools=TOOLS)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["reasoning_content"] == "Need weather." and choice["message"]["content"] is None

    r = chat(http, front, CALL, tools=TOOLS, stream=True)
    chunks = sse(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."


def test_chat_streamed_reasoning_then_content(http, front):
    r = chat(http, front, THINK_ANSWER, stream=True)
    deltas = [c["choices"][0]["delta"] for c in sse(r.text)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets. Reply é."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello, é!"
    # the thoughts come before the answer
    kinds = [("r" if "reasoning_content" in d else "c") for d in deltas
             if d.get("reasoning_content") or d.get("content")]
    assert kinds == sorted(kinds, reverse=True)


def test_chat_cut_inside_a_header_is_content(http, front):
    answer = toks("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>fin")
    r = chat(http, front, answer, finish="length")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "hmm"
    assert choice["message"]["content"] == "<|start|>assistant<|channel|>fin"


def test_responses_reasoning_message_and_function_call(http, front):
    front.answer = THINK_ANSWER
    r = http.post("/v1/responses", json={"model": "gpt-oss-tiny", "input": "hi",
                                         "reasoning": {"effort": "high"}})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == "The user greets. Reply é."
    assert out[1]["content"][0]["text"] == "Hello, é!"
    assert r.json()["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert ENC.decode(front.prompts[-1]).count("Reasoning: high") == 1

    front.answer = CALL
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = http.post("/v1/responses", json={"model": "gpt-oss-tiny", "input": "weather?", "tools": tools,
                                         "stream": True})
    done = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]
    items = done["response"]["output"]
    assert [o["type"] for o in items] == ["reasoning", "function_call"]
    assert items[1]["name"] == "get_weather" and json.loads(items[1]["arguments"]) == {"city": "Paris"}


def test_messages_thinking_text_and_tool_use(http, front):
    head = {"anthropic-version": "2023-06-01"}
    front.answer = THINK_ANSWER
    r = http.post("/v1/messages", headers=head, json={"model": "gpt-oss-tiny", "max_tokens": 50,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [
        {"type": "thinking", "thinking": "The user greets. Reply é.", "signature": ""},
        {"type": "text", "text": "Hello, é!"}]
    assert r.json()["stop_reason"] == "end_turn"

    front.answer = CALL
    body = {"model": "gpt-oss-tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}]}
    r = http.post("/v1/messages", headers=head, json=body)
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {"city": "Paris"}
    assert r.json()["stop_reason"] == "tool_use"

    r = http.post("/v1/messages", headers=head, json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    args = "".join(e["delta"]["partial_json"] for e in events
                   if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_agent_apis_tool_round_trips_render_as_harmony_tool_messages(http, front):
    """A Responses function_call + function_call_output, and a Messages tool_use + tool_result,
    come back to the model as its call and the tool's answer to it."""
    front.answer = THINK_ANSWER
    inp = [{"role": "user", "content": "weather?"},
           {"type": "function_call", "call_id": "call_9", "name": "get_weather",
            "arguments": '{"city": "Paris"}'},
           {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = http.post("/v1/responses", json={"model": "gpt-oss-tiny", "input": inp, "tools": tools})
    assert r.status_code == 200, r.text
    tail = ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
            '<|message|>sunny<|end|><|start|>assistant')
    assert ENC.decode(front.prompts[-1]).endswith(tail)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "sunny"}]}]
    r = http.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                  json={"model": "gpt-oss-tiny", "max_tokens": 9, "messages": msgs,
                        "tools": [{"name": "get_weather", "input_schema": WEATHER}]})
    assert r.status_code == 200, r.text
    assert ENC.decode(front.prompts[-1]).endswith(tail)


# ---- selection ----------------------------------------------------------------------------------
def test_gpt_oss_is_served_in_harmony_unless_another_parser_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"]}))
    assert ScriptedFront(str(tmp_path), None).harmony is not None
    other = ScriptedFront(str(tmp_path), "deepseek_r1")
    assert other.harmony is None and other.reasoning_parser == "deepseek_r1"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert ScriptedFront(str(tmp_path), None).harmony is None
    named = ScriptedFront(str(tmp_path), harmony.NAME)
    assert named.harmony is not None and named.reasoning_parser is None


def test_a_missing_vocabulary_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv(harmony.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="fetch_harmony_vocab"):
        harmony.load_encoding()


# ---- a daemon on a tiny random gpt-oss -----------------------------------------------------------
HARMONY_VOCAB = 201088  # o200k_harmony's size: every harmony token is in the model's vocabulary


@pytest.fixture(scope="module")
def gpt_oss_daemon(tmp_path_factory):
    """A daemon with its HTTP front on a random-weight gpt-oss of harmony's vocabulary size,
    without a tokenizer (harmony renders and parses; the daemon's own text is not used)."""
    import torch
    import transformers

    from test_http import run_cli

    path = tmp_path_factory.mktemp("gpt-oss-harmony")
    config = transformers.GptOssConfig(
        vocab_size=HARMONY_VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, head_dim=8,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        tie_word_embeddings=False, architectures=["GptOssForCausalLM"], eos_token_id=200002)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.25)
    model.save_pretrained(path, safe_serialization=True)
    # the released models' ends: <|return|>, <|endoftext|>, <|call|>
    transformers.GenerationConfig(eos_token_id=[200002, 199999, 200012]).save_pretrained(path)
    rd = tmp_path_factory.mktemp("rd")
    env = dict(os.environ, TPSERVE_API_KEY="")
    out = run_cli("start", "--model", path, "--runtime-dir", rd, "--http-port", 0, "--num-kv-blocks", 64,
                  "--block-size", 16, "--startup-timeout", 200, env=env)
    assert out.returncode == 0, out.stderr + out.stdout
    url = out.stdout.split()[1]
    yield url, path.name
    assert run_cli("stop", "--runtime-dir", rd, "--timeout", 60).returncode == 0


def test_a_gpt_oss_daemon_renders_and_parses_in_harmony(gpt_oss_daemon):
    import httpx

    url, name = gpt_oss_daemon
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    body = {"model": name, "messages": messages, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    choice = got["choices"][0]
    assert choice["prompt_token_ids"] == harmony.render(ENC, messages)
    assert got["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    # the answer's random tokens, parsed as harmony parses them
    thoughts, answer, calls, _ = harmony.parse_whole(ENC, choice["token_ids"])
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["content"], msg.get("tool_calls", [])) == (thoughts, answer, calls)
    assert thoughts or answer

    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    deltas = [c["choices"][0]["delta"] for c in sse(r.text) if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (answer or "")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (thoughts or "")

    r = httpx.post(url + "/v1/messages", headers={"anthropic-version": "2023-06-01"}, timeout=120,
                   json={"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(harmony.render(ENC, messages[1:]))
    r = httpx.post(url + "/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 8},
                   timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "incomplete", r.text
