"""Offline throughput: tpserve's LLM.generate vs transformers, same workload, same run.

Workload: the ~40M-parameter Qwen3-architecture model of scripts/bench_models.py (random bf16
weights), 64 requests with prompts of 32-256 tokens and outputs of 32-256 tokens (ignore_eos,
greedy, fixed seed). Peers:
  * transformers continuous batching (``init_continuous_batching``, attn "paged|sdpa"), each
    request added with its own max_new_tokens, so both engines generate the same tokens;
  * transformers padded ``generate`` in batches of 16 (useful tokens only are counted).
Also measures the machine's matmul peak and prints tpserve's fraction of the model's compute
roofline (2 FLOPs per weight per generated token).

Precision: the checkpoint is bf16. On a CPU without native bf16 (no AVX512-BF16/AMX) bf16
matmuls are emulated and ~30x slower than fp32, so there every engine runs the model in fp32
(tpserve's dtype "auto" does this by itself) and the roofline uses the fp32 peak.

    python scripts/bench_throughput.py [--requests 64] [--skip-hf-padded] [--quick]
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
from bench_models import build_bench_model, count_params  # noqa: E402


def workload(n: int, vocab: int, seed: int = 0, lo: int = 32, hi: int = 256):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    outs = [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    return prompts, outs


def matmul_peak(dtype=torch.bfloat16, size=2048, reps=5) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * size ** 3 / min(times)


def run_tpserve(path, prompts, outs, args):
    from tpserve import LLM, SamplingParams
    llm = LLM(str(path), dtype=args.dtype_name, block_size=args.block_size, max_num_seqs=len(prompts),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=2.0)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(r.token_ids) for r in res)
    stats = llm.stats()
    llm.shutdown()
    return n_out / dt, [r.token_ids for r in res], stats


def run_hf_continuous(path, prompts, outs, dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation="paged|sdpa").eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=-1,
                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        t = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, outs)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        results = {}
        while len(results) < len(prompts):
            r = manager.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers continuous batching stopped early")
            if r.is_finished():
                results[r.request_id] = r.generated_tokens
        dt = time.perf_counter() - t
    finally:
        manager.stop(block=True)
    toks = [results[f"r{i}"] for i in range(len(prompts))]
    return sum(len(x) for x in toks) / dt, toks


def run_hf_padded(path, prompts, outs, dtype, batch=16):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ps, ns = prompts[i:i + batch], outs[i:i + batch]
            width = max(len(p) for p in ps)
            ids = torch.zeros(len(ps), width, dtype=torch.long)
            mask = torch.zeros(len(ps), width, dtype=torch.long)
            for j, p in enumerate(ps):  # left padding
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ns), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    dt = time.perf_counter() - t
    return sum(outs) / dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model-dir", default="/tmp/tpserve-bench/qwen3-40m")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf-padded", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="compute dtype of every engine; auto = bf16 only where the CPU has it natively")
    ap.add_argument("--quick", action="store_true", help="8 requests of 32-64 tokens (smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = build_bench_model(args.model_dir)
    vocab = 32768
    if args.quick:
        prompts, outs = workload(8, vocab, lo=32, hi=64)
    else:
        prompts, outs = workload(args.requests, vocab)
    from tpserve.workers.model_runner import cpu_has_fast_bf16
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    args.dtype_name = args.dtype
    dtype = getattr(torch, args.dtype)
    params = count_params(path)
    flops_per_token = 2 * (params["layers"] + params["lm_head"])
    peak = matmul_peak(dtype)
    roofline = peak / flops_per_token
    print(f"machine {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads) "
          f"-> roofline {roofline:.0f} output tok/s for {sum(params.values()) / 1e6:.1f}M params "
          f"(native bf16: {cpu_has_fast_bf16()})")

    tp_tps, tp_tokens, stats = run_tpserve(path, prompts, outs, args)
    print(f"tpserve LLM.generate        {tp_tps:8.1f} output tok/s  "
          f"({stats['num_preemptions']} preemptions, {tp_tps / roofline:.1%} of roofline)")
    best = None
    if not args.skip_hf:
        cb_tps, cb_tokens = run_hf_continuous(path, prompts, outs, dtype)
        same = statistics.mean(
            float(np.mean(np.array(a[:len(b)]) == np.array(b[:len(a)]))) for a, b in zip(tp_tokens, cb_tokens))
        print(f"transformers continuous     {cb_tps:8.1f} output tok/s  (token agreement with tpserve {same:.0%})")
        best = cb_tps
        if not args.skip_hf_padded:
            pad_tps = run_hf_padded(path, prompts, outs, dtype)
            print(f"transformers padded (bs16)  {pad_tps:8.1f} output tok/s")
            best = max(best, pad_tps)
        print(f"throughput tpserve={tp_tps:.1f} tok/s best-transformers={best:.1f} tok/s "
              f"ratio={tp_tps / best:.2f}x roofline-fraction={tp_tps / roofline:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
