"""max_tokens over the rest of the context: refused by OpenAI's completions and chat (vLLM's
behaviour), clamped for an API that declares ``clamp_max_tokens`` (tpserve/request.py), as agent
clients send fixed large limits; the HTTP front fits each prompt's params before sending them."""
from __future__ import annotations

import asyncio

import pytest

from tpserve.client.client import GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.app import Front
from tpserve.request import Api, clamp_max_tokens, make_request
from tpserve.sampling import SamplingParams

AGENT = Api("test.agent", None, min_max_tokens=1, clamp_max_tokens=True)


def test_only_an_api_that_declares_it_clamps():
    assert not O.CHAT.clamp_max_tokens and not O.COMPLETIONS.clamp_max_tokens
    chat = make_request(O.CHAT, {"max_tokens": 32000})
    assert chat.fit_to_context(4096, 1000) is chat.params  # admission refuses it, as vLLM does
    agent = make_request(AGENT, {"max_tokens": 32000})
    assert agent.fit_to_context(4096, 1000).max_tokens == 3096
    assert agent.params.max_tokens == 32000  # the request's own params are left as asked


def test_a_limit_that_fits_is_kept_and_an_unset_one_is_the_rest_of_the_context():
    p = SamplingParams(max_tokens=100)
    assert clamp_max_tokens(AGENT, p, 4096, 1000) is p
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=3096), 4096, 1000).max_tokens == 3096
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=3097), 4096, 1000).max_tokens == 3096
    # None: resolved against the context the front serves (which may be below max_model_len)
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=None), 4096, 1000).max_tokens == 3096
    assert clamp_max_tokens(O.CHAT, SamplingParams(max_tokens=None), 4096, 1000).max_tokens is None


def test_clamping_lowers_min_tokens_and_counts_a_truncated_prompt():
    p = SamplingParams(max_tokens=5000, min_tokens=4000, truncate_prompt_tokens=500)
    got = clamp_max_tokens(AGENT, p, 4096, 3000)  # the engine keeps the prompt's last 500 tokens
    assert (got.max_tokens, got.min_tokens) == (3596, 3596)
    assert got.truncate_prompt_tokens == 500 and p.max_tokens == 5000


def test_a_prompt_that_fills_the_context_keeps_one_token_for_admission_to_refuse():
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=50), 64, 64).max_tokens == 1
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=50), 64, 90).max_tokens == 1
    # scoring the prompt alone (max_tokens 0) is not a limit to clamp
    assert clamp_max_tokens(AGENT, SamplingParams(max_tokens=0), 64, 10).max_tokens == 0


class _Recorder:
    """A daemon client that records the params each generate is sent with."""

    def __init__(self):
        self.sent = []

    async def generate(self, prompt, params, **kw):
        self.sent.append((len(prompt), params.max_tokens))
        return GenerateResult("r", "", [], "length", len(prompt), 0)


@pytest.mark.parametrize("api,expected", [(AGENT, [(10, 22), (30, 2)]), (O.CHAT, [(10, 500), (30, 500)])])
def test_the_http_front_fits_each_prompt_before_sending_it(api, expected):
    front = Front("tcp://127.0.0.1:1", "unused", "m", 32, tokenizer=object())
    recorder = front._client = _Recorder()
    request = make_request(api, {"max_tokens": 500})

    async def drain():
        return [item async for item in front.choices([[1] * 10, [1] * 30], request, whole=True)]
    got = asyncio.run(drain())
    assert len(got) == 2 and sorted(recorder.sent) == expected
