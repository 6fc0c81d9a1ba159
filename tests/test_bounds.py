"""Every documented bound holds end to end: a value at the limit is served, one past it is a
refusal naming the field, over the wire (raw frames and the Client), HTTP and the offline API.

docs/protocol.md and tpserve/limits.py document the bounds; the wire decoder has limits of its
own (map entries, nesting, string and array lengths). No layer below may be stricter than the
documented bound: a logit_bias of 65 to 1,024 entries (the documented maximum) was refused by
the decoder as a ``bad_message`` without an id, which the HTTP front could not match to its
request and waited on forever. Also here: an error the daemon cannot attribute to a request
still reaches the client that sent it (the id salvaged from an undecodable frame; a client
ending its unanswered requests when an error without an id comes).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from test_daemon import FakeEngine, Raw, ServerThread
from test_http import HttpDaemon
from tpserve import limits as R
from tpserve.client import protocol as P
from tpserve.client.client import AsyncClient, Client, RequestError
from tpserve.errors import InvalidFieldError
from tpserve.sampling import SamplingParams

VOCAB = 1 << 17  # the fake engine's: every documented token-id list fits it

# (name, sampling field, value at the limit, value one past it, the field an error names).
# The values are what a wire client sends in ``params`` (logit_bias keys as strings).
SAMPLING_BOUNDS = [
    ("logit_bias entries", "logit_bias", {str(i): 1.0 for i in range(R.MAX_LOGIT_BIAS)},
     {str(i): 1.0 for i in range(R.MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ("logit_bias value", "logit_bias", {"5": R.MAX_ABS_LOGIT_BIAS}, {"5": R.MAX_ABS_LOGIT_BIAS + 1},
     "logit_bias"),
    ("stop strings", "stop", ["s%d" % i for i in range(R.MAX_STOP_STRINGS)],
     ["s%d" % i for i in range(R.MAX_STOP_STRINGS + 1)], "stop"),
    ("stop chars", "stop", ["x" * R.MAX_STOP_CHARS], ["x" * (R.MAX_STOP_CHARS + 1)], "stop"),
    ("stop_token_ids", "stop_token_ids", list(range(R.MAX_STOP_TOKEN_IDS)),
     list(range(R.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ("allowed_token_ids", "allowed_token_ids", list(range(R.MAX_ALLOWED_TOKEN_IDS)),
     list(range(R.MAX_ALLOWED_TOKEN_IDS + 1)), "allowed_token_ids"),
    ("bad_words", "bad_words", ["w%d" % i for i in range(R.MAX_BAD_WORDS)],
     ["w%d" % i for i in range(R.MAX_BAD_WORDS + 1)], "bad_words"),
    ("bad word chars", "bad_words", ["w" * R.MAX_BAD_WORD_CHARS], ["w" * (R.MAX_BAD_WORD_CHARS + 1)],
     "bad_words"),
    ("n", "n", R.MAX_N, R.MAX_N + 1, "n"),
    ("logprobs", "logprobs", R.MAX_LOGPROBS, R.MAX_LOGPROBS + 1, "logprobs"),
    ("prompt_logprobs", "prompt_logprobs", R.MAX_LOGPROBS, R.MAX_LOGPROBS + 1, "prompt_logprobs"),
    ("max_tokens", "max_tokens", 4, R.MAX_MAX_TOKENS + 1, "max_tokens"),
    ("top_k", "top_k", R.MAX_TOP_K, R.MAX_TOP_K + 1, "top_k"),
    ("seed", "seed", R.MAX_SEED, R.MAX_SEED + 1, "seed"),
    ("temperature", "temperature", R.MAX_TEMPERATURE, R.MAX_TEMPERATURE + 1, "temperature"),
    ("repetition_penalty", "repetition_penalty", R.MAX_REPETITION_PENALTY, R.MAX_REPETITION_PENALTY + 1,
     "repetition_penalty"),
    ("presence_penalty", "presence_penalty", -R.MAX_ABS_PENALTY, -R.MAX_ABS_PENALTY - 1, "presence_penalty"),
    ("truncate_prompt_tokens", "truncate_prompt_tokens", R.MAX_PROMPT_TOKENS, R.MAX_PROMPT_TOKENS + 1,
     "truncate_prompt_tokens"),
    ("choice entries", "structured_outputs", {"choice": ["c%d" % i for i in range(R.MAX_CHOICES)]},
     {"choice": ["c%d" % i for i in range(R.MAX_CHOICES + 1)]}, "structured_outputs.choice"),
    ("choice chars", "structured_outputs", {"choice": ["c" * R.MAX_CHOICE_CHARS]},
     {"choice": ["c" * (R.MAX_CHOICE_CHARS + 1)]}, "structured_outputs.choice"),
    ("regex chars", "structured_outputs", {"regex": "a" * R.MAX_GRAMMAR_CHARS},
     {"regex": "a" * (R.MAX_GRAMMAR_CHARS + 1)}, "structured_outputs.regex"),
    ("json text chars", "structured_outputs", {"json": "{" + " " * (R.MAX_GRAMMAR_CHARS - 2) + "}"},
     {"json": "{" + " " * (R.MAX_GRAMMAR_CHARS - 1) + "}"}, "structured_outputs.json"),
    # a schema sent as a map: its maps are wire maps (docs/protocol.md, Transport)
    ("json map entries", "structured_outputs",
     {"json": {"type": "object",
               "properties": {"p%d" % i: {"type": "integer"} for i in range(R.MAX_LOGIT_BIAS)}}},
     {"json": "{" + " " * (R.MAX_GRAMMAR_CHARS - 1) + "}"}, "structured_outputs.json"),
]
IDS = [row[0] for row in SAMPLING_BOUNDS]
# Rows whose at-limit value the fake engine runs (it makes one completion: n is served over HTTP).
SERVED = {"logit_bias entries", "logit_bias value", "stop strings", "stop chars", "stop_token_ids",
          "allowed_token_ids", "bad_words", "bad word chars", "logprobs", "max_tokens", "top_k", "seed",
          "temperature", "repetition_penalty", "presence_penalty", "truncate_prompt_tokens"}


def frame(params: dict | None = None, rid: str = "b", **fields) -> bytes:
    msg = {"v": 1, "type": "generate", "id": rid, "prompt": [1, 2, 3], **fields}
    if params is not None:
        msg["params"] = params
    return msgpack.packb(msg, use_bin_type=True)


def offline_params(field: str, value) -> SamplingParams:
    """SamplingParams as the offline API takes them (logit_bias keys as ints)."""
    if field == "logit_bias":
        value = {int(k): v for k, v in value.items()}
    return SamplingParams(**{field: value})


# ---- the wire decoder and the offline API, every row ---------------------------------------
@pytest.mark.parametrize("name,field,at,past,named", SAMPLING_BOUNDS, ids=IDS)
def test_the_decoder_takes_every_value_at_its_bound_and_names_the_field_past_it(name, field, at, past, named):
    msg = P.decode(frame({field: at}))
    assert isinstance(msg, P.GenerateRequest) and msg.id == "b"
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame({field: past}))
    assert e.value.code == P.INVALID_FIELD and e.value.field.startswith(f"params.{named}"), e.value
    assert P.readable_id(P.unpack_frame(frame({field: past}))) == "b"


@pytest.mark.parametrize("name,field,at,past,named", SAMPLING_BOUNDS, ids=IDS)
def test_the_offline_api_takes_every_value_at_its_bound_and_names_the_field_past_it(name, field, at, past,
                                                                                    named):
    offline_params(field, at)
    with pytest.raises(InvalidFieldError) as e:
        offline_params(field, past)
    assert e.value.field.startswith(named), e.value


@pytest.mark.parametrize("name,fields,past,named", [
    ("id", {"id": "i" * R.MAX_ID_CHARS}, {"id": "i" * (R.MAX_ID_CHARS + 1)}, "id"),
    ("prompt chars", {"prompt": "p" * R.MAX_PROMPT_CHARS}, {"prompt": "p" * (R.MAX_PROMPT_CHARS + 1)},
     "prompt"),
    ("prompt ids", {"prompt": [1] * R.MAX_PROMPT_TOKENS}, {"prompt": [1] * (R.MAX_PROMPT_TOKENS + 1)},
     "prompt"),
    ("priority", {"priority": R.MIN_PRIORITY}, {"priority": R.MIN_PRIORITY - 1}, "priority"),
    ("timeout", {"timeout": R.MAX_TIMEOUT}, {"timeout": R.MAX_TIMEOUT * 2}, "timeout"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_the_request_fields_at_their_bounds(name, fields, past, named):
    assert isinstance(P.decode(frame(**fields)), P.GenerateRequest)
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame(**past))
    assert e.value.code == P.INVALID_FIELD and e.value.field.startswith(named)


def test_maps_and_nesting_at_the_decoders_own_limits():
    """The decoder's limits are documented and above every documented bound: a map of
    MAX_MAP_ENTRIES entries and MAX_NESTING levels decode; one more is a bad_message whose
    id is still salvaged."""
    assert P.MAX_MAP_ENTRIES >= R.MAX_LOGIT_BIAS
    wide = {"type": "object", "properties": {"p%d" % i: {} for i in range(P.MAX_MAP_ENTRIES)}}
    assert isinstance(P.unpack_frame(frame({"structured_outputs": {"json": wide}})), dict)
    wide["properties"]["one more"] = {}
    raw = frame({"structured_outputs": {"json": wide}})
    with pytest.raises(P.ProtocolError) as e:
        P.unpack_frame(raw)
    assert e.value.code == P.BAD_MESSAGE and P.salvage_id(raw) == "b"

    def nested(levels: int) -> bytes:  # the message map holds "deep": levels - 1 more maps
        return frame(deep=msgpack.unpackb(b"\x81\xa1a" * (levels - 2) + b"\x80"))
    assert isinstance(P.unpack_frame(nested(P.MAX_NESTING)), dict)
    with pytest.raises(P.ProtocolError) as e:
        P.unpack_frame(nested(P.MAX_NESTING + 1))
    assert e.value.code == P.BAD_MESSAGE and "nest" in e.value.message
    assert P.salvage_id(nested(P.MAX_NESTING + 1)) == "b"


@pytest.mark.parametrize("raw,rid", [
    (frame({"logit_bias": {str(i): 1.0 for i in range(P.MAX_MAP_ENTRIES + 1)}}), "b"),  # over the map cap
    (frame({"top_k": 1}, rid="cut")[:-3], "cut"),                            # cut short after the id
    (b"\x84\xa1v\x01\xa4type\xa4ping\xa2id\xa1a\xa6params\x82\xa1k\x01\xa1k\x02", "a"),  # a key twice, inside
    (b"\x84\xa1v\x01\xa4type\xa4ping\xa2id\xa1a\xa2id\xa1b", None),                   # two ids: which?
    (b"\x83\xa1v\x01\xa4type\xa4ping\xa2id\x05", None),                                # not an id
    (b"\xc1", None),
    (b"", None),
    (msgpack.packb([1, 2]), None),
])
def test_salvage_id_reads_the_id_of_a_frame_that_does_not_decode(raw, rid):
    assert P.salvage_id(raw) == rid


# ---- over ZMQ: a daemon (fake engine) and the Client -----------------------------------------
@pytest.fixture(scope="module")
def zmq_daemon():
    s = ServerThread(FakeEngine(vocab=VOCAB))
    yield s
    if s.thread.is_alive():
        assert s.stop() == 0
    s.cleanup()


@pytest.mark.parametrize("name,field,at,past,named", [r for r in SAMPLING_BOUNDS if r[0] in SERVED],
                         ids=[r[0] for r in SAMPLING_BOUNDS if r[0] in SERVED])
def test_over_zmq_a_value_at_its_bound_is_served_and_one_past_is_invalid_field(zmq_daemon, name, field, at,
                                                                                past, named):
    with Client(zmq_daemon.address, timeout=30) as c:
        result = c.generate([1, 2, 3], _with_small_output(offline_params(field, at)))
        assert result.finish_reason in ("length", "stop")
        with pytest.raises(InvalidFieldError) as e:  # the Client checks before it sends
            c.generate([1, 2, 3], offline_params(field, past))
        assert e.value.field.startswith(named)
    r = Raw(zmq_daemon.address)  # a client that does not check: the daemon answers it by id
    try:
        r.sock.send(frame({field: past}, rid="past"))
        e = r.recv(timeout=30)
        assert (e.code, e.id) == (P.INVALID_FIELD, "past") and e.field.startswith(f"params.{named}"), e
    finally:
        r.close()


def _with_small_output(params: SamplingParams) -> SamplingParams:
    """A few tokens at most, whatever the row's field is."""
    if params.max_tokens is None or params.max_tokens > 4:
        params.max_tokens = 4
    if params.min_tokens > params.max_tokens:
        params.min_tokens = 0
    return params


def test_an_undecodable_frame_is_answered_with_its_salvaged_id(zmq_daemon):
    r = Raw(zmq_daemon.address)
    try:
        r.sock.send(frame({"logit_bias": {str(i): 1.0 for i in range(P.MAX_MAP_ENTRIES + 1)}}, rid="wide"))
        e = r.recv(timeout=30)
        assert (e.code, e.id) == (P.BAD_MESSAGE, "wide"), e
        r.sock.send(frame({"top_k": 1}, rid="cut")[:-3])
        e = r.recv(timeout=30)
        assert (e.code, e.id) == (P.BAD_MESSAGE, "cut"), e
    finally:
        r.close()


# ---- an error without an id: the client ends the requests it may answer ----------------------
class IdlessDaemon:
    """A ROUTER that answers every request with one ``error`` that carries no id."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tpb-", dir="/tmp")
        self.address = f"ipc://{self.dir}/s.sock"
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopping.is_set():
            if self.sock.poll(50):
                identity, _ = self.sock.recv_multipart()
                self.sock.send_multipart([identity, P.encode(P.ErrorReply(P.BAD_MESSAGE, "unreadable"))])

    def stop(self):
        self.stopping.set()
        self.thread.join(10)
        self.sock.close(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def idless():
    d = IdlessDaemon()
    yield d
    d.stop()


def test_a_client_ends_its_unanswered_request_on_an_error_without_an_id(idless):
    with Client(idless.address, timeout=20) as c:
        with pytest.raises(RequestError) as e:
            c.generate([1, 2], max_tokens=2)
        assert e.value.code == P.BAD_MESSAGE and e.value.request_id is not None
        with pytest.raises(RequestError):
            list(c.stream([1, 2], max_tokens=2))


def test_an_async_client_ends_its_unanswered_requests_on_an_error_without_an_id(idless):
    async def go():
        c = AsyncClient(idless.address, timeout=20)
        try:
            got = await asyncio.gather(c.generate([1, 2], max_tokens=2), c.ping(), return_exceptions=True)
        finally:
            await c.close()
        return got

    started = time.monotonic()
    got = asyncio.run(go())
    assert all(isinstance(g, RequestError) and g.code == P.BAD_MESSAGE for g in got), got
    assert time.monotonic() - started < 15  # answered, not the client's 20 s timeout


# ---- over HTTP: the daemon on the bundled model and its front ------------------------------
@pytest.fixture(scope="module")
def http_daemon():
    daemon = HttpDaemon(api_key=None, num_kv_blocks=600)
    yield daemon.address, daemon.url
    daemon.stop()


def _vocab() -> int:
    config = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model" / "config.json"
    return json.loads(config.read_text())["vocab_size"]


# (name, body fields at the limit, body fields one past, the param the 400 names)
HTTP_BOUNDS = [
    ("logit_bias entries", {"logit_bias": {str(i): 1.0 for i in range(R.MAX_LOGIT_BIAS)}},
     {"logit_bias": {str(i): 1.0 for i in range(R.MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ("logit_bias 100 entries", {"logit_bias": {str(i): 1.0 for i in range(100)}},
     {"logit_bias": {"100": R.MAX_ABS_LOGIT_BIAS + 1}}, "logit_bias"),
    ("stop strings", {"stop": ["s%d" % i for i in range(R.MAX_STOP_STRINGS)]},
     {"stop": ["s%d" % i for i in range(R.MAX_STOP_STRINGS + 1)]}, "stop"),
    ("allowed_token_ids", {"allowed_token_ids": [i % _vocab() for i in range(R.MAX_ALLOWED_TOKEN_IDS)]},
     {"allowed_token_ids": [0] * (R.MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids"),
    ("n", {"n": R.MAX_N}, {"n": R.MAX_N + 1}, "n"),
    ("logprobs", {"logprobs": R.MAX_LOGPROBS}, {"logprobs": R.MAX_LOGPROBS + 1}, "logprobs"),
    ("seed", {"seed": R.MAX_SEED}, {"seed": R.MAX_SEED + 1}, "seed"),
    ("max_tokens", {"max_tokens": 4}, {"max_tokens": R.MAX_MAX_TOKENS + 1}, "max_tokens"),
    ("choice entries", {"structured_outputs": {"choice": ["c%d" % i for i in range(R.MAX_CHOICES)]}},
     {"structured_outputs": {"choice": ["c%d" % i for i in range(R.MAX_CHOICES + 1)]}}, "structured_outputs"),
]


@pytest.mark.parametrize("name,at,past,param", HTTP_BOUNDS, ids=[r[0] for r in HTTP_BOUNDS])
@pytest.mark.parametrize("stream", [False, True])
def test_over_http_a_value_at_its_bound_is_served_and_one_past_is_a_400_naming_it(http_daemon, name, at, past,
                                                                                  param, stream):
    url = http_daemon[1] + "/v1/completions"
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "stream": stream, **at}
    r = httpx.post(url, json=body, timeout=60)  # the front used to wait forever: the 60 s would end it
    assert r.status_code == 200, r.text
    assert ('"finish_reason":"' in r.text) if stream else r.json()["choices"][0]["finish_reason"], r.text
    r = httpx.post(url, json={**body, **past}, timeout=60)
    assert r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(param), r.text


def test_over_zmq_the_daemon_serves_a_logit_bias_at_its_bound(http_daemon):
    bias = {i: 1.0 for i in range(R.MAX_LOGIT_BIAS)}
    with Client(http_daemon[0], timeout=60) as c:
        assert c.generate("def f(x):", max_tokens=4, logit_bias=bias).completion_tokens == 4

    async def go():
        c = AsyncClient(http_daemon[0], timeout=60)
        try:
            return await c.generate("def f(x):", max_tokens=4, logit_bias=bias)
        finally:
            await c.close()
    assert asyncio.run(go()).completion_tokens == 4
