"""Property tests of the KV tiers' scheduler side: random workloads on the fake runner of
test_scheduler_properties.py, whose KV cache holds a digest of each position's whole prefix,
with a fake worker that saves blocks (digests and tokens) into a host and a disk dict, loads
them back after a random number of steps, and loses some disk blocks on the way (a corrupt
file). A wrong load, a block reused while it loads, a lost save or a wrong cached-token count
changes the tokens: every output must equal the plain sequential reference, every step keeps
the scheduler's and the tiers' invariants, and at the end the fake worker's tiers hold exactly
the index's entries and every block is free."""
from __future__ import annotations

import random
import tempfile

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from test_scheduler_properties import FakeRunner, Harness, add_st
from tpserve.kv_tiers import files
from tpserve.kv_tiers.connector import DISK
from tpserve.kv_tiers.index import KVTierIndex


class TierRunner(FakeRunner):
    """FakeRunner plus a worker side of the tiers over its digest KV cache."""

    def __init__(self, num_blocks, block_size, vocab, salt, rng: random.Random, corrupt: float):
        super().__init__(num_blocks, block_size, vocab, salt)
        self.rng = rng
        self.corrupt = corrupt
        self.host: dict[int, tuple] = {}
        self.disk: dict[int, tuple] = {}
        self.jobs: dict[int, list] = {}  # job id -> [steps left, items]
        self.loading: set[int] = set()   # blocks being written by a job

    def _block(self, b):
        bs = self.bs
        return self.kv[b * bs:(b + 1) * bs].copy(), self.kv_tokens[b * bs:(b + 1) * bs].copy()

    def handle(self, meta: dict | None, wait: bool = False):
        if not meta:
            return None
        for b, h, parent, tokens, to_host, to_disk in meta.get("save", ()):
            assert b not in self.loading, f"saving block {b} while a load writes it"
            data = self._block(b)
            assert list(data[1]) == list(tokens), "a saved block's KV is not of its tokens"
            if to_host:
                self.host[h] = data
            if to_disk:
                self.disk[h] = data
        for h in meta.get("drop_host", ()):
            self.host.pop(h, None)
        for h in meta.get("drop_disk", ()):
            self.disk.pop(h, None)
        for job_id, items in meta.get("load", ()):
            self.jobs[job_id] = [self.rng.randrange(0, 4), items]
            self.loading.update(it[0] for it in items)
        results = {}
        for job_id in meta.get("poll", ()):
            job = self.jobs[job_id]
            if job[0] > 0 and not wait:
                job[0] -= 1
                continue
            oks = []
            for b, h, parent, tokens, src in job[1]:
                data = self.host.get(h) if src != DISK else None
                if data is None and self.rng.random() >= self.corrupt:
                    data = self.disk.get(h)
                if data is not None and tokens is not None:
                    assert list(data[1]) == list(tokens)
                if data is not None:
                    bs = self.bs
                    self.kv[b * bs:(b + 1) * bs], self.kv_tokens[b * bs:(b + 1) * bs] = data
                oks.append(int(data is not None))
                self.loading.discard(b)
            del self.jobs[job_id]
            results[job_id] = oks
        return results


class TierHarness(Harness):
    def __init__(self, *args, host_blocks, disk_blocks, corrupt, seed, **kw):
        super().__init__(*args, **kw)
        bs, blocks = self.cfg.block_size, self.cfg.num_kv_blocks
        self.runner = TierRunner(blocks, bs, kw.get("vocab", 6), kw.get("salt", 0), random.Random(seed),
                                 corrupt)
        self.dir = tempfile.mkdtemp(prefix="tpserve-kvt-")
        self.tiers = KVTierIndex(bs, 1, host_blocks, self.dir if disk_blocks else None,
                                 disk_blocks * files.file_size(bs, 1), {"test": True})
        self.s.attach_kv_tiers(self.tiers)

    def step(self):
        s = self.s
        self.timed_out.update(q.request_id for q in s.expire(self.clock))
        s.check_integrity()
        self.clock += 1
        batch = s.schedule()
        if not batch:
            if s.kv_has_work():
                s.kv_results(self.runner.handle(s.kv_meta(wait=True), wait=True))
            s.check_integrity()
            return batch
        plan = s.build_plan(batch)
        results = self.runner.handle(plan.args.get("kv"))
        for b in self.runner.loading:  # nothing this step reads or writes is being loaded
            assert b not in plan.block_tables, f"block {b} is in a plan while it loads"
        tokens = self.runner.run(plan)
        s.kv_results(results)
        s.postprocess(batch, tokens, None)
        s.check_integrity()
        return batch

    def check_tiers(self):
        t, r = self.tiers, self.runner
        assert set(r.host) == set(t.host) and set(r.disk) == set(t.disk)
        assert not t.jobs and not t._pins and not r.jobs and not r.loading


# Three long prefixes that a small pool cannot hold together: they leave it and come back.
BASES = [[(7 * k + 3 * i) % 5 + 1 for i in range(14)] for k in range(3)]
prefix_add_st = st.tuples(st.just("add"),
                          st.builds(lambda k, n, tail: BASES[k][:n] + tail, st.integers(0, 2),
                                    st.integers(6, 14), st.lists(st.integers(0, 5), max_size=3)),
                          st.integers(1, 6), st.booleans(), st.just([]), st.just(1), st.just(0),
                          st.one_of(st.none(), st.none(), st.none(), st.integers(0, 12)))
op_st = st.one_of(add_st, prefix_add_st, prefix_add_st, st.tuples(st.just("step")),
                  st.tuples(st.just("step")), st.tuples(st.just("step")),
                  st.tuples(st.just("abort"), st.integers(0, 50)),
                  st.tuples(st.just("preempt"), st.integers(0, 50)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 3, 4]), pool_tokens=st.integers(12, 22),
       max_num_seqs=st.sampled_from([1, 2, 4]), max_batched=st.integers(1, 16), salt=st.integers(0, 1000),
       policy=st.sampled_from(["mixed", "prefill-first"]), host_blocks=st.integers(0, 12),
       disk_blocks=st.integers(0, 12), corrupt=st.sampled_from([0.0, 0.3, 0.6]),
       seed=st.integers(0, 1000), initial=st.lists(prefix_add_st, min_size=1, max_size=6),
       ops=st.lists(op_st, max_size=50))
def test_random_workloads_with_tiers_match_the_reference(bs, pool_tokens, max_num_seqs, max_batched, salt,
                                                         policy, host_blocks, disk_blocks, corrupt, seed,
                                                         initial, ops):
    if not host_blocks and not disk_blocks:
        host_blocks = 4
    h = TierHarness(bs, -(-pool_tokens // bs), max_num_seqs, max_batched, 40, True, vocab=6, salt=salt,
                    policy=policy, host_blocks=host_blocks, disk_blocks=disk_blocks, corrupt=corrupt,
                    seed=seed)
    h.run(initial + ops)
    h.drain()
    h.check_outputs()
    h.check_tiers()
    st_ = h.s.stats()
    event(f"tier loads: {st_['kv_offload_host_loads'] + st_['kv_offload_disk_loads'] > 0}")
    event(f"failed disk loads: {st_['kv_offload_disk_corrupt'] > 0}")
    event(f"preempted: {st_['num_preemptions'] > 0}")


def test_a_workload_that_reloads_prefixes_uses_both_tiers():
    """A fixed workload (shared prefixes through a pool smaller than two of them) loads from both
    tiers, and still matches the reference."""
    rng = np.random.default_rng(0)
    base = [rng.integers(1, 6, size=12).tolist() for _ in range(3)]
    h = TierHarness(2, 10, 2, 8, 40, True, vocab=6, salt=1, policy="mixed", host_blocks=8, disk_blocks=30,
                    corrupt=0.0, seed=0)
    for rnd in range(4):
        for b in base:
            h.add(b + [1 + rnd], 3, ignore_eos=True)
            for _ in range(3):
                h.step()
    h.drain()
    h.check_outputs()
    h.check_tiers()
    st_ = h.s.stats()
    assert st_["kv_offload_host_loads"] > 0 and st_["kv_offload_disk_loads"] > 0
