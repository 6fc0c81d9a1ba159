"""Profile tpserve's decode steps on a benchmark model: where one step's time goes.

Builds the benchmark model (scripts/bench_models.py), admits N requests with 256-token prompts,
runs steps until every request is decoding, then times and profiles decode steps with
torch.profiler and prints the mean step time and the ops with the most self CPU time.

It also prints where a step's wall time goes outside the model: scheduling, plan building,
the forward, the LM head and sampling, and postprocessing (per step, over the timed steps).
``TPSERVE_FUSED_DECODE=0`` runs the decode steps layer by layer, for comparison.

    python scripts/profile_step.py [--shape 40m|0.6b|tiny] [--batch 64] [--steps 5] [--threads 2]
                                   [--quantization int8|int4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["40m", "0.6b", "tiny"], default="40m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}", **SHAPE_OVERRIDES[args.shape])

    from tpserve import LLM, SamplingParams
    llm = LLM(str(path), dtype=args.dtype, max_num_seqs=args.batch, kv_cache_memory_gb=2.0,
              max_num_batched_tokens=max(2048, args.prompt_len), quantization=args.quantization)
    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", rng.integers(3, 1000, args.prompt_len).tolist(), params,
                           detokenize=False)
    while engine.scheduler.waiting or any(s.num_cached_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first all-decode step (warm)
    parts = {"schedule": 0.0, "build_plan": 0.0, "forward": 0.0, "execute": 0.0, "postprocess": 0.0}
    sched, runner = engine.scheduler, engine.executor.runner
    originals = [(sched, "schedule"), (sched, "build_plan"), (runner.model, "forward"),
                 (engine.executor, "execute"), (sched, "postprocess")]

    def timed(fn, key):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[key] += time.perf_counter() - t0
        return call

    for obj, name in originals:
        setattr(obj, name, timed(getattr(obj, name), name))
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    for obj, name in originals:
        delattr(obj, name)
    split = {k: v / args.steps * 1e3 for k, v in parts.items()}
    split["execute"] -= split["forward"]  # the rest of execute: staging, LM head, sampling
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(f"decode step, batch {args.batch}, shape {args.shape}, {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}, {args.threads} threads: "
          f"{step_ms:.2f} ms (schedule {split['schedule']:.2f}, plan {split['build_plan']:.2f}, "
          f"forward {split['forward']:.2f}, LM head + sampling + staging {split['execute']:.2f}, "
          f"postprocess {split['postprocess']:.2f}; load average {os.getloadavg()[0]:.1f})")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
