"""The daemon's front under pressure, against a fake engine: refusals (overloaded, draining),
priority and timeout fields, the drain and its stop-now, also through real signals.

The real engine's side of the same (scheduler, queue limits, deadlines) is tested in
test_scheduler_pressure.py and test_engine_pressure.py; a real daemon in test_pressure_daemon.py.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from test_daemon import FakeEngine, Raw, ServerThread, _spawn_fake_daemon, gen, short_tmpdir, wait_for_state
from tpserve.client import protocol as P
from tpserve.client.client import Client, RequestError
from tpserve.server.server import ServerOptions
from tpserve.errors import OverloadedError
from tpserve.outputs import EngineOutput

STEP_S = 0.01  # PressureEngine's virtual seconds per step


class PressureEngine(FakeEngine):
    """FakeEngine with a queue limit (``cap`` unfinished requests, then OverloadedError) and
    timeouts on a virtual clock: every step is STEP_S seconds, so a request with timeout t gets
    floor(t / STEP_S) tokens, then ends with "timeout"."""

    def __init__(self, cap=10**6, **kw):
        super().__init__(**kw)
        self.cap = cap
        self.seen: dict[str, tuple] = {}
        self.deadlines: dict[str, float] = {}

    def add_request(self, request_id, prompt, params=None, *, priority=0, timeout=None, arrival=None):
        if len(self.requests) >= self.cap:
            raise OverloadedError(request_id, "max_waiting_requests", len(self.requests) + 1, self.cap, 2.5)
        n = super().add_request(request_id, prompt, params, priority=priority, timeout=timeout, arrival=arrival)
        self.seen[request_id] = (priority, timeout)
        if timeout is not None:
            self.deadlines[request_id] = self.num_steps * STEP_S + timeout
        return n

    def step(self):
        now = (self.num_steps + 1) * STEP_S
        expired = [rid for rid, d in self.deadlines.items() if d < now and rid in self.requests]
        for rid in expired:
            r = self.requests.pop(rid)
            del self.deadlines[rid]
        if expired:
            return [EngineOutput(rid, [], "", True, "timeout", 2, len(r["out"])) for rid in expired]
        return super().step()


def test_a_full_queue_answers_overloaded_with_the_limit_and_a_retry_estimate():
    engine = PressureEngine(cap=2, step_delay=0.005)
    with ServerThread(engine) as s:
        r = Raw(s.address)
        r.send_msg(gen("a", max_tokens=10**6))
        r.send_msg(gen("b", max_tokens=10**6))
        r.send_msg(gen("c", max_tokens=3))
        msgs = r.recv_until_done("c")
        e = msgs[-1]
        assert (e.code, e.id, e.limit, e.requested, e.allowed, e.retry_after) == \
            (P.OVERLOADED, "c", "max_waiting_requests", 3, 2, 2.5)
        with Client(s.address, timeout=10) as c:
            stats = c.status()
            assert stats["refused_max_waiting_requests"] == 1 and stats["refused_shutting_down"] == 0
            assert 'tpserve:requests_refused_total{model_name="fake-model",reason="max_waiting_requests"} 1.0' \
                in c.metrics()
            with pytest.raises(RequestError) as err:
                c.generate([1, 2], max_tokens=2)
            assert err.value.code == P.OVERLOADED and err.value.retry_after == 2.5
        r.send_msg(P.AbortRequest("a"))
        r.recv_until_done("a")
        r.send_msg(gen("c", max_tokens=3))             # room again
        assert r.recv_until_done("c")[-1].finish_reason == "length"
        r.close()


def test_priority_and_timeout_reach_the_engine_and_the_default_timeout_applies():
    engine = PressureEngine()
    with ServerThread(engine, ServerOptions(shutdown_grace=0.0, request_timeout=7.0)) as s:
        r = Raw(s.address)
        r.send_msg(gen("plain", max_tokens=2))
        r.send_msg(P.GenerateRequest("set", "ab", P.SamplingParams(max_tokens=2), True, 3, 2.0))
        for rid in ("plain", "set"):
            assert r.recv_until_done(rid)[-1].finish_reason == "length"
        assert [v for k, v in sorted(engine.seen.items())] == [(0, 7.0), (3, 2.0)]
        for field, value in (("priority", 2**31), ("priority", 1.5), ("timeout", 0), ("timeout", -1),
                             ("timeout", float("nan"))):
            r.send_obj({"v": 1, "type": "generate", "id": "bad", "prompt": "ab", field: value})
            e = r.recv()
            assert (e.code, e.id, e.field) == (P.INVALID_FIELD, "bad", field), (field, value, e)
        r.close()


def test_a_request_past_its_timeout_ends_with_finish_reason_timeout():
    engine = PressureEngine()
    with ServerThread(engine) as s, Client(s.address, timeout=10) as c:
        stream = c.stream([1, 2], max_tokens=10**6, request_timeout=5.5 * STEP_S)
        tokens = [t for d in stream for t in d.token_ids]
        assert (stream.result.finish_reason, stream.result.completion_tokens, len(tokens)) == ("timeout", 5, 5)
        result = c.generate([1, 2], max_tokens=10**6, request_timeout=0.5 * STEP_S)
        assert (result.finish_reason, result.completion_tokens, result.token_ids) == ("timeout", 0, [])
        assert not engine.requests


def test_the_drain_finishes_what_is_in_flight_and_refuses_the_rest():
    engine = PressureEngine(step_delay=0.005)
    with ServerThread(engine, ServerOptions(shutdown_grace=60.0)) as s:
        r = Raw(s.address)
        for i in range(3):
            r.send_msg(gen(f"s{i}", max_tokens=60))
        r.send_msg(gen("whole", max_tokens=60, stream=False))
        r.send_msg(P.PingRequest(id="sync"))
        early = []
        while (m := r.recv()) != P.PongReply(id="sync"):
            early.append(m)
        s.server.request_shutdown()
        early += wait_for_state(r, "shutting_down")
        r.send_msg(P.StatusRequest(id="st"))
        r.send_msg(gen("late", max_tokens=2))
        seen = {m.id: m for m in early if not isinstance(m, P.DeltaReply)}
        while not all(k in seen for k in ("s0", "s1", "s2", "whole", "late", "st")):
            m = r.recv()
            assert m is not None, seen
            if not isinstance(m, P.DeltaReply):
                seen[m.id] = m
        assert all((seen[k].finish_reason, seen[k].completion_tokens) == ("length", 60)
                   for k in ("s0", "s1", "s2", "whole"))
        late = seen["late"]
        assert (late.code, late.id) == (P.SHUTTING_DOWN, "late") and 1 <= late.retry_after <= 60
        st = seen["st"].stats
        assert (st["state"], st["ready"]) == ("shutting_down", False) and 0 < st["drain_left_s"] <= 60
        s.thread.join(10)
        assert s.exit_code == 0 and engine.aborted == []
        r.close()


def test_stop_now_ends_the_drain_at_once():
    engine = PressureEngine(step_delay=0.005)
    with ServerThread(engine, ServerOptions(shutdown_grace=600.0)) as s:
        r = Raw(s.address)
        r.send_msg(gen("long", max_tokens=10**6))
        assert isinstance(r.recv(), P.DeltaReply)
        s.server.request_shutdown()
        wait_for_state(r, "shutting_down")
        s.server.request_shutdown(now=True)
        done = r.recv_until_done("long")[-1]
        assert (done.finish_reason, done.abort_reason) == ("abort", "shutting_down")
        s.thread.join(10)
        assert s.exit_code == 0
        r.close()


@pytest.mark.parametrize("how", ["second SIGTERM", "SIGUSR1"])
def test_stop_now_signals_abort_a_draining_daemon_and_exit_cleanly(how):
    rd = short_tmpdir()
    proc = _spawn_fake_daemon(rd, grace=600.0)
    try:
        with Client(runtime_dir=rd, timeout=10) as c:
            stream = c.stream("hello", max_tokens=10**6)
            next(stream)
            if how == "second SIGTERM":
                proc.send_signal(signal.SIGTERM)
                while c.status()["state"] != "shutting_down":
                    pass
                next(stream)                      # draining: the stream goes on
                with pytest.raises(RequestError) as e:
                    c.generate("new", max_tokens=1)
                assert e.value.code == P.SHUTTING_DOWN
                proc.send_signal(signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGUSR1)
            for _ in stream:
                pass
            assert (stream.result.finish_reason, stream.result.abort_reason) == ("abort", "shutting_down")
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "shutdown_called True" in out and os.listdir(rd) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)
