"""Fuzzing the daemon's socket with random and malformed frames (fake engine).

The documented rule (docs/protocol.md, "Errors"): every message of at most MAX_MESSAGE_BYTES
gets exactly one reply -- an ``error`` whose code is what ``protocol.decode`` says for that
frame, or, for a valid request, its normal reply sequence -- and the daemon keeps serving.
Each example is followed by a ping; everything received before the pong belongs to the example.
"""
from __future__ import annotations

import socket
import uuid

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from test_daemon import FakeEngine, Raw, ServerThread
from tpserve.client import protocol as P
from tpserve.client.client import Client
from tpserve.sampling import SamplingParams

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server():
    # Short limits so fuzzed max_tokens values are refused or finish fast.
    s = ServerThread(FakeEngine(max_model_len=64, num_blocks=8, block_size=8, vocab=500))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def conn(server):
    r = Raw(server.address)
    yield r
    r.close()


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

param_maps = st.dictionaries(
    st.sampled_from(list(P.SAMPLING_FIELDS) + ["bogus"]),
    st.one_of(values, st.integers(-3, 40), st.floats(-1, 3), st.lists(st.integers(-1, 600), max_size=3),
              st.lists(st.text(max_size=3), max_size=3)),
    max_size=4)

field_values = {
    "v": st.one_of(st.just(1), st.just(1), values),
    "type": st.one_of(st.sampled_from(["generate", "abort", "status", "ping", "delta", "done", "x"]), values),
    "id": st.one_of(st.text(min_size=1, max_size=8), st.text(max_size=140), values),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 600), max_size=10), values),
    "params": st.one_of(param_maps, values),
    "stream": st.one_of(st.booleans(), values),
}

message_maps = st.fixed_dictionaries({}, optional={**field_values, "extra": values})

good_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 499), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2)})
good_fields = {
    "generate": {"id": st.text(min_size=1, max_size=8),
                 "prompt": st.one_of(st.text(min_size=1, max_size=20),
                                     st.lists(st.integers(0, 520), min_size=1, max_size=10)),
                 "params": good_params, "stream": st.booleans()},
    "abort": {"id": st.text(min_size=1, max_size=8)},
    "status": {"id": st.text(min_size=1, max_size=8)},
    "ping": {"id": st.text(min_size=1, max_size=8)},
}
REQUIRED = {"generate": ("id", "prompt"), "abort": ("id",), "status": (), "ping": ()}


@st.composite
def near_valid(draw):
    """A well-formed request, then maybe one mutation: a field dropped, replaced or added."""
    type_ = draw(st.sampled_from(sorted(good_fields)))
    msg = {"v": 1, "type": type_}
    for name, strat in good_fields[type_].items():
        if name in REQUIRED[type_] or draw(st.booleans()):
            msg[name] = draw(strat)
    mutation = draw(st.sampled_from(["none", "none", "drop", "replace", "add"]))
    keys = sorted(msg)
    if mutation == "drop":
        del msg[draw(st.sampled_from(keys))]
    elif mutation == "replace":
        msg[draw(st.sampled_from(keys))] = draw(values)
    elif mutation == "add":
        msg[draw(st.text(max_size=8))] = draw(values)
    return msg


frames = st.one_of(
    near_valid().map(lambda m: [msgpack.packb(m, use_bin_type=True)]),
    near_valid().map(lambda m: [msgpack.packb(m, use_bin_type=True)]),
    st.binary(max_size=64).map(lambda b: [b]),
    values.map(lambda o: [msgpack.packb(o, use_bin_type=True)]),
    message_maps.map(lambda m: [msgpack.packb(m, use_bin_type=True)]),
    st.lists(st.binary(max_size=16), min_size=2, max_size=4),
)


def _expected_code(parts):
    """None if the frame is a valid request, else the error code the daemon must answer with."""
    if len(parts) != 1:
        return P.BAD_MESSAGE
    try:
        return ("valid", P.decode(parts[0], "request"))
    except P.ProtocolError as e:
        return e.code


@SETTINGS
@given(parts=frames)
def test_every_frame_gets_its_answer(server, conn, parts):
    conn.sock.send_multipart(parts)
    sync = uuid.uuid4().hex
    conn.send_msg(P.PingRequest(id=sync))
    replies = []
    while True:
        m = conn.recv(timeout=10)
        assert m is not None, f"daemon stopped answering after {parts!r}"
        if m == P.PongReply(id=sync):
            break
        replies.append(m)
    expected = _expected_code(parts)
    event(f"valid {expected[1].TYPE}" if isinstance(expected, tuple) else f"error {expected}")
    if not isinstance(expected, tuple):
        assert len(replies) == 1, replies
        assert isinstance(replies[0], P.ErrorReply) and replies[0].code == expected
        return
    msg = expected[1]
    if isinstance(msg, P.GenerateRequest):
        # The ping overtook nothing: a generate may still be running; read until it ends.
        while not replies or not isinstance(replies[-1], (P.DoneReply, P.ErrorReply)):
            m = conn.recv(timeout=10)
            assert m is not None
            replies.append(m)
        assert all(r.id == msg.id for r in replies)
        assert all(isinstance(r, P.DeltaReply) for r in replies[:-1])
        last = replies[-1]
        if isinstance(last, P.ErrorReply):
            assert last.code in (P.ADMISSION, P.INVALID_FIELD) and len(replies) == 1
        else:
            assert last.finish_reason in ("stop", "length")
    elif isinstance(msg, P.AbortRequest):
        assert len(replies) == 1 and replies[0].code == P.UNKNOWN_ID
    elif isinstance(msg, P.StatusRequest):
        assert len(replies) == 1 and isinstance(replies[0], P.StatusReply) and replies[0].id == msg.id
    else:
        assert replies == [P.PongReply(id=msg.id)]


@pytest.fixture(scope="module")
def tcp_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerThread(FakeEngine(), address=f"tcp://127.0.0.1:{port}")
    srv.port = port
    yield srv
    assert srv.stop() == 0


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=512))
def test_garbage_on_the_tcp_stream_does_not_hurt(tcp_server, garbage):
    """Bytes that are not even ZMTP (the transport framing) only cost that connection."""
    with socket.create_connection(("127.0.0.1", tcp_server.port), timeout=5) as s:
        try:
            s.sendall(garbage)
        except OSError:
            pass
    with Client(tcp_server.address, timeout=10) as c:
        assert c.generate("ok", max_tokens=2).finish_reason == "length"


def test_normal_requests_still_work_after_fuzzing(server, conn):
    with Client(server.address, timeout=10) as c:
        assert c.ping() > 0
        r = c.generate("hello", max_tokens=4, seed=1)
        assert r.finish_reason == "length"
        assert r.token_ids == FakeEngine.expected_tokens("hello", SamplingParams(max_tokens=4, seed=1), vocab=500)
        stats = c.status()
    assert stats["requests_in_flight"] == 0 and stats["kv_blocks_used"] == 0


def test_the_soaks_bad_inputs_get_the_codes_it_expects(server):
    """scripts/soak.py counts a bad input the daemon serves as a failure: each frame of its lists
    must get exactly the error code the soak expects (so the list follows the protocol)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import soak
    conn = soak.Conn(server.address, 10)
    try:
        for i, (frame, code) in enumerate(soak.BAD_INPUTS + soak.EDGE_INPUTS):
            if frame == "DUPLICATE":
                reply = soak.duplicate(conn, f"soak-dup-{i}")
            else:
                if isinstance(frame, dict):
                    frame = {k: (f"soak-{i}" if v == "ID" else v) for k, v in frame.items()}
                conn.send(frame)
                reply = conn.recv()
            assert (reply.get("type"), reply.get("code")) == ("error", code), (frame, reply)
    finally:
        conn.close()
