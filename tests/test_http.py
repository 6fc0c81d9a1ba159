"""The OpenAI-compatible HTTP front, through the official `openai` client, against one real
daemon on the bundled model (started once for the module with `tpserve start --http-port 0`).

Also: OpenAI error bodies for bad requests (the server keeps serving), /metrics parsed with
prometheus_client, n siblings served from the prefix cache, a disconnecting client's request
aborted, and the front stopped together with its daemon.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from tpserve import LLM, SamplingParams
from tpserve.cli.main import main
from tpserve.client.client import Client
from tpserve.client.addresses import read_ready
from tpserve.procs import descendants, pid_alive

TPSERVE = [sys.executable, "-m", "tpserve"]
API_KEY = "test-key-123"
MODEL = "default-model"
BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"
PROMPT = "def fibonacci(n):\n    "


def run_cli(*args, timeout=240, env=None):
    return subprocess.run(TPSERVE + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env)


class HttpDaemon:
    """A daemon on the bundled model with its HTTP front (``api_key`` None: /v1 is open);
    ``env``: more environment variables for it (options' ``TPSERVE_*`` spellings)."""

    def __init__(self, api_key: str | None = API_KEY, num_kv_blocks: int = 300, env: dict | None = None):
        self.rd = tempfile.mkdtemp(prefix="tph-", dir="/tmp")
        env = dict(os.environ, **(env or {}), TPSERVE_API_KEY=api_key or "")
        out = run_cli("start", "--runtime-dir", self.rd, "--num-kv-blocks", num_kv_blocks, "--block-size", 4,
                      "--http-port", 0, "--startup-timeout", 200, env=env)
        if out.returncode != 0:
            shutil.rmtree(self.rd, ignore_errors=True)
        assert out.returncode == 0, out.stderr + out.stdout
        self.address, self.url = out.stdout.split()
        assert read_ready(Path(self.rd))["http"] == self.url
        self.pid = int(Path(self.rd, "tpserve.pid").read_text())
        self.tree = [self.pid] + descendants(self.pid)
        self.stopped = False

    def zmq(self) -> Client:
        return Client(self.address, timeout=30)

    def stop(self):
        if not self.stopped:
            self.stopped = True
            out = run_cli("stop", "--runtime-dir", self.rd, "--timeout", 60)
            assert out.returncode == 0, out.stderr + out.stdout
        shutil.rmtree(self.rd, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(daemon, path, body, key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(daemon.url + path, content=data, headers={"Content-Type": "application/json", **headers},
                      timeout=120, **kw)


def idle(daemon, timeout=30.0) -> dict:
    """The daemon's status once nothing is in flight and every block is free."""
    deadline = time.monotonic() + timeout
    with daemon.zmq() as c:
        while True:
            s = c.status()
            if s["requests_in_flight"] == 0 and s["kv_blocks_used"] == 0:
                return s
            assert time.monotonic() < deadline, s
            time.sleep(0.05)


# ---- completions ---------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_completion_equals_offline_generate(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    with LLM(str(BUNDLED), num_kv_blocks=64, block_size=4) as llm:
        offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        prompt_len = len(llm.tokenizer.encode(PROMPT, add_special_tokens=False))
    choice = reply.choices[0]
    assert choice.text == offline.text
    assert choice.finish_reason == offline.finish_reason
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert reply.usage.total_tokens == prompt_len + len(offline.token_ids)


def test_streamed_completion_matches_whole_and_counts_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_prompt_lists(client):
    reply = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == 7 and reply.usage.completion_tokens == 6
    one = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == reply.choices[1].text


def test_seeded_sampling_is_reproducible(client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = run(1234), run(1234), run(99)
    assert a == b
    assert a != c


def test_stop_strings_cut_the_text(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = free.strip()[:3]
    assert stop, free
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[:free.index(stop)]


def test_logprobs_of_completions(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
    assert lp.text_offset[0] == 0


def test_n_siblings_share_the_prompt_blocks(daemon, client):
    prompt = "import collections\nimport itertools\nclass Graph:\n    def __init__(self):\n"
    before = idle(daemon)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0,
                                      seed=5, extra_body={"ignore_eos": True})
    after = idle(daemon)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1  # siblings get their own seeds
    prompt_len = reply.usage.prompt_tokens
    assert reply.usage.completion_tokens == 12
    full_blocks = (prompt_len - 1) // 4  # block size 4; a fully cached prompt recomputes its last token
    assert full_blocks >= 3
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits >= 2 * full_blocks * 4, (hits, prompt_len)


def test_unset_max_tokens_is_16_for_completions_and_the_rest_of_the_context_for_chat(client):
    """docs/protocol.md: each API's default for an unset max_tokens (tpserve/request.py)."""
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16 and done.choices[0].finish_reason == "length"
    context = client.models.retrieve(MODEL).model_extra["max_model_len"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f():"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == context


def test_n_is_the_engines_for_several_prompts_streamed_and_whole(daemon, client):
    """Each prompt is one request of n completions to the daemon; choice i * n + j is
    completion j of prompt i, streamed in the order the engine produces them."""
    prompts = ["x = 1\n", "def g(a):\n"]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text and whole.choices[2].text == whole.choices[3].text
    assert whole.usage.completion_tokens == 12
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finished = {}, []
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.index not in finished
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3] and texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    with daemon.zmq() as c:
        assert c.status()["requests_in_flight"] == 0


def _streamed_choices(client, chat: bool, seed: int) -> tuple[list[tuple[int, int, str | None]], object]:
    """A streamed n=2 request, sampled, each line of the completion its end: its chunks as
    (choice index, tokens it carries, finish_reason), and its usage."""
    kw = dict(model=MODEL, n=2, temperature=1.0, seed=seed, max_tokens=12, stop=["\n"], stream=True,
              stream_options={"include_usage": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "def f(x):"}],
                                                     logprobs=True, top_logprobs=0, **kw))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, logprobs=0, **kw))
    events = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        lp = choice.logprobs
        tokens = 0 if lp is None else len(lp.content or []) if chat else len(lp.tokens)
        events.append((choice.index, tokens, choice.finish_reason))
    return events, chunks[-1].usage


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_streamed_each_choice_ends_as_soon_as_its_completion_did(client, chat):
    """OpenAI and vLLM send a choice's finish_reason chunk when that choice ends: with n=2 and
    choices of different lengths, the shorter one's last chunk comes before the longer one's
    last tokens (not both once the request is done)."""
    for seed in range(16):
        events, usage = _streamed_choices(client, chat, seed)
        counts = [sum(t for i, t, _ in events if i == index) for index in (0, 1)]
        for index in (0, 1):
            mine = [e for e in events if e[0] == index]
            assert [e[2] is not None for e in mine] == [False] * (len(mine) - 1) + [True], mine
        assert usage.completion_tokens == sum(counts)
        # choice 1 starts a step after choice 0: these choices end at least two steps apart
        if counts[0] + 2 <= counts[1] or counts[1] + 3 <= counts[0]:
            break
    else:
        pytest.fail("no seed made the two choices end apart")
    early = 0 if counts[0] < counts[1] else 1
    at = next(k for k, e in enumerate(events) if e[0] == early and e[2] is not None)
    assert any(i == 1 - early and t for i, t, _ in events[at + 1:]), \
        f"choice {early} ended only after choice {1 - early}'s last tokens: {events}"


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client):
    # A first line no other test sends: nothing of the prompt is cached before the first request.
    prompt = ("# zq usage probe\ndef fibonacci(n):\n    if n < 2:\n        return n\n"
              "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    full_blocks = (first.usage.prompt_tokens - 1) // 4  # block size 4; the last token is recomputed
    assert full_blocks >= 3
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * 4
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == full_blocks * 4


# ---- chat ----------------------------------------------------------------------------------
def test_chat_completion_and_its_stream(client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that adds two numbers."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_template_of_the_bundled_model(daemon, client):
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    with LLM(str(BUNDLED), num_kv_blocks=16) as llm:
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == "# user:\nhello\n# assistant:\n"
        assert reply.usage.prompt_tokens == len(llm.tokenizer.encode(text, add_special_tokens=False))


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)


def test_async_client_streams_concurrently(daemon):
    async def go():
        aclient = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            async def one(i):
                stream = await aclient.completions.create(model=MODEL, prompt=f"x{i} = ", max_tokens=5,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])

            texts = await asyncio.gather(*(one(i) for i in range(3)))
            chat = await aclient.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                                         messages=[{"role": "user", "content": "hi"}])
            whole = await aclient.completions.create(model=MODEL, prompt="x0 = ", max_tokens=5, temperature=0)
            return texts, chat, whole
        finally:
            await aclient.close()

    texts, chat, whole = asyncio.run(go())
    assert texts[0] == whole.choices[0].text
    assert chat.choices[0].message.content is not None


# ---- auth and errors -----------------------------------------------------------------------
def test_api_key_is_required_on_v1_only(daemon):
    assert post(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 401
    wrong = post(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    bad_client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert httpx.get(daemon.url + "/health", timeout=30).status_code == 200
    assert post(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "seed": -3}, 400, "seed"),
    ({"prompt": "x", "stop": 7}, 400, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [2**40]}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x" * 10, "max_tokens": 5000}, 400, "max_tokens"),  # the prompt fits; max_tokens does not
    ({"prompt": list(range(1, 1100))}, 400, "prompt"),
])
def test_bad_completion_requests_get_openai_errors(daemon, body, status, param):
    reply = post(daemon, "/v1/completions", body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert post(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200  # still serving


def test_too_long_prompt_names_the_limit(daemon):
    error = post(daemon, "/v1/completions", {"prompt": list(range(1, 1100))}).json()["error"]
    assert "max_model_len" in error["message"] and error["code"] == "context_length_exceeded"


def test_a_prompt_longer_than_the_context_is_refused_by_the_front_alone(daemon):
    """Its ids never reach the daemon (no admission refusal counted there), text or ids, chat
    too; truncate_prompt_tokens lets it through to be cut."""
    def admissions():
        with daemon.zmq() as c:
            return c.status()["refused_admission"]
    before = admissions()
    for path, body in [("/v1/completions", {"prompt": list(range(1, 3000))}),
                       ("/v1/completions", {"prompt": "x = 1\n" * 2000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1\n" * 2000}]})]:
        reply = post(daemon, path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded" and "max_model_len=" in error["message"]
        assert error["param"] == ("messages" if "chat" in path else "prompt")
    assert admissions() == before
    cut = post(daemon, "/v1/completions", {"prompt": list(range(1, 3000)), "max_tokens": 2,
                                           "truncate_prompt_tokens": 100})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 100


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
])
def test_bad_chat_requests_get_openai_errors(daemon, body, param):
    reply = post(daemon, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_oversized_request_is_413(daemon):
    reply = post(daemon, "/v1/completions", b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=7.5e9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


# ---- disconnects, metrics, life cycle ------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_disconnecting_client_aborts_its_request(daemon, stream):
    idle(daemon)
    with daemon.zmq() as c:
        generated = c.status()["generation_tokens"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1000, "stream": stream, "ignore_eos": True}).encode()
    host, port = daemon.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            got = b""
            while got.count(b"data: ") < 3:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
        deadline = time.monotonic() + 30
        with daemon.zmq() as c:
            while c.status()["generation_tokens"] - generated < 3:  # it is running
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.status()["requests_in_flight"] == 1
    status = idle(daemon)  # the front noticed, aborted the request, and its blocks are free
    assert status["kv_blocks_used"] == 0
    assert status["generation_tokens"] - generated < 1000  # it was cut short, not run to the end


def test_metrics_parse_and_move(daemon, client):
    def scrape():
        text = httpx.get(daemon.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model_name") == MODEL and "le" not in s.labels:
                    out[s.name] = s.value
        return out

    before = scrape()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    idle(daemon)
    after = scrape()
    for name in ("tpserve:num_requests_running", "tpserve:num_requests_waiting", "tpserve:kv_cache_usage_perc"):
        assert name in after
    assert after["tpserve:generation_tokens_total"] - before["tpserve:generation_tokens_total"] == 6
    assert after["tpserve:prompt_tokens_total"] - before["tpserve:prompt_tokens_total"] == \
        reply.usage.prompt_tokens
    assert after["tpserve:prefix_cache_queries_total"] > before["tpserve:prefix_cache_queries_total"]
    assert "tpserve:prefix_cache_hits_total" in after and "tpserve:num_preemptions_total" in after
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"tpserve:{hist}_count"] == before[f"tpserve:{hist}_count"] + 1
    assert after["tpserve:inter_token_latency_seconds_count"] == \
        before["tpserve:inter_token_latency_seconds_count"] + 5
    # The same registry through ZMQ, for daemons without an HTTP port.
    out = run_cli("status", "--metrics", "--runtime-dir", daemon.rd)
    assert out.returncode == 0, out.stderr
    names = {f.name for f in text_string_to_metric_families(out.stdout)}
    assert {"tpserve:generation_tokens", "tpserve:time_to_first_token_seconds"} <= names


def test_non_loopback_host_needs_an_api_key(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--runtime-dir", str(tmp_path), "--http-port", "0",
                                  "--http-host", "0.0.0.0"], env={"TPSERVE_API_KEY": ""})
    assert result.exit_code == 2 and "API key" in result.output and "--http-host" in result.output
    from_env = runner.invoke(main, ["start", "--runtime-dir", str(tmp_path)],
                             env={"TPSERVE_HTTP_PORT": "0", "TPSERVE_HTTP_HOST": "10.1.2.3", "TPSERVE_API_KEY": ""})
    assert from_env.exit_code == 2 and "API key" in from_env.output
    bad_port = runner.invoke(main, ["serve", "--runtime-dir", str(tmp_path), "--http-port", "70000"])
    assert bad_port.exit_code == 2 and "--http-port" in bad_port.output
    help_text = runner.invoke(main, ["start", "--help"], terminal_width=200).output
    for opt in ("--http-port", "--http-host", "--api-key", "TPSERVE_HTTP_PORT", "TPSERVE_API_KEY"):
        assert opt in help_text


def test_max_completion_tokens_top_k_user_and_unknown_fields(daemon):
    body = {"prompt": PROMPT, "max_completion_tokens": 3, "temperature": 0.8, "top_k": 1, "seed": 3,
            "user": "someone", "frequency_penalty_v9": 1, "ignore_eos": True}
    reply = post(daemon, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    greedy = post(daemon, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert reply.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # top_k 1 is greedy
    assert post(daemon, "/v1/completions", {**body, "user": 5}).json()["error"]["param"] == "user"


def test_stopping_the_daemon_stops_the_front(daemon):
    fronts = [p for p in daemon.tree if "tpserve.fronts.http.front" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(fronts) == 1
    daemon.stop()
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in daemon.tree):
        assert time.monotonic() < deadline, [p for p in daemon.tree if pid_alive(p)]
        time.sleep(0.1)


def test_front_dies_with_a_killed_daemon(tmp_path):
    """A daemon killed with SIGKILL cannot stop its front: the kernel does (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
        front = HttpFrontProcess(HttpOptions(0), "ipc://{tmp_path}/none.sock", {str(BUNDLED)!r}, "m", 64)
        print(front.start(), front.proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        url, pid = parent.stdout.readline().split()
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "m"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while pid_alive(int(pid)):
        assert time.monotonic() < deadline, "the front outlived its daemon"
        time.sleep(0.1)


def _fake_front(code: str) -> "HttpFrontProcess":
    """An HttpFrontProcess whose child is ``code`` (it gets ``--ready-fd N`` as its arguments)."""
    from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
    front = HttpFrontProcess(HttpOptions(0), "ipc:///nonexistent", str(BUNDLED), "m", 64)
    front.argv = [sys.executable, "-c", code]
    return front


def test_front_that_dies_is_reported_in_the_log(caplog):
    front = _fake_front("import os, sys, time; os.write(int(sys.argv[-1]), b'4321\\n'); time.sleep(0.3)")
    with caplog.at_level("ERROR", logger="tpserve.http"):
        assert front.start(timeout=30) == "http://127.0.0.1:4321"
        proc = front.proc
        proc.wait(30)
        deadline = time.monotonic() + 10
        while "exited with status 0" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    front.stop()


def test_front_that_cannot_listen_fails_the_start():
    from tpserve.fronts.process import FrontError
    front = _fake_front("import sys; sys.exit(3)")
    with pytest.raises(FrontError, match="status 3"):
        front.start(timeout=30)
    front.stop()


def test_busy_port_fails_the_start():
    from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
    from tpserve.fronts.process import FrontError
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        front = HttpFrontProcess(HttpOptions(busy.getsockname()[1]), "ipc:///nonexistent", str(BUNDLED), "m", 64)
        with pytest.raises(FrontError, match="before listening"):
            front.start(timeout=60)
        front.stop()
