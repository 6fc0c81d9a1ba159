"""How much one request's logits move with what else the engine runs: one line per situation
and mode (the default mode, and ``batch_invariant=True``).

    .venv/bin/python scripts/determinism.py [--dtype bfloat16|float32] [--model-dir DIR] [--smoke]
                                            [--skip-tp]

Runs a prompt P alone on the benchmark model (random weights, built locally) and records the
logits of its first 16 greedy steps; then reruns P in other situations, in the same mode, and
prints for each the largest |difference| of any logit and how many steps differed at all:

    alone again            nothing else changed: must be 0
    first/last of 8        P batched with 7 other prompts in the same steps
    prefix-cache hit       P's 40-token prefix computed earlier by another prompt, P alone
    chunked prefill        P's prompt split over steps of 20 tokens
    preempted              P last of 8 in a KV pool too small for all: preempted, recomputed
    speculated             n-gram speculative decoding (P repeats itself: drafts are accepted)
    TP=2                   P batched with 7 others against P alone, both at TP=2

In the batch-invariant mode every line must read 0 (docs/protocol.md, "Reproducibility").
``--smoke`` runs the same on a 2-layer model for 4 steps (seconds; tests/test_scripts.py),
without TP=2. tests/test_determinism.py and tests/test_batch_invariance.py check the promises.
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
    ap.add_argument("--smoke", action="store_true",
                    help="a 2-layer model and 4 steps, no TP=2 (a quick check)")
    ap.add_argument("--skip-tp", action="store_true", help="leave out the TP=2 situation")
    args = ap.parse_args()
    from tpserve import LLM, SamplingParams

    steps = 4 if args.smoke else 16
    default_dir = "/tmp/tpserve-bench/qwen3-tiny" if args.smoke else "/tmp/tpserve-bench/qwen3-40m"
    path = build_bench_model(args.model_dir or default_dir, **(TINY if args.smoke else {}))
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(5, 32768) for _ in range(n)]  # noqa: E731
    prefix = tokens(40)
    phrase = tokens(6)
    p, q = prefix + phrase * 3, prefix + tokens(23)
    others = [tokens(rng.randrange(5, 60)) for _ in range(7)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}

    def run(llm, spy, prompts, tag, reset=True):
        if reset:
            llm.reset_prefix_cache()
        spy.rows.clear()
        params = [SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        return spy.take(tag, steps)

    def engine(invariant, **options):
        return LLM(str(path), dtype=args.dtype, num_kv_blocks=options.pop("num_kv_blocks", 512),
                   batch_invariant=invariant, **options)

    for invariant in (False, True):
        mode = "invariant" if invariant else "default"
        results = []
        with engine(invariant) as llm:
            spy = LogitSpy(llm)
            ref = run(llm, spy, [p], 0)
            results.append(("alone again", run(llm, spy, [p], 0)))
            results.append(("first of 8 in the same steps", run(llm, spy, [p] + others, 0)))
            results.append(("last of 8 in the same steps", run(llm, spy, others + [p], 7)))
            run(llm, spy, [q] + others, 0)
            results.append(("prefix-cache hit, alone", run(llm, spy, [p], 0, reset=False)))
        with engine(invariant, max_num_batched_tokens=20, max_stall_tokens=20) as llm:
            results.append(("chunked prefill (20 tokens/step)", run(llm, LogitSpy(llm), [p], 0)))
        # A pool of exactly the 8 prompts' blocks, all prefilled in one step: the first decode step
        # needs blocks and preempts the last sequence admitted (P), recomputed later.
        crowd = [(o * 32)[:32] for o in others] + [p]  # each other's first token needs a new block
        blocks = sum(-(-len(x) // 16) for x in crowd)
        with engine(invariant, num_kv_blocks=blocks, scheduling_policy="prefill-first") as llm:
            rows = run(llm, LogitSpy(llm), crowd, 7)
            results.append((f"preempted ({llm.stats()['num_preemptions']} preemptions)", rows))
        with engine(invariant, speculative_config=spec) as llm:
            rows = run(llm, LogitSpy(llm), [p], 0)
            kept = llm.stats()["spec_decode_num_accepted_tokens"]
            results.append((f"speculated ({kept} drafts kept)", rows))
        for name, rows in results:
            report(args.dtype, mode, name, ref, rows, steps)
        if not (args.smoke or args.skip_tp):
            with engine(invariant, tensor_parallel_size=2) as llm:
                spy = LogitSpy(llm)
                ref2 = run(llm, spy, [p], 0)
                report(args.dtype, mode, "TP=2: first of 8 vs alone", ref2,
                       run(llm, spy, [p] + others, 0), steps)
    return 0


def report(dtype: str, mode: str, name: str, ref: list, rows: list, steps: int) -> None:
    diffs = [(a - b).abs().max().item() for a, b in zip(ref, rows)]
    print(f"determinism {dtype} {platform.machine()} {mode:9s}: {name:36s} max|dlogit| {max(diffs):.3g}, "
          f"steps differing {sum(d > 0 for d in diffs)}/{steps}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
