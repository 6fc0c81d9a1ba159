"""Host cost of one step: schedule + build_plan + postprocess, per sequence in the step.

Two workloads, no model (sampled tokens are drawn up front), each at block sizes 16 and 256:

- decode: 512 decoding sequences for a few hundred steps;
- mixed: the same 512 decoding sequences while long prompts (2,048 tokens) arrive one after
  another and are prefilled in chunks of a 256-token share of the step budget, so every step
  is a mixed step (all decodes, then a chunk; finished prompts join the decoders).

One line per workload and block size with tpserve's cost and, measured in the same run on the
same workload, the cost of a straightforward per-sequence implementation in the style of the
seed (Python loops over sequences and chunk tokens for scheduling, plan lists and
postprocessing), written below as the peer.

    .venv/bin/python scripts/bench_scheduler.py [--seqs 512] [--steps 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np
import xxhash

from tpserve.config import EngineConfig
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Scheduler, Sequence

EOS = 0


# ---- the peer: a seed-style per-sequence implementation --------------------------------------

class PeerSeq:
    def __init__(self, token_ids, max_tokens, bs):
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_table: list[int] = []
        self.max_tokens = max_tokens
        self.ignore_eos = False
        self.temperature, self.top_k, self.top_p, self.seed = 0.7, -1, 1.0, 0
        self.bs = bs
        self.finished = False
        self.num_computed = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def last_token(self):
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_block_num_tokens(self):
        return len(self.token_ids) - (len(self.block_table) - 1) * self.bs

    def block(self, i):
        return self.token_ids[i * self.bs:(i + 1) * self.bs]


class PeerBlock:
    def __init__(self, block_id):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, -1, []


class PeerBlockManager:
    def __init__(self, num_blocks, bs):
        self.bs = bs
        self.blocks = [PeerBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids, prefix=-1):
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self):
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        self.used_block_ids.add(block_id)
        return block_id

    def allocate(self, seq):
        for _ in range((len(seq) + self.bs - 1) // self.bs):
            seq.block_table.append(self._allocate_block())

    def can_append(self, seq):
        return len(self.free_block_ids) >= ((len(seq) - 1) % self.bs == 0)

    def may_append(self, seq):
        if (len(seq) - 1) % self.bs == 0:
            seq.block_table.append(self._allocate_block())

    def hash_last_full_block(self, seq):
        i = (len(seq) - 1) // self.bs - 1
        table = seq.block_table
        prefix = self.blocks[table[i - 1]].hash if i > 0 else -1
        token_ids = seq.block(i)
        h = self.compute_hash(token_ids, prefix)
        block = self.blocks[table[i]]
        block.hash, block.token_ids = h, token_ids
        self.hash_to_block_id[h] = table[i]


class PeerScheduler:
    def __init__(self, num_blocks, bs, max_num_seqs):
        self.bm = PeerBlockManager(num_blocks, bs)
        self.bs = bs
        self.max_num_seqs = max_num_seqs
        self.running: deque[PeerSeq] = deque()
        self.waiting: deque[PeerSeq] = deque()

    def schedule_decode(self):
        scheduled = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                raise RuntimeError("the benchmark pool is sized to avoid preemption")
            else:
                self.bm.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def build_plan(self, seqs):
        bs = self.bs
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        temperatures, top_ks, top_ps, seeds, sample_steps = [], [], [], [], []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * bs + seq.last_block_num_tokens - 1)
            temperatures.append(seq.temperature)
            top_ks.append(seq.top_k)
            top_ps.append(seq.top_p)
            seeds.append(seq.seed)
            sample_steps.append(seq.num_completion_tokens)
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        cu_k = [0]
        for n in context_lens:
            cu_k.append(cu_k[-1] + n)
        i32 = np.int32
        return dict(input_ids=np.array(input_ids, i32), positions=np.array(positions, i32),
                    slot_mapping=np.array(slot_mapping, i32), context_lens=np.array(context_lens, i32),
                    cu_seqlens_q=np.arange(len(seqs) + 1, dtype=i32), cu_seqlens_k=np.array(cu_k, i32),
                    block_tables=np.array(block_tables, i32),
                    logits_indices=np.arange(len(seqs), dtype=i32),
                    temperatures=np.array(temperatures, np.float32), top_ks=np.array(top_ks, i32),
                    top_ps=np.array(top_ps, np.float32), seeds=np.array(seeds, np.int64),
                    sample_steps=np.array(sample_steps, i32))

    def build_mixed_plan(self, seqs, chunk_seq, start, n, sampled):
        """Decode rows of ``seqs``, then ``n`` prompt tokens of ``chunk_seq`` from ``start``."""
        plan = {k: v.tolist() for k, v in self.build_plan(seqs).items()}
        bs = self.bs
        for p in range(start, start + n):
            plan["input_ids"].append(chunk_seq.token_ids[p])
            plan["positions"].append(p)
            plan["slot_mapping"].append(chunk_seq.block_table[p // bs] * bs + p % bs)
        plan["cu_seqlens_q"].append(plan["cu_seqlens_q"][-1] + n)
        plan["context_lens"].append(start + n)
        plan["cu_seqlens_k"].append(plan["cu_seqlens_k"][-1] + start + n)
        width = max(len(plan["block_tables"][0]), len(chunk_seq.block_table))
        tables = [row + [-1] * (width - len(row)) for row in plan["block_tables"]]
        tables.append(chunk_seq.block_table + [-1] * (width - len(chunk_seq.block_table)))
        plan["block_tables"] = tables
        if sampled:
            plan["logits_indices"].append(plan["cu_seqlens_q"][-1] - 1)
            for k, v in (("temperatures", chunk_seq.temperature), ("top_ks", chunk_seq.top_k),
                         ("top_ps", chunk_seq.top_p), ("seeds", chunk_seq.seed),
                         ("sample_steps", 0)):
                plan[k].append(v)
        dtypes = dict(temperatures=np.float32, top_ps=np.float32, seeds=np.int64)
        return {k: np.array(v, dtypes.get(k, np.int32)) for k, v in plan.items()}

    def step_mixed(self, budget, tokens):
        """One mixed step: every decode, then the front waiting prompt's next chunk."""
        seqs = self.schedule_decode()
        chunk_seq = self.waiting[0]
        if not chunk_seq.block_table:
            self.bm.allocate(chunk_seq)
        start = chunk_seq.num_computed
        n = min(len(chunk_seq) - start, budget - len(seqs))
        sampled = start + n == len(chunk_seq)
        plan = self.build_mixed_plan(seqs, chunk_seq, start, n, sampled)
        self.postprocess(seqs, tokens[:len(seqs)])
        chunk_seq.num_computed = start + n
        if sampled:
            self.waiting.popleft()
            chunk_seq.token_ids.append(int(tokens[len(seqs)]))
            self.running.append(chunk_seq)
        return plan, len(seqs) + 1

    def postprocess(self, seqs, token_ids):
        out = []
        for seq, tok in zip(seqs, token_ids.tolist()):
            seq.token_ids.append(tok)
            if (len(seq) - 1) % self.bs == 0:
                self.bm.hash_last_full_block(seq)
            if (not seq.ignore_eos and tok == EOS) or seq.num_completion_tokens == seq.max_tokens:
                seq.finished = True
            out.append(seq)
        return out


# ---- workload ----------------------------------------------------------------------------------

def workload(num_seqs, steps, bs, seed=0):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(64, 1024, size=num_seqs)
    prompts = [rng.integers(1, 30000, size=int(n)).tolist() for n in prompt_lens]
    tokens = rng.integers(1, 30000, size=(steps, num_seqs))      # never EOS
    blocks = int(sum(-(-(int(n) + steps + 2) // bs) for n in prompt_lens)) + 8
    return prompts, tokens, blocks


def per_seq_us(step_ns: list[int], num_seqs: int) -> float:
    """Mean step time over the steps between the 10th and 90th percentile (robust to other
    processes stealing the CPU), in microseconds per sequence."""
    t = np.sort(np.array(step_ns, dtype=np.float64))
    lo, hi = int(len(t) * 0.1), max(int(len(t) * 0.9), int(len(t) * 0.1) + 1)
    return float(t[lo:hi].mean()) / 1e3 / num_seqs


def bench_tpserve(prompts, tokens, blocks, bs, warmup):
    n = len(prompts)
    steps = len(tokens)
    cfg = EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=n,
                       max_num_batched_tokens=1 << 20, max_model_len=1 << 16, eos_token_ids=[EOS])
    s = Scheduler(cfg)
    for i, p in enumerate(prompts):
        s.add(Sequence(f"r{i}", p, SamplingParams(max_tokens=steps + 10, temperature=0.7), seed=i))
    batch = s.schedule()
    assert batch.is_prefill and len(batch) == n
    s.postprocess(batch, np.ones(n, dtype=np.int64))
    times = []
    for k in range(steps):
        t0 = time.perf_counter_ns()
        batch = s.schedule()
        plan = s.build_plan(batch)
        s.postprocess(batch, tokens[k])
        t1 = time.perf_counter_ns()
        assert plan.num_seqs == n and not plan.is_prefill
        times.append(t1 - t0)
    assert s.num_preemptions == 0
    return per_seq_us(times[warmup:], n)


CHUNK = 256          # the prompt tokens a mixed step leaves beside its decodes
LONG_PROMPT = 2048     # a multiple of CHUNK: one prompt per step on both sides


def mixed_workload(num_seqs, steps, bs, seed=1):
    """Decoding prompts and tokens as in ``workload``, plus the long prompts that arrive."""
    prompts, tokens, _ = workload(num_seqs, steps, bs, seed)
    rng = np.random.default_rng(seed + 1)
    arrivals = [rng.integers(1, 30000, size=LONG_PROMPT).tolist()
                for _ in range(-(-steps * CHUNK // LONG_PROMPT) + 1)]
    # Tokens for up to every decoder plus every finished arrival, one row per step.
    width = num_seqs + len(arrivals) + 1
    tokens = rng.integers(1, 30000, size=(steps, width))
    blocks = int(sum(-(-(len(p) + steps + 2) // bs) for p in prompts + arrivals)) + 8
    return prompts, arrivals, tokens, blocks


def bench_tpserve_mixed(prompts, arrivals, tokens, blocks, bs, warmup):
    n = len(prompts)
    steps = len(tokens)
    cfg = EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=n + len(arrivals),
                       max_num_batched_tokens=1 << 20, max_model_len=1 << 16,
                       eos_token_ids=[EOS], scheduling_policy="mixed")
    s = Scheduler(cfg)
    for i, p in enumerate(prompts):
        s.add(Sequence(f"r{i}", p, SamplingParams(max_tokens=steps + 10, temperature=0.7), seed=i))
    batch = s.schedule()
    s.postprocess(batch, np.ones(n, dtype=np.int64))
    for i, p in enumerate(arrivals):
        s.add(Sequence(f"a{i}", p, SamplingParams(max_tokens=steps + 10, temperature=0.7), seed=i))
    times, sizes = [], []
    for k in range(steps):
        # Keep the chunk at CHUNK tokens whatever the number of decoders.
        s.max_num_batched_tokens = len(s.running) - (s._prefilling is not None) + CHUNK
        t0 = time.perf_counter_ns()
        batch = s.schedule()
        plan = s.build_plan(batch)
        s.postprocess(batch, tokens[k, :plan.num_samples])
        t1 = time.perf_counter_ns()
        assert 0 < batch.num_decodes < plan.num_seqs and plan.num_tokens == batch.num_decodes + CHUNK
        times.append(t1 - t0)
        sizes.append(plan.num_seqs)
    assert s.num_preemptions == 0
    return per_seq_us(times[warmup:], int(np.mean(sizes)))


def bench_peer_mixed(prompts, arrivals, tokens, blocks, bs, warmup):
    n = len(prompts)
    steps = len(tokens)
    s = PeerScheduler(blocks, bs, n + len(arrivals))
    for p in prompts:
        seq = PeerSeq(p, steps + 10, bs)
        s.bm.allocate(seq)
        seq.token_ids.append(1)
        s.running.append(seq)
    for p in arrivals:
        s.waiting.append(PeerSeq(p, steps + 10, bs))
    times, sizes = [], []
    for k in range(steps):
        t0 = time.perf_counter_ns()
        plan, size = s.step_mixed(len(s.running) + CHUNK, tokens[k])
        t1 = time.perf_counter_ns()
        assert len(plan["input_ids"]) == size - 1 + CHUNK
        times.append(t1 - t0)
        sizes.append(size)
    return per_seq_us(times[warmup:], int(np.mean(sizes)))


def bench_peer(prompts, tokens, blocks, bs, warmup):
    n = len(prompts)
    steps = len(tokens)
    s = PeerScheduler(blocks, bs, n)
    for p in prompts:
        seq = PeerSeq(p, steps + 10, bs)
        s.bm.allocate(seq)
        seq.token_ids.append(1)
        s.running.append(seq)
    times = []
    for k in range(steps):
        t0 = time.perf_counter_ns()
        seqs = s.schedule_decode()
        plan = s.build_plan(seqs)
        s.postprocess(seqs, tokens[k])
        t1 = time.perf_counter_ns()
        assert len(plan["input_ids"]) == n
        times.append(t1 - t0)
    return per_seq_us(times[warmup:], n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many runs of each")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    warmup = min(10, args.steps // 10)
    for bs in args.block_sizes:
        prompts, tokens, blocks = workload(args.seqs, args.steps, bs)
        ours, peer = [], []
        for _ in range(args.rounds):
            ours.append(bench_tpserve(prompts, tokens, blocks, bs, warmup))
            peer.append(bench_peer(prompts, tokens, blocks, bs, warmup))
        report("decode", bs, args, min(ours), min(peer))
        prompts, arrivals, tokens, blocks = mixed_workload(args.seqs, args.steps, bs)
        ours, peer = [], []
        for _ in range(args.rounds):
            ours.append(bench_tpserve_mixed(prompts, arrivals, tokens, blocks, bs, warmup))
            peer.append(bench_peer_mixed(prompts, arrivals, tokens, blocks, bs, warmup))
        report(f"mixed(+{CHUNK}-token chunk)", bs, args, min(ours), min(peer))


def report(kind, bs, args, a, b):
    print(f"bench_scheduler {kind} block_size={bs} seqs={args.seqs} steps={args.steps}: "
          f"tpserve {a:.3f} us/seq/step, seed-style peer {b:.3f} us/seq/step, "
          f"peer/tpserve {b / a:.2f}x", flush=True)


if __name__ == "__main__":
    main()
