"""A real daemon under pressure (the bundled model, `tpserve serve` in the foreground with an
HTTP front), through the official `openai` client and the ZMQ client: a flood beyond the
queue's cap is refused with 429 / ``overloaded`` while every admitted request finishes; a
high-priority request overtakes 32 low-priority streams on a small KV pool; timeouts end
requests and free their blocks; SIGTERM drains 20 streams to their end while new requests get
503; `tpserve stop --now` aborts at once. Every daemon is checked to leave no process, no
/dev/shm segment and nothing in its runtime dir.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import Raw
from tpserve.client import protocol as P
from tpserve.client.client import Client, RequestError
from tpserve.client.addresses import read_ready

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak  # noqa: E402

TPSERVE = [sys.executable, "-m", "tpserve"]
MODEL = "default-model"
LONG = 60.0  # s: generous bounds on waits that only a broken daemon reaches
DRAINED = 12000  # tokens of a holder that keeps a drain going for seconds
HELD = 1500  # tokens of a request that keeps its slot for seconds, on a tiny model of a longer context


class Served(soak.Daemon):
    """`tpserve serve --http-port 0` in the foreground (its exit code is ours to read)."""

    def __init__(self, *args):
        super().__init__("--http-port", "0", "--block-size", "4", "--startup-timeout", "200", *map(str, args),
                         startup_timeout=LONG)
        ready = read_ready(Path(self.rd))
        assert ready["pid"] == self.proc.pid and ready.get("http"), ready
        self.url = ready["http"]

    def zmq(self, timeout=LONG) -> Client:
        return Client(self.address, timeout=timeout)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=LONG)

    def status(self, timeout=LONG) -> dict:
        with self.zmq(timeout) as c:
            return c.status()

    def wait_for(self, condition, what: str) -> dict:
        """The daemon's status once ``condition(status)`` holds (polled on one connection: a
        new one per poll made each poll slow enough to miss a short-lived state)."""
        deadline = time.monotonic() + LONG
        with self.zmq() as c:
            while not condition(s := c.status()):
                assert time.monotonic() < deadline, (what, s, self.log_text()[-3000:])
                time.sleep(0.005)
        return s

    def stop(self) -> int:
        """SIGTERM, then the exit code; checks that nothing is left behind."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_gone()

    def wait_gone(self) -> int:
        code = self.proc.wait(timeout=LONG)
        assert self.leftovers() == (0, 0)
        assert os.listdir(self.rd) == ["serve.log"], os.listdir(self.rd)
        return code


@pytest.fixture
def serve():
    started = []

    def start(*args) -> Served:
        started.append(Served(*args))
        return started[-1]

    yield start
    for d in started:
        d.close()


def idle(d: Served) -> dict:
    return d.wait_for(lambda s: s["requests_in_flight"] == 0 and s["kv_blocks_used"] == 0, "idle")


def drain_stream(stream) -> list[int]:
    return [t for delta in stream for t in delta.token_ids]


# ---- the queue's cap -----------------------------------------------------------------------------
def test_a_flood_beyond_the_cap_gets_429s_while_admitted_requests_all_finish(serve, tiny_models_root):  # noqa: F811
    # Two running and three waiting: the queue is full until they finish. They must outlast
    # the test's look at the daemon's status by far: the bundled model writes its whole context
    # (1,020 tokens) in ~0.3 s, shorter than the CPU a hypervisor steals at times, so they run
    # on a tiny model of a long context instead (HELD tokens take seconds).
    model = make_tiny_model(tiny_models_root, max_position_embeddings=HELD + 64)
    d = serve("--model", model, "--served-model-name", MODEL, "--max-num-seqs", 2, "--max-waiting-requests", 3,
              "--num-kv-blocks", 2 * (HELD + 8) // 4 + 16, "--max-model-len", HELD + 64)
    assert d.status()["max_waiting_requests"] == 3
    with d.zmq() as c:
        holders = [c.stream([5, 6, 7, i], max_tokens=HELD, ignore_eos=True) for i in range(2)]
        d.wait_for(lambda s: s["num_running"] == 2, "two running")
        holders += [c.stream([5, 6, 7, i], max_tokens=HELD, ignore_eos=True) for i in range(2, 5)]
        d.wait_for(lambda s: s["num_waiting"] == 3, "a full queue")
        with pytest.raises(RequestError) as e:
            c.generate([1, 2, 3], max_tokens=4)
        assert (e.value.code, e.value.limit, e.value.allowed) == (P.OVERLOADED, "max_waiting_requests", 3)
        assert e.value.retry_after >= 1

        async def flood(n):
            client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=LONG)

            async def one(i):
                try:
                    return await client.completions.create(model=MODEL, prompt=f"flood {i}", max_tokens=12,
                                                           temperature=0, extra_body={"ignore_eos": True})
                except openai.RateLimitError as err:
                    return err
            try:
                return await asyncio.gather(*(one(i) for i in range(n)))
            finally:
                await client.close()

        results = asyncio.run(flood(40))
        for h in holders:
            assert len(drain_stream(h)) == HELD and (h.result.finish_reason, h.result.completion_tokens) == \
                ("length", HELD)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert refused and len(refused) + len(served) == 40
    for err in refused:
        assert err.status_code == 429 and int(err.response.headers["retry-after"]) >= 1
        assert err.body["code"] == "rate_limit_exceeded" and "max_waiting_requests" in err.body["message"]
    for r in served:
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 12)
    s = idle(d)
    assert s["refused_max_waiting_requests"] == len(refused) + 1 and s["refused_max_waiting_tokens"] == 0
    metrics = httpx.get(d.url + "/metrics", timeout=LONG).text
    assert (f'tpserve:requests_refused_total{{model_name="{MODEL}",reason="max_waiting_requests"}} '
            f'{len(refused) + 1}.0') in metrics
    assert d.stop() == 0


# ---- priority ------------------------------------------------------------------------------------
def test_a_high_priority_request_overtakes_32_low_priority_streams_on_a_small_pool(serve):
    d = serve("--scheduling-order", "priority", "--num-kv-blocks", 64, "--max-num-seqs", 64,
              "--max-waiting-tokens", 4096)
    low_tokens = 120
    r = Raw(d.address)
    for i in range(32):  # 32 * (6 + 120) tokens want 1008 blocks of a pool of 64: constant preemption
        r.send_msg(P.GenerateRequest(f"low{i}", [5, 6, 7, 8, 9, 10 + i],
                                     P.SamplingParams(max_tokens=low_tokens, ignore_eos=True), True, 5))
    seen = []
    while not any(isinstance(m, P.DeltaReply) for m in seen):
        seen.append(m := r.recv(LONG))
        assert m is not None and not isinstance(m, P.ErrorReply), m
    r.send_msg(P.GenerateRequest("high", [11, 12, 13], P.SamplingParams(max_tokens=8, ignore_eos=True), True, 0))
    done = {}
    while len(done) < 33:
        seen.append(m := r.recv(LONG))
        assert m is not None and not isinstance(m, P.ErrorReply), m
        if isinstance(m, P.DoneReply):
            assert m.id not in done, f"{m.id} finished twice"
            done[m.id] = m
    r.close()
    first_high = next(i for i, m in enumerate(seen) if isinstance(m, P.DeltaReply) and m.id == "high")
    first_low_done = next(i for i, m in enumerate(seen) if isinstance(m, P.DoneReply) and m.id != "high")
    assert first_high < first_low_done
    assert (done["high"].finish_reason, done["high"].completion_tokens) == ("length", 8)
    for i in range(32):
        tokens = [t for m in seen if isinstance(m, P.DeltaReply) and m.id == f"low{i}" for t in m.token_ids]
        assert (done[f"low{i}"].finish_reason, done[f"low{i}"].completion_tokens, len(tokens)) == \
            ("length", low_tokens, low_tokens)
    s = idle(d)
    assert s["scheduling_order"] == "priority" and s["num_preemptions"] >= s["num_priority_preemptions"] >= 0
    assert d.stop() == 0


def test_priority_needs_the_priority_order_and_bad_fields_are_named(serve):
    d = serve()
    client = d.openai()
    for extra, field in (({"priority": 1}, "priority"), ({"priority": "high"}, "priority"),
                         ({"timeout": 0}, "timeout"), ({"timeout": "soon"}, "timeout")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == field, (extra, e.value.body)
    with d.zmq() as c:
        with pytest.raises(RequestError) as e:
            c.generate([1, 2], max_tokens=2, priority=1)
        assert (e.value.code, e.value.field) == (P.INVALID_FIELD, "priority")
        assert c.generate([1, 2], max_tokens=2, priority=0).finish_reason == "length"
    assert d.stop() == 0


# ---- timeouts ------------------------------------------------------------------------------------
def test_timeouts_end_waiting_and_decoding_requests_and_free_their_blocks(serve):
    d = serve("--max-num-seqs", 1, "--num-kv-blocks", 512, "--request-timeout", 1000,
              "--max-num-batched-tokens", 16, "--max-stall-tokens", 16)  # prefill in chunks of 16
    client = d.openai()
    with d.zmq() as c:
        holder = c.stream([5, 6, 7, 8], max_tokens=1000, ignore_eos=True)
        next(holder)                                    # running: whatever comes next waits
        waited = c.generate([1, 2, 3], max_tokens=8, request_timeout=0.2)
        assert (waited.finish_reason, waited.completion_tokens) == ("timeout", 0)
        with pytest.raises(openai.APIStatusError) as e:  # nothing generated: 504
            client.completions.create(model=MODEL, prompt="waits", max_tokens=8, extra_body={"timeout": 0.2})
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
        assert c.status()["num_timed_out"] == 2
        assert c.abort(holder.request_id) is True
        drain_stream(holder)
        assert holder.result.finish_reason == "abort"
        idle(d)
        # Decoding: the tokens so far, then finish_reason "timeout".
        stream = c.stream([5, 6, 7, 8], max_tokens=1000, ignore_eos=True, request_timeout=0.3)
        tokens = drain_stream(stream)
        assert stream.result.finish_reason == "timeout" and 0 < len(tokens) == stream.result.completion_tokens < 1000
        chunks = list(client.completions.create(model=MODEL, prompt="decodes", max_tokens=1000, stream=True,
                                                extra_body={"ignore_eos": True, "timeout": 0.3}))
        assert chunks[-1].choices[0].finish_reason == "timeout" and "".join(ch.choices[0].text for ch in chunks)
        # Prefilling: 56 chunks of a long prompt take longer than its timeout.
        long = c.generate(list(range(1, 900)), max_tokens=4, request_timeout=0.01)
        assert (long.finish_reason, long.completion_tokens) == ("timeout", 0)
        s = idle(d)
    assert s["num_timed_out"] == 5 and s["request_timeout"] == 1000
    assert d.stop() == 0


def test_a_request_held_in_front_of_a_full_engine_times_out_at_its_deadline(serve):
    """With the engine's waiting queue full the daemon holds a request back (fair_queue.py);
    its timeout still counts from its arrival, not from when the engine takes it."""
    d = serve("--max-num-seqs", 1, "--num-kv-blocks", 512, "--max-waiting-requests", 16)
    with d.zmq() as c, d.zmq() as other:
        holder = c.stream([5, 6, 7, 8], max_tokens=1000, ignore_eos=True)
        next(holder)                                                  # running
        queued = c.stream([9, 10, 11], max_tokens=4, ignore_eos=True)  # waiting: the engine is full
        deadline = 0.2
        held = other.generate([1, 2, 3], max_tokens=8, request_timeout=deadline)  # held back
        assert (held.finish_reason, held.completion_tokens, held.prompt_tokens) == ("timeout", 0, 3)
        several = other.generate([1, 2, 3], max_tokens=8, n=2, request_timeout=deadline)
        assert [(x.finish_reason, x.completion_tokens) for x in several.completions] == [("timeout", 0)] * 2
        # It ended while the holder still ran: the engine never took it.
        assert c.abort(holder.request_id) is True
        drain_stream(holder)
        assert holder.result.finish_reason == "abort"
        drain_stream(queued)
        assert queued.result.finish_reason == "length"
        s = idle(d)
    assert s["num_timed_out"] == 2 and s["requests_queued"] == 0
    assert d.stop() == 0


# ---- the drain -----------------------------------------------------------------------------------
def test_sigterm_drains_20_streams_to_their_end_while_new_requests_get_503(serve, tiny_models_root):  # noqa: F811
    # The drain must outlast the test's look at the draining daemon: the bundled model writes
    # 20 streams of 500 tokens in ~3 s, which a loaded machine's checks can outlast. A holder of
    # DRAINED tokens on a tiny model of a long context keeps it draining for seconds more, and the
    # grace is long enough for both on a slow machine (the default grace is checked below).
    model = make_tiny_model(tiny_models_root, max_position_embeddings=DRAINED + 64)
    d = serve("--model", model, "--served-model-name", MODEL, "--num-kv-blocks", 3000 + DRAINED // 4,
              "--max-model-len", DRAINED + 64, "--shutdown-grace", 120)
    assert d.status()["shutdown_grace"] == 120.0
    client = d.openai()
    tokens, started, results = 500, [threading.Event() for _ in range(20)], [None] * 20

    def stream(i):
        chunks = []
        for ch in client.completions.create(model=MODEL, prompt=[5, 6, i], max_tokens=tokens, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True}):
            chunks.append(ch)
            started[i].set()
        results[i] = chunks

    with d.zmq() as holder_client:
        holder = holder_client.stream([5, 6, 7], max_tokens=DRAINED, ignore_eos=True)
        next(holder)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(LONG)
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + LONG
        while (health := httpx.get(d.url + "/health", timeout=LONG)).status_code == 200:
            assert time.monotonic() < deadline
        body = health.json()
        assert (health.status_code, body["status"], body["ready"]) == (503, "draining", False)
        assert 0 < body["drain_left_s"] <= 120 and body["requests_in_flight"] >= 1
        ready = httpx.get(d.url + "/ready", timeout=LONG)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="too late", max_tokens=2)
        assert e.value.status_code == 503 and 1 <= int(e.value.response.headers["retry-after"]) <= 120
        with d.zmq() as c:
            with pytest.raises(RequestError) as refused:
                c.generate([1, 2], max_tokens=2)
            assert refused.value.code == P.SHUTTING_DOWN
            s = c.status()
            assert (s["state"], s["ready"], s["refused_shutting_down"]) == ("shutting_down", False, 2)
            assert 'tpserve:draining{model_name="default-model"} 1.0' in c.metrics()
        held = drain_stream(holder)
        assert (holder.result.finish_reason, len(held) + 1) == ("length", DRAINED)
    for t in threads:
        t.join(LONG)
    for chunks in results:
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == tokens
    assert d.wait_gone() == 0


def test_the_default_shutdown_grace_is_30_s(serve):
    assert serve().status()["shutdown_grace"] == 30.0


def test_stop_now_aborts_the_requests_in_flight_and_exits_cleanly(serve):
    d = serve("--shutdown-grace", 600)
    with d.zmq() as c:
        stream = c.stream([5, 6, 7], max_tokens=1000, ignore_eos=True)
        next(stream)
        out = subprocess.run(TPSERVE + ["stop", "--now", "--runtime-dir", d.rd], capture_output=True, text=True,
                             timeout=LONG)
        assert out.returncode == 0, out.stderr
        drain_stream(stream)
        assert (stream.result.finish_reason, stream.result.abort_reason) == ("abort", "shutting_down")
    assert d.wait_gone() == 0
