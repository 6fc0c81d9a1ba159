"""The daemon's front (Server) against a fake engine: protocol handling, robustness, shutdown.

FakeEngine follows tpserve.engine.Engine's interface exactly and emits deterministic tokens,
so these tests exercise the socket loop without loading a model. test_client.py and
test_daemon_fuzz.py import FakeEngine and ServerThread from here. The real engine is driven
end to end in test_cli.py.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from tpserve.daemon import protocol as P
from tpserve.daemon.client import Client, ClientTimeout
from tpserve.daemon.keys import generate_keypair, load_secret_keys
from tpserve.daemon.runtime import (InsecureAddressError, RuntimeDirError, check_address, connect_address,
                                    is_loopback_tcp, read_ready)
from tpserve.daemon.server import Server, ServerOptions
from tpserve.errors import AdmissionError, ConfigError, WorkerDiedError
from tpserve.outputs import RequestOutput
from tpserve.sampling import SamplingParams

TESTS_DIR = Path(__file__).resolve().parent


class FakeEngine:
    """Engine stand-in: token k of a request is (sum(prompt ids) + 31 k + seed) % vocab, text "<tok> ".

    Prompts of text map each character to ``ord(c) % vocab``. Each request holds
    ceil((prompt + max_tokens) / block_size) blocks from admission to finish/abort, so tests can
    see blocks being freed. ``fail_after`` makes step() raise after that many steps;
    ``step_delay`` slows steps down; ``shutdown_delay`` makes shutdown() hang.
    """

    def __init__(self, max_model_len=10**7, num_blocks=10**6, block_size=16, vocab=1000,
                 step_delay=0.0, fail_after=None, shutdown_delay=0.0, eos=None):
        self.config = SimpleNamespace(model="fake", model_path="fake-model", tensor_parallel_size=1,
                                      max_model_len=max_model_len, num_kv_blocks=num_blocks,
                                      block_size=block_size, hf_config={"vocab_size": vocab})
        self.vocab = vocab
        self.eos = eos
        self.step_delay = step_delay
        self.fail_after = fail_after
        self.shutdown_delay = shutdown_delay
        self.requests: dict[str, dict] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = 0
        self.generated = 0
        self.shutdown_called = False

    @staticmethod
    def expected_tokens(prompt, params: SamplingParams, vocab=1000, eos=None) -> list[int]:
        ids = [ord(c) % vocab for c in prompt] if isinstance(prompt, str) else list(prompt)
        out = []
        for k in range(params.max_tokens):
            tok = (sum(ids) + 31 * k + (params.seed or 0)) % vocab
            out.append(tok)
            if tok in params.stop_token_ids or (tok == eos and not params.ignore_eos):
                break
        return out

    def add_request(self, request_id, prompt, params):
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = [ord(c) % self.vocab for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: is empty")
        total = len(ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise AdmissionError(request_id, "max_model_len", total, self.config.max_model_len)
        blocks = math.ceil(total / self.config.block_size)
        if blocks > self.config.num_kv_blocks:
            raise AdmissionError(request_id, "num_kv_blocks", blocks, self.config.num_kv_blocks)
        self.requests[request_id] = dict(ids=ids, params=params, out=[], blocks=blocks)
        self.added.append(request_id)
        return len(ids)

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is None:
            return False
        self.aborted.append(request_id)
        return True

    def has_unfinished(self):
        return bool(self.requests)

    def health_fd(self):
        return None

    def check_health(self):
        pass

    def step(self):
        if self.fail_after is not None and self.num_steps >= self.fail_after:
            raise RuntimeError("worker rank 1 died")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            params, k = r["params"], len(r["out"])
            tok = (sum(r["ids"]) + 31 * k + (params.seed or 0)) % self.vocab
            r["out"].append(tok)
            self.generated += 1
            reason = None
            if tok in params.stop_token_ids or (tok == self.eos and not params.ignore_eos):
                reason = "stop"
            elif len(r["out"]) >= params.max_tokens:
                reason = "length"
            if reason:
                del self.requests[rid]
            outputs.append(RequestOutput(rid, [tok], f"{tok} ", reason is not None, reason,
                                         len(r["ids"]), len(r["out"])))
        return outputs

    def stats(self):
        used = sum(r["blocks"] for r in self.requests.values())
        return dict(num_running=len(self.requests), num_waiting=0, kv_blocks_used=used,
                    kv_blocks_total=self.config.num_kv_blocks, prefix_cache_hit_rate=0.0,
                    num_preemptions=0, prompt_tokens=0, generation_tokens=self.generated,
                    tokens_per_s=0.0, model=self.config.model_path, tensor_parallel_size=1)

    def shutdown(self):
        self.shutdown_called = True
        time.sleep(self.shutdown_delay)


def short_tmpdir() -> str:
    """A short directory (ipc socket paths are limited to 107 bytes)."""
    return tempfile.mkdtemp(prefix="tps-", dir="/tmp")


class ServerThread:
    """Runs Server(engine).run() on a thread; ``stop()`` shuts it down and returns the exit code."""

    def __init__(self, engine=None, options: ServerOptions | None = None, address: str | None = None):
        self.engine = engine or FakeEngine()
        self.dir = short_tmpdir()
        self.address = address or f"ipc://{self.dir}/s.sock"
        self.server = Server(self.engine, self.address, options or ServerOptions())
        self.exit_code = None
        self.thread = threading.Thread(target=self._run, name="tpserve-test-server", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.exit_code = self.server.run()
        finally:
            self.server.close()

    def stop(self, timeout=10.0):
        self.server.request_shutdown()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"
        self.cleanup()
        return self.exit_code

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.stop()
        self.cleanup()


class Raw:
    """A bare DEALER for sending arbitrary frames."""

    def __init__(self, address, sockopts=None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for k, v in (sockopts or {}).items():
            self.sock.setsockopt(k, v)
        self.sock.connect(address)

    def send_obj(self, obj):
        self.sock.send(msgpack.packb(obj, use_bin_type=True))

    def send_msg(self, msg):
        self.sock.send(P.encode(msg))

    def recv(self, timeout=5.0):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return P.decode(self.sock.recv(), "reply")

    def recv_until_done(self, rid, timeout=5.0):
        msgs = []
        while True:
            m = self.recv(timeout)
            assert m is not None, f"no reply for {rid}; got {msgs}"
            if m.id == rid:
                msgs.append(m)
                if isinstance(m, (P.DoneReply, P.ErrorReply)):
                    return msgs

    def close(self):
        self.sock.close(linger=0)


@pytest.fixture
def srv():
    s = ServerThread()
    yield s
    if s.thread.is_alive():
        assert s.stop() == 0
    s.cleanup()


@pytest.fixture
def raw(srv):
    r = Raw(srv.address)
    yield r
    r.close()


def client_ids(engine_ids):
    """Strip the per-connection tag the server prefixes to request ids."""
    return [e.split(":", 1)[1] for e in engine_ids]


def gen(rid, prompt="ab", stream=True, **params):
    return P.GenerateRequest(rid, prompt, SamplingParams(**params), stream)


# ---- basic request types -----------------------------------------------------------------
def test_ping_and_status(srv, raw):
    raw.send_msg(P.PingRequest(id="p1"))
    assert raw.recv() == P.PongReply(id="p1")
    raw.send_obj({"v": 1, "type": "ping"})
    assert raw.recv() == P.PongReply()
    raw.send_msg(P.StatusRequest(id="s"))
    reply = raw.recv()
    assert isinstance(reply, P.StatusReply) and reply.id == "s"
    assert reply.stats["pid"] == os.getpid()
    assert reply.stats["kv_blocks_used"] == 0 and reply.stats["state"] == "running"
    assert reply.stats["model"] == "fake-model" and reply.stats["requests_in_flight"] == 0


def test_streaming_generate(srv, raw):
    params = dict(max_tokens=5, seed=3, temperature=0.0)
    raw.send_msg(gen("g", "hello", **params))
    msgs = raw.recv_until_done("g")
    deltas, done = msgs[:-1], msgs[-1]
    expected = FakeEngine.expected_tokens("hello", SamplingParams(**params))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == "".join(f"{t} " for t in expected)
    assert done == P.DoneReply("g", "length", 5, 5)
    assert srv.engine.added == ["1:g"]  # connection tag + client id
    assert client_ids(srv.engine.added) == ["g"]


def test_non_streaming_generate_and_stop_token(srv, raw):
    first = FakeEngine.expected_tokens([1, 2], SamplingParams(max_tokens=10))
    raw.send_msg(gen("n", [1, 2], stream=False, max_tokens=10, stop_token_ids=[first[2]]))
    msgs = raw.recv_until_done("n")
    assert len(msgs) == 1
    done = msgs[0]
    assert done.finish_reason == "stop" and done.token_ids == first[:3]
    assert done.text == "".join(f"{t} " for t in first[:3])
    assert (done.prompt_tokens, done.completion_tokens) == (2, 3)


def test_many_interleaved_requests_on_one_connection(srv, raw):
    for i in range(20):
        raw.send_msg(gen(f"r{i}", "x" * (i + 1), max_tokens=1 + i % 4, seed=i))
    got = {}
    while len(got) < 20:
        m = raw.recv()
        assert m is not None
        if isinstance(m, P.DoneReply):
            got[m.id] = m
    assert all(got[f"r{i}"].completion_tokens == 1 + i % 4 for i in range(20))


# ---- robustness ----------------------------------------------------------------------------
@pytest.mark.parametrize("frames,code", [
    ([b"\xc1"], P.BAD_MESSAGE),
    ([b""], P.BAD_MESSAGE),
    ([msgpack.packb([1, 2])], P.BAD_MESSAGE),
    ([msgpack.packb({"v": 1, "type": "ping"}), b"second"], P.BAD_MESSAGE),
    ([b"", msgpack.packb({"v": 1, "type": "ping"})], P.BAD_MESSAGE),  # a REQ-style envelope
    ([msgpack.packb({"v": 9, "type": "ping"})], P.UNSUPPORTED_VERSION),
    ([msgpack.packb({"v": 1, "type": "reboot"})], P.UNKNOWN_TYPE),
    ([msgpack.packb({"v": 1, "type": "ping", "x": 1})], P.UNKNOWN_FIELD),
    ([msgpack.packb({"v": 1, "type": "generate", "id": "q"})], P.MISSING_FIELD),
    ([msgpack.packb({"v": 1, "type": "generate", "id": "q", "prompt": "a",
                     "params": {"top_p": 2.0}})], P.INVALID_FIELD),
])
def test_bad_frames_get_an_error_and_the_daemon_keeps_serving(srv, raw, frames, code):
    raw.sock.send_multipart(frames)
    reply = raw.recv()
    assert isinstance(reply, P.ErrorReply) and reply.code == code
    assert srv.engine.added == []
    raw.send_msg(gen("ok", max_tokens=2))
    assert raw.recv_until_done("ok")[-1].finish_reason == "length"


def test_error_names_the_id_and_field_when_readable(srv, raw):
    raw.send_obj({"v": 1, "type": "generate", "id": "bad1", "prompt": "a", "params": {"max_tokens": -4}})
    reply = raw.recv()
    assert (reply.code, reply.id, reply.field) == (P.INVALID_FIELD, "bad1", "params.max_tokens")
    assert ">= 1" in reply.message


def test_oversized_frame_is_dropped_and_daemon_keeps_serving(srv, raw):
    raw.sock.send(b"\x00" * (P.MAX_MESSAGE_BYTES + 1024))
    assert raw.recv(timeout=1.0) is None  # dropped by ZMQ (MAXMSGSIZE); the peer is disconnected
    other = Raw(srv.address)
    try:
        other.send_msg(gen("after", max_tokens=2))
        assert other.recv_until_done("after")[-1].finish_reason == "length"
    finally:
        other.close()
    # The same DEALER reconnects by itself and is served again.
    deadline = time.monotonic() + 10
    while True:
        raw.send_msg(P.PingRequest(id="again"))
        if raw.recv(timeout=0.5) == P.PongReply(id="again"):
            break
        assert time.monotonic() < deadline


def test_duplicate_id_is_per_connection(srv, raw):
    raw.send_msg(gen("dup", max_tokens=10**6))
    raw.send_msg(gen("dup", max_tokens=2))
    err = None
    while err is None:
        m = raw.recv()
        if isinstance(m, P.ErrorReply):
            err = m
    assert (err.code, err.id, err.field) == (P.DUPLICATE_ID, "dup", "id")
    other = Raw(srv.address)  # another connection may use the same id
    try:
        other.send_msg(gen("dup", max_tokens=2))
        assert other.recv_until_done("dup")[-1].finish_reason == "length"
    finally:
        other.close()
    raw.send_msg(P.AbortRequest("dup"))
    done = raw.recv_until_done("dup")[-1]
    assert (done.finish_reason, done.abort_reason) == ("abort", "client")
    raw.send_msg(gen("dup", max_tokens=1))  # ids may be reused once finished
    assert raw.recv_until_done("dup")[-1].finish_reason == "length"


def test_abort_unknown_and_known_ids(srv, raw):
    raw.send_msg(P.AbortRequest("nope"))
    reply = raw.recv()
    assert (reply.code, reply.id) == (P.UNKNOWN_ID, "nope")
    raw.send_msg(gen("long", [1, 2], max_tokens=10**6, stream=False))
    raw.send_msg(P.StatusRequest(id="s"))
    while not isinstance(m := raw.recv(), P.StatusReply):
        pass
    assert m.stats["kv_blocks_used"] > 0
    raw.send_msg(P.AbortRequest("long"))
    done = raw.recv_until_done("long")[-1]
    assert done.finish_reason == "abort" and done.abort_reason == "client"
    assert done.completion_tokens == len(done.token_ids) and done.prompt_tokens == 2
    assert client_ids(srv.engine.aborted) == ["long"]
    raw.send_msg(P.StatusRequest(id="s2"))
    assert raw.recv().stats["kv_blocks_used"] == 0
    raw.send_msg(P.AbortRequest("long"))  # a second abort: no longer in flight
    assert raw.recv().code == P.UNKNOWN_ID


def test_abort_of_a_text_prompt_reports_its_token_count(srv, raw):
    # Sent back to back: the abort arrives before the engine ever reports on the request.
    raw.send_msg(gen("txt", "hello", max_tokens=10**6))
    raw.send_msg(P.AbortRequest("txt"))
    done = raw.recv_until_done("txt")[-1]
    assert done.finish_reason == "abort" and done.prompt_tokens == len("hello")


def test_abort_from_another_connection_is_unknown(srv, raw):
    raw.send_msg(gen("mine", max_tokens=10**6))
    raw.recv()
    other = Raw(srv.address)
    try:
        other.send_msg(P.AbortRequest("mine"))
        assert other.recv().code == P.UNKNOWN_ID
    finally:
        other.close()
    assert srv.engine.aborted == []


def test_admission_error_carries_limit_and_numbers():
    engine = FakeEngine(max_model_len=64, num_blocks=3, block_size=16)
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(gen("big", "x" * 10, max_tokens=60))
        e = r.recv()
        assert (e.code, e.id, e.limit, e.requested, e.allowed) == (P.ADMISSION, "big", "max_model_len", 70, 64)
        assert "over by 6" in e.message
        r.send_msg(gen("blocks", "x" * 10, max_tokens=50))
        e = r.recv()
        assert (e.code, e.limit, e.requested, e.allowed) == (P.ADMISSION, "num_kv_blocks", 4, 3)
        r.send_msg(gen("fits", "x" * 10, max_tokens=5))
        assert r.recv_until_done("fits")[-1].finish_reason == "length"
        r.close()
        assert s.stop() == 0


def test_token_ids_outside_the_vocabulary_are_rejected(srv, raw):
    raw.send_msg(gen("v", [1, 999, 1000]))
    e = raw.recv()
    assert (e.code, e.field) == (P.INVALID_FIELD, "prompt[2]")
    assert srv.engine.added == []


def test_engine_input_errors_become_invalid_request():
    class Picky(FakeEngine):
        def add_request(self, request_id, prompt, params):
            if prompt == "typed":
                raise ConfigError("prompt", "is empty after tokenization")
            raise ValueError("the engine does not like this")

    with ServerThread(Picky()) as s:
        r = Raw(s.address)
        r.send_msg(gen("p", "typed"))
        e = r.recv()
        assert (e.code, e.id, e.field, e.message) == (P.INVALID_REQUEST, "p", "prompt", "is empty after tokenization")
        r.send_msg(gen("q", "untyped"))
        e = r.recv()
        assert (e.code, e.id, e.field) == (P.INVALID_REQUEST, "q", None) and "does not like" in e.message
        r.send_msg(P.PingRequest(id="alive"))
        assert r.recv() == P.PongReply(id="alive")
        r.close()


# ---- slow and vanished clients -------------------------------------------------------------
def test_stalled_client_is_dropped_without_stalling_others():
    opts = ServerOptions(client_timeout=0.5, send_hwm=4)
    with ServerThread(FakeEngine(), opts) as s:
        slow = Raw(s.address, {zmq.RCVHWM: 4})
        slow.send_msg(gen("flood", max_tokens=10**6))
        fast = Raw(s.address)
        deadline = time.monotonic() + 30
        while "flood" not in client_ids(s.engine.aborted):
            fast.send_msg(P.PingRequest(id="p"))  # served while the slow one is stuck
            assert fast.recv(timeout=5) == P.PongReply(id="p")
            assert time.monotonic() < deadline, "stalled client was never dropped"
            time.sleep(0.05)
        fast.send_msg(P.StatusRequest(id="s"))
        stats = fast.recv().stats
        assert stats["kv_blocks_used"] == 0 and stats["requests_in_flight"] == 0
        fast.send_msg(gen("after", max_tokens=3))
        assert fast.recv_until_done("after")[-1].finish_reason == "length"
        slow.close()
        fast.close()


def test_disconnected_client_requests_are_aborted(srv):
    gone = Raw(srv.address)
    gone.send_msg(gen("orphan", max_tokens=10**6))
    assert isinstance(gone.recv(), P.DeltaReply)
    gone.close()
    deadline = time.monotonic() + 10
    while client_ids(srv.engine.aborted) != ["orphan"]:
        assert time.monotonic() < deadline, "requests of a vanished client kept running"
        time.sleep(0.02)
    assert not srv.engine.has_unfinished()


# ---- shutdown and failure ------------------------------------------------------------------
def test_shutdown_aborts_in_flight_requests(srv, raw):
    srv.engine.step_delay = 0.005  # a stream the test's reader keeps up with
    raw.send_msg(gen("a", max_tokens=10**6))
    raw.send_msg(gen("b", max_tokens=10**6, stream=False))
    raw.send_msg(P.PingRequest(id="sync"))  # answered after both generates were admitted
    while raw.recv() != P.PongReply(id="sync"):
        pass
    srv.server.request_shutdown()
    dones = {}
    while len(dones) < 2:
        m = raw.recv()
        assert m is not None
        if isinstance(m, P.DoneReply):
            dones[m.id] = m
    assert all((d.finish_reason, d.abort_reason) == ("abort", "shutting_down") for d in dones.values())
    assert len(dones["b"].token_ids) == dones["b"].completion_tokens
    srv.thread.join(10)
    assert srv.exit_code == 0
    assert sorted(client_ids(srv.engine.aborted)) == ["a", "b"]


def test_frames_queued_at_shutdown_are_still_answered():
    class Gated(FakeEngine):
        """step() blocks on the first call until the test opens the gate."""

        def __init__(self):
            super().__init__()
            self.entered, self.gate = threading.Event(), threading.Event()

        def step(self):
            self.entered.set()
            self.gate.wait(10)
            return super().step()

    engine = Gated()
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(gen("running", max_tokens=10**6))
        assert engine.entered.wait(10)
        r.send_msg(gen("queued", max_tokens=2))  # arrives while the engine is busy
        r.send_msg(P.PingRequest(id="queued-ping"))
        time.sleep(0.2)
        s.server.request_shutdown()
        engine.gate.set()
        seen = {}
        while len(seen) < 3:
            m = r.recv()
            assert m is not None, seen
            if not isinstance(m, P.DeltaReply):
                seen[m.id] = m
        assert (seen["queued"].code, seen["queued"].id) == (P.SHUTTING_DOWN, "queued")
        assert seen["queued-ping"] == P.PongReply(id="queued-ping")
        assert seen["running"].abort_reason == "shutting_down"
        s.thread.join(10)
        assert s.exit_code == 0
        r.close()


def test_shutdown_grace_lets_requests_finish_and_refuses_new_ones():
    engine = FakeEngine(step_delay=0.01)
    with ServerThread(engine, ServerOptions(shutdown_grace=20.0)) as s:
        r = Raw(s.address)
        r.send_msg(gen("finishing", max_tokens=40))
        assert isinstance(r.recv(), P.DeltaReply)
        s.server.request_shutdown()
        time.sleep(0.05)
        r.send_msg(gen("late", max_tokens=2))
        r.send_msg(P.PingRequest(id="still"))
        seen = {}
        while "finishing" not in seen or "late" not in seen or "still" not in seen:
            m = r.recv()
            assert m is not None
            if not isinstance(m, P.DeltaReply):
                seen[m.id] = m
        assert seen["finishing"].finish_reason == "length" and seen["finishing"].completion_tokens == 40
        assert (seen["late"].code, seen["late"].id) == (P.SHUTTING_DOWN, "late")
        s.thread.join(10)
        assert s.exit_code == 0 and engine.aborted == []
        r.close()


def test_engine_failure_fails_requests_and_exits_1():
    with ServerThread(FakeEngine(fail_after=3)) as s:
        r = Raw(s.address)
        r.send_msg(gen("doomed", max_tokens=100))
        msgs = r.recv_until_done("doomed")
        err = msgs[-1]
        assert isinstance(err, P.ErrorReply) and err.code == P.INTERNAL and "worker rank 1 died" in err.message
        assert len(msgs) == 4  # three deltas, then the error
        s.thread.join(10)
        assert s.exit_code == 1
        r.close()


class DyingEngine(FakeEngine):
    """FakeEngine whose worker can be killed: like Engine, it reports it through health_fd."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._dead_r, self._dead_w = os.pipe()
        self.dead = False

    def health_fd(self):
        return self._dead_r

    def check_health(self):
        if self.dead:
            raise WorkerDiedError(1, -signal.SIGKILL)

    def kill_worker(self):
        self.dead = True
        os.write(self._dead_w, b"x")

    def shutdown(self):
        super().shutdown()
        os.close(self._dead_r)
        os.close(self._dead_w)


def test_worker_death_while_idle_wakes_the_loop_and_exits_1():
    engine = DyingEngine()
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(P.PingRequest(id="p"))
        assert isinstance(r.recv(), P.PongReply)  # the loop is up and idle in poll
        engine.kill_worker()
        s.thread.join(10)
        assert not s.thread.is_alive() and s.exit_code == 1
        st = s.server.stats()
        assert st["state"] == "failed" and "worker rank 1 died" in st["failure"]
        r.close()
    engine.shutdown()


def test_worker_death_fails_requests_in_flight_with_an_error():
    engine = DyingEngine(step_delay=0.01)
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(gen("waiting", max_tokens=10**6))
        first = r.recv()
        assert isinstance(first, P.DeltaReply) and first.id == "waiting"
        engine.kill_worker()
        msgs = r.recv_until_done("waiting")
        err = msgs[-1]
        assert isinstance(err, P.ErrorReply) and err.code == P.INTERNAL
        assert "WorkerDiedError" in err.message and "rank 1" in err.message
        s.thread.join(10)
        assert s.exit_code == 1
        r.close()
    engine.shutdown()


def test_a_client_gone_when_its_request_finishes_costs_nothing_else():
    """The last delta's send finds the client gone (EHOSTUNREACH drops it) in the step that also
    finishes its request: the daemon must not trip over the request it just dropped."""
    engine, d = FakeEngine(), short_tmpdir()
    server = Server(engine, f"ipc://{d}/s.sock")  # driven by hand, no serving thread
    try:
        server._on_generate(b"gone", P.GenerateRequest(id="r", prompt="ab", params=SamplingParams(max_tokens=1)))
        server._try_send = lambda peer, frame: server._drop_peer(peer, "disconnected")  # as on EHOSTUNREACH
        server._dispatch(engine.step())
        assert server._requests == {} and server._peers == {} and not engine.has_unfinished()
    finally:
        server.close()
        shutil.rmtree(d, ignore_errors=True)


# ---- security ------------------------------------------------------------------------------
@pytest.mark.parametrize("address,loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:1", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://lo:5555", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.1:5555", False),
    ("tcp://eth0:5555", False), ("tcp://example.com:80", False), ("tcp://[::]:5555", False),
])
def test_loopback_detection(address, loopback):
    assert is_loopback_tcp(address) is loopback


def test_address_policy():
    check_address("ipc:///tmp/x.sock", False)
    check_address("tcp://127.0.0.1:5555", False)
    check_address("tcp://0.0.0.0:5555", True)
    with pytest.raises(InsecureAddressError, match="curve-secret-key"):
        check_address("tcp://0.0.0.0:5555", False)
    with pytest.raises(InsecureAddressError, match="supported transports"):
        check_address("udp://1.2.3.4:5", True)
    with pytest.raises(RuntimeDirError, match="longer than"):
        check_address("ipc:///" + "d" * 120 + "/tpserve.sock", False)


def test_connect_address_for_wildcard_binds():
    assert connect_address("tcp://*:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://[::]:5555") == "tcp://[::1]:5555"
    assert connect_address("tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5555"
    assert connect_address("ipc:///tmp/a.sock") == "ipc:///tmp/a.sock"


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_curve_server_ignores_clients_without_its_key(tmp_path):
    pub_file, sec_file = generate_keypair(tmp_path / "server")
    public, secret = load_secret_keys(sec_file)
    opts = ServerOptions(curve_public_key=public, curve_secret_key=secret)
    address = f"tcp://127.0.0.1:{_free_port()}"
    with ServerThread(FakeEngine(), opts, address=address) as s:
        with Client(address, timeout=0.5) as plain:
            with pytest.raises(ClientTimeout, match="within 0.5 s"):
                plain.ping()
        wrong_public, _ = zmq.curve_keypair()
        with Client(address, timeout=0.5, server_public_key=wrong_public) as wrong:
            with pytest.raises(ClientTimeout):
                wrong.ping()
        with Client(address, timeout=10, server_public_key=pub_file) as good:
            assert good.generate("hi", max_tokens=3).completion_tokens == 3
        assert len(s.engine.added) == 1  # nothing from the clients without the key got through
        assert s.stop() == 0


def test_curve_client_allow_list(tmp_path):
    _, sec_file = generate_keypair(tmp_path / "server")
    allowed_pub, allowed_sec = generate_keypair(tmp_path / "clients", name="alice")
    _, other_sec = generate_keypair(tmp_path / "others", name="mallory")
    public, secret = load_secret_keys(sec_file)
    opts = ServerOptions(curve_public_key=public, curve_secret_key=secret,
                         curve_client_keys_dir=str(tmp_path / "clients"))
    address = f"tcp://127.0.0.1:{_free_port()}"
    with ServerThread(FakeEngine(), opts, address=address) as s:
        with Client(address, timeout=0.5, server_public_key=public, client_keys=other_sec) as mallory:
            with pytest.raises(ClientTimeout):
                mallory.ping()
        with Client(address, timeout=10, server_public_key=public, client_keys=allowed_sec) as alice:
            assert alice.ping() > 0
        assert s.stop() == 0


# ---- run_daemon in a real process: pid/ready files and signals --------------------------------
DAEMON_SCRIPT = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {tests!r})
    from test_daemon import FakeEngine
    from tpserve.config import EngineConfig
    from tpserve.daemon.daemon import run_daemon
    from tpserve.daemon.server import ServerOptions
    logging.basicConfig(level="INFO")
    engine = FakeEngine(shutdown_delay={shutdown_delay})
    code = run_daemon(EngineConfig(), None, {rd!r}, ServerOptions(), engine_factory=lambda cfg: engine)
    print("shutdown_called", engine.shutdown_called, flush=True)
    sys.exit(code)
""")


def _spawn_fake_daemon(rd, shutdown_delay=0.0):
    script = DAEMON_SCRIPT.format(tests=str(TESTS_DIR), rd=rd, shutdown_delay=shutdown_delay)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while not (read_ready(Path(rd)) or {}).get("pid") == proc.pid:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def test_daemon_process_sigterm_aborts_in_flight_and_cleans_up():
    rd = short_tmpdir()
    proc = _spawn_fake_daemon(rd)
    try:
        assert sorted(os.listdir(rd)) == ["tpserve.pid", "tpserve.ready", "tpserve.sock"]
        assert (os.stat(rd).st_mode & 0o777) == 0o700
        with Client(runtime_dir=rd, timeout=10) as c:
            stream = c.stream("hello", max_tokens=10**6)
            next(stream)
            assert c.status()["pid"] == proc.pid
            proc.send_signal(signal.SIGTERM)
            for _ in stream:
                pass
            assert (stream.result.finish_reason, stream.result.abort_reason) == ("abort", "shutting_down")
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "shutdown_called True" in out
        assert os.listdir(rd) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)


def test_daemon_second_signal_exits_at_once():
    rd = short_tmpdir()
    proc = _spawn_fake_daemon(rd, shutdown_delay=120.0)  # engine.shutdown() hangs
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # stuck in engine.shutdown()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
        assert proc.returncode == 1
        assert not (Path(rd) / "tpserve.pid").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)


def test_second_daemon_on_the_same_runtime_dir_is_refused():
    rd = short_tmpdir()
    proc = _spawn_fake_daemon(rd)
    try:
        script = DAEMON_SCRIPT.format(tests=str(TESTS_DIR), rd=rd, shutdown_delay=0.0)
        second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert f"(pid {proc.pid}) is already running" in second.stderr
        with Client(runtime_dir=rd, timeout=10) as c:  # the first one is untouched
            assert c.status()["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
        shutil.rmtree(rd, ignore_errors=True)
