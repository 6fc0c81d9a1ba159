"""Reasoning output (--reasoning-parser): the parser alone, then through the HTTP front."""
import json

import pytest

from tpserve.fronts.http.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning

from test_http import API_KEY, MODEL, HttpDaemon, post


def streamed(parser, deltas, opened=False):
    s = ReasoningStream(parser, opened)
    parts = {"reasoning": "", "content": ""}
    for d in deltas:
        for kind, text in s.feed(d):
            parts[kind] += text
    for kind, text in s.flush():
        parts[kind] += text
    return parts["reasoning"] or None, parts["content"] or None


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_split_with_tags_whole_and_in_any_pieces(parser):
    text = "<think>step one\nstep two</think>\n\nthe answer"
    want = ("step one\nstep two", "\n\nthe answer")
    assert split_reasoning(text, parser) == want
    # one piece per character: every tag arrives split across deltas
    assert streamed(parser, list(text)) == want
    # the tags as the several tokens a tokenizer without special tokens makes of them
    assert streamed(parser, ["<", "think", ">step one\nstep two</", "think", ">", "\n\nthe answer"]) == want
    # "</" then text that is not the tag: nothing is lost
    assert split_reasoning("<think>a </b> c</think>d", parser) == ("a </b> c", "d")


def test_no_opening_tag_qwen3_is_all_answer_deepseek_is_thoughts():
    assert split_reasoning("plain answer", "qwen3") == (None, "plain answer")
    assert split_reasoning("thoughts</think>answer", "deepseek_r1") == ("thoughts", "answer")
    assert streamed("deepseek_r1", ["thou", "ghts</th", "ink>ans", "wer"]) == ("thoughts", "answer")
    assert split_reasoning("no close tag", "deepseek_r1") == ("no close tag", None)
    assert streamed("qwen3", ["<", "b>x"]) == (None, "<b>x")


def test_opened_in_the_prompt():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert split_reasoning("thoughts</think>answer", "qwen3", prompt_opened=True) == ("thoughts", "answer")
    assert streamed("qwen3", ["thoughts</", "think>answer"], opened=True) == ("thoughts", "answer")
    # generation ended inside the thoughts: no answer
    assert split_reasoning("<think>still thinking", "qwen3") == ("still thinking", None)
    cut = split_reasoning("still thinking</thi", "qwen3", prompt_opened=True)
    assert cut == ("still thinking</thi", None)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningStream("nope")


# ---- through the HTTP front -------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(env={"TPSERVE_REASONING_PARSER": "deepseek_r1"})  # the option's environment variable
    yield d
    d.stop()


def chat(daemon, regex, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": 40, "structured_outputs": {"regex": regex}, **extra}
    return post(daemon, "/v1/chat/completions", body, key=API_KEY)


def test_http_whole_answer_is_split(daemon):
    r = chat(daemon, "<think>abc</think>xyz")
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "abc"
    assert msg["content"] == "xyz"


def test_http_stream_is_split(daemon):
    r = chat(daemon, "<think>abc</think>xyz", stream=True)
    assert r.status_code == 200, r.text
    reasoning, reasoning_alt, content = "", "", ""
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            d = choice["delta"]
            assert not (d.get("content") and d.get("reasoning_content"))
            reasoning += d.get("reasoning_content") or ""
            reasoning_alt += d.get("reasoning") or ""
            content += d.get("content") or ""
    assert reasoning == reasoning_alt == "abc"
    assert content == "xyz"


def test_http_thoughts_that_never_close_have_no_answer(daemon):
    r = chat(daemon, "hmm[a-z]{3}", max_tokens=4)
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"].startswith("hmm") and msg["content"] is None


def test_reasoning_effort_needs_a_template_that_reads_it(daemon):
    r = chat(daemon, "x", reasoning_effort="low")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = chat(daemon, "x", reasoning_effort=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    template = "{% for m in messages %}{{ m.content }}{% endfor %}effort={{ reasoning_effort }}"
    r = chat(daemon, "x", reasoning_effort="low", chat_template=template,
             return_token_ids=True)
    assert r.status_code == 200, r.text
    tok = post(daemon, "/tokenize", {"prompt": "hieffort=low", "add_special_tokens": False},
               key=API_KEY).json()
    assert r.json()["choices"][0]["prompt_token_ids"] == tok["tokens"]



def test_enable_thinking_needs_a_template_that_reads_it(daemon):
    for value in (True, False):  # the bundled template has no thinking switch
        r = chat(daemon, "x", chat_template_kwargs={"enable_thinking": value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking", r.text
    r = post(daemon, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                       "chat_template_kwargs": {"enable_thinking": False}}, key=API_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    r = chat(daemon, "x", chat_template_kwargs={"enable_thinking": False}, chat_template=template,
             return_token_ids=True)
    assert r.status_code == 200, r.text
    tok = post(daemon, "/tokenize", {"prompt": "hi<think></think>", "add_special_tokens": False},
               key=API_KEY).json()
    assert r.json()["choices"][0]["prompt_token_ids"] == tok["tokens"]
    assert chat(daemon, "x").status_code == 200  # still serving

def test_a_reasoning_parser_without_an_http_front_is_refused(tmp_path):
    from click.testing import CliRunner

    from tpserve.cli.main import main
    result = CliRunner().invoke(main, ["serve", "--runtime-dir", str(tmp_path), "--reasoning-parser", "qwen3"])
    assert result.exit_code == 2 and "--reasoning-parser" in result.output and "--http-port" in result.output
    from_env = CliRunner().invoke(main, ["start", "--runtime-dir", str(tmp_path)],
                                  env={"TPSERVE_REASONING_PARSER": "deepseek_r1"})
    assert from_env.exit_code == 2 and "--reasoning-parser" in from_env.output


# ---- tool calls come from the answer only, in each API (the front in this process) ----------
THOUGHT_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
ANSWER_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
OUTPUT = f"I could call {THOUGHT_CALL} here.</think>{ANSWER_CALL}"
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}


def test_tool_calls_are_read_from_the_answer_never_from_the_thoughts():
    """A call written inside the thoughts stays thoughts; the call after ``</think>`` is the
    answer's, whole and streamed (in pieces that split the tags), through chat, Responses and
    Messages."""
    import asyncio

    from test_http import BUNDLED
    from tpserve.client.client import Delta, GenerateResult
    from tpserve.fronts.http import openai_api as O, structured_api
    from tpserve.fronts.http.app import Front
    from tpserve.fronts.http.chat_output import Response
    from tpserve.fronts.http.messages_input import prepare as messages_prepare
    from tpserve.fronts.http.messages_output import Message
    from tpserve.fronts.http.response_store import ResponseStore
    from tpserve.fronts.http.responses_input import prepare as responses_prepare, translate
    from tpserve.fronts.http.responses_items import TemplateTraits
    from tpserve.fronts.http.responses_output import Output
    from tpserve.tokenizer import load_tokenizer

    front = Front("ipc:///unused", str(BUNDLED), MODEL, 1024, tokenizer=load_tokenizer(BUNDLED),
                  reasoning_parser="deepseek_r1")
    ask = [{"role": "user", "content": "time?"}]
    pieces = [OUTPUT[i:i + 7] for i in range(0, len(OUTPUT), 7)]
    result = GenerateResult("r", OUTPUT, [5], "stop", 10, 1)

    def deltas():
        return [Delta("r", p, [5], prompt_tokens=10 if i == 0 else None, cached_tokens=0 if i == 0 else None)
                for i, p in enumerate(pieces)]

    async def chat(stream: bool):
        body = {"model": MODEL, "messages": ask, "tool_choice": "auto", "stream": stream,
                "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}]}
        job = O.parse_chat(body, MODEL)
        await structured_api.prepare(job, body, O.build_request)
        r = Response(front, job, [[1]])
        if not stream:
            r.add(0, Delta("r", OUTPUT, [5]))
            r.add(0, result)
            msg = r.whole()["choices"][0]["message"]
            return msg["reasoning_content"], [c["function"]["arguments"] for c in msg["tool_calls"]]
        thoughts, args = "", []
        for item in [*deltas(), result]:
            for chunk in r.chunks(0, item):
                for d in [c["delta"] for c in json.loads(chunk[6:])["choices"]]:
                    thoughts += d.get("reasoning_content") or ""
                    for call in d.get("tool_calls") or []:
                        if "id" in call:
                            args.append("")
                        args[-1] += call["function"].get("arguments") or ""
        return thoughts, args

    async def responses(stream: bool):
        body = {"model": MODEL, "input": ask, "stream": stream, "tool_choice": "auto",
                "tools": [{"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}]}
        tr = translate(body, front, ResponseStore(), TemplateTraits.of(front.tokenizer))
        await responses_prepare(tr)
        tr.job.thinking_opened = False
        out = Output(tr, front, "resp_x", stream)
        for d in deltas():
            out.feed(d)
        obj = await out.finish(result)
        if stream:  # the events say the same as the object
            done = [json.loads(e.split("data: ", 1)[1]) for e in out.take() if "output_item.done" in e]
            assert [e["item"] for e in done] == obj["output"]
        (thought,) = [i for i in obj["output"] if i["type"] == "reasoning"]
        return thought["content"][0]["text"], [i["arguments"] for i in obj["output"]
                                               if i["type"] == "function_call"]

    async def messages(stream: bool):
        body = {"model": MODEL, "max_tokens": 50, "messages": ask, "tool_choice": {"type": "auto"},
                "tools": [{"name": "get_time", "input_schema": TIME_SCHEMA}]}
        job, ids, t = await messages_prepare(front, body)
        m = Message(front, job, t, len(ids))
        if not stream:
            content = m.whole(OUTPUT, result)["content"]
        else:
            events = m.start(deltas()[0])
            for d in deltas():
                events += m.events(d.text)
            events += m.end(result)
            content = []
            for e in events:
                data = json.loads(e.split("data: ", 1)[1])
                if data["type"] == "content_block_start":
                    content.append(dict(data["content_block"], partial=""))
                elif data["type"] == "content_block_delta":
                    d, block = data["delta"], content[data["index"]]
                    if d["type"] == "thinking_delta":
                        block["thinking"] += d["thinking"]
                    elif d["type"] == "input_json_delta":
                        block["partial"] += d["partial_json"]
            for block in content:
                if block["type"] == "tool_use":
                    block["input"] = json.loads(block["partial"])
        thought = next(b["thinking"] for b in content if b["type"] == "thinking")
        return thought, [json.dumps(b["input"]) for b in content if b["type"] == "tool_use"]

    async def run():
        try:
            for api in (chat, responses, messages):
                for stream in (False, True):
                    thoughts, calls = await api(stream)
                    assert thoughts == f"I could call {THOUGHT_CALL} here.", (api.__name__, stream, thoughts)
                    assert [json.loads(a) for a in calls] == [{"zone": "CET"}], (api.__name__, stream, calls)
        finally:
            await front.close()
    asyncio.run(run())
