"""Structured output cost: 64 requests, each with its own JSON schema, against the same 64
requests unconstrained with the same output lengths; and the time to first token of a request
whose 20-property schema is compiled cold vs found in the cache, while other streams decode.

Model: the ~40M-parameter benchmark model (scripts/bench_models.py, random weights) with the
bundled model's byte-level tokenizer copied beside it and its EOS id (the benchmark's id
tokenizer has no bytes a JSON grammar could use; ids past the tokenizer's 4096 are never allowed
by a mask).
Each round compiles 64 new schemas (seeded, bounded: integers, enums, short strings, arrays,
one nested object), samples at temperature 1, then runs the unconstrained twin with
``ignore_eos`` and ``max_tokens`` set to each constrained output's length. Rounds alternate
(constrained, unconstrained) and the medians are printed, so drift of a shared machine hits
both. The peer is the same engine without the constraint: the line is tpserve's own overhead.

    python scripts/bench_structured.py [--rounds 3] [--quick] [--smoke]

``--smoke``: the benchmark models' tiny shape (2 layers of width 64), one round of 4 requests of
at most 16 tokens, TTFT over 2 schemas beside 2 streams: the whole run in seconds
(tests/test_scripts.py), not a measurement.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

from tpserve.config import EngineConfig  # noqa: E402
from tpserve.engine import Engine  # noqa: E402
from tpserve.sampling import SamplingParams, StructuredOutputsParams  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"


def schema(rng: random.Random, props: int | None = None) -> dict:
    def leaf(depth):
        kind = rng.choice(["int", "enum", "str", "array"] + (["object"] if depth == 0 and props is None else []))
        if kind == "int":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, True, None], rng.randint(1, 4))}
        if kind == "str":
            return {"type": "string", "maxLength": rng.randint(3, 8)}
        if kind == "array":
            return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}
        return obj(depth + 1, rng.randint(2, 3))

    def obj(depth, n):
        names = [f"k{rng.randrange(10**6)}_{i}" for i in range(n)]
        return {"type": "object", "properties": {k: leaf(depth) for k in names}, "required": names,
                "additionalProperties": False}
    return obj(0, props or rng.randint(3, 6))


def run(engine: Engine, prompts, params) -> tuple[float, float, list[int]]:
    """Wall seconds, CPU seconds of this process (all its threads) and output lengths of one
    batch run to completion. On a shared machine the CPU time is the steadier figure."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp, detokenize=False)
    lens = [0] * len(prompts)
    while engine.has_unfinished():
        for out in engine.step():
            lens[int(out.request_id[1:])] += len(out.new_token_ids)
    return time.perf_counter() - t0, time.process_time() - c0, lens


def ttft(engine: Engine, background: list, so: StructuredOutputsParams, rid: str) -> tuple[float, float]:
    """(seconds from add_request to the first token of ``rid``, the longest gap between two
    tokens of the background streams meanwhile)."""
    t0 = time.perf_counter()
    engine.add_request(rid, background[0][1], SamplingParams(max_tokens=8, temperature=1.0, seed=1,
                                                             structured_outputs=so), detokenize=False)
    first, last, gap = None, None, 0.0
    while first is None:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("bg") and o.new_token_ids for o in outs):
            gap = max(gap, now - (last or t0))
            last = now
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            first = now - t0
    engine.abort_request(rid)
    return first, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shape", choices=("40m", "tiny"), default="40m")
    ap.add_argument("--model-dir", help="[default: /tmp/tpserve-bench-<shape>-structured]")
    ap.add_argument("--quick", action="store_true", help="1 round of 16 requests")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shape, 1 round of 4 requests of 16 tokens, 2 schemas beside 2 streams")
    args = ap.parse_args()
    ttft_schemas, streams = 5, 8
    if args.quick:
        args.rounds, args.requests = 1, 16
    if args.smoke:
        args.shape, args.rounds, args.requests, args.max_tokens = "tiny", 1, 4, 16
        ttft_schemas, streams = 2, 2
    # The tokenizer's EOS (<|endoftext|>, id 0) is the model's: id 2 is a text byte there.
    path = build_bench_model(args.model_dir or f"/tmp/tpserve-bench-{args.shape}-structured",
                             eos_token_id=0, bos_token_id=0, **SHAPE_OVERRIDES[args.shape])
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED / f, path / f)
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=2048, block_size=16,
                                 max_num_seqs=args.requests, max_num_batched_tokens=4096))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4096, size=int(rng.integers(32, 65))).tolist() for _ in range(args.requests)]
    run(engine, prompts[:2], [SamplingParams(max_tokens=4)] * 2)  # warm-up
    con, unc, con_cpu, unc_cpu, finished = [], [], [], [], []
    for r in range(args.rounds):
        srng = random.Random(1000 + r)  # new schemas every round: every one compiles cold
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema(srng)))
                  for i in range(args.requests)]
        dt, cpu, lens = run(engine, prompts, params)
        con.append(sum(lens) / dt)
        con_cpu.append(sum(lens) / cpu)
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=max(n, 1), ignore_eos=True)
                 for i, n in enumerate(lens)]
        dt2, cpu2, lens2 = run(engine, prompts, plain)
        assert lens2 == [max(n, 1) for n in lens], "the unconstrained twin must emit the same lengths"
        unc.append(sum(lens2) / dt2)
        unc_cpu.append(sum(lens2) / cpu2)
        finished.append(sum(n < args.max_tokens for n in lens))
    # TTFT: background streams (8) decode; a 20-property schema arrives cold, then cached.
    bg = [(f"bg{i}", prompts[i % len(prompts)]) for i in range(streams)]
    for rid, p in bg:
        engine.add_request(rid, p, SamplingParams(max_tokens=100000 // 100, ignore_eos=True, temperature=0.0),
                           detokenize=False)
    for _ in range(5):
        engine.step()
    base_gaps = []
    last = time.perf_counter()
    for _ in range(10):
        engine.step()
        now = time.perf_counter()
        base_gaps.append(now - last)
        last = now
    colds, cacheds, cold_gaps = [], [], []
    for k in range(ttft_schemas):
        so = StructuredOutputsParams(json=schema(random.Random(50 + k), props=20))
        cold, gap = ttft(engine, bg, so, f"cold{k}")
        cached, _ = ttft(engine, bg, StructuredOutputsParams(json=so.json), f"cached{k}")
        colds.append(cold)
        cacheds.append(cached)
        cold_gaps.append(gap)
    for rid, _ in bg:
        engine.abort_request(rid)
    engine.shutdown()
    c, u = statistics.median(con), statistics.median(unc)
    print(f"bench_structured: shape={args.shape} isa={cpu_isa()} dtype={engine.config.dtype} "
          f"requests={args.requests} "
          f"rounds={args.rounds} constrained={c:.0f} tok/s unconstrained={u:.0f} tok/s ratio={c / u:.3f} "
          f"(per CPU second: {statistics.median(con_cpu):.0f} vs {statistics.median(unc_cpu):.0f}, "
          f"ratio={statistics.median(con_cpu) / statistics.median(unc_cpu):.3f}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs) "
          f"grammars_finished={statistics.median(finished):.0f}/{args.requests} | "
          f"ttft 20-prop schema cold={statistics.median(colds) * 1e3:.1f} ms "
          f"cached={statistics.median(cacheds) * 1e3:.1f} ms "
          f"added={(statistics.median(colds) - statistics.median(cacheds)) * 1e3:.1f} ms | "
          f"other streams' longest gap during a cold compile={statistics.median(cold_gaps) * 1e3:.1f} ms "
          f"(median step {statistics.median(base_gaps) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
