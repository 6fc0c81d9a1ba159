"""How much one request's logits move with what else the engine runs: one line per situation.

    .venv/bin/python scripts/determinism.py [--dtype bfloat16|float32] [--model-dir DIR]

Runs a prompt P alone on the benchmark model (random weights, built locally) and records the
logits of its first 16 greedy steps; then reruns P in other situations and prints, for each,
the largest |difference| of any logit and how many steps differed at all:

    alone again            nothing else changed: must be 0
    first/last of 8        P batched with 7 other prompts in the same steps
    prefix-cache hit       P's 40-token prefix computed earlier by another prompt, P alone
    chunked prefill        P's prompt split over steps of 20 tokens

docs/protocol.md ("Reproducibility") states what is guaranteed; tests/test_determinism.py
checks it. Differences in the batched rows come from the order of floating-point sums in
matrix products and padded attention, which depends on the batch's shape.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import build_bench_model  # noqa: E402

STEPS = 16


class LogitSpy:
    """Wraps the in-process runner's sampler; keeps the logits row of every (seed, step)."""

    def __init__(self, llm):
        runner = llm.engine.executor.runner
        self.inner, runner.sampler, self.rows = runner.sampler, self, {}

    def __call__(self, logits, temperatures, top_ks, top_ps, seeds, steps):
        for i in range(logits.shape[0]):
            self.rows[(int(seeds[i]), int(steps[i]))] = logits[i].float().clone()
        return self.inner(logits, temperatures, top_ks, top_ps, seeds, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--model-dir", default="/tmp/tpserve-bench/qwen3-40m")
    args = ap.parse_args()
    from tpserve import LLM, SamplingParams

    path = build_bench_model(args.model_dir)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(5, 32768) for _ in range(n)]  # noqa: E731
    prefix = tokens(40)
    p, q = prefix + tokens(9), prefix + tokens(23)
    others = [tokens(rng.randrange(5, 60)) for _ in range(7)]

    def run(llm, spy, prompts, tag, reset=True):
        if reset:
            llm.reset_prefix_cache()
        spy.rows.clear()
        params = [SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        return [spy.rows[(tag, s)] for s in range(STEPS)]

    results = []
    with LLM(str(path), dtype=args.dtype, num_kv_blocks=512) as llm:
        spy = LogitSpy(llm)
        ref = run(llm, spy, [p], 0)
        results.append(("alone again", run(llm, spy, [p], 0)))
        results.append(("first of 8 in the same steps", run(llm, spy, [p] + others, 0)))
        results.append(("last of 8 in the same steps", run(llm, spy, others + [p], 7)))
        run(llm, spy, [q] + others, 0)
        results.append(("prefix-cache hit, alone", run(llm, spy, [p], 0, reset=False)))
    with LLM(str(path), dtype=args.dtype, num_kv_blocks=512, max_num_batched_tokens=20) as llm:
        results.append(("chunked prefill (20 tokens/step)", run(llm, LogitSpy(llm), [p], 0)))
    for name, rows in results:
        diffs = [(a - b).abs().max().item() for a, b in zip(ref, rows)]
        print(f"determinism {args.dtype} {platform.machine()}: {name:34s} max|dlogit| {max(diffs):.3g}, "
              f"steps differing {sum(d > 0 for d in diffs)}/{STEPS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
