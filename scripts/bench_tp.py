"""TP=2 vs TP=1 output tokens/s on the ~40M benchmark model, same workload, same run.

On a 2-core CPU machine each of the two ranks gets one core and every layer adds two
all-reduces over gloo, so TP=1 is expected to win there; on GPUs the split pays off for models
too large or too slow for one device.

    python scripts/bench_tp.py [--requests 16] [--tp 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import build_bench_model  # noqa: E402
from bench_throughput import workload  # noqa: E402


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
    ap.add_argument("--model-dir", default="/tmp/tpserve-bench/qwen3-40m")
    args = ap.parse_args()
    path = build_bench_model(args.model_dir)
    prompts, outs = workload(args.requests, 32768, lo=32, hi=128)
    one = run(path, 1, prompts, outs)
    many = run(path, args.tp, prompts, outs)
    print(f"bench_tp requests={args.requests} tp1={one:.1f} tok/s tp{args.tp}={many:.1f} tok/s "
          f"ratio tp{args.tp}/tp1={many / one:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
