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
