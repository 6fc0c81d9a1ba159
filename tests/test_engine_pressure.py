"""The engine under pressure, in process: priority and timeout fields, timeouts of whole request
families, a full queue. The engine's clock is replaced, so nothing here depends on timing."""
from __future__ import annotations

import pytest

import tpserve.engine as engine_module
from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.engine import Engine
from tpserve.errors import ConfigError, InvalidFieldError, OverloadedError


class Clock:
    """Stands in for the engine module's ``time``: ``monotonic()`` is ``now``."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3")


@pytest.fixture(scope="module")
def engine(model):
    with Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=16, block_size=4,
                             scheduling_order="priority", max_waiting_requests=3,
                             max_waiting_tokens=200)) as e:
        yield e


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(engine_module, "time", c)
    return c


def run(engine, limit=500, until=None):
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished() or (until is not None and until()):
            break
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).append(o)
    return outs


def idle(engine):
    engine.check_integrity()
    return engine.stats()["kv_blocks_used"] == 0 and not engine.requests and not engine.families


P = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("kw,field", [
    (dict(priority=2**31), "priority"), (dict(priority=1.5), "priority"), (dict(priority=True), "priority"),
    (dict(timeout=0), "timeout"), (dict(timeout=-1.0), "timeout"), (dict(timeout=float("inf")), "timeout"),
    (dict(timeout="5"), "timeout"), (dict(timeout=2e6), "timeout"),
])
def test_priority_and_timeout_bounds_name_the_field(engine, kw, field):
    with pytest.raises(InvalidFieldError) as e:
        engine.add_request("bad", [5, 6, 7], P, **kw)
    assert e.value.field == field and "bad" not in engine.families and idle(engine)


def test_a_timeout_ends_every_completion_of_a_request_in_any_state(engine, clock):
    engine.add_request("fam", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                                             n=3), timeout=10.0)
    engine.add_request("other", [9, 8, 7], P)
    outs = run(engine, until=lambda: len(engine.requests) == 3 and engine.scheduler.running
               and all(len(r.seq.completion_token_ids) >= 2 for r in engine.requests.values()
                       if r.family.request_id == "fam"))
    assert ("other", 0) in outs and outs[("other", 0)][-1].finish_reason == "length"
    clock.now += 10.0
    ended = engine.step()
    assert sorted(o.index for o in ended) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "timeout" and o.request_id == "fam" for o in ended)
    assert idle(engine) and engine.stats()["num_timed_out"] == 3


def test_a_request_timed_out_while_waiting_reports_nothing_generated(engine, clock):
    engine.add_request("long", list(range(5, 50)), SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True))
    engine.step()                                     # 12 of 16 blocks
    engine.add_request("late", list(range(60, 80)), P, timeout=1.0, priority=3)   # 7 blocks: waits
    engine.step()
    assert engine.scheduler.get("late").status.name == "WAITING"
    clock.now += 1.0
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.num_completion_tokens) == ("late", "timeout", 0)
    run(engine)
    assert idle(engine)


def test_a_full_queue_refuses_with_a_retry_estimate_and_queues_nothing(engine):
    engine.add_request("hold", list(range(5, 50)), SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True))
    engine.step()
    for i in range(3):
        engine.add_request(f"q{i}", list(range(60, 80)), P)
    with pytest.raises(OverloadedError) as e:
        engine.add_request("refused", [1, 2, 3], SamplingParams(n=4))
    assert e.value.limit == "max_waiting_requests" and 1 <= e.value.retry_after <= 60
    assert "refused" not in engine.families and engine.scheduler.num_refused["max_waiting_requests"] == 1
    outs = run(engine)
    assert sorted(k[0] for k in outs) == ["hold", "q0", "q1", "q2"] and idle(engine)


def test_the_daemon_holds_nothing_back_under_priority_and_held_requests_count(engine, model):
    """has_room: always under "priority" (its queue orders by priority); check_queue_room
    counts the requests a daemon holds back with the engine's waiting ones."""
    assert engine.has_room()
    engine.check_queue_room("a", held=2)  # 0 waiting + 2 held < 3
    with pytest.raises(OverloadedError) as e:
        engine.check_queue_room("b", held=3)
    assert (e.value.limit, e.value.requested, e.value.allowed) == ("max_waiting_requests", 4, 3)
    with Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=16, block_size=4,
                             max_num_seqs=2)) as fcfs:
        assert fcfs.has_room()
        for i in range(2):
            fcfs.add_request(f"w{i}", [5, 6, 7], P)
        assert not fcfs.has_room()  # a step's worth waits: the daemon holds the next one


def test_offline_generate_takes_vllm_priorities_and_timeouts(model):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    with LLM(str(model), dtype="float32", num_kv_blocks=64, scheduling_order="priority") as llm:
        outs = llm.generate(prompts, P, use_tqdm=False, priority=[2, 0, 1], timeout=[None, 1e-9, None])
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "timeout", "length"]
        assert outs[1].outputs[0].token_ids == [] and len(outs[0].outputs[0].token_ids) == 8
        with pytest.raises(ConfigError) as e:
            llm.generate(prompts, P, use_tqdm=False, priority=[0])
        assert e.value.field == "priority"
    with LLM(str(model), dtype="float32", num_kv_blocks=64) as llm:  # fcfs: a priority is refused
        with pytest.raises(InvalidFieldError) as e:
            llm.generate(prompts, P, use_tqdm=False, priority=[0, 1, 0])
        assert e.value.field == "priority" and "fcfs" in e.value.reason
        assert llm.engine.families == {}
