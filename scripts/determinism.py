"""How much one request's logits move with what else the engine runs: one line per situation.

    .venv/bin/python scripts/determinism.py [--dtype bfloat16|float32] [--model-dir DIR] [--smoke]

Runs a prompt P alone on the benchmark model (random weights, built locally) and records the
logits of its first 16 greedy steps; then reruns P in other situations and prints, for each,
the largest |difference| of any logit and how many steps differed at all:

    alone again            nothing else changed: must be 0
    first/last of 8        P batched with 7 other prompts in the same steps
    prefix-cache hit       P's 40-token prefix computed earlier by another prompt, P alone
    chunked prefill        P's prompt split over steps of 20 tokens

``--smoke`` runs the same on a 2-layer model for 4 steps (seconds; tests/test_scripts.py).

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
from bench_models import TINY, build_bench_model  # noqa: E402


class LogitSpy:
    """Records the logits row of every (seed, step) the in-process runner's sampler is given.

    It wraps the sampler's ``sample(logits, plan)`` method on the instance, so every other part
    of the sampler stays the runner's own; an interface that no longer matches fails loudly
    (``rows`` stays empty and ``take`` says so) instead of crashing inside the engine.
    """

    def __init__(self, llm):
        sampler = llm.engine.executor.runner.sampler
        inner = sampler.sample
        self.rows = {}

        def sample(logits, plan, *args, **kwargs):
            seeds, steps = plan.seeds, plan.steps
            for i in range(logits.shape[0]):
                self.rows[(int(seeds[i]), int(steps[i]))] = logits[i].float().clone()
            return inner(logits, plan, *args, **kwargs)

        sampler.sample = sample

    def take(self, seed: int, steps: int) -> list:
        missing = [s for s in range(steps) if (seed, s) not in self.rows]
        if missing:
            raise RuntimeError(f"the sampler was never given the logits of seed {seed}, steps "
                               f"{missing[:4]}...: has Sampler.sample(logits, plan) changed? "
                               f"({len(self.rows)} rows seen)")
        return [self.rows[(seed, s)] for s in range(steps)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--model-dir", default=None,
                    help="[default: /tmp/tpserve-bench/qwen3-40m; with --smoke, qwen3-tiny]")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model and 4 steps (a quick check)")
    args = ap.parse_args()
    from tpserve import LLM, SamplingParams

    steps = 4 if args.smoke else 16
    default_dir = "/tmp/tpserve-bench/qwen3-tiny" if args.smoke else "/tmp/tpserve-bench/qwen3-40m"
    path = build_bench_model(args.model_dir or default_dir, **(TINY if args.smoke else {}))
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(5, 32768) for _ in range(n)]  # noqa: E731
    prefix = tokens(40)
    p, q = prefix + tokens(9), prefix + tokens(23)
    others = [tokens(rng.randrange(5, 60)) for _ in range(7)]

    def run(llm, spy, prompts, tag, reset=True):
        if reset:
            llm.reset_prefix_cache()
        spy.rows.clear()
        params = [SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        return spy.take(tag, steps)

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
              f"steps differing {sum(d > 0 for d in diffs)}/{steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
