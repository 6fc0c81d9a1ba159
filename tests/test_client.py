"""Client and AsyncClient: timeouts without a daemon, and the full API against a fake-engine server."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from test_daemon import FakeEngine, ServerThread, client_ids
from tpserve.client import protocol as P
from tpserve.client.client import AsyncClient, Client, ClientTimeout, GenerateResult, RequestError
from tpserve.client.addresses import default_address
from tpserve.errors import InvalidFieldError
from tpserve.sampling import SamplingParams


def _unused_tcp_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def srv():
    s = ServerThread(FakeEngine())
    yield s
    if s.thread.is_alive():
        assert s.stop() == 0
    s.cleanup()


# ---- no daemon -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_timeouts_without_a_daemon(kind, tmp_path):
    address = f"ipc://{tmp_path}/nobody.sock" if kind == "ipc" else _unused_tcp_address()
    with Client(address, timeout=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(ClientTimeout) as e:
            c.ping()
        assert time.monotonic() - t0 < 10
        assert str(e.value) == f"no reply from tpserve daemon at {address} within 0.2 s"
        assert isinstance(e.value, TimeoutError)
        with pytest.raises(ClientTimeout):
            c.status()
        with pytest.raises(ClientTimeout):
            c.generate("hello", max_tokens=2)
        with pytest.raises(ClientTimeout):
            next(iter(c.stream("hello")))
        with pytest.raises(ClientTimeout, match="within 0.1 s"):
            c.ping(timeout=0.1)  # per-call override


def test_async_timeouts_without_a_daemon():
    address = _unused_tcp_address()

    async def main():
        async with AsyncClient(address, timeout=0.2) as c:
            with pytest.raises(ClientTimeout, match=f"at {address} within 0.2 s"):
                await c.ping()
            with pytest.raises(ClientTimeout):
                await c.generate("x")
            with pytest.raises(ClientTimeout):
                async for _ in c.stream("x"):
                    pass

    asyncio.run(main())


def test_default_address_is_the_runtime_dir_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("TPSERVE_ADDRESS", raising=False)
    monkeypatch.setenv("TPSERVE_RUNTIME_DIR", str(tmp_path / "rt"))
    assert Client(timeout=0.1).address == f"ipc://{tmp_path}/rt/tpserve.sock"
    assert Client(runtime_dir=tmp_path / "x", timeout=0.1).address == f"ipc://{tmp_path}/x/tpserve.sock"
    monkeypatch.delenv("TPSERVE_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert default_address() == f"ipc://{tmp_path}/xdg/tpserve/tpserve.sock"
    monkeypatch.setenv("TPSERVE_ADDRESS", "tcp://127.0.0.1:1")
    assert Client(timeout=0.1).address == "tcp://127.0.0.1:1"


# ---- against a server ----------------------------------------------------------------------
def test_generate_stream_status_ping(srv):
    with Client(srv.address, timeout=10) as c:
        assert c.ping() > 0
        params = SamplingParams(max_tokens=6, seed=5)
        expected = FakeEngine.expected_tokens("hello", params)
        result = c.generate("hello", params, request_id="mine")
        assert result == GenerateResult("mine", "".join(f"{t} " for t in expected), expected, "length", 5, 6)
        stream = c.stream("hello", max_tokens=6, seed=5)
        deltas = list(stream)
        assert [t for d in deltas for t in d.token_ids] == expected
        assert all(d.request_id == stream.request_id for d in deltas)
        assert stream.result.token_ids == expected and stream.result.text == result.text
        assert stream.result.finish_reason == "length" and stream.result.completion_tokens == 6
        stats = c.status()
        assert stats["generation_tokens"] == 12 and stats["kv_blocks_used"] == 0


def test_two_streams_interleaved_on_one_client(srv):
    with Client(srv.address, timeout=10) as c:
        a = c.stream([1, 2, 3], max_tokens=8)
        b = c.stream([4, 5], max_tokens=8, seed=1)
        got_a, got_b = [], []
        for da, db in zip(a, b):
            got_a += da.token_ids
            got_b += db.token_ids
        got_a += [t for d in a for t in d.token_ids]
        got_b += [t for d in b for t in d.token_ids]
        assert got_a == FakeEngine.expected_tokens([1, 2, 3], SamplingParams(max_tokens=8))
        assert got_b == FakeEngine.expected_tokens([4, 5], SamplingParams(max_tokens=8, seed=1))


def test_abort_mid_stream_frees_the_request(srv):
    with Client(srv.address, timeout=10) as c:
        stream = c.stream("abc", max_tokens=10**6)
        next(stream)
        assert c.abort(stream.request_id) is True
        rest = list(stream)  # deltas already on their way, then the end
        assert stream.result.finish_reason == "abort" and stream.result.abort_reason == "client"
        assert stream.result.completion_tokens >= 1 + len(rest)
        assert c.abort(stream.request_id) is False  # no longer in flight
        assert c.abort("never-sent") is False
        assert c.status()["kv_blocks_used"] == 0
    assert client_ids(srv.engine.aborted) == [stream.request_id]


def test_closing_a_stream_early_aborts_it(srv):
    with Client(srv.address, timeout=10) as c:
        with c.stream("abc", max_tokens=10**6) as stream:
            next(stream)
        deadline = time.monotonic() + 10
        while client_ids(srv.engine.aborted) != [stream.request_id]:
            assert time.monotonic() < deadline
            c.ping()  # keeps the loop turning; the abort is processed in order
        assert c.status()["requests_in_flight"] == 0


def test_timeout_of_a_running_request_aborts_it():
    engine = FakeEngine(step_delay=0.05)
    with ServerThread(engine) as s:
        with Client(s.address, timeout=0.3) as c:
            with pytest.raises(ClientTimeout):
                c.generate("slow", max_tokens=1000, request_id="slow")
            deadline = time.monotonic() + 10
            while "slow" not in client_ids(engine.aborted):
                assert time.monotonic() < deadline, "timed-out request still running"
                time.sleep(0.05)
            assert c.ping(timeout=5) > 0  # the late replies of "slow" do not confuse later calls


def test_request_errors_are_typed(srv):
    engine = srv.engine
    engine.config.max_model_len = 20
    with Client(srv.address, timeout=10) as c:
        with pytest.raises(RequestError) as e:
            c.generate("x" * 10, max_tokens=15, request_id="big")
        err = e.value
        assert (err.code, err.request_id, err.limit, err.requested, err.allowed) == \
            (P.ADMISSION, "big", "max_model_len", 25, 20)
        with pytest.raises(RequestError) as e:
            list(c.stream("x" * 10, max_tokens=15))
        assert e.value.code == P.ADMISSION
        with pytest.raises(RequestError) as e:
            c.generate([5, 5000])
        assert (e.value.code, e.value.field) == (P.INVALID_FIELD, "prompt[1]")
        assert c.generate("ok", max_tokens=2).finish_reason == "length"


def test_bad_input_is_caught_before_sending(srv):
    with Client(srv.address, timeout=10) as c:
        with pytest.raises(InvalidFieldError) as e:
            c.generate("hi", temperature=-1.0)
        assert e.value.field == "temperature"
        with pytest.raises(TypeError):
            c.generate("hi", SamplingParams(), max_tokens=3)
        with pytest.raises(P.ProtocolError) as e:
            c.generate("")
        assert e.value.field == "prompt"
        with pytest.raises(P.ProtocolError):
            c.generate("hi", request_id="x" * 200)
    assert srv.engine.added == []


def test_async_client_concurrent_requests(srv):
    async def main():
        async with AsyncClient(srv.address, timeout=10) as c:
            results = await asyncio.gather(*(c.generate(f"p{i}", max_tokens=1 + i % 5, seed=i)
                                             for i in range(16)))
            for i, r in enumerate(results):
                assert r.token_ids == FakeEngine.expected_tokens(f"p{i}", SamplingParams(max_tokens=1 + i % 5,
                                                                                         seed=i))
            streamed = []
            async for d in c.stream("zz", max_tokens=4):
                streamed += d.token_ids
            assert streamed == FakeEngine.expected_tokens("zz", SamplingParams(max_tokens=4))
            status, rtt = await asyncio.gather(c.status(), c.ping())
            assert status["requests_in_flight"] == 0 and rtt > 0
            with pytest.raises(RequestError) as e:
                await c.generate([1, 10**6])
            assert e.value.code == P.INVALID_FIELD

    asyncio.run(main())


def test_a_cancelled_async_generate_aborts_its_request():
    """Cancelling a non-streaming generate (an HTTP client that left) stops the request in the
    daemon, as closing a stream does: nothing else would, since the connection stays open."""
    srv = ServerThread(FakeEngine(step_delay=0.002))

    async def main():
        async with AsyncClient(srv.address, timeout=10) as c:
            task = asyncio.ensure_future(c.generate("abc", max_tokens=10**6, request_id="whole"))
            deadline = time.monotonic() + 10
            while (await c.status())["requests_in_flight"] == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            while (await c.status())["requests_in_flight"]:
                assert time.monotonic() < deadline, "the cancelled request kept running"
                await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert client_ids(srv.engine.aborted) == ["whole"]
    finally:
        assert srv.stop() == 0


def test_async_abort():
    # Slow steps: a fast fake engine would queue so many deltas before the abort arrives that
    # draining them dominates the test on a loaded machine.
    srv = ServerThread(FakeEngine(step_delay=0.002))

    async def main():
        async with AsyncClient(srv.address, timeout=10) as c:
            agen = c.stream("abc", max_tokens=10**6, request_id="long")
            await agen.__anext__()
            assert await c.abort("long") is True
            async for _ in agen:
                pass
            assert await c.abort("long") is False
            assert (await c.status())["kv_blocks_used"] == 0

    try:
        asyncio.run(main())
        assert client_ids(srv.engine.aborted) == ["long"]
    finally:
        assert srv.stop() == 0
