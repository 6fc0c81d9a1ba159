"""The daemon's front (Server) against a fake engine: protocol handling, robustness, shutdown.

FakeEngine follows tpserve.engine.Engine's interface exactly and emits deterministic tokens,
so these tests exercise the socket loop without loading a model. test_client.py and
test_daemon_fuzz.py import FakeEngine and ServerThread from here. The real engine is driven
end to end in test_cli.py.
"""
from __future__ import annotations

import array
import math
import os
import select
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

from model_factory import tiny_models_root  # noqa: F401
from tpserve.client import protocol as P
from tpserve.client.client import Client, ClientTimeout
from tpserve.server.connections import Connections
from tpserve.client.keys import generate_keypair, load_secret_keys
from tpserve.server.outbox import Peers
from tpserve.client.addresses import (InsecureAddressError, RuntimeDirError, check_address, connect_address,
                                      is_loopback_tcp, read_ready)
from tpserve.server.server import Server, ServerOptions
from tpserve.errors import AdmissionError, ConfigError, InvalidRequestError, OverloadedError, StepFailedError, WorkerDiedError
from tpserve.outputs import EngineOutput
from tpserve.procs import pid_alive
from tpserve.limits import check_request
from tpserve.sampling import SamplingParams

TESTS_DIR = Path(__file__).resolve().parent


class FakeEngine:
    """Engine stand-in: token k of a request is (sum(prompt ids) + 31 k + seed) % vocab, text "<tok> ".

    Prompts of text map each character to ``ord(c) % vocab`` (``tokenize``; a prompt containing
    ``hold_marker`` waits in ``tokenize`` until ``release_tokenize`` is set). Each request holds
    ceil((prompt + max_tokens) / block_size) blocks from admission to finish/abort, so tests can
    see blocks being freed. ``fail_after`` makes step() raise after that many steps;
    ``step_delay`` slows steps down; ``shutdown_delay`` makes shutdown() hang. ``max_running``
    models the scheduler's limit: only the first that many requests (in order of admission)
    advance in a step, the others wait, and ``has_room`` holds while fewer than that many wait.
    While ``paused`` is set, steps advance nothing. ``finished`` lists request ids in the order
    they finished.
    """

    def __init__(self, max_model_len=10**7, num_blocks=10**6, block_size=16, vocab=1000,
                 step_delay=0.0, fail_after=None, shutdown_delay=0.0, eos=None, max_running=None):
        self.config = SimpleNamespace(model="fake", model_path="fake-model", tensor_parallel_size=1,
                                      max_model_len=max_model_len, num_kv_blocks=num_blocks,
                                      block_size=block_size)
        self.vocab = vocab
        self.max_running = max_running  # None: every request advances each step
        self.max_waiting = None  # requests the server may hold back (None: no limit)
        self.hold_marker = "\x00hold\x00"
        self.release_tokenize = threading.Event()
        self.tokenize_started = threading.Event()
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
        self.profiling = False
        self.profiles: list[str] = []
        self.integrity_checks = 0
        self.paused = threading.Event()
        self.finished: list[str] = []
        self.broken = False  # check_integrity fails
        self.lent: list[int] = []  # lend_cores calls

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

    def tokenizer_path(self):
        return None

    def tokenize(self, prompt, add_special_tokens=False):
        if self.hold_marker in prompt:
            self.tokenize_started.set()
            assert self.release_tokenize.wait(60), "the test never released the tokenizer"
        return [ord(c) % self.vocab for c in prompt]

    def add_request(self, request_id, prompt, params=None, *, priority=0, timeout=None, arrival=None):
        params = params or SamplingParams()
        self.last_priority, self.last_timeout = priority, timeout
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt = check_request(prompt, params, self.vocab)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        total = len(ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise AdmissionError(request_id, "max_model_len", total, self.config.max_model_len)
        blocks = math.ceil(total / self.config.block_size)
        if blocks > self.config.num_kv_blocks:
            raise AdmissionError(request_id, "num_kv_blocks", blocks, self.config.num_kv_blocks)
        self.requests[request_id] = dict(ids=ids, params=params, out=[], blocks=blocks)
        self.added.append(request_id)
        return len(ids)

    def add_pooling_request(self, request_id, prompts, params=None, *, priority=0, timeout=None,
                            arrival=None):
        from tpserve.pooling import wrong_runner
        raise InvalidRequestError("runner", wrong_runner("generate", "embed / classify"))

    def lend_cores(self, cores):
        self.lent.append(cores)

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is None:
            return False
        self.aborted.append(request_id)
        return True

    def has_unfinished(self):
        return bool(self.requests)

    def has_room(self):
        return self.max_running is None or len(self.requests) - self.max_running < self.max_running

    def check_queue_room(self, request_id, held):
        if self.max_waiting is not None and held >= self.max_waiting:
            raise OverloadedError(request_id, "max_waiting_requests", held + 1, self.max_waiting, 2.0)

    def health_fd(self):
        return None

    def enable_kv_events(self, capacity=65536):
        self.kv_events_enabled = True

    def drain_kv_events(self, resync=False):
        return []

    def check_integrity(self):
        assert not self.requests, "check_integrity called while requests are unfinished"
        self.integrity_checks += 1
        assert not self.broken, "block 3 is both free and used"

    def check_health(self):
        pass

    def step(self):
        if self.fail_after is not None and self.num_steps >= self.fail_after:
            raise RuntimeError("worker rank 1 died")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        outputs = []
        if self.paused.is_set():
            return outputs
        for rid, r in list(self.requests.items())[:self.max_running]:
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
                self.finished.append(rid)
            outputs.append(EngineOutput(rid, [tok], f"{tok} ", reason is not None, reason,
                                        len(r["ids"]), len(r["out"])))
        return outputs

    def stats(self):
        used = sum(r["blocks"] for r in self.requests.values())
        running = len(self.requests) if self.max_running is None else min(len(self.requests), self.max_running)
        return dict(num_running=running, num_waiting=len(self.requests) - running, kv_blocks_used=used,
                    kv_blocks_total=self.config.num_kv_blocks, prefix_cache_hit_rate=0.0,
                    num_preemptions=0, prompt_tokens=0, generation_tokens=self.generated,
                    tokens_per_s=0.0, model=self.config.model_path, tensor_parallel_size=1)

    def start_profile(self):
        assert not self.profiling
        self.profiling = True

    def stop_profile(self, path):
        assert self.profiling
        self.profiling = False
        self.profiles.append(path)
        return [f"{path}.rank0.json"]

    def shutdown(self):
        self.shutdown_called = True
        time.sleep(self.shutdown_delay)


def short_tmpdir() -> str:
    """A short directory (ipc socket paths are limited to 107 bytes)."""
    return tempfile.mkdtemp(prefix="tps-", dir="/tmp")


class ServerThread:
    """Runs Server(engine).run() on a thread; ``stop()`` shuts it down and returns the exit code."""

    def __init__(self, engine=None, options: ServerOptions | None = None, address: str | None = None,
                 context: zmq.Context | None = None):
        self.engine = engine or FakeEngine()
        self.dir = short_tmpdir()
        self.address = address or f"ipc://{self.dir}/s.sock"
        # No drain by default: these tests stop at once unless they test the drain.
        self.server = Server(self.engine, self.address, options or ServerOptions(shutdown_grace=0.0),
                             context=context)
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

    def final_replies(self, count, timeout=5.0) -> dict:
        """The final reply (done or error) of ``count`` requests, by id, in whatever order
        their messages interleave."""
        finals = {}
        while len(finals) < count:
            m = self.recv(timeout)
            assert m is not None, f"{len(finals)} of {count} answered: {sorted(finals)}"
            if isinstance(m, (P.DoneReply, P.ErrorReply)):
                finals[m.id] = m
        return finals

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


def wait_for_state(r, state, timeout=10.0) -> list:
    """Ask for status over ``r`` until the daemon reports ``state``; returns the other replies."""
    deadline = time.monotonic() + timeout
    others = []
    while True:
        r.send_msg(P.StatusRequest(id="state"))
        while True:
            m = r.recv()
            assert m is not None and time.monotonic() < deadline, f"never reached state {state!r}"
            if isinstance(m, P.StatusReply) and m.id == "state":
                break
            others.append(m)
        if m.stats["state"] == state:
            return others


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
    assert "[0, 2147483647]" in reply.message


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
    # No id: an error with an id would end "dup", which keeps running.
    assert (err.code, err.id, err.field) == (P.DUPLICATE_ID, None, "id") and "'dup'" in err.message
    assert isinstance(raw.recv(), P.DeltaReply)
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
        def add_request(self, request_id, prompt, params, **kw):
            if prompt == "typed":
                raise InvalidRequestError("prompt", "is empty after tokenization")
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
def wait_idle(client: "Raw") -> dict:
    """Status through ``client`` until nothing is in flight (the serving loop keeps turning)."""
    while True:
        client.send_msg(P.StatusRequest(id="s"))
        stats = client.recv().stats
        if stats["requests_in_flight"] == 0:
            return stats


def streamed(msgs) -> tuple[list[int], str]:
    return [t for m in msgs[:-1] for t in m.token_ids], "".join(m.text for m in msgs[:-1])


def test_a_client_that_stops_reading_stalls_nobody_and_gets_everything_later():
    """It is not dropped, and what waits for it stays a few messages: 3000 deltas are merged."""
    with ServerThread(FakeEngine(), ServerOptions(send_hwm=4, max_queued_replies=8)) as s:
        slow = Raw(s.address, {zmq.RCVHWM: 4})
        slow.send_msg(gen("flood", max_tokens=3000))
        fast = Raw(s.address)
        stats = wait_idle(fast)  # served while the slow one reads nothing
        assert stats["kv_blocks_used"] == 0 and s.engine.aborted == []
        fast.send_msg(gen("after", max_tokens=3))
        assert fast.recv_until_done("after")[-1].finish_reason == "length"
        msgs = slow.recv_until_done("flood")
        assert msgs[-1].finish_reason == "length"
        tokens, text = streamed(msgs)
        assert tokens == FakeEngine.expected_tokens("ab", SamplingParams(max_tokens=3000))
        assert text == "".join(f"{t} " for t in tokens)
        assert len(msgs) - 1 < 3000  # deltas that waited were merged
        slow.close()
        fast.close()


class BigTextEngine(FakeEngine):
    """Every token comes with 2 KB of text, so that socket buffers hold few deltas."""

    def step(self):
        return [EngineOutput(o.request_id, o.new_token_ids, o.new_text + "." * 2048, o.finished,
                             o.finish_reason, o.num_prompt_tokens, o.num_completion_tokens)
                for o in super().step()]


def test_deltas_of_a_reused_id_are_not_merged_into_the_previous_request():
    with ServerThread(BigTextEngine(), ServerOptions(send_hwm=2)) as s:
        slow = Raw(s.address, {zmq.RCVHWM: 2})
        fast = Raw(s.address)
        slow.send_msg(gen("r", "ab", max_tokens=500))
        wait_idle(fast)  # "r" finished; its last deltas and done wait for the slow reader
        slow.send_msg(gen("r", "xyz", max_tokens=500))
        wait_idle(fast)
        first, second = slow.recv_until_done("r"), slow.recv_until_done("r")
        assert streamed(first)[0] == FakeEngine.expected_tokens("ab", SamplingParams(max_tokens=500))
        assert streamed(second)[0] == FakeEngine.expected_tokens("xyz", SamplingParams(max_tokens=500))
        assert first[-1].finish_reason == second[-1].finish_reason == "length"
        slow.close()
        fast.close()


def test_a_slowly_reading_client_is_not_dropped():
    """ZeroMQ shows a sender its reader's progress only every half of the reader's receive
    high-water mark (50 messages here, 500 by default), so a reader that takes its time accepts
    nothing for long stretches, longer than any timeout a stopped reader could be caught by. It
    gets every reply, and each of its requests exactly one done; what waits for it stays within
    a few messages per request (its deltas merged)."""
    engine = BigTextEngine(step_delay=0.001)
    with ServerThread(engine, ServerOptions(send_hwm=10, max_queued_replies=32)) as s:
        slow = Raw(s.address, {zmq.RCVHWM: 100})
        ids = [f"s{i}" for i in range(10)] + ["whole0", "whole1"]  # the last two not streamed
        for rid in ids:
            slow.send_msg(gen(rid, max_tokens=400, stream=rid.startswith("s")))
        got: dict[str, list] = {rid: [] for rid in ids}
        texts: dict[str, str] = {rid: "" for rid in ids}
        ends: dict[str, list] = {rid: [] for rid in ids}
        deltas = 0
        while any(not e for e in ends.values()):
            m = slow.recv(30)
            assert m is not None, f"no reply; ended: {[r for r, e in ends.items() if e]}"
            if isinstance(m, P.DeltaReply):
                assert not ends[m.id], f"a delta of {m.id} after its done"
                got[m.id] += m.token_ids
                texts[m.id] += m.text
                deltas += 1
            else:
                ends[m.id].append(m)
                if m.token_ids is not None:
                    got[m.id], texts[m.id] = m.token_ids, m.text
            time.sleep(0.01)  # a slow reader, not a timing under test
        slow.send_msg(P.PingRequest(id="last"))
        assert slow.recv(30) == P.PongReply(id="last")  # nothing more came for the requests
        assert {rid: [(type(m).__name__, m.finish_reason) for m in e] for rid, e in ends.items()} \
            == {rid: [("DoneReply", "length")] for rid in ids}
        expected = FakeEngine.expected_tokens("ab", SamplingParams(max_tokens=400))
        for rid in ids:
            assert got[rid] == expected
            assert texts[rid] == "".join(f"{t} " + "." * 2048 for t in expected)
            assert ends[rid][0].completion_tokens == 400
        assert engine.aborted == []
        assert deltas < 10 * 400  # it fell behind: some deltas were merged
        slow.close()
        assert s.stop() == 0


def test_a_slow_readers_merged_deltas_equal_the_whole_reply_for_each_of_n_completions(tiny_models_root):
    """The real engine, n=2 with log-probabilities and prompt log-probabilities: the slow
    reader's answers to 4000 status requests fill its buffers, so every delta of its request
    waits and is merged; per index, the deltas concatenate to exactly the non-streamed reply."""
    from model_factory import make_tiny_model
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4))
    params = dict(n=2, temperature=0.9, seed=8, max_tokens=60, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    try:
        with ServerThread(engine) as s:
            fast = Raw(s.address)
            fast.send_msg(gen("whole", [5, 6, 7, 8, 9], stream=False, **params))
            whole = fast.recv_until_done("whole", 120)[-1]
            generated = wait_idle(fast)["generation_tokens"]
            slow = Raw(s.address, {zmq.RCVHWM: 2})
            for _ in range(4000):
                slow.send_msg(P.StatusRequest())
            slow.send_msg(gen("s", [5, 6, 7, 8, 9], **params))
            while wait_idle(fast)["generation_tokens"] == generated:
                time.sleep(0.01)  # until "s" has run (to its end: idle); its messages wait for the slow reader
            msgs = [m for m in slow.recv_until_done("s", 60) if m.id == "s"]
            fast.close()
            slow.close()
    finally:
        engine.shutdown()
    deltas, done = msgs[:-1], msgs[-1]
    assert all(isinstance(m, P.DeltaReply) for m in deltas) and isinstance(done, P.DoneReply)
    assert len(deltas) < 2 * 60  # they were merged
    assert deltas[0].prompt_logprobs == whole.prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for c in whole.completions:
        mine = [d for d in deltas if d.index == c["index"]]
        assert [t for d in mine for t in d.token_ids] == c["token_ids"] and len(c["token_ids"]) == 60
        assert "".join(d.text for d in mine) == c["text"]
        assert [e for d in mine for e in d.logprobs] == c["logprobs"]
    assert [(c["index"], c["finish_reason"], c["completion_tokens"]) for c in done.completions] \
        == [(c["index"], c["finish_reason"], c["completion_tokens"]) for c in whole.completions]
    assert done.completion_tokens == whole.completion_tokens == 120


def test_a_client_that_asks_without_ever_reading_is_dropped():
    """Its answers cannot be merged: past max_queued_replies waiting it is dropped, and its
    request in the engine aborted."""
    with ServerThread(FakeEngine(step_delay=0.001), ServerOptions(send_hwm=2, max_queued_replies=50)) as s:
        mute = Raw(s.address, {zmq.RCVHWM: 2, zmq.SNDHWM: 0})
        mute.send_msg(gen("running", max_tokens=10**6))
        for _ in range(5000):  # ~1 MB of answers fill the socket buffers, then the daemon's queue
            mute.send_msg(P.StatusRequest())
        deadline = time.monotonic() + 30
        while client_ids(s.engine.aborted) != ["running"]:
            assert time.monotonic() < deadline, "a client that never reads kept its request"
            time.sleep(0.02)
        other = Raw(s.address)
        other.send_msg(gen("fine", max_tokens=2))
        assert other.recv_until_done("fine")[-1].finish_reason == "length"
        other.close()
        mute.close()
        assert s.stop() == 0


class RefusingSocket:
    """Stands in for the ROUTER socket: accepts ``room`` more frames, then refuses (EAGAIN)."""

    def __init__(self, room=0):
        self.room = room
        self.sent: list = []

    def send_multipart(self, frames, flags=0):
        if self.room <= 0:
            raise zmq.Again()
        self.room -= 1
        self.sent.append(P.decode(frames[1], "reply"))


def lp(k):
    return [-0.5 * k, [[k, -0.5 * k], [k + 1, -1.0 - k]]]


def delta(rid, k):
    """Delta ``k`` of ``rid``: token k, text "<k>,", its log-probability entry."""
    return P.DeltaReply(rid, f"{k},", [k], logprobs=[lp(k)])


def test_waiting_deltas_are_merged_exactly_in_order_per_request():
    sock, gone = RefusingSocket(), []
    peers = Peers(sock, lambda peer, why: gone.append(why))
    peer = peers.peer(b"c")
    peers.send(peer, delta("a", 0))  # refused: the head of the outbox, closed to merging
    for k in range(1, 6):
        peers.send(peer, delta("a", k))
        peers.send(peer, delta("b", 100 + k))
    peers.send(peer, P.PongReply(id="p"))
    peers.send(peer, delta("a", 6))  # joins a's waiting delta, ahead of the pong
    peers.send(peer, P.DoneReply("a", "length", 2, 7))
    peers.send(peer, delta("a", 50))  # the id reused by a new request: not merged into the old one
    assert len(peer.outbox) == 6 and gone == []
    sock.room = 1
    peers.flush()  # sends the head; the merged delta of "a" becomes the head, closed
    peers.send(peer, delta("b", 106))  # b's waiting delta is still open
    sock.room = 100
    peers.flush()
    assert not peer.outbox and peers.get(b"c") is None
    assert sock.sent == [
        delta("a", 0),
        P.DeltaReply("a", "1,2,3,4,5,6,", [1, 2, 3, 4, 5, 6], logprobs=[lp(k) for k in range(1, 7)]),
        P.DeltaReply("b", "101,102,103,104,105,106,", list(range(101, 107)),
                     logprobs=[lp(k) for k in range(101, 107)]),
        P.PongReply(id="p"),
        P.DoneReply("a", "length", 2, 7),
        delta("a", 50),
    ]


def test_waiting_deltas_of_different_completions_are_not_mixed():
    """n > 1: deltas merge per (id, index); the request's first delta keeps the prompt's
    log-probabilities."""
    sock = RefusingSocket()
    peers = Peers(sock, lambda peer, why: None)
    peer = peers.peer(b"c")
    peers.send(peer, P.PongReply(id="p"))
    prompt_lps = [None, lp(7)]
    for k in range(4):
        for index in (0, 1):
            peers.send(peer, P.DeltaReply("a", f"{index}.{k},", [10 * index + k], logprobs=[lp(10 * index + k)],
                                          index=index, prompt_logprobs=prompt_lps if k == index == 0 else None))
    peers.send(peer, P.DoneReply("a", "length", 2, 8))
    sock.room = 100
    peers.flush()
    assert sock.sent[1:] == [
        P.DeltaReply("a", "0.0,0.1,0.2,0.3,", [0, 1, 2, 3], logprobs=[lp(k) for k in range(4)], index=0,
                     prompt_logprobs=prompt_lps),
        P.DeltaReply("a", "1.0,1.1,1.2,1.3,", [10, 11, 12, 13], logprobs=[lp(k) for k in range(10, 14)], index=1),
        P.DoneReply("a", "length", 2, 8),
    ]


def test_a_delta_at_the_head_of_the_outbox_takes_no_more():
    sock = RefusingSocket()
    peers = Peers(sock, lambda peer, why: None)
    peer = peers.peer(b"c")
    peers.send(peer, P.PongReply(id="p"))
    peers.send(peer, delta("a", 0))
    peers.send(peer, delta("a", 1))
    sock.room = 1
    peers.flush()  # the pong leaves; a's merged delta is encoded, refused, kept as it is
    peers.send(peer, delta("a", 2))
    sock.room = 100
    peers.flush()
    assert sock.sent == [P.PongReply(id="p"), P.DeltaReply("a", "0,1,", [0, 1], logprobs=[lp(0), lp(1)]),
                         delta("a", 2)]


def test_a_merged_delta_stops_at_its_limits(monkeypatch):
    import tpserve.server.outbox as outbox
    monkeypatch.setattr(outbox, "MAX_MERGED_TOKENS", 3)
    sock = RefusingSocket()
    peers = Peers(sock, lambda peer, why: None)
    peer = peers.peer(b"c")
    peers.send(peer, P.PongReply(id="p"))
    for k in range(8):
        peers.send(peer, delta("a", k))
    monkeypatch.setattr(outbox, "MAX_MERGED_TOKENS", 10**6)
    monkeypatch.setattr(outbox, "MAX_MERGED_CHARS", 7)
    for k in range(8, 12):
        peers.send(peer, P.DeltaReply("a", "xyz", [], logprobs=None))
    sock.room = 100
    peers.flush()
    got = [(m.text, m.token_ids) for m in sock.sent[1:]]
    assert got == [("0,1,2,", [0, 1, 2]), ("3,4,5,", [3, 4, 5]), ("6,7,xyz", [6, 7]),
                   ("xyzxyz", []), ("xyz", [])]
    assert [m.logprobs for m in sock.sent[1:3]] == [[lp(0), lp(1), lp(2)], [lp(3), lp(4), lp(5)]]


def test_a_peer_with_too_many_waiting_replies_is_dropped():
    sock, gone = RefusingSocket(), []
    peers = Peers(sock, lambda peer, why: gone.append(why), max_queued=5)
    peer = peers.peer(b"c")
    for k in range(100):  # one request's deltas take one place however many they are
        peers.send(peer, delta("a", k))
    assert gone == [] and len(peer.outbox) == 2
    for k in range(3):
        peers.send(peer, P.PongReply(id=f"p{k}"))
    assert gone == []
    peers.send(peer, P.PongReply(id="p3"))
    assert gone == ["not reading: more than 5 replies waiting"]
    assert not peer.outbox and peers.get(b"c") is None


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


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_non_streaming_requests_of_a_vanished_client_are_aborted(transport):
    """Nothing is sent to a non-streaming request before it ends, so only the connection's
    close can tell that nobody waits for it any more."""
    address = None if transport == "ipc" else f"tcp://127.0.0.1:{_free_port()}"
    with ServerThread(FakeEngine(step_delay=0.001), address=address) as s:
        gone = Raw(s.address)
        for i in range(5):
            gone.send_msg(gen(f"n{i}", max_tokens=10**6, stream=False))
        gone.send_msg(P.PingRequest(id="after"))  # answered once the five are admitted
        assert gone.recv() == P.PongReply(id="after")
        gone.close()
        deadline = time.monotonic() + 30
        while sorted(client_ids(s.engine.aborted)) != [f"n{i}" for i in range(5)]:
            assert time.monotonic() < deadline, "requests of a vanished client kept running"
            time.sleep(0.02)
        assert not s.engine.has_unfinished()
        other = Raw(s.address)  # a new connection is served as before
        other.send_msg(gen("next", max_tokens=2, stream=False))
        assert other.recv_until_done("next")[-1].finish_reason == "length"
        other.close()
        assert s.stop() == 0


def test_a_message_that_comes_before_its_accept_was_drained_is_kept():
    """The accept of a connection may be reported after the serving loop drained the monitor
    events and before it reads that connection's first message: the message is answered."""
    d = short_tmpdir()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    connections = Connections(router)
    try:
        router.bind(f"ipc://{d}/r.sock")
        assert connections.drain_events() == []  # drained before the client connects
        client = Raw(f"ipc://{d}/r.sock")
        client.send_msg(P.PingRequest(id="p"))
        assert router.poll(5000)
        parts = router.recv_multipart(copy=False)
        assert connections.attach(parts[0].bytes, parts[-1])
        client.close()
        deadline = time.monotonic() + 30
        while parts[0].bytes not in connections.drain_events():  # and its close is still seen
            assert time.monotonic() < deadline, "the connection's close was not reported"
            time.sleep(0.01)
    finally:
        connections.close()
        router.close(0)
        shutil.rmtree(d, ignore_errors=True)


def test_connections_made_one_after_another_in_a_process_each_get_their_monitor():
    """A closed ROUTER's monitor endpoint stays bound until ZeroMQ reaps it: a new Connections
    (a new Server in the same process) must not ask for the same name. It did when the name
    came from id(), which Python hands out again at once; every later server then failed."""
    context = zmq.Context.instance()
    for _ in range(20):
        router = context.socket(zmq.ROUTER)
        try:
            connections = Connections(router)  # raised "Address already in use" from the second on
            connections.close()
        finally:
            router.close(0)


def test_a_new_connection_on_the_descriptor_of_one_that_closed_is_not_taken_for_it():
    """A client closes and the next one gets its descriptor, both between two of the serving
    loop's drains of the monitor events: the new client's message must not be tied to the old
    connection (whose close, drained next, would then drop the new client's requests)."""
    d = short_tmpdir()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    connections = Connections(router)

    def connect():
        client = Raw(f"ipc://{d}/r.sock")
        client.send_msg(P.PingRequest(id="p"))
        assert router.poll(5000)
        return client, router.recv_multipart(copy=False)
    try:
        router.bind(f"ipc://{d}/r.sock")
        old, a = connect()
        assert connections.attach(a[0].bytes, a[-1]) and connections.drain_events() == []
        # The clients live in this process too, so the kernel may hand the freed descriptor to a
        # client's own socket: try until the daemon's side gets it back.
        for _ in range(50):
            old.close()
            time.sleep(0.05)  # the daemon's side of the old connection closes its descriptor
            new, b = connect()
            if b[-1].get(zmq.SRCFD) == a[-1].get(zmq.SRCFD):
                break
            assert connections.attach(b[0].bytes, b[-1])
            connections.drain_events()
            old, a = new, b
        else:
            raise AssertionError("no new connection got a closed one's descriptor in 50 tries")
        assert connections.attach(b[0].bytes, b[-1])
        gone = connections.drain_events()
        assert a[0].bytes in gone and b[0].bytes not in gone
        new.close()
    finally:
        connections.close()
        router.close(0)
        shutil.rmtree(d, ignore_errors=True)


def test_a_connection_with_many_queued_requests_does_not_hold_up_another():
    """One connection queues 500 requests; another's request, sent after them, is served after
    a few of them, not after all (the scheduler alone serves first come, first served)."""
    engine = FakeEngine(max_running=4)
    engine.paused.set()  # everything is received before anything runs
    with ServerThread(engine) as s:
        flood, other = Raw(s.address), Raw(s.address)
        for i in range(500):
            flood.send_msg(gen(f"f{i}", max_tokens=1, stream=False))
        flood.send_msg(P.PingRequest(id="sent"))
        assert flood.recv(10) == P.PongReply(id="sent")
        other.send_msg(gen("other", max_tokens=1, stream=False))
        other.send_msg(P.PingRequest(id="sent"))
        assert other.recv(10) == P.PongReply(id="sent")
        other.send_msg(P.StatusRequest())
        stats = other.recv().stats
        assert (stats["requests_in_flight"], stats["num_waiting"]) == (501, 501 - 4)
        engine.paused.clear()
        assert other.recv_until_done("other")[-1].finish_reason == "length"
        done = 0
        while done < 500:
            m = flood.recv(10)
            assert m is not None, f"{done} of the flood answered"
            done += isinstance(m, P.DoneReply)
        order = client_ids(engine.finished)
        # 4 running and 4 waiting in the engine, then one from each connection in turn
        assert order.index("other") < 12, order.index("other")
        assert sorted(order) == sorted(["other"] + [f"f{i}" for i in range(500)])
        flood.close()
        other.close()
        assert s.stop() == 0


def test_requests_held_in_the_daemon_count_against_the_waiting_limit():
    """Past the engine's waiting-request limit a request is refused with overloaded at once,
    not held in the daemon's per-connection queue; the held ones still finish."""
    engine = FakeEngine(max_running=2)
    engine.max_waiting = 3  # the daemon may hold 3 requests beyond what the engine takes
    engine.paused.set()
    with ServerThread(engine) as s:
        c = Raw(s.address)
        for i in range(9):
            c.send_msg(gen(f"r{i}", max_tokens=1, stream=False))
        c.send_msg(P.PingRequest(id="sent"))
        refused = []
        while True:
            m = c.recv(10)
            assert m is not None
            if isinstance(m, P.PongReply):
                break
            assert isinstance(m, P.ErrorReply) and m.code == P.OVERLOADED, m
            assert m.limit == "max_waiting_requests" and m.retry_after == 2.0
            refused.append(m.id)
        # 2 running + 2 waiting in the engine (has_room), 3 held: the last 2 refused
        assert refused == ["r7", "r8"]
        c.send_msg(P.StatusRequest())
        stats = c.recv().stats
        assert stats["requests_queued"] == 3 and stats["refused_max_waiting_requests"] == 2
        engine.paused.clear()
        done = [c.recv_until_done(f"r{i}")[-1] for i in range(7)]
        assert all(d.finish_reason == "length" for d in done)
        c.close()
        assert s.stop() == 0


def test_fair_queue_takes_connections_in_turn_and_skips_discarded_entries():
    from tpserve.server.fair_queue import FairQueue
    q = FairQueue()
    for i in range(3):
        q.push("a", f"a{i}", f"A{i}")
    q.push("b", "b0", "B0")
    q.push("c", "c0", "C0")
    q.push("c", "c1", "C1")
    assert q.discard("c0") and not q.discard("c0") and len(q) == 5
    assert [q.pop() for _ in range(6)] == ["A0", "B0", "C1", "A1", "A2", None]
    assert len(q) == 0


def test_requests_per_connection_are_capped():
    engine = FakeEngine()
    engine.paused.set()
    with ServerThread(engine, ServerOptions(max_requests_per_connection=3)) as s:
        r, other = Raw(s.address), Raw(s.address)
        for i in range(3):
            r.send_msg(gen(f"r{i}", max_tokens=2))
        r.send_msg(gen("r3", max_tokens=2))
        e = r.recv()
        assert (type(e), e.code, e.id) == (P.ErrorReply, P.TOO_MANY_REQUESTS, "r3")
        assert "3 requests in flight" in e.message and "--max-requests-per-connection" in e.message
        other.send_msg(gen("o", max_tokens=2))  # another connection has its own allowance
        r.send_msg(P.AbortRequest("r0"))
        assert r.recv_until_done("r0")[-1].finish_reason == "abort"
        r.send_msg(gen("r3", max_tokens=2))  # room again
        engine.paused.clear()
        for rid in ("r1", "r2", "r3"):
            assert r.recv_until_done(rid)[-1].finish_reason == "length"
        assert other.recv_until_done("o")[-1].finish_reason == "length"
        r.close()
        other.close()
        assert s.stop() == 0


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
    # inproc: a sent frame is in the server's queue when send() returns, so no wait is needed
    # to know both frames below are queued before the shutdown begins.
    with ServerThread(engine, address="inproc://tpserve-queued-at-shutdown", context=zmq.Context.instance()) as s:
        r = Raw(s.address)
        r.send_msg(gen("running", max_tokens=10**6))
        assert engine.entered.wait(10)
        r.send_msg(gen("queued", max_tokens=2))  # arrives while the engine is busy
        r.send_msg(P.PingRequest(id="queued-ping"))
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
        early = wait_for_state(r, "shutting_down")
        r.send_msg(gen("late", max_tokens=2))
        r.send_msg(P.PingRequest(id="still"))
        seen = {m.id: m for m in early if not isinstance(m, P.DeltaReply)}
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


def test_a_drain_lets_requests_held_in_the_daemon_finish_too():
    """Requests held back in the daemon's per-connection queue when the drain begins arrived
    before it: they enter the engine and finish like the rest."""
    engine = FakeEngine(max_running=2)
    engine.paused.set()
    with ServerThread(engine, ServerOptions(shutdown_grace=20.0)) as s:
        r = Raw(s.address)
        for i in range(8):
            r.send_msg(gen(f"h{i}", max_tokens=3, stream=False))
        r.send_msg(P.StatusRequest())
        assert r.recv().stats["requests_queued"] == 4  # 4 in the engine (has_room), 4 held
        s.server.request_shutdown()
        wait_for_state(r, "shutting_down")
        engine.paused.clear()
        done = r.final_replies(8)
        assert all(isinstance(m, P.DoneReply) and m.finish_reason == "length" for m in done.values()), done
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


def test_the_engine_is_checked_once_each_time_it_becomes_idle():
    engine = FakeEngine()
    with ServerThread(engine) as s:
        r = Raw(s.address)
        for i in range(3):
            r.send_msg(gen(f"r{i}", max_tokens=3))
            r.recv_until_done(f"r{i}")
            for _ in range(3):  # each pong: the loop went through an idle turn (and sleeps again)
                r.send_msg(P.PingRequest())
                assert isinstance(r.recv(), P.PongReply)
            assert engine.integrity_checks == i + 1
        r.send_msg(gen("gone", max_tokens=10**6))
        r.send_msg(P.AbortRequest("gone"))  # idle again through an abort: checked at the next turn
        assert r.recv_until_done("gone")[-1].finish_reason == "abort"
        # A drain answers at most max_messages_per_step frames, so these pings span new turns.
        for _ in range(ServerOptions().max_messages_per_step + 1):
            r.send_msg(P.PingRequest())
            assert isinstance(r.recv(), P.PongReply)
        assert engine.integrity_checks == 4
        r.close()
        assert s.stop() == 0


def test_a_broken_invariant_when_idle_fails_the_daemon():
    engine = FakeEngine()
    engine.broken = True
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(gen("r", max_tokens=2))
        assert r.recv_until_done("r")[-1].finish_reason == "length"
        s.thread.join(10)
        assert s.exit_code == 1 and "block 3 is both free and used" in s.server.failure
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
        server.peers.try_send = lambda peer, frame: server.peers.drop(peer, "disconnected")  # as on EHOSTUNREACH
        server._dispatch(engine.step())
        assert server._requests == {} and len(server.peers) == 0 and not engine.has_unfinished()
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
    from tpserve.server.daemon import run_daemon
    from tpserve.server.server import ServerOptions
    logging.basicConfig(level="INFO")
    class Announcing(FakeEngine):
        def shutdown(self):
            print("engine shutdown started", flush=True)
            super().shutdown()
    engine = Announcing(shutdown_delay={shutdown_delay})
    code = run_daemon(EngineConfig(), None, {rd!r}, ServerOptions(shutdown_grace={grace}),
                      engine_factory=lambda cfg: engine)
    import gc
    print("shutdown_called", engine.shutdown_called, "heap_frozen", gc.get_freeze_count() > 0, flush=True)
    sys.exit(code)
""")


def wait_for_line(proc, text, timeout=30.0):
    """Read ``proc``'s output until a line containing ``text``."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"{text!r} never printed; got {seen}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            assert line, f"output ended before {text!r}; got {seen}"
            if text in line:
                return
            seen.append(line)


def _spawn_fake_daemon(rd, shutdown_delay=0.0, grace=0.0):
    script = DAEMON_SCRIPT.format(tests=str(TESTS_DIR), rd=rd, shutdown_delay=shutdown_delay, grace=grace)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while not (read_ready(Path(rd)) or {}).get("pid") == proc.pid:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def test_freeze_heap_collects_start_up_garbage_and_freezes_the_rest():
    code = textwrap.dedent("""
        import gc, weakref
        from tpserve.procs import freeze_heap
        class Node: pass
        garbage = Node(); garbage.self = garbage; dead = weakref.ref(garbage); del garbage
        kept = [Node() for _ in range(100)]
        frozen = freeze_heap()
        assert dead() is None, "start-up garbage was frozen"
        assert frozen >= 100 and gc.get_freeze_count() == frozen and gc.isenabled()
        later = Node(); later.self = later; ref = weakref.ref(later); del later
        gc.collect()
        assert ref() is None, "garbage made after the freeze is still collected"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_release_freed_heap_gives_fragmented_free_memory_back():
    """Blocks freed between kept ones stay resident until the heap is trimmed (a model's load
    leaves such holes); release_freed_heap returns their pages to the system."""
    code = textwrap.dedent("""
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        keep, drop = [], []
        for i in range(4000):
            (keep if i % 2 else drop).append(bytearray(100_000))
        drop.clear()
        before = rss()
        from tpserve.procs import release_freed_heap
        assert release_freed_heap()
        print((before - rss()) >> 20)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 100  # of the 200 MB freed


def test_keep_step_heap_reuses_a_freed_step_buffer_without_faulting_its_pages():
    """A step's 48 MiB activation freed, then the next step's 40 MiB one: by default glibc unmaps
    the first and the next step faults every page in again; after keep_step_heap the heap hands
    the freed pages back (minor page faults of the second round near zero). The second buffer is
    smaller so that it fits the freed one whatever small allocations landed beside it."""
    code = textwrap.dedent("""
        import resource, sys, torch
        from tpserve.procs import keep_step_heap
        if sys.argv[1] == "keep":
            assert keep_step_heap()
        def faults(mib):
            t = torch.empty(mib << 20, dtype=torch.uint8)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t.fill_(1)
            n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            del t
            return n
        faults(48)
        print(faults(40))
    """)
    got = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got[mode] = int(out.stdout)
    assert got["default"] > 5000  # 10,240 pages of 4 KiB unless huge pages served them
    assert got["keep"] < 100, got


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
        assert "shutdown_called True heap_frozen True" in out  # before serving (procs.freeze_heap)
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
        wait_for_line(proc, "engine shutdown started")
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
        script = DAEMON_SCRIPT.format(tests=str(TESTS_DIR), rd=rd, shutdown_delay=0.0, grace=0.0)
        second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert f"(pid {proc.pid}) is already running" in second.stderr
        with Client(runtime_dir=rd, timeout=10) as c:  # the first one is untouched
            assert c.status()["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
        shutil.rmtree(rd, ignore_errors=True)


# ---- hardening: one reply per frame, bounded fields, failures contained ----------------------
WIDTH_EDGES = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**31, -2**31 - 1, -2**63,
               float(2**64)]  # 2**64 itself does not fit msgpack; as a float it does


@pytest.mark.parametrize("where", ["v", "prompt[0]", "params.temperature", "params.top_p", "params.top_k",
                                   "params.seed", "params.max_tokens", "params.stop_token_ids[0]"])
def test_every_numeric_field_at_every_width_edge_gets_exactly_one_reply(where):
    with ServerThread(FakeEngine(max_model_len=1000)) as s:
        r = Raw(s.address)
        try:
            for i, value in enumerate(WIDTH_EDGES):
                rid = f"e{i}"
                msg = {"v": 1, "type": "generate", "id": rid, "prompt": [1, 2], "stream": False,
                       "params": {"max_tokens": 2}}
                if where == "v":
                    msg["v"] = value
                elif where == "prompt[0]":
                    msg["prompt"] = [value]
                elif where == "params.stop_token_ids[0]":
                    msg["params"]["stop_token_ids"] = [value]
                else:
                    msg["params"][where.split(".")[1]] = value
                r.send_obj(msg)
                reply = r.recv()
                assert isinstance(reply, (P.DoneReply, P.ErrorReply)), f"{where}={value}: no reply"
                if isinstance(reply, P.ErrorReply) and where != "v" and reply.code != P.ADMISSION:
                    assert reply.id == rid and reply.field is not None
                    assert reply.field.startswith(where.split("[")[0]), (where, value, reply)
                r.send_msg(P.PingRequest(id=f"p{i}"))  # and nothing else for that frame
                assert r.recv() == P.PongReply(id=f"p{i}"), f"{where}={value}: a second reply"
        finally:
            r.close()
        assert s.stop() == 0
        assert s.engine.requests == {}


def test_admission_error_at_the_max_tokens_bound_is_answered():
    with ServerThread(FakeEngine(max_model_len=100)) as s:
        r = Raw(s.address)
        r.send_obj({"v": 1, "type": "generate", "id": "big", "prompt": [1, 2],
                    "params": {"max_tokens": 2**31 - 1}})
        e = r.recv()
        assert (e.code, e.id, e.requested, e.allowed) == (P.ADMISSION, "big", 2**31 + 1, 100)
        r.close()
        assert s.stop() == 0


def test_an_error_reply_that_cannot_encode_still_answers():
    class Overflowing(FakeEngine):
        def add_request(self, request_id, prompt, params=None, **kw):
            raise AdmissionError(request_id, "max_model_len", 2**70, 10)
    with ServerThread(Overflowing()) as s:
        r = Raw(s.address)
        r.send_msg(gen("o"))
        e = r.recv()
        assert (e.code, e.id, e.requested) == (P.ADMISSION, "o", None)
        r.close()
        assert s.stop() == 0


def test_a_failed_step_fails_only_its_requests_and_the_daemon_serves_on():
    class OneBadStep(FakeEngine):
        def step(self):
            bad = [rid for rid, r in self.requests.items() if r["ids"] == [66, 66]]
            if bad:
                for rid in bad:
                    self.abort_request(rid)
                raise StepFailedError(bad, OverflowError("Python int too large to convert to C int"))
            return super().step()
    with ServerThread(OneBadStep()) as s:
        r = Raw(s.address)
        r.send_msg(gen("good", [1, 2], max_tokens=3))
        r.send_msg(gen("bad", [66, 66], max_tokens=3))
        replies = r.final_replies(2)
        assert (replies["bad"].code, replies["bad"].id) == (P.STEP_FAILED, "bad")
        assert "OverflowError" in replies["bad"].message
        assert replies["good"].finish_reason == "length"
        r.send_msg(gen("after", [3], max_tokens=2))
        assert r.recv_until_done("after")[-1].finish_reason == "length"
        r.send_msg(P.StatusRequest())
        stats = r.recv().stats
        assert (stats["state"], stats["requests_in_flight"], stats["kv_blocks_used"]) == ("running", 0, 0)
        r.close()
        assert s.stop() == 0


def test_a_long_prompt_is_tokenized_off_the_serving_loop():
    engine = FakeEngine()
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=16)) as s:
        r = Raw(s.address)
        try:
            huge = "x" * 100 + engine.hold_marker
            r.send_msg(gen("huge", huge, max_tokens=2, stream=False))
            assert engine.tokenize_started.wait(10)
            # The tokenizer is stuck on "huge"; pings, status and short prompts are still served.
            r.send_msg(P.PingRequest(id="p"))
            assert r.recv() == P.PongReply(id="p")
            r.send_msg(gen("short", "hi", max_tokens=2))
            assert r.recv_until_done("short")[-1].finish_reason == "length"
            r.send_msg(gen("huge", "again"))  # still in flight while it is tokenized
            dup = r.recv()
            assert (dup.code, dup.id) == (P.DUPLICATE_ID, None)
            r.send_msg(P.StatusRequest())
            assert r.recv().stats["requests_in_flight"] == 1
            engine.release_tokenize.set()
            done = r.recv_until_done("huge")[-1]
            assert (done.finish_reason, done.prompt_tokens) == ("length", len(huge))
            assert done.token_ids == FakeEngine.expected_tokens(huge, SamplingParams(max_tokens=2))
        finally:
            engine.release_tokenize.set()
            r.close()
        assert s.stop() == 0


def test_the_engine_lends_a_core_while_a_long_prompt_is_tokenized():
    """The tokenizer takes a core while it works: the engine runs on one fewer meanwhile and
    takes it back once the prompt is tokenized."""
    engine = FakeEngine()
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=16)) as s:
        r = Raw(s.address)
        try:
            r.send_msg(gen("long", "y" * 50 + engine.hold_marker, max_tokens=2))
            # Sent at once, so usually drained in the same turn: the core is lent on submission,
            # before the loop answers the next message.
            r.send_msg(P.PingRequest(id="p"))
            assert r.recv() == P.PongReply(id="p")
            assert engine.lent == [1]
            assert engine.tokenize_started.wait(10)
            engine.release_tokenize.set()
            assert r.recv_until_done("long")[-1].finish_reason == "length"
            assert engine.lent == [1, 0]
            r.send_msg(gen("short", "hi", max_tokens=2))  # tokenized inline: nothing is lent
            assert r.recv_until_done("short")[-1].finish_reason == "length"
            assert engine.lent == [1, 0]
        finally:
            engine.release_tokenize.set()
            r.close()
        assert s.stop() == 0


def test_tokenize_answers_the_ids_short_texts_at_once_long_ones_off_the_loop():
    class Special(FakeEngine):
        def tokenize(self, prompt, add_special_tokens=False):
            return ([999] if add_special_tokens else []) + super().tokenize(prompt)
    engine = Special()
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=16, max_requests_per_connection=2)) as s:
        r = Raw(s.address)
        try:
            r.send_msg(P.TokenizeRequest("a", "hi"))
            assert r.recv() == P.TokensReply("a", array.array("i", [ord("h"), ord("i")]))
            r.send_msg(P.TokenizeRequest("a", "hi", add_special_tokens=True))
            assert r.recv() == P.TokensReply("a", array.array("i", [999, ord("h"), ord("i")]))
            long = "z" * 40 + engine.hold_marker
            r.send_msg(P.TokenizeRequest("long", long))
            assert engine.tokenize_started.wait(10)
            r.send_msg(P.TokenizeRequest("long", "again"))  # its id is in flight
            dup = r.recv()
            assert (dup.code, dup.id, dup.field) == (P.DUPLICATE_ID, None, "id")
            r.send_msg(gen("g", "x" * 20, max_tokens=1))  # queued behind it on the tokenizer
            r.send_msg(gen("third", [1], max_tokens=1))  # over the connection's cap of 2
            over = r.recv()
            assert (over.code, over.id) == (P.TOO_MANY_REQUESTS, "third")
            r.send_msg(P.PingRequest(id="p"))
            assert r.recv() == P.PongReply(id="p") and engine.lent == [1]
            engine.release_tokenize.set()
            assert r.recv() == P.TokensReply("long", array.array("i", [ord(c) % 1000 for c in long]))  # before "g"'s
            assert r.recv_until_done("g")[-1].finish_reason == "length"
            r.send_obj({"v": 1, "type": "tokenize", "id": "empty", "text": ""})
            e = r.recv()
            assert (e.code, e.id, e.field) == (P.INVALID_FIELD, "empty", "text")
        finally:
            engine.release_tokenize.set()
            r.close()
        assert s.stop() == 0


def test_an_engine_that_cannot_lend_its_cores_fails_like_a_failed_step():
    class Dead(FakeEngine):
        def lend_cores(self, cores):
            raise RuntimeError("worker 1 is gone")
    engine = Dead()
    s = ServerThread(engine, ServerOptions(inline_tokenize_chars=16))
    r = Raw(s.address)
    try:
        r.send_msg(gen("long", "y" * 50 + engine.hold_marker, max_tokens=2))
        e = r.recv(10)
        assert (e.code, e.id) == (P.INTERNAL, "long") and "worker 1 is gone" in e.message
        s.thread.join(10)
        assert s.exit_code == 1 and "worker 1 is gone" in s.server.failure
    finally:
        engine.release_tokenize.set()
        r.close()
        s.cleanup()


def test_a_text_of_more_ids_than_a_reply_carries_is_refused(monkeypatch):
    monkeypatch.setattr(P, "MAX_TOKENIZED_IDS", 3)
    with ServerThread(FakeEngine(), ServerOptions(inline_tokenize_chars=16)) as s:
        r = Raw(s.address)
        for text in ("four", "x" * 20):  # tokenized at once, and off the loop
            r.send_msg(P.TokenizeRequest("t", text))
            e = r.recv()
            assert (e.code, e.id, e.field) == (P.INVALID_REQUEST, "t", "text") and "more than one reply" in e.message
        r.send_msg(P.TokenizeRequest("t", "abc"))
        assert r.recv() == P.TokensReply("t", array.array("i", [97, 98, 99]))
        r.close()
        assert s.stop() == 0


def test_a_tokenize_without_a_tokenizer_and_one_cut_by_the_shutdown_get_errors():
    class NoTokenizer(FakeEngine):
        def tokenize(self, prompt, add_special_tokens=False):
            if self.hold_marker in prompt:
                return super().tokenize(prompt)
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token ids")
    engine = NoTokenizer()
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=16, shutdown_grace=0.0)) as s:
        r = Raw(s.address)
        try:
            for text in ("short", "long enough to go to the tokenizer"):
                r.send_msg(P.TokenizeRequest("t", text))
                e = r.recv()
                assert (e.code, e.id, e.field) == (P.INVALID_REQUEST, "t", "text") and "no tokenizer" in e.message
            r.send_msg(P.TokenizeRequest("held", "w" * 30 + engine.hold_marker))
            assert engine.tokenize_started.wait(10)
            s.server.request_shutdown()
            e = r.recv()
            assert (e.code, e.id) == (P.SHUTTING_DOWN, "held")
            s.thread.join(10)
            assert s.exit_code == 0
        finally:
            engine.release_tokenize.set()
            r.close()


DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model")


def test_a_long_prompt_is_tokenized_in_the_tokenizer_process():
    """With a tokenizer on disk, a long text is tokenized in a child process (no GIL, no core
    taken from the engine), with the same ids as in process; closing stops the child."""
    from tpserve.tokenizer import load_tokenizer

    class OnDisk(FakeEngine):
        def tokenizer_path(self):
            return DEFAULT_MODEL

        def tokenize(self, prompt, add_special_tokens=False):
            raise AssertionError("a long prompt was tokenized in the serving process")
    engine = OnDisk(vocab=10**5)
    text = " ".join(f"word{i % 97} and more" for i in range(2000))
    expected = load_tokenizer(DEFAULT_MODEL).encode(text, add_special_tokens=False)
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=1000)) as s:
        r = Raw(s.address)
        r.send_msg(gen("long", text, max_tokens=1, stream=False))
        done = r.recv_until_done("long", timeout=120)[-1]
        assert (done.finish_reason, done.prompt_tokens) == ("length", len(expected))
        assert engine.requests == {} and done.token_ids == FakeEngine.expected_tokens(
            expected, SamplingParams(max_tokens=1), vocab=10**5)
        child = s.server._tokenizer_process.pid
        assert child is not None and pid_alive(child)
        r.close()
        assert s.stop() == 0
    assert not pid_alive(child)


def test_abort_while_tokenizing_and_shutdown_while_tokenizing():
    engine = FakeEngine()
    with ServerThread(engine, ServerOptions(inline_tokenize_chars=16, shutdown_grace=0.0)) as s:
        r = Raw(s.address)
        prompt = "y" * 50 + engine.hold_marker
        r.send_msg(gen("a", prompt))
        assert engine.tokenize_started.wait(10)
        r.send_msg(P.AbortRequest("a"))
        done = r.recv()
        assert (done.id, done.finish_reason, done.abort_reason, done.prompt_tokens) == ("a", "abort", "client", 0)
        r.send_msg(gen("b", prompt))  # queued behind "a" on the tokenizer thread
        r.send_msg(P.PingRequest())
        assert r.recv() == P.PongReply()
        s.server.request_shutdown()
        done = r.recv()
        assert (done.id, done.finish_reason, done.abort_reason) == ("b", "abort", "shutting_down")
        engine.release_tokenize.set()
        s.thread.join(10)
        assert s.exit_code == 0 and engine.added == []
        r.close()


def test_a_tokenizer_error_is_the_requests_error():
    class NoTokenizer(FakeEngine):
        def tokenize(self, prompt, add_special_tokens=False):
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token ids")
    with ServerThread(NoTokenizer(), ServerOptions(inline_tokenize_chars=4)) as s:
        r = Raw(s.address)
        r.send_msg(gen("t", "long enough"))
        e = r.recv()
        assert (e.code, e.id, e.field) == (P.INVALID_REQUEST, "t", "prompt")
        r.send_msg(gen("t", [1, 2], max_tokens=1))  # the id is free again
        assert r.recv_until_done("t")[-1].finish_reason == "length"
        r.close()
        assert s.stop() == 0


def test_repeated_keys_and_bytes_keys_are_bad_messages(srv, raw):
    raw.sock.send(b"\x84\xa1v\x01\xa4type\xa4ping\xa2id\xa1a\xa2id\xa1b")
    e = raw.recv()
    assert (e.code, e.id) == (P.BAD_MESSAGE, None) and "more than once" in e.message
    raw.send_obj({"v": 1, "type": "ping", b"id": "x"})
    e = raw.recv()
    assert e.code == P.BAD_MESSAGE and "string" in e.message


def test_too_many_prompt_tokens_names_the_request(srv, raw):
    raw.send_obj({"v": 1, "type": "generate", "id": "many", "prompt": [1] * (P.MAX_PROMPT_TOKENS + 1)})
    e = raw.recv(timeout=30)
    assert (e.code, e.id, e.field) == (P.INVALID_FIELD, "many", "prompt")


def test_explicit_ipc_socket_is_private_and_removed_on_close():
    d = short_tmpdir()
    path = f"{d}/explicit.sock"
    old = os.umask(0)
    try:
        server = Server(FakeEngine(), f"ipc://{path}")
    finally:
        os.umask(old)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        server.close()
    assert not os.path.exists(path)
    shutil.rmtree(d, ignore_errors=True)


def test_engine_and_fake_engine_satisfy_the_serving_interface():
    import inspect

    from tpserve.server.engine_api import ServingEngine
    from tpserve.engine import Engine
    assert isinstance(FakeEngine(), ServingEngine)
    names = [n for n, v in vars(ServingEngine).items() if callable(v) and not n.startswith("_")]
    assert set(names) == {"tokenize", "tokenizer_path", "add_request", "add_pooling_request", "abort_request",
                          "has_unfinished", "has_room",
                          "check_queue_room",
                          "step", "stats",
                          "start_profile", "stop_profile", "lend_cores", "check_integrity", "health_fd", "check_health",
                          "shutdown", "enable_kv_events", "drain_kv_events"}
    def split(fn):
        params = inspect.signature(fn).parameters.values()
        return ([p.name for p in params if p.kind is not p.KEYWORD_ONLY],
                {p.name for p in params if p.kind is p.KEYWORD_ONLY})

    for cls in (Engine, FakeEngine):
        for name in names:
            (want, want_kw), (got, got_kw) = split(getattr(ServingEngine, name)), split(getattr(cls, name))
            assert got[:len(want)] == want and want_kw <= got_kw, (cls.__name__, name, got, got_kw)


def test_profile_records_while_serving_and_answers_with_the_files():
    engine = FakeEngine(step_delay=0.001)
    with ServerThread(engine, ServerOptions(profile_dir="/tmp/traces")) as s:
        r = Raw(s.address)
        r.send_msg(P.ProfileRequest(0.3, id="prof"))
        r.send_msg(P.ProfileRequest(0.3, id="again"))  # one at a time
        e = r.recv()
        assert (e.code, e.id) == (P.INVALID_REQUEST, "again") and "already" in e.message
        r.send_msg(gen("g", max_tokens=3))  # generation goes on meanwhile
        assert r.recv_until_done("g")[-1].finish_reason == "length"
        assert engine.profiling
        reply = r.recv(timeout=10)
        assert isinstance(reply, P.ProfileReply) and reply.id == "prof"
        assert reply.files == [f"{engine.profiles[0]}.rank0.json"]
        assert engine.profiles[0].startswith("/tmp/traces/tpserve-profile-") and not engine.profiling
        r.send_msg(P.ProfileRequest(600, id="cut"))  # a shutdown ends a profile early, answered
        r.send_msg(P.PingRequest())
        assert r.recv() == P.PongReply()
        s.server.request_shutdown()
        reply = r.recv()
        assert isinstance(reply, P.ProfileReply) and reply.id == "cut" and len(engine.profiles) == 2
        s.thread.join(10)
        assert s.exit_code == 0
        r.close()


def test_profile_through_the_client_and_bad_seconds(srv, raw):
    with Client(srv.address, timeout=10) as c:
        assert c.profile(0.05) == [f"{srv.engine.profiles[0]}.rank0.json"]
    with pytest.raises(P.ProtocolError):
        P.encode(P.ProfileRequest(-1.0))
    for bad in (-1, P.MAX_PROFILE_SECONDS + 1, "5", 2**64 - 1):
        raw.send_obj({"v": 1, "type": "profile", "id": "b", "seconds": bad})
        e = raw.recv()
        assert (e.code, e.id, e.field) == (P.INVALID_FIELD, "b", "seconds")
    assert not srv.engine.profiling
