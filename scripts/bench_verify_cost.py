"""What verifying k draft tokens costs per step, on a mixture of experts and on a dense model.

Speculative decoding pays when a verify step (each decode row's last token plus its k drafts,
1 + k query rows) keeps more tokens than it costs plain decode steps. On a dense model a
verify step reads the same weights as a plain one; on a mixture of experts every one of the
1 + k rows picks its own top-k experts, so a verify step reads more expert weights (at batch 1
and k=4 on a 128-expert top-8 layer: ~35 experts instead of 8). This measures, for batch sizes
1..8 and each ``--k``:

  * the engine step time of a plain decode step (B rows) and of a verify step (B rows with k
    drafts each): blocks of ``--block`` steps of one kind, ``--pairs`` pairs of blocks run
    interleaved (ABBA: plain, verify, verify, plain, ...) on the same sequences, so load on a
    shared machine hits both alike; medians, their ratio and the median of the pairs' ratios,
    and the same of the process's CPU time (with ``--threads 1``, a figure other processes on
    the cores barely disturb: a loaded machine stalls multi-threaded steps at every barrier).
    The ratio is the mean acceptance length (tokens kept per verify step) speculation needs
    at that batch size to break even;
  * on MoE shapes, the distinct experts a layer uses per step, counted from the routers in
    separate untimed steps, beside the expectation for uniformly random routing.

Drafts are random tokens (a proposer that always guesses k): nearly all are rejected, so both
kinds of step append one token and the sequences stay alike. Prompts are 64 random token ids.

``--sweep`` then measures end to end what the step costs imply, as ``bench_spec.py --sweep``
does on the dense shapes: decode tok/s with n-gram speculation (no batch-size limit) against
without, on bench_spec's copy-heavy workload, at each batch size, with the mean acceptance
length.

Shapes: ``moe-small`` (default), a Qwen3-MoE of Qwen3-30B-A3B's proportions scaled to ~0.7 GB
in bf16 (hidden 1024, 4 layers, 16 query / 4 KV heads of 64, 128 experts of 192, top-8,
norm_topk_prob, vocab 16384; written once by bench_moe.py's builder under ``.bench/``), the
dense benchmark shapes of bench_spec.py (``40m``, ``0.6b``), and ``tiny-moe`` / ``tiny`` for
smoke runs (seconds; not measurements).

    python scripts/bench_verify_cost.py [--shape moe-small|0.6b|40m|tiny-moe|tiny] [--k 2 4]
                                        [--batches 1,2,3,4,5,6,8] [--pairs 9] [--block 3] [--threads N]
                                        [--sweep] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

from tpserve import LLM, SamplingParams  # noqa: E402
from tpserve.models.moe import SparseMoeBlock  # noqa: E402
from tpserve.scheduler.spec_decode import Speculator  # noqa: E402
from tpserve.spec_config import SpeculativeConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Qwen3-30B-A3B's proportions (128 experts, top-8, experts ~2/3 of a token's weight bytes, the
# LM head ~1/10), scaled down to a model of ~0.7 GB in bf16.
MOE_SHAPES = {
    "moe-small": dict(bench_moe._COMMON, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=64, intermediate_size=3072, num_experts=128,
                      moe_intermediate_size=192, num_experts_per_tok=8, vocab_size=16384,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2),
    "tiny-moe": bench_moe.SHAPES["tiny"],
}
PROMPT = 64


class RandomDrafts:
    """A proposer that always guesses ``k`` random tokens (the cost of verifying k drafts)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, seqs, max_drafts):
        return [self.rng.integers(3, self.vocab, size=int(k)).tolist() for k in max_drafts]


def build(shape: str) -> Path:
    if shape in MOE_SHAPES:
        bench_moe.SHAPES.setdefault(shape, MOE_SHAPES[shape])  # bench_moe's builder reads its table
        return bench_moe.build_moe_model(ROOT / ".bench" / f"moe-{shape}", shape)
    return build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS[shape]}", **SHAPE_OVERRIDES[shape])


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class ExpertCounter:
    """Distinct experts each sparse layer's router picks per forward (module path only: the
    fused decode routes inside C++, so counting steps run with it switched off)."""

    def __init__(self, model):
        self.model = model
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.counts: list[int] = []
        self.on = False
        for b in self.blocks:
            b.gate.register_forward_hook(self._hook(b.top_k))

    def _hook(self, k):
        def hook(module, args, out):
            if self.on:
                self.counts.append(int(out.float().topk(k, dim=-1).indices.unique().numel()))
        return hook

    def count(self, step) -> float:
        """Mean distinct experts per layer over one call of ``step`` (fused decode off)."""
        fused, self.model.fused_decode = self.model.fused_decode, None
        self.counts, self.on = [], True
        try:
            step()
        finally:
            self.on, self.model.fused_decode = False, fused
        return statistics.mean(self.counts) if self.counts else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(MOE_SHAPES) + sorted(SHAPE_DIRS), default="moe-small")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="draft tokens per row")
    ap.add_argument("--batches", default="1,2,3,4,5,6,8")
    ap.add_argument("--pairs", type=int, default=9, help="timed plain/verify pairs per batch size")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: every core); 1 makes cpu-time immune to other processes")
    ap.add_argument("--block", type=int, default=3, help="consecutive steps of one kind timed together")
    ap.add_argument("--sweep", action="store_true", help="end-to-end decode speedup (bench_spec's workload)")
    ap.add_argument("--repeats", type=int, default=2, help="--sweep: ABBA pairs per batch size")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 pairs, batches 1,2")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.batches, args.repeats = 2, "1,2", 1
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    path = build(args.shape)
    from tpserve.workers.model_runner import cpu_has_fast_bf16
    dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    kmax = max(args.k)
    spec = {"method": "ngram", "num_speculative_tokens": kmax, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "disable_by_batch_size": None}
    llm = LLM(str(path), dtype=dtype, max_num_seqs=64, kv_cache_memory_gb=1.0, max_num_batched_tokens=2048,
              speculative_config=spec)
    engine, sched = llm.engine, llm.engine.scheduler
    ngram = sched.speculator
    model = engine.executor.runner.model
    counter = ExpertCounter(model)
    moe = bool(counter.blocks)
    num_experts = counter.blocks[0].experts.num_experts if moe else 0
    top_k = counter.blocks[0].top_k if moe else 0
    isa = cpu_isa()
    print(f"bench_verify_cost shape={args.shape} isa={isa} dtype={dtype} threads={torch.get_num_threads()} "
          f"cores={os.cpu_count()} load={os.getloadavg()[0]:.1f} pairs={args.pairs}"
          + (f" experts={num_experts} top_k={top_k}" if moe else " dense"))
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=2 * (args.pairs + 2) * args.block + 16,
                            ignore_eos=True)
    for k in args.k:
        verify = Speculator(SpeculativeConfig(**dict(ngram.config.to_dict(), num_speculative_tokens=k)),
                            proposer=RandomDrafts(vocab))
        for b in batches:
            ids = [f"vc-{k}-{b}-{i}" for i in range(b)]
            for rid in ids:
                engine.add_request(rid, rng.integers(3, vocab, size=PROMPT).tolist(), params,
                                   detokenize=False)
            sched.speculator = None
            started = set()
            while len(started) < b:  # the prefills (and any first decode steps)
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
            times = {False: [], True: []}
            cpu = {False: [], True: []}
            for i in range(2 + args.pairs):
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    sched.speculator = verify if on else None
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.block):
                        engine.step()
                    if i >= 2:  # the first two pairs warm each path up
                        times[on].append((time.perf_counter() - t0) / args.block)
                        cpu[on].append((time.process_time() - c0) / args.block)
            experts = ""
            if moe:
                got = []
                for on in (False, True):
                    sched.speculator = verify if on else None
                    got.append(statistics.mean(counter.count(engine.step) for _ in range(2)))
                exp = [expected_experts(num_experts, top_k, b * n) for n in (1, 1 + k)]
                experts = (f" experts/layer plain={got[0]:.1f} verify={got[1]:.1f} ({got[1] / got[0]:.2f}x; "
                           f"uniform routing {exp[0]:.1f} / {exp[1]:.1f})")
            for rid in ids:
                engine.abort_request(rid)
            sched.speculator = None
            while engine.has_unfinished():
                engine.step()
            plain, ver = statistics.median(times[False]), statistics.median(times[True])
            pair = statistics.median(v / p for p, v in zip(times[False], times[True]))
            c_plain, c_ver = statistics.median(cpu[False]), statistics.median(cpu[True])
            print(f"verify-cost shape={args.shape} dtype={dtype} batch={b} k={k}: plain={plain * 1e3:.1f} ms "
                  f"verify={ver * 1e3:.1f} ms ratio={ver / plain:.2f}x (per pair {pair:.2f}x; cpu-time "
                  f"{c_plain * 1e3:.1f} / {c_ver * 1e3:.1f} ms = {c_ver / c_plain:.2f}x; break-even "
                  f"tokens/verify step)"
                  f"{experts} load={os.getloadavg()[0]:.1f}", flush=True)
    sched.speculator = ngram

    if args.sweep:
        from bench_spec import Switch, acceptance, alternate, decode_rate, replayed_tokens_per_step
        switch = Switch(llm)
        switch.set(False)
        max_tokens = 32 if args.quick else 96
        cands = [[int(t)] * 128 for t in rng.choice(np.arange(3, vocab), size=8 if args.quick else 32,
                                                     replace=False)]
        outs = llm.generate(cands, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        scored = sorted(((replayed_tokens_per_step(p, o.token_ids, kmax, (2, 4)), i)
                         for i, (p, o) in enumerate(zip(cands, outs))), reverse=True)
        chosen = [cands[i] for _, i in scored[:8]]
        print(f"sweep: copy-heavy prompts, the 8 of {len(cands)} the proposer predicts best (replayed "
              f"tokens/step {', '.join(f'{s:.2f}' for s, _ in scored[:8])}), k={kmax}, no batch limit")
        for b in batches:
            prompts = [chosen[i % len(chosen)] for i in range(b)]
            off, on, counters = alternate(args.repeats, switch, lambda: decode_rate(llm, prompts, max_tokens),
                                          limit=None)
            r_off, r_on = statistics.median(r[0] for r in off), statistics.median(r[0] for r in on)
            print(f"sweep shape={args.shape} dtype={dtype} batch={b}: plain={r_off:.1f} spec={r_on:.1f} "
                  f"decode tok/s ratio={r_on / r_off:.2f}x (medians of {len(on)}) {acceptance(counters)} "
                  f"load={os.getloadavg()[0]:.1f}", flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
