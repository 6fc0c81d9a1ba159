"""Streams of n > 1 completions: each completion's end reaches the client as soon as it ended,
not with the request's ``done`` (docs/protocol.md, ``delta``).

The server's replies (client_requests.py) and the outbox's merging, on engine outputs made
here; then the real tiny engine behind a daemon loop, read by Client and AsyncClient. The
HTTP front's streams are in test_http.py, gRPC's in test_grpc_front.py; the HTTP response's
chunks here, without a daemon.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import RefusingSocket, ServerThread
from tpserve.client import protocol as P
from tpserve.client.client import AsyncClient, Client, Delta, GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.app import timed_out_before_output
from tpserve.fronts.http.chat_output import Response
from tpserve.outputs import EngineOutput
from tpserve.sampling import SamplingParams
from tpserve.server.client_requests import ClientRequest
from tpserve.server.outbox import Peers
from tpserve.server.server import ServerOptions

PROMPT = list(range(10, 30))


# ---- the server's replies, without an engine ------------------------------------------------------
def _request(n: int, stream: bool = True) -> ClientRequest:
    return ClientRequest(peer=None, client_id="r", engine_id="c:r", stream=stream, prompt_tokens=0, n=n)


def test_the_last_delta_of_each_of_n_completions_carries_its_end():
    req = _request(2)
    first = req.take(EngineOutput("c:r", [5], "a", num_prompt_tokens=20, num_completion_tokens=1,
                                  num_cached_tokens=16))
    assert first.finish_reason is None and first.completion_tokens is None
    end = req.take(EngineOutput("c:r", [6], "b", finished=True, finish_reason="stop", num_prompt_tokens=20,
                                num_completion_tokens=2))
    assert (end.index, end.token_ids, end.finish_reason, end.completion_tokens) == (0, [6], "stop", 2)
    assert (end.prompt_tokens, end.cached_tokens) == (20, 16)
    # a completion whose last step adds nothing to send still tells its end, in an empty delta
    empty = req.take(EngineOutput("c:r", [], "", finished=True, finish_reason="length", index=1,
                                  num_prompt_tokens=20, num_completion_tokens=3))
    assert (empty.index, empty.text, empty.token_ids) == (1, "", [])
    assert (empty.finish_reason, empty.completion_tokens, empty.prompt_tokens) == ("length", 3, 20)
    for msg in (first, end, empty):  # they are wire messages
        assert P.decode(P.encode(msg), "reply") == msg


def test_with_one_completion_or_not_streamed_no_delta_carries_an_end():
    one = _request(1)
    last = one.take(EngineOutput("c:r", [6], "b", finished=True, finish_reason="stop",
                                 num_completion_tokens=1))
    assert last.finish_reason is None and "finish_reason" not in P.unpack_frame(P.encode(last))
    assert one.take(EngineOutput("c:r", [], "", finished=True, finish_reason="stop")) is None
    whole = _request(2, stream=False)
    assert whole.take(EngineOutput("c:r", [6], "b", finished=True, finish_reason="stop")) is None


def test_a_merged_delta_keeps_the_end_of_its_last():
    """A slow reader's waiting deltas of one completion merge; the end stays on the merged one."""
    sock = RefusingSocket()
    peers = Peers(sock, lambda peer, why: None)
    peer = peers.peer(b"c")
    peers.send(peer, P.PongReply(id="p"))  # refused: what follows waits
    peers.send(peer, P.DeltaReply("a", "x", [1], index=1))
    peers.send(peer, P.DeltaReply("a", "y", [2], index=0))
    peers.send(peer, P.DeltaReply("a", "z", [3], index=1, finish_reason="stop", completion_tokens=2,
                                  prompt_tokens=4, cached_tokens=0))
    peers.send(peer, P.DeltaReply("a", "w", [4], index=0))
    sock.room = 100
    peers.flush()
    assert sock.sent[1:] == [
        P.DeltaReply("a", "xz", [1, 3], index=1, finish_reason="stop", completion_tokens=2, prompt_tokens=4,
                     cached_tokens=0),
        P.DeltaReply("a", "yw", [2, 4], index=0),
    ]


# ---- the HTTP response's chunks, without a daemon -------------------------------------------------
def _response(chat: bool, n: int = 2) -> Response:
    body = {"model": "m", "n": n, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        job = O.parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}, "m")
    else:
        job = O.parse_completion({**body, "prompt": "hi"}, "m")
    O.build_request(job)
    front = SimpleNamespace(model_name="m", token_text=lambda t: f"<{t}>")
    return Response(front, job, [[7, 8, 9]], None)


def _choices(chunks: list[str]) -> list[dict]:
    return [c for chunk in chunks for c in json.loads(chunk[len("data: "):])["choices"]]


@pytest.mark.parametrize("chat", [False, True])
def test_a_choice_ends_with_its_last_delta_and_its_result_only_counts(chat):
    r = _response(chat)
    key = "delta" if chat else "text"
    got = _choices(r.chunks(0, Delta("r", "ab", [1, 2])))
    got += _choices(r.chunks(0, Delta("r", "c", [3], finish_reason="stop", completion_tokens=3)))
    assert [c["finish_reason"] for c in got if c["index"] == 0][-1] == "stop"
    assert "".join((c[key].get("content", "") if chat else c[key]) for c in got) == "abc"
    later = _choices(r.chunks(1, Delta("r", "d", [4], index=1)))
    assert [c["finish_reason"] for c in later] == [None] * len(later)
    # an end without output: the finish chunk alone
    alone = _choices(r.chunks(1, Delta("r", "", [], index=1, finish_reason="length", completion_tokens=1)))
    assert [c["finish_reason"] for c in alone] == ["length"]
    # the request's done: nothing more to send for the choices, their figures for the usage
    for index, tokens in ((0, 3), (1, 1)):
        result = GenerateResult("r", "", [], "stop" if index == 0 else "length", 3, tokens, index=index)
        assert r.chunks(index, result) == []
    usage = json.loads(r.final_chunks()[0][len("data: "):])["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 4)


def test_a_choice_without_an_end_on_a_delta_ends_with_its_result():
    r = _response(False)
    r.chunks(0, Delta("r", "ab", [1, 2]))
    (last,) = _choices(r.chunks(0, GenerateResult("r", "", [], "abort", 3, 2, abort_reason="client")))
    assert last["finish_reason"] == "abort"


def test_a_first_end_without_a_token_by_timeout_is_a_504_on_a_delta_too():
    job = SimpleNamespace(timeout=2.0)
    for first in (Delta("r", "", [], finish_reason="timeout", completion_tokens=0),
                  GenerateResult("r", "", [], "timeout", 3, 0)):
        assert timed_out_before_output(first, job).status == 504
    late = Delta("r", "a", [1], finish_reason="timeout", completion_tokens=1)
    assert timed_out_before_output(late, job) is None
    assert timed_out_before_output(Delta("r", "", [], finish_reason="stop", completion_tokens=0), job) is None


# ---- the real tiny engine behind a daemon loop -----------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_models_root):  # noqa: F811
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    engine = Engine(EngineConfig(model=str(make_tiny_model(tiny_models_root)), dtype="float32",
                                 num_kv_blocks=64, block_size=4, max_model_len=256))
    server = ServerThread(engine, ServerOptions(shutdown_grace=0.0))
    yield server
    server.stop()
    engine.shutdown()


def early_stop(seed: int, n: int = 2) -> SamplingParams:
    """Sampled with half the byte tokens as stop tokens: each completion (seed + index) stops
    after a few tokens of its own."""
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=16, stop_token_ids=list(range(3, 200)))


def ended_apart(deltas: list[Delta]) -> tuple[int, int] | None:
    """(early, late) completion indices of a two-completion stream whose completions ended at
    least two steps apart (completion 1 starts a step after completion 0), else None."""
    counts = [sum(len(d.token_ids) for d in deltas if d.index == i) for i in (0, 1)]
    if counts[0] + 2 <= counts[1]:
        return 0, 1
    if counts[1] + 3 <= counts[0]:
        return 1, 0
    return None


def check_ends(deltas: list[Delta], result: GenerateResult) -> tuple[int, int] | None:
    """Each completion's end is on its last delta, once, with its counts; returns ``ended_apart``."""
    by_index = {c.index: c for c in result.completions}
    for i, c in by_index.items():
        mine = [d for d in deltas if d.index == i]
        ends = [d for d in mine if d.finish_reason is not None]
        assert ends == mine[-1:], "the end is on the completion's last delta, and on no other"
        (end,) = ends
        assert (end.finish_reason, end.completion_tokens) == (c.finish_reason, c.completion_tokens)
        assert end.completion_tokens == sum(len(d.token_ids) for d in mine)
        assert (end.prompt_tokens, end.cached_tokens) == (result.prompt_tokens, result.cached_tokens)
    assert result.completion_tokens == sum(c.completion_tokens for c in by_index.values())
    return ended_apart(deltas)


def test_zmq_deltas_carry_each_completions_end_as_it_comes(served):
    with Client(served.address, timeout=60) as c:
        for seed in range(16):
            stream = c.stream(PROMPT, early_stop(seed))
            deltas = list(stream)
            apart = check_ends(deltas, stream.result)
            if apart is not None:
                break
        else:
            pytest.fail("no seed made the two completions end apart")
        early, late = apart
        at = next(k for k, d in enumerate(deltas) if d.index == early and d.finish_reason is not None)
        assert any(d.index == late and d.token_ids for d in deltas[at + 1:]), \
            "the early completion's end came only after its sibling's last tokens"
        assert stream.result.prompt_tokens == len(PROMPT)
        # n = 1: the stream's result ends it; no delta carries an end
        one = c.stream(PROMPT, early_stop(seed, n=1))
        assert all(d.finish_reason is None for d in one) and one.result.finish_reason == "stop"


def test_async_client_deltas_carry_each_completions_end(served):
    async def main():
        async with AsyncClient(served.address, timeout=60) as c:
            items = [x async for x in c.stream(PROMPT, early_stop(3, n=3), final=True)]
        return items[:-1], items[-1]
    deltas, result = asyncio.run(main())
    check_ends(deltas, result)
    assert sorted(d.index for d in deltas if d.finish_reason is not None) == [0, 1, 2]
