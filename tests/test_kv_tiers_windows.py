"""KV tiers with sliding-window KV groups (kv_tiers/index.py ``match_groups``,
BlockManager.tiered_hits).

Scheduler side: the fake windowed runner of test_scheduler_windows.py (each slot holds the
digest of its whole prefix and the group that wrote it; every query checks every key its
group's window reads) with a fake worker that saves each group's blocks into a host and a disk
dict, loads them back after a few steps and loses some on the way. A block loaded into the
wrong group or position, a window missing a block, or a wrong cached-token count changes the
tokens or fails an assertion. End to end: tiny random-weight Gemma 3 and Mistral models (8-token
window) serve an evicted prefix longer than the window from host RAM, then from disk, with the
log-probabilities of the prefix cache and of a computation from nothing."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from model_factory import tiny_models_root  # noqa: F401
from test_scheduler_windows import GEMMA_LIKE, run_workload
from test_window_kv_engine import path_of
from tpserve import LLM, SamplingParams
from tpserve.blockpool.kv_events import BlockStored
from tpserve.kv_tiers import files
from tpserve.kv_tiers.connector import DISK
from tpserve.kv_groups import kv_cache_groups
from tpserve.kv_tiers.index import KVTierIndex


class WindowTierWorker:
    """The tiers' worker side over WindowedRunner's slots (digest, token) and their owners."""

    def __init__(self, runner, rng: random.Random, lose: float):
        self.runner, self.rng, self.lose = runner, rng, lose
        self.host: dict[int, tuple] = {}
        self.disk: dict[int, tuple] = {}
        self.jobs: dict[int, list] = {}
        self.loading: set[int] = set()
        self.loaded = 0

    def _block(self, b):
        bs, r = self.runner.bs, self.runner
        return r.kv[b * bs:(b + 1) * bs].copy(), r.owner[b * bs:(b + 1) * bs].copy()

    def handle(self, meta: dict):
        bs, r = self.runner.bs, self.runner
        for b, h, parent, tokens, to_host, to_disk in meta.get("save", ()):
            assert b not in self.loading, f"saving block {b} while a load writes it"
            data = self._block(b)
            assert list(data[0][:, 1]) == list(tokens), "a saved block's KV is not of its tokens"
            if to_host:
                self.host[h] = data
            if to_disk:
                self.disk[h] = data
        for h in meta.get("drop_host", ()):
            self.host.pop(h, None)
        for h in meta.get("drop_disk", ()):
            self.disk.pop(h, None)
        for job_id, items in meta.get("load", ()):
            self.jobs[job_id] = [self.rng.randrange(0, 3), items]
            self.loading.update(it[0] for it in items)
        results = {}
        for job_id in meta.get("poll", ()):
            job = self.jobs[job_id]
            if job[0] > 0 and not meta.get("wait"):
                job[0] -= 1
                continue
            oks = []
            for b, h, parent, tokens, src in job[1]:
                data = self.host.get(h) if src != DISK else None
                if data is None and self.rng.random() >= self.lose:
                    data = self.disk.get(h)
                if data is not None:
                    r.kv[b * bs:(b + 1) * bs], r.owner[b * bs:(b + 1) * bs] = data
                    self.loaded += 1
                oks.append(int(data is not None))
                self.loading.discard(b)
            del self.jobs[job_id]
            results[job_id] = oks
        return results or None


def with_tiers(host_blocks: int, disk_blocks: int, tmp_dir, seed: int = 0, lose: float = 0.0):
    """A ``run_workload(tiers=...)`` hook: an index of ``host_blocks`` / ``disk_blocks`` blocks
    (one byte each) and the fake worker; both are kept in ``made``."""
    made = {}

    def attach(sched, runner):
        index = KVTierIndex(runner.bs, 1, host_blocks, str(tmp_dir) if disk_blocks else None,
                            disk_blocks * files.file_size(runner.bs, 1))
        sched.attach_kv_tiers(index)
        made["index"], made["worker"] = index, WindowTierWorker(runner, random.Random(seed), lose)
        return made["worker"]

    return attach, made


def check_tiers_exact(made) -> None:
    index, worker = made["index"], made["worker"]
    assert not index.jobs and not index._pins and not worker.jobs and not worker.loading
    assert set(worker.host) == set(index.host)
    assert set(worker.disk) == set(index.disk)


def shared_prefix_prompts(rng: random.Random, n: int, length: int, vocab: int = 50) -> list[list[int]]:
    """Rounds of distinct prompts of ``length`` tokens, each of the first two coming back with a
    suffix after the others pushed it out of the pool."""
    bases = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]
    return bases + [bases[0] + [7, 3], bases[1]] + bases[2:] + [bases[0], bases[1] + [9]]


@pytest.mark.parametrize("bs", [4, 1, 3])
def test_evicted_prefixes_longer_than_the_window_come_back_from_the_tiers(bs, tmp_path):
    prompts = shared_prefix_prompts(random.Random(bs), 4, 30)
    attach, made = with_tiers(120 // bs, 400 // bs, tmp_path)
    s = run_workload(GEMMA_LIKE, bs, 200 // bs, prompts, 12, max_num_seqs=2, arrive_every=12, tiers=attach)
    index = made["index"]
    assert index.counters["host_loads"] > 0 and index.counters["disk_loads"] > 0
    assert made["worker"].loaded == index.counters["host_loads"] + index.counters["disk_loads"]
    jobs = index.counters["host_load_jobs"] + index.counters["disk_load_jobs"]
    # (a fully cached prompt recomputes its last token)
    assert index.hit_tokens > 0 and s.prefix_cache_hit_tokens >= index.hit_tokens - jobs
    check_tiers_exact(made)


def test_a_load_that_misses_a_block_readmits_the_sequence(tmp_path):
    """Half the disk reads fail: a grouped load is all or nothing, the sequence is admitted again."""
    prompts = shared_prefix_prompts(random.Random(3), 4, 30)
    attach, made = with_tiers(0, 200, tmp_path, seed=1, lose=0.5)
    run_workload(GEMMA_LIKE, 2, 60, prompts * 2, 8, max_num_seqs=2, arrive_every=10, tiers=attach)
    index = made["index"]
    assert index.counters["disk_corrupt"] > 0 and index.counters["disk_loads"] > 0
    check_tiers_exact(made)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
# A decode that preempts its only runner for the blocks a sequence loaded from the disk tier holds:
# that sequence runs in the same step (an empty step used to fail the loop's check).
@example(layers=GEMMA_LIKE, bs=4, host=0, disk=28, seed=1, lose=0.0, arrive_every=4, preempt_every=5)
@given(layers=st.sampled_from([GEMMA_LIKE, [4, 4], [3, None, 9, 3, None, 9]]), bs=st.sampled_from([1, 2, 4]),
       host=st.integers(0, 40), disk=st.integers(0, 80), seed=st.integers(0, 1000),
       lose=st.sampled_from([0.0, 0.3]), arrive_every=st.sampled_from([0, 4, 9]),
       preempt_every=st.sampled_from([0, 5]))
def test_random_workloads_with_tiers_match_the_reference(layers, bs, host, disk, seed, lose, arrive_every,
                                                         preempt_every, tmp_path_factory):
    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng, 4, rng.randrange(5, 25), vocab=6)
    attach, made = with_tiers(host, disk, tmp_path_factory.mktemp("tiers"), seed, lose)
    # A pool of one or two sequences: the prompts push each other out of it.
    need = -(-(max(map(len, prompts)) + 8) // bs) * len(kv_cache_groups(layers))
    run_workload(layers, bs, need + rng.randrange(need), prompts, 8, max_num_seqs=2,
                 arrive_every=arrive_every, preempt_every=preempt_every, vocab=11, tiers=attach)
    check_tiers_exact(made)


# ---- end to end -------------------------------------------------------------------------------
BS = 4
P = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(40)] for _ in range(6)]  # 5 windows of 8 tokens


def gen(llm, prompt):
    out = llm.generate([prompt], P, use_tqdm=False)[0]
    c = out.outputs[0]
    return list(c.token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs], \
        out.num_cached_tokens


def tier_stats(llm) -> dict:
    return {k[len("kv_offload_"):]: v for k, v in llm.engine.stats().items() if k.startswith("kv_offload_")}


@pytest.mark.parametrize("arch, kv", [("gemma3", "auto"), ("mistral", "auto"), ("gemma3", "int8")])
def test_windowed_model_serves_an_evicted_prefix_from_host_then_disk(arch, kv, tiny_models_root,  # noqa: F811
                                                                     tmp_path):
    """(An int8 cache's blocks carry their scales: docs/kv_int8.md.)"""
    path = path_of(tiny_models_root, arch)
    a, others = PROMPTS[0], PROMPTS[1:]
    kw = dict(dtype="float32", num_kv_blocks={"gemma3": 48, "mistral": 16}[arch], block_size=BS,
              kv_cache_dtype=kv, attention_backend="cpu")
    with LLM(str(path), **kw) as ref:  # no tiers, no cache hit: computed from nothing
        want = gen(ref, a)
        bm = ref.engine.scheduler.block_manager
        assert all(g.window == 8 for g in bm.groups[arch == "gemma3":])
        groups, block_bytes = len(bm.groups), ref.engine.executor.runner.block_bytes
        # What a hit of the prompt's 10 blocks needs: a full group all 10, a sliding group the
        # blocks its last query's window reads (8 and 9).
        needed = sum(10 if g.window is None else 10 - (40 - g.window) // BS for g in bm.groups)
    host_gb = 2 * 10 * groups * block_bytes / (1 << 30)  # about two prompts' blocks of every group
    with LLM(str(path), kv_offload_host_gb=host_gb, kv_offload_dir=str(tmp_path), **kw) as llm:
        assert gen(llm, a)[:2] == want[:2]
        pool = gen(llm, a)
        assert pool == (want[0], want[1], 39)  # the prefix cache: the same logits
        gen(llm, others[0]), gen(llm, others[1])
        before = tier_stats(llm)
        assert before["host_saves"] >= 10
        assert gen(llm, a) == pool  # from the host tier: bit-identical
        s = tier_stats(llm)
        assert s["host_loads"] > before["host_loads"] and s["disk_loads"] == before["disk_loads"]
        for p in others[1:5]:  # the host tier lets go of it; the disk keeps it
            gen(llm, p)
        before = tier_stats(llm)
        assert gen(llm, a) == pool  # from disk
        s = tier_stats(llm)
        assert s["disk_loads"] > before["disk_loads"] and s["disk_corrupt"] == 0
        assert s["hit_tokens"] >= 2 * 8
        eng = llm.engine
        eng.check_integrity()
        tiers, worker = eng.scheduler.kv_tiers, eng.executor.runner.kv_tiers
        assert not tiers.jobs and not tiers._pins and set(worker.host) == set(tiers.host)
        assert worker.block_bytes == tiers.block_bytes
        bm = eng.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    with LLM(str(path), kv_offload_dir=str(tmp_path), **kw) as llm:  # a restart: disk only
        assert gen(llm, a) == pool
        s = tier_stats(llm)
        assert s["disk_loads"] == needed and s["disk_corrupt"] == 0
        llm.engine.check_integrity()


def test_tier_events_name_the_group(tiny_models_root):  # noqa: F811
    from tpserve.blockpool.kv_events import KVEventSink, resync_events
    path = path_of(tiny_models_root, "gemma3")
    kw = dict(dtype="float32", num_kv_blocks=48, block_size=BS, kv_offload_host_gb=1e-4)
    with LLM(str(path), **kw) as llm:
        bm = llm.engine.scheduler.block_manager
        bm.kv_events = KVEventSink()
        for p in PROMPTS[:4]:
            gen(llm, p)
        host = [e for e in bm.kv_events.drain() if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert {e.group_idx for e in host} == set(range(len(bm.groups)))
        assert all((e.kv_cache_spec_sliding_window is not None) == (e.group_idx > 0) for e in host)
        tiers = llm.engine.scheduler.kv_tiers
        replay = resync_events([], BS, tiers.tier_blocks())
        assert {e.group_idx for e in replay if isinstance(e, BlockStored)} == set(range(len(bm.groups)))


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_keep_each_groups_blocks(tiny_models_root, tmp_path):  # noqa: F811
    path = path_of(tiny_models_root, "gemma3")
    a, others = PROMPTS[0], PROMPTS[1:4]
    kw = dict(dtype="float32", num_kv_blocks=48, block_size=BS, tensor_parallel_size=2,
              kv_offload_dir=str(tmp_path))
    with LLM(str(path), kv_offload_host_gb=0.001, **kw) as llm:
        first = gen(llm, a)
        pool = gen(llm, a)
        for p in others:
            gen(llm, p)
        before = tier_stats(llm)
        got = gen(llm, a)
        assert tier_stats(llm)["host_loads"] > before["host_loads"]
        assert got == pool and got[:2] == first[:2]
        llm.engine.check_integrity()
        fp = llm.engine.scheduler.kv_tiers.fingerprint
    for rank in (0, 1):
        assert len(list(files.rank_dir(tmp_path, fp, rank).glob("*.kv"))) >= 14
    with LLM(str(path), **kw) as llm:
        assert gen(llm, a) == pool
        assert tier_stats(llm)["disk_loads"] == 14  # the full group's 10 blocks, 2 of each window's
