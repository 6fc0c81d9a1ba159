"""TP=2 vs TP=1 output tokens/s on the ~40M benchmark model, same workload, same run.

On a 2-core CPU machine each of the two ranks gets one core and every layer adds two
all-reduces over gloo, so TP=1 is expected to win there; on GPUs the split pays off for models
too large or too slow for one device.

    python scripts/bench_tp.py [--requests 16] [--tp 2] [--shape 40m|tiny]

``--shape tiny`` (2 layers of width 64, 16-48 tokens in and out) is a smoke run of seconds
(tests/test_scripts.py), not a measurement.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import workload  # noqa: E402

LENGTHS = {"40m": (32, 128), "tiny": (16, 48)}  # prompt and output lengths, lo..hi


def run(path: Path, tp: int, prompts, outs) -> float:
    from tpserve import LLM, SamplingParams
    with LLM(str(path), tensor_parallel_size=tp, max_num_seqs=len(prompts), kv_cache_memory_gb=1.0) as llm:
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(LENGTHS), default="40m")
    ap.add_argument("--model-dir", help="[default: /tmp/tpserve-bench/qwen3-40m, or qwen3-tiny]")
    args = ap.parse_args()
    path = build_bench_model(args.model_dir or f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}",
                             **SHAPE_OVERRIDES[args.shape])
    lo, hi = LENGTHS[args.shape]
    prompts, outs = workload(args.requests, 32768, lo=lo, hi=hi)
    one = run(path, 1, prompts, outs)
    many = run(path, args.tp, prompts, outs)
    print(f"bench_tp shape={args.shape} requests={args.requests} tp1={one:.1f} tok/s "
          f"tp{args.tp}={many:.1f} tok/s "
          f"ratio tp{args.tp}/tp1={many / one:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
