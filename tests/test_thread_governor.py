"""ThreadGovernor: a CPU rank's thread count follows the CPU time other processes take."""
import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve.config import EngineConfig
from tpserve.engine import Engine
from tpserve.sampling import SamplingParams
from tpserve.workers import thread_governor
from tpserve.workers.thread_governor import ThreadGovernor, read_busy_seconds


class Machine:
    """A fake clock, /proc/stat busy time and own CPU time, advanced by ``run``."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` of wall time in which this process used ``ours`` cores, others ``others``."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def governor(self, threads: int, cpus: int) -> ThreadGovernor:
        return ThreadGovernor(threads, interval=0.5, busy=lambda: self.busy, own=lambda: self.own,
                              clock=lambda: self.now, cpus=cpus)


def test_a_busy_neighbour_takes_a_thread_and_a_quiet_machine_gives_it_back():
    m = Machine()
    g = m.governor(2, cpus=2)
    m.run(0.6, ours=2, others=0)
    assert g.tick() == 2 and g.others == 0
    m.run(0.6, ours=1.33, others=0.67)  # one busy process beside two spinning threads
    assert g.tick() == 1 and g.others == pytest.approx(0.67)
    m.run(0.6, ours=1, others=1)  # it keeps its core: stay at one
    assert g.tick() == 1
    m.run(0.6, ours=1, others=0.3)  # between the margins: no flip
    assert g.tick() == 1
    m.run(0.6, ours=1, others=0.1)
    assert g.tick() == 2


def test_it_looks_at_most_once_per_interval_and_moves_one_thread_at_a_time():
    m = Machine()
    g = m.governor(8, cpus=8)
    m.run(0.2, ours=2, others=6)
    assert g.tick() == 8  # too soon to look
    m.run(0.4, ours=2, others=6)
    assert g.tick() == 7
    m.run(0.1, ours=2, others=6)
    assert g.tick() == 7
    for want in (6, 5, 4, 3, 2, 2):  # six cores busy elsewhere: two threads, then steady
        m.run(0.5, ours=2, others=6)
        assert g.tick() == want


def test_the_ceiling_is_the_lent_share_and_never_below_one():
    m = Machine()
    g = m.governor(4, cpus=4)
    assert g.set_max(2) == 2 and g.tick() == 2
    assert g.set_max(0) == 1
    m.run(0.6, ours=1, others=4)
    assert g.tick() == 1
    m.run(0.6, ours=0, others=0)
    assert g.tick() == 1  # the ceiling holds with the cores idle
    assert g.set_max(4) == 4


def test_without_a_reading_the_count_stays():
    g = ThreadGovernor(2, busy=lambda: None, cpus=2)
    assert g.tick() == 2 and g.threads == 2


def test_proc_stat_is_read_for_all_cpus_and_a_subset():
    every = read_busy_seconds(None)
    assert every is not None and every > 0
    assert 0 <= read_busy_seconds(frozenset({0})) <= every
    assert read_busy_seconds(frozenset()) == 0


def test_the_runner_steps_with_the_governors_count(tiny_models_root, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TPSERVE_THREAD_GOVERNOR", "0")
    assert not thread_governor.enabled()
    monkeypatch.setenv("TPSERVE_THREAD_GOVERNOR", "1")
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    own = torch.get_num_threads()
    seen = []
    with Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, block_size=16)) as engine:
        runner = engine.executor.runner
        assert isinstance(runner.governor, ThreadGovernor) and runner.governor.max_threads == own

        def tokens(rid):
            engine.add_request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0.0))
            out = []
            while engine.has_unfinished():
                out += [t for o in engine.step() for t in o.new_token_ids]
                seen.append(torch.get_num_threads())
            return out
        before = tokens("own")
        runner.governor.tick = lambda: 1  # as if another process kept the other cores busy
        try:
            assert tokens("one") == before and len(before) == 6
            assert seen[-1] == 1
        finally:
            engine.lend_cores(0)  # the share again, as a runner's lent cores come back
    assert torch.get_num_threads() == own
