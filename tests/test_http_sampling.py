"""Sampling controls, echo and prompt log-probabilities over HTTP, through the official `openai`
client (vLLM-only fields through ``extra_body``), on one daemon: each field reaches the engine
(the output equals the ZMQ client's for the same SamplingParams) or is refused with a 400 naming
it; the tokenizer endpoints answer as vLLM's do."""
from __future__ import annotations

import httpx
import pytest

from test_http import API_KEY, MODEL, client, daemon  # noqa: F401  (module fixtures: one daemon here)
from tpserve import SamplingParams

PROMPT = "def parse(line):\n    "


@pytest.fixture(scope="module")
def raw(daemon):
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def zmq_tokens(daemon, prompt, **kw) -> list[int]:
    with daemon.zmq() as c:
        return c.generate(prompt, SamplingParams(temperature=0, **kw)).token_ids


CONTROLS = [
    (dict(frequency_penalty=1.2), {}),
    (dict(presence_penalty=1.5), {}),
    (dict(logit_bias={"13": -100, "8": 5}), {}),
    ({}, dict(repetition_penalty=1.4)),
    ({}, dict(min_tokens=6)),  # with the greedy output's second token as a stop id
    ({}, dict(allowed_token_ids=[8, 13, 26, 300])),
    ({}, dict(bad_words=[])),  # filled with a span of the greedy output
    ({}, dict(min_p=0.2)),
]


@pytest.mark.parametrize("openai_kw,extra", CONTROLS)
def test_each_control_reaches_the_engine(daemon, client, raw, openai_kw, extra):
    greedy = zmq_tokens(daemon, PROMPT, max_tokens=8)
    if "bad_words" in extra:
        extra = dict(bad_words=[raw.post("/detokenize", json={"tokens": greedy[2:4]}).json()["prompt"]])
    if "min_tokens" in extra:
        extra = dict(extra, stop_token_ids=[greedy[1]])
        assert len(zmq_tokens(daemon, PROMPT, max_tokens=8, stop_token_ids=[greedy[1]])) == 2
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=dict(
        extra, return_token_ids=True), **openai_kw)
    got = out.choices[0].model_extra["token_ids"]
    params = dict(openai_kw, **extra)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    assert got == zmq_tokens(daemon, PROMPT, max_tokens=8, **params)
    assert got != greedy[:len(got)] or "min_p" in params or "min_tokens" in params  # min_p: greedy as it is
    if "min_tokens" in params:
        assert len(got) >= 6
    if "allowed_token_ids" in params:
        assert set(got) <= set(params["allowed_token_ids"])


def test_echo_scores_the_prompt_as_the_engine_does(daemon, client):
    with daemon.zmq() as c:
        ref = c.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = out.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e[0] for e in ref.prompt_logprobs[1:]])
    for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
        assert tok in top and len(top) <= 3  # the 2 best and the prompt's own token
    assert "".join(lp.tokens) == PROMPT
    # As lm-eval sends it: token ids, one generated token, echo.
    ids = client.completions.create(model=MODEL, prompt=[10, 20, 30, 40], max_tokens=1, echo=True, logprobs=1,
                                    temperature=0).choices[0]
    assert len(ids.logprobs.token_logprobs) == 5 and ids.logprobs.token_logprobs[0] is None


def test_logprobs_include_the_sampled_token(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=1, temperature=0.9, seed=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(val) and len(top) <= 2


def test_prompt_logprobs_n_and_stop_string_options(daemon, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens
    assert all(any("logprob" in v for v in d.values()) for d in plp[1:])
    two = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=5, n=2)
    with daemon.zmq() as c:
        ref = c.generate(PROMPT, SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6))
    assert sorted(ch.text for ch in two.choices) == sorted(c.text for c in ref.completions)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = base[4:6]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == base[:base.index(stop) + len(stop)] and kept.finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 200}), "logit_bias[5]"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(use_beam_search=True), "use_beam_search"),
    (dict(suffix="x"), "suffix"),
    (dict(store=True), "store"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(bad_words=[""]), "bad_words[0]"),
    (dict(prompt_logprobs=50), "prompt_logprobs"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),  # checked by the daemon against the vocabulary
])
def test_bad_fields_are_400s_naming_them_and_the_daemon_serves_on(raw, body, param):
    r = raw.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert raw.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_chat_template_options_and_echo(client, raw):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f"}]
    cont = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert cont.choices[0].message.content.startswith("def f")
    r = raw.post("/v1/chat/completions", json={"messages": msgs, "add_generation_prompt": True,
                                               "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = raw.post("/v1/chat/completions", json={"messages": msgs[:1], "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    ok = client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2,
                                        extra_body={"chat_template_kwargs": {"add_bos": False}})
    assert ok.choices[0].finish_reason in ("stop", "length")
    # a reasoning switch the template does not read would change nothing: refused, named
    r = raw.post("/v1/chat/completions", json={"messages": msgs[:1],
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"


def test_tokenizer_endpoints_and_model_card(daemon, raw):
    tok = raw.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    assert raw.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    chat = raw.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = raw.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                             "return_token_strs": True}).json()
    assert with_tools["count"] > chat["count"] and "get_weather" in "".join(with_tools["token_strs"])
    bad_tools = raw.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": "x"})
    assert bad_tools.status_code == 400 and bad_tools.json()["error"]["param"] == "tools"
    info = raw.get("/tokenizer_info").json()
    assert info["vocab_size"] > 0 and info["tokenizer_class"]
    assert raw.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = raw.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = raw.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


def test_zmq_client_streams_n_completions_and_prompt_logprobs(daemon):
    with daemon.zmq() as c:
        whole = c.generate(PROMPT, SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=5, prompt_logprobs=1))
        stream = c.stream(PROMPT, SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=5, prompt_logprobs=1))
        deltas = list(stream)
    assert sorted({d.index for d in deltas}) == [0, 1]
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert deltas[0].prompt_logprobs == whole.prompt_logprobs and whole.prompt_logprobs[0] is None
    res = stream.result
    assert [c.index for c in res.completions] == [0, 1] == [c.index for c in whole.completions]
    for streamed, one in zip(res.completions, whole.completions):
        assert (streamed.text, streamed.token_ids) == (one.text, one.token_ids)
        assert "".join(d.text for d in deltas if d.index == one.index) == one.text
    assert res.completion_tokens == sum(c.completion_tokens for c in whole.completions) == 10
