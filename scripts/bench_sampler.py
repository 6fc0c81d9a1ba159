#!/usr/bin/env python3
"""The sampler's cost per step: the exponential race (fused operator vs the torch reference)
and the logits controls (penalties, logit bias) on top of plain sampling.

    python scripts/bench_sampler.py [--rows 64 256] [--vocab 32000 151936] [--repeat 7]

One line per (rows, vocab): medians in ms. ``race`` is the draw alone (torch reference vs the
C++ operator on CPU, the Triton kernel on CUDA); ``step`` is a whole Sampler call at
temperature 0.8 / top-p 0.9 without controls and with every row penalised and biased;
``greedy`` is the same at temperature 0 on bf16 logits (what a decode step of the bench models
samples), where the controls' cost stands out most.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tpserve.sample_plan import SamplePlan  # noqa: E402
from tpserve.workers.model_runner import cpu_has_fast_bf16  # noqa: E402
from tpserve.workers.sampler import Sampler, race, race_reference  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    isa = "avx512_bf16" if cpu_has_fast_bf16() else "avx2"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for s in args.rows:
        for v in args.vocab:
            gen = torch.Generator().manual_seed(0)
            x = (torch.randn(s, v, generator=gen) * 3).to(dev)
            seeds = torch.arange(s, dtype=torch.long, device=dev)
            steps = torch.zeros(s, dtype=torch.long, device=dev)
            ref = median_ms(lambda: race_reference(x, seeds, steps), args.repeat)
            fused = median_ms(lambda: race(x, seeds, steps), args.repeat)
            sampler = Sampler(device=dev)

            def plan(temperature: float, top_p: float, **controls) -> SamplePlan:
                return SamplePlan.rows(np.full(s, temperature, np.float32), top_ks=-1, top_ps=top_p,
                                       seeds=np.arange(s), steps=0, **controls)

            plain_plan = plan(0.8, 0.9)
            plain = median_ms(lambda: sampler(x, plain_plan), args.repeat)
            rows = np.arange(s, dtype=np.int32)
            penalties = dict(penalty_rows=rows, penalty_slots=rows, repetition=np.full(s, 1.1, np.float32),
                             frequency=np.full(s, 0.2, np.float32), presence=np.full(s, 0.1, np.float32))
            init = plan(0.8, 0.9, **penalties, init_slots=rows,
                        init_cu=np.arange(0, 65 * s + 1, 65, dtype=np.int32)[:s + 1],
                        init_prompt_lens=np.full(s, 64, np.int32),
                        init_tokens=np.random.default_rng(0).integers(0, v, 65 * s).astype(np.int32))
            sampler(x, init)  # counts in place
            bias = dict(bias_rows=np.repeat(rows, 4), bias_tokens=np.tile(np.arange(4, dtype=np.int32), s),
                        bias_values=np.full(4 * s, -5.0, np.float32))
            controls = plan(0.8, 0.9, **penalties, **bias)
            ctl = median_ms(lambda: sampler(x, controls), args.repeat)
            xb = x.to(torch.bfloat16)
            greedy, greedy_controls = plan(0.0, 1.0), plan(0.0, 1.0, **penalties, **bias)
            g_plain = median_ms(lambda: sampler(xb, greedy), args.repeat)
            g_ctl = median_ms(lambda: sampler(xb, greedy_controls), args.repeat)
            print(f"bench_sampler device={dev} isa={isa} rows={s} vocab={v} race_ms torch={ref:.2f} "
                  f"fused={fused:.2f} ({ref / fused:.1f}x) step_ms plain={plain:.2f} "
                  f"penalties+bias={ctl:.2f} (+{(ctl - plain) / plain * 100:.0f}%) "
                  f"greedy_ms plain={g_plain:.2f} penalties+bias={g_ctl:.2f} (+{g_ctl - g_plain:.2f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
