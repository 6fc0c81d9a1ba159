"""Wire protocol: a round trip per message type, and a typed error for every bad field."""
from __future__ import annotations

import array

import msgpack
import pytest

from tpserve.client import protocol as P
from tpserve.sampling import SamplingParams


def raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def base(type_, **fields):
    return {"v": 1, "type": type_, **fields}


ROUND_TRIP = [
    ("request", P.GenerateRequest("r1", "Hello", SamplingParams(temperature=0.0, max_tokens=5), stream=True)),
    ("request", P.GenerateRequest("r2", [1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, top_k=40,
                                                                   seed=2**62, max_tokens=3, stop=["\n", "x"],
                                                                   stop_token_ids=[7], ignore_eos=True),
                                  stream=False)),
    ("request", P.AbortRequest("r1")),
    ("request", P.StatusRequest()),
    ("request", P.StatusRequest(id="s")),
    ("request", P.PingRequest()),
    ("request", P.PingRequest(id="p" * 128)),
    ("request", P.ProfileRequest(2.5, id="prof")),
    ("reply", P.ProfileReply(["/run/tpserve/tpserve-profile-1-1.rank0.json"], id="prof")),
    ("request", P.MetricsRequest()),
    ("request", P.MetricsRequest(id="m")),
    ("request", P.GenerateRequest("r3", "Hi", SamplingParams(logprobs=2))),
    ("reply", P.DeltaReply("r1", "wörld", [5, 6])),
    ("reply", P.DeltaReply("r1", "", [])),
    ("reply", P.DeltaReply("r1", "ab", [5, 6], logprobs=[[-0.5, [[5, -0.5], [9, -1.5]]], [-2.0, []]])),
    ("reply", P.DoneReply("r1", "length", 3, 5)),
    ("request", P.GenerateRequest("r4", "Hi", SamplingParams(
        n=3, seed=1, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1,
        min_tokens=2, logit_bias={5: -100.0, 7: 2.5}, allowed_token_ids=[5, 7, 9], bad_words=["x y"],
        prompt_logprobs=1, include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False, truncate_prompt_tokens=10, max_tokens=4))),
    ("reply", P.DeltaReply("r1", "a", [5], index=2, prompt_logprobs=[None, [-1.5, [[3, -0.5]]]])),
    ("reply", P.DeltaReply("r1", "", [], index=1, finish_reason="length", completion_tokens=4, prompt_tokens=3,
                           cached_tokens=0)),
    ("reply", P.DoneReply("r1", "length", 3, 4, text="ab", token_ids=[1, 2], prompt_logprobs=[None],
                          completions=[{"index": 0, "finish_reason": "length", "completion_tokens": 2,
                                        "text": "ab", "token_ids": [1, 2]},
                                       {"index": 1, "finish_reason": "error", "completion_tokens": 2,
                                        "text": "cd", "token_ids": [3, 4], "logprobs": [[-1.0, []], [-2.0, []]]}])),
    ("reply", P.DoneReply("r1", "stop", 3, 2, text="ab", token_ids=[1, 2])),
    ("reply", P.DoneReply("r1", "abort", 3, 0, text="", token_ids=[], abort_reason="shutting_down")),
    ("reply", P.ErrorReply(P.BAD_MESSAGE, "not msgpack")),
    ("reply", P.ErrorReply(P.ADMISSION, "too long", id="r1", field="prompt", limit="max_model_len",
                           requested=600, allowed=512)),
    ("reply", P.StatusReply({"pid": 1, "model": "m", "rate": 0.5, "ok": True, "none": None}, id="s")),
    ("reply", P.PongReply()),
    ("reply", P.PongReply(id="x")),
    ("reply", P.DoneReply("r1", "stop", 3, 1, text="a", token_ids=[1], logprobs=[[-0.25, [[1, -0.25]]]])),
    ("reply", P.DoneReply("r1", "stop", 20, 1, cached_tokens=16)),
    ("reply", P.MetricsReply("# HELP x y\nx 1.0\n", id="m")),
    ("request", P.TokenizeRequest("t", "wörld")),
    ("request", P.TokenizeRequest("t", "x", add_special_tokens=True)),
    ("reply", P.TokensReply("t", array.array("i", [1, 2, 3, 2**31 - 1]))),
    ("request", P.PoolRequest("p", [[1, 2], [3]], "embed", dimensions=8, normalize=False, priority=1,
                              timeout=2.0)),
    ("request", P.PoolRequest("p", [[5]], "classify")),
    ("reply", P.PooledReply("p", array.array("f", [0.5, -1.25, 3.0, 0.0]), 2, [2, 1])),
]


@pytest.mark.parametrize("direction,msg", ROUND_TRIP, ids=lambda x: getattr(x, "TYPE", x))
def test_round_trip(direction, msg):
    frame = P.encode(msg)
    obj = msgpack.unpackb(frame, raw=False)
    assert obj["v"] == P.PROTOCOL_VERSION and obj["type"] == msg.TYPE
    back = P.decode(frame, direction)
    assert type(back) is type(msg)
    assert back == msg


def test_every_type_has_a_round_trip_case():
    covered = {(d, type(m)) for d, m in ROUND_TRIP}
    assert {("request", c) for c in P.REQUESTS.values()} | {("reply", c) for c in P.REPLIES.values()} <= covered


def test_optional_fields_are_left_out_and_defaulted():
    obj = msgpack.unpackb(P.encode(P.DoneReply("a", "stop", 1, 2)), raw=False)
    assert set(obj) == {"v", "type", "id", "finish_reason", "prompt_tokens", "completion_tokens"}
    msg = P.decode(raw(base("generate", id="a", prompt="hi")))
    assert msg.stream is True and msg.params == SamplingParams()
    sp = msgpack.unpackb(P.encode(P.GenerateRequest("a", "x", SamplingParams())), raw=False)["params"]
    assert "seed" not in sp  # None seeds are omitted, not sent as nil


def test_status_type_string_names_request_and_reply():
    assert isinstance(P.decode(raw(base("status")), "request"), P.StatusRequest)
    assert isinstance(P.decode(raw(base("status", stats={})), "reply"), P.StatusReply)
    with pytest.raises(P.ProtocolError) as e:
        P.decode(raw(base("delta", id="a", text="", token_ids=[])), "request")
    assert e.value.code == P.UNKNOWN_TYPE


# ---- frame-level faults --------------------------------------------------------------------
@pytest.mark.parametrize("frame,code,field", [
    (b"", P.BAD_MESSAGE, None),
    (b"\xc1", P.BAD_MESSAGE, None),                       # never-used msgpack byte
    (b"\x92\x01", P.BAD_MESSAGE, None),                   # truncated array
    (raw([1, 2]), P.BAD_MESSAGE, None),                   # not a map
    (raw("generate"), P.BAD_MESSAGE, None),
    (raw({"v": 1, "type": "ping"}) + b"\x00", P.BAD_MESSAGE, None),  # trailing bytes
    (raw({1: 2}), P.BAD_MESSAGE, None),                   # non-string keys
    (b"\xd4\x01\x00", P.BAD_MESSAGE, None),               # ext type
    (b"\xff\xfe", P.BAD_MESSAGE, None),
    (raw({"type": "ping"}), P.MISSING_FIELD, "v"),
    (raw({"v": 2, "type": "ping"}), P.UNSUPPORTED_VERSION, "v"),
    (raw({"v": "1", "type": "ping"}), P.UNSUPPORTED_VERSION, "v"),
    (raw({"v": True, "type": "ping"}), P.UNSUPPORTED_VERSION, "v"),
    (raw({"v": 1}), P.MISSING_FIELD, "type"),
    (raw({"v": 1, "type": "shutdown"}), P.UNKNOWN_TYPE, "type"),
    (raw({"v": 1, "type": 5}), P.UNKNOWN_TYPE, "type"),
    (raw({"v": 1, "type": "ping", "extra": 1}), P.UNKNOWN_FIELD, "extra"),
    (raw({"v": 1, "type": "ping", b"bin": 1}), P.BAD_MESSAGE, None),  # maps have string keys
    (raw({"v": 1, "type": "ping", 5: 1}), P.BAD_MESSAGE, None),
])
def test_bad_frames(frame, code, field):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame, "request")
    assert e.value.code == code
    assert e.value.field == field
    assert e.value.message


def test_deeply_nested_frame_is_rejected_not_crashing():
    frame = b"\x91" * 100_000 + b"\x00"
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert e.value.code == P.BAD_MESSAGE


def test_frame_over_the_size_limit():
    with pytest.raises(P.ProtocolError) as e:
        P.unpack_frame(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))
    assert e.value.code == P.BAD_MESSAGE and "exceeds" in e.value.message


# ---- field validation ----------------------------------------------------------------------
GOOD_GENERATE = dict(id="r", prompt="hi", params={"max_tokens": 2}, stream=True)


@pytest.mark.parametrize("override,code,field", [
    (dict(id=""), P.INVALID_FIELD, "id"),
    (dict(id="x" * 129), P.INVALID_FIELD, "id"),
    (dict(id=5), P.INVALID_FIELD, "id"),
    (dict(id=None), P.INVALID_FIELD, "id"),
    (dict(prompt=""), P.INVALID_FIELD, "prompt"),
    (dict(prompt=[]), P.INVALID_FIELD, "prompt"),
    (dict(prompt="x" * (P.MAX_PROMPT_CHARS + 1)), P.INVALID_FIELD, "prompt"),
    (dict(prompt=[1, -1]), P.INVALID_FIELD, "prompt[1]"),
    (dict(prompt=[1, 2**31]), P.INVALID_FIELD, "prompt[1]"),
    (dict(prompt=[1, "a"]), P.INVALID_FIELD, "prompt[1]"),
    (dict(prompt=[1, True]), P.INVALID_FIELD, "prompt[1]"),
    (dict(prompt=[1.5]), P.INVALID_FIELD, "prompt[0]"),
    (dict(prompt={"a": 1}), P.INVALID_FIELD, "prompt"),
    (dict(prompt=7), P.INVALID_FIELD, "prompt"),
    (dict(stream=1), P.INVALID_FIELD, "stream"),
    (dict(stream="yes"), P.INVALID_FIELD, "stream"),
    (dict(params=[1]), P.INVALID_FIELD, "params"),
    (dict(params={"temperatur": 1.0}), P.UNKNOWN_FIELD, "params.temperatur"),
    (dict(params={"temperature": -1}), P.INVALID_FIELD, "params.temperature"),
    (dict(params={"temperature": "hot"}), P.INVALID_FIELD, "params.temperature"),
    (dict(params={"temperature": float("nan")}), P.INVALID_FIELD, "params.temperature"),
    (dict(params={"top_p": 0.0}), P.INVALID_FIELD, "params.top_p"),
    (dict(params={"top_p": 1.5}), P.INVALID_FIELD, "params.top_p"),
    (dict(params={"top_k": -2}), P.INVALID_FIELD, "params.top_k"),
    (dict(params={"top_k": 1.5}), P.INVALID_FIELD, "params.top_k"),
    (dict(params={"seed": -1}), P.INVALID_FIELD, "params.seed"),
    (dict(params={"seed": 2**63}), P.INVALID_FIELD, "params.seed"),
    (dict(params={"max_tokens": -1}), P.INVALID_FIELD, "params.max_tokens"),
    (dict(params={"max_tokens": "5"}), P.INVALID_FIELD, "params.max_tokens"),
    (dict(params={"stop_token_ids": [-1]}), P.INVALID_FIELD, "params.stop_token_ids[0]"),
    (dict(params={"stop_token_ids": [5, 2**31]}), P.INVALID_FIELD, "params.stop_token_ids[1]"),
    (dict(params={"top_k": 2**31}), P.INVALID_FIELD, "params.top_k"),
    (dict(params={"top_k": 2**64 - 1}), P.INVALID_FIELD, "params.top_k"),
    (dict(params={"max_tokens": 2**31}), P.INVALID_FIELD, "params.max_tokens"),
    (dict(params={"max_tokens": 2**63 - 1}), P.INVALID_FIELD, "params.max_tokens"),
    (dict(params={"temperature": float("inf")}), P.INVALID_FIELD, "params.temperature"),
    (dict(params={"stop_token_ids": list(range(P.MAX_STOP_TOKEN_IDS + 1))}), P.INVALID_FIELD,
     "params.stop_token_ids"),
    (dict(params={"stop": [""]}), P.INVALID_FIELD, "params.stop[0]"),
    (dict(params={"stop": ["a", 1]}), P.INVALID_FIELD, "params.stop[1]"),
    (dict(params={"stop": ["a"] * (P.MAX_STOP_STRINGS + 1)}), P.INVALID_FIELD, "params.stop"),
    (dict(params={"stop": ["a" * (P.MAX_STOP_CHARS + 1)]}), P.INVALID_FIELD, "params.stop[0]"),
    (dict(params={"stop": "a" * (P.MAX_STOP_CHARS + 1)}), P.INVALID_FIELD, "params.stop"),
    (dict(params={"ignore_eos": 1}), P.INVALID_FIELD, "params.ignore_eos"),
    (dict(params={"logprobs": -1}), P.INVALID_FIELD, "params.logprobs"),
    (dict(params={"logprobs": 21}), P.INVALID_FIELD, "params.logprobs"),
    (dict(params={"logprobs": True}), P.INVALID_FIELD, "params.logprobs"),
    (dict(extra=1), P.UNKNOWN_FIELD, "extra"),
])
def test_generate_bad_fields(override, code, field):
    fields = {**GOOD_GENERATE, **override}
    P.decode(raw(base("generate", **GOOD_GENERATE)))  # the baseline is valid
    with pytest.raises(P.ProtocolError) as e:
        P.decode(raw(base("generate", **fields)))
    assert (e.value.code, e.value.field) == (code, field)


@pytest.mark.parametrize("missing", ["id", "prompt"])
def test_generate_missing_fields(missing):
    fields = {k: v for k, v in GOOD_GENERATE.items() if k != missing}
    with pytest.raises(P.ProtocolError) as e:
        P.decode(raw(base("generate", **fields)))
    assert (e.value.code, e.value.field) == (P.MISSING_FIELD, missing)


def test_numeric_bounds_are_inclusive():
    params = P.decode(raw(base("generate", id="a", prompt="x", params={
        "top_k": 2**31 - 1, "max_tokens": 2**31 - 1, "seed": 2**63 - 1,
        "stop_token_ids": [0, 2**31 - 1]}))).params
    assert (params.top_k, params.max_tokens, params.seed) == (2**31 - 1, 2**31 - 1, 2**63 - 1)
    assert params.stop_token_ids == [0, 2**31 - 1]


@pytest.mark.parametrize("frame", [
    # a repeated key at the top level, and inside params (msgpack maps can hold one twice)
    b"\x84\xa1v\x01\xa4type\xa4ping\xa2id\xa1a\xa2id\xa1b",
    b"\x85\xa1v\x01\xa4type\xa8generate\xa2id\xa1a\xa6prompt\xa1x"
    b"\xa6params\x82\xa5top_k\x01\xa5top_k\x02",
])
def test_repeated_map_keys_are_a_bad_message(frame):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert e.value.code == P.BAD_MESSAGE and "more than once" in e.value.message


def test_too_many_prompt_tokens_is_an_invalid_field_with_the_id():
    frame = raw(base("generate", id="long", prompt=[1] * (P.MAX_PROMPT_TOKENS + 1)))
    assert len(frame) <= P.MAX_MESSAGE_BYTES
    obj = P.unpack_frame(frame)
    with pytest.raises(P.ProtocolError) as e:
        P.decode(obj)
    assert (e.value.code, e.value.field) == (P.INVALID_FIELD, "prompt")
    assert P.readable_id(obj) == "long"


def test_prompt_limits_are_inclusive():
    assert len(P.decode(raw(base("generate", id="i" * 128, prompt=[0, P.MAX_TOKEN_ID]))).prompt) == 2
    P.decode(raw(base("generate", id="a", prompt="x" * P.MAX_PROMPT_CHARS)))


@pytest.mark.parametrize("type_,fields,code,field", [
    ("abort", {}, P.MISSING_FIELD, "id"),
    ("abort", {"id": ""}, P.INVALID_FIELD, "id"),
    ("abort", {"id": "a", "reason": "x"}, P.UNKNOWN_FIELD, "reason"),
    ("status", {"id": 3}, P.INVALID_FIELD, "id"),
    ("status", {"verbose": True}, P.UNKNOWN_FIELD, "verbose"),
    ("ping", {"id": "x" * 129}, P.INVALID_FIELD, "id"),
    ("ping", {"payload": b"x"}, P.UNKNOWN_FIELD, "payload"),
    ("metrics", {"id": 3}, P.INVALID_FIELD, "id"),
    ("metrics", {"format": "json"}, P.UNKNOWN_FIELD, "format"),
    ("tokenize", {"id": "t"}, P.MISSING_FIELD, "text"),
    ("tokenize", {"id": "t", "text": ""}, P.INVALID_FIELD, "text"),
    ("tokenize", {"id": "t", "text": "x" * (P.MAX_PROMPT_CHARS + 1)}, P.INVALID_FIELD, "text"),
    ("tokenize", {"id": "t", "text": "x", "add_special_tokens": 1}, P.INVALID_FIELD, "add_special_tokens"),
    ("tokenize", {"text": "x"}, P.MISSING_FIELD, "id"),
])
def test_other_request_bad_fields(type_, fields, code, field):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(raw(base(type_, **fields)))
    assert (e.value.code, e.value.field) == (code, field)


@pytest.mark.parametrize("type_,fields,code,field", [
    ("delta", {"id": "a", "text": 1, "token_ids": []}, P.INVALID_FIELD, "text"),
    ("delta", {"id": "a", "text": "", "token_ids": [-1]}, P.INVALID_FIELD, "token_ids[0]"),
    ("delta", {"id": "a", "text": ""}, P.MISSING_FIELD, "token_ids"),
    ("done", {"id": "a", "finish_reason": "eos", "prompt_tokens": 1, "completion_tokens": 1},
     P.INVALID_FIELD, "finish_reason"),
    ("done", {"id": "a", "finish_reason": "stop", "prompt_tokens": -1, "completion_tokens": 1},
     P.INVALID_FIELD, "prompt_tokens"),
    ("done", {"id": "a", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1.0},
     P.INVALID_FIELD, "completion_tokens"),
    ("done", {"id": "a", "finish_reason": "abort", "prompt_tokens": 1, "completion_tokens": 1,
              "abort_reason": "bored"}, P.INVALID_FIELD, "abort_reason"),
    ("done", {"id": "a", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
              "cached_tokens": -1}, P.INVALID_FIELD, "cached_tokens"),
    ("error", {"message": "m"}, P.MISSING_FIELD, "code"),
    ("error", {"code": "", "message": "m"}, P.INVALID_FIELD, "code"),
    ("error", {"code": "x", "message": "m" * (P.MAX_MESSAGE_CHARS + 1)}, P.INVALID_FIELD, "message"),
    ("error", {"code": "x", "message": "m", "requested": "5"}, P.INVALID_FIELD, "requested"),
    ("status", {"stats": []}, P.INVALID_FIELD, "stats"),
    ("status", {"stats": {"a": [1]}}, P.INVALID_FIELD, "stats.a"),
    ("status", {}, P.MISSING_FIELD, "stats"),
    ("pong", {"extra": 1}, P.UNKNOWN_FIELD, "extra"),
    ("delta", {"id": "a", "text": "", "token_ids": [1], "logprobs": [-1.0]}, P.INVALID_FIELD, "logprobs[0]"),
    ("delta", {"id": "a", "text": "", "token_ids": [1], "logprobs": [[-1.0, [[-3, 0.0]]]]},
     P.INVALID_FIELD, "logprobs[0]"),
    ("delta", {"id": "a", "text": "", "token_ids": [1], "logprobs": [[-1.0, [[1, 0.0]] * 21]]},
     P.INVALID_FIELD, "logprobs[0]"),
    ("delta", {"id": "a", "text": "", "token_ids": [1], "logprobs": {"a": 1}}, P.INVALID_FIELD, "logprobs"),
    ("delta", {"id": "a", "text": "", "token_ids": [], "finish_reason": "bored"}, P.INVALID_FIELD, "finish_reason"),
    ("delta", {"id": "a", "text": "", "token_ids": [], "completion_tokens": -1}, P.INVALID_FIELD,
     "completion_tokens"),
    ("delta", {"id": "a", "text": "", "token_ids": [], "prompt_tokens": 1.5}, P.INVALID_FIELD, "prompt_tokens"),
    ("delta", {"id": "a", "text": "", "token_ids": [], "cached_tokens": "0"}, P.INVALID_FIELD, "cached_tokens"),
    ("metrics", {}, P.MISSING_FIELD, "text"),
    ("metrics", {"text": 5}, P.INVALID_FIELD, "text"),
    ("tokens", {"id": "t", "token_ids": "ab"}, P.INVALID_FIELD, "token_ids"),
    ("tokens", {"id": "t", "token_ids": b"\x01\x00\x00"}, P.INVALID_FIELD, "token_ids"),
    ("tokens", {"id": "t", "token_ids": b"\x01\x00\x00\x00\xff\xff\xff\xff"}, P.INVALID_FIELD, "token_ids[1]"),
    ("tokens", {"id": "t"}, P.MISSING_FIELD, "token_ids"),
])
def test_reply_bad_fields(type_, fields, code, field):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(raw(base(type_, **fields)), "reply")
    assert (e.value.code, e.value.field) == (code, field)


def test_encode_validates_too():
    with pytest.raises(P.ProtocolError) as e:
        P.encode(P.GenerateRequest("", "hi"))
    assert e.value.field == "id"
    with pytest.raises(P.ProtocolError) as e:
        P.encode(P.DoneReply("a", "finished", 0, 0))
    assert e.value.field == "finish_reason"


def test_readable_id():
    assert P.readable_id({"id": "abc"}) == "abc"
    assert P.readable_id({"id": ""}) is None
    assert P.readable_id({"id": 5}) is None
    assert P.readable_id([1]) is None
    assert P.readable_id(None) is None


def test_error_codes_are_distinct_strings():
    assert len(set(P.ERROR_CODES)) == len(P.ERROR_CODES)
    assert all(isinstance(c, str) and c == c.lower() for c in P.ERROR_CODES)


def test_limits_have_one_home():
    """The wire re-exports tpserve.limits' limits; the scheduler and kernels share their lists."""
    from tpserve import limits as R
    from tpserve.config import ATTENTION_BACKENDS
    from tpserve.kernels.backend_factory import BACKEND_NAMES
    from tpserve.scheduler import scheduler
    for name in ("MAX_ID_CHARS", "MAX_PROMPT_CHARS", "MAX_PROMPT_TOKENS", "MAX_TOKEN_ID", "MAX_STOP_STRINGS",
                 "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "FINISH_REASONS"):
        assert getattr(P, name) is getattr(R, name), name
    assert scheduler.FINISH_REASONS is R.FINISH_REASONS and BACKEND_NAMES is ATTENTION_BACKENDS


def test_tokens_are_packed_little_endian_int32_and_a_list_is_packed_when_encoded():
    frame = P.encode(P.TokensReply("t", [1, 256, 2**31 - 1]))
    assert msgpack.unpackb(frame)["token_ids"] == (1).to_bytes(4, "little") + (256).to_bytes(4, "little") + \
        (2**31 - 1).to_bytes(4, "little")
    assert P.decode(frame, "reply").token_ids == array.array("i", [1, 256, 2**31 - 1])
    with pytest.raises(P.ProtocolError) as e:
        P.encode(P.TokensReply("t", [1, -2]))
    assert e.value.field == "token_ids[1]"
