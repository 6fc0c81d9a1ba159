"""Offline throughput: tpserve's LLM.generate against its peers, same workload, same run.

Shapes (random weights, built locally by scripts/bench_models.py; token-id prompts, greedy,
ignore_eos, fixed seed):
  * 40m  (default): the ~40M-parameter Qwen3 model, 64 requests of 32-256 in / 32-256 out;
  * 0.6b: Qwen3-0.6B's shape, 16 requests of 64-128 in / 64-128 out (GEMMs dominate);
  * tiny: 2 layers of width 64, 8 requests of 16-48 in / out (a smoke run: tests/test_scripts.py);
  * gemma3-1b: Gemma 3 1B's attention layout (sliding window 512, 5:1 sliding:global): the KV
    pool's capacity at 8k contexts and decode tok/s with the windows against the same model with
    its window ignored (scripts/bench_window_kv.py; ``--context``, ``--kv-gb``, ``--streams``,
    ``--decode-context``, ``--decode-tokens``); with ``--peer-vllm`` also offline throughput against
    vLLM-CPU, 32 requests of 512-1024 prompt tokens and 64-128 output tokens.
Peers:
  * ``--peer-vllm PYTHON``: vLLM's CPU backend (default settings, torch.compile on), run by the
    interpreter of its own virtualenv (scripts/peer_vllm_cpu.sh makes one) between two tpserve
    runs, so drift of a shared machine shows as a difference between the two tpserve lines;
  * transformers continuous batching and padded ``generate`` (skip with --skip-hf).
Also measures the machine's matmul peak and prints tpserve's fraction of the model's compute
roofline (2 FLOPs per weight per generated token), the CPU's ISA and the dtype.

The batch-invariant mode (``batch_invariant=True``, docs/protocol.md "Reproducibility") gets a
``batch-invariant`` line: its throughput at all the requests' streams and at one stream, each
against the default mode's in the same run (targets: >= 0.9x and >= 0.97x), and against
vLLM-CPU's default mode with ``--peer-vllm``; ``--skip-invariant`` leaves it out.

Precision: the checkpoints are bf16. On a CPU without native bf16 (no AVX512-BF16/AMX) bf16
matmuls are emulated and ~30x slower than fp32, so there every engine runs the model in fp32
(tpserve's dtype "auto" does this by itself) and the roofline uses the fp32 peak.

    python scripts/bench_throughput.py [--shape 40m|0.6b|tiny|gemma3-1b] [--peer-vllm PYTHON] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
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


# Environment variables that cap the instruction set torch, oneDNN, MKL and tpserve's C++
# operators use: set together, they emulate a smaller CPU (e.g. AVX2-only) on a bigger one.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "TPSERVE_CPU_ARCH")


def cpu_isa() -> str:
    """The best matmul instruction set this CPU offers, as the benchmark lines print it, with
    any cap from ISA_CAPS appended (``avx512_bf16-capped:ATEN_CPU_CAPABILITY=avx2,...``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return "unknown"
    best = next((isa for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if isa in flags),
                "baseline")
    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k)]
    return best + ("-capped:" + ",".join(caps) if caps else "")


AVX2_SITECUSTOMIZE = """\
import torch.cpu
for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
    setattr(torch.cpu, _name, lambda: False)
"""


def run_vllm_peer(python, path, prompts, outs, dtype_name, tmp_dir):
    """Run this script as vLLM's peer in another interpreter; returns (tok/s, token ids)."""
    import subprocess
    work = Path(tmp_dir) / "peer_workload.json"
    result = Path(tmp_dir) / "peer_result.json"
    work.write_text(json.dumps(dict(model=str(path), prompts=prompts, outs=outs, dtype=dtype_name)))
    result.unlink(missing_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if os.environ.get("ATEN_CPU_CAPABILITY") in ("avx2", "default"):
        # vLLM picks its compiled kernels (_C, _C_AVX512 or _C_AVX2) from torch.cpu's view of
        # the CPU's flags, which ignores the cap: report the capped CPU to every process of the
        # peer (its engine runs in a child process), so that it loads its AVX2 build.
        site = Path(tmp_dir) / "avx2_site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(AVX2_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    proc = subprocess.run([python, __file__, "--as-vllm-peer", str(work), str(result)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not result.exists():
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}):\n{tail}")
    r = json.loads(result.read_text())
    return r["tps"], r["tokens"]


def vllm_peer_main(work_path: str, result_path: str) -> int:
    """Inside the peer's virtualenv: vLLM's offline LLM on the workload, default settings."""
    from vllm import LLM, SamplingParams
    w = json.loads(Path(work_path).read_text())
    prompts, outs = w["prompts"], w["outs"]
    llm = LLM(model=w["model"], skip_tokenizer_init=True, dtype=w["dtype"], seed=0,
              max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + max(outs) + 16)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in outs]
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    tokens = [list(r.outputs[0].token_ids) for r in res]
    Path(result_path).write_text(json.dumps(dict(tps=sum(map(len, tokens)) / dt, tokens=tokens)))
    return 0


def agreement(a_runs, b_runs) -> float:
    """Mean fraction of equal tokens over the common length of each pair of outputs."""
    return statistics.mean(
        float(np.mean(np.array(a[:len(b)]) == np.array(b[:len(a)]))) for a, b in zip(a_runs, b_runs))


# The logits controls of the second tpserve line: every request penalised and biased.
CONTROLS = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                logit_bias={1: -5.0, 2: 2.0, 3: -1.0, 4: 1.0})


def run_tpserve(path, prompts, outs, args, controls=None, **engine):
    from tpserve import LLM, SamplingParams
    llm = LLM(str(path), dtype=args.dtype_name, block_size=args.block_size, max_num_seqs=len(prompts),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=2.0, **engine)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **(controls or {})) for n in outs]
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


def run_invariant(path, prompts, outs, args, default_tps: float, default_tokens) -> str:
    """The batch-invariant mode against the default one, each run back to back with a default
    run: all the requests' streams, and one stream (the longest output alone). (The process's
    first engine, ``default_tps``, runs slower than those after it.) Returns the
    ``batch-invariant`` line; the mode's many-stream tok/s goes to invariant_tps."""
    default_tps, _, _ = run_tpserve(path, prompts, outs, args)
    inv_tps, inv_tokens, _ = run_tpserve(path, prompts, outs, args, batch_invariant=True)
    one = [max(range(len(outs)), key=outs.__getitem__)]
    one_p, one_o = [prompts[i] for i in one], [outs[i] for i in one]
    d1, _, _ = run_tpserve(path, one_p, one_o, args)
    i1, _, _ = run_tpserve(path, one_p, one_o, args, batch_invariant=True)
    invariant_tps[:] = [inv_tps]
    return (f"batch-invariant shape={args.shape} isa={cpu_isa()} dtype={args.dtype} "
            f"streams={len(prompts)}: invariant={inv_tps:.1f} default={default_tps:.1f} tok/s "
            f"ratio={inv_tps / default_tps:.2f}x; streams=1: invariant={i1:.1f} default={d1:.1f} tok/s "
            f"ratio={i1 / d1:.2f}x; token agreement with default {agreement(default_tokens, inv_tokens):.0%}")


invariant_tps: list[float] = []

SHAPES = {"40m": (64, 32, 256), "0.6b": (16, 64, 128), "tiny": (8, 16, 48)}  # requests, lengths lo..hi
WINDOW_SHAPES = ("gemma3-1b",)  # sliding-window KV memory: bench_window_kv.py


# gemma3-1b against vLLM-CPU: requests, prompt and output lengths (prompts past the 512-token window,
# so that its sliding layers attend to their windows only).
WINDOW_THROUGHPUT = (32, 512, 1024)


def window_against_vllm(args, isa: str, dtype: str) -> None:
    """Offline throughput of the Gemma 3 1B-shaped model (its windows kept), tpserve before and
    after vLLM-CPU on the same workload."""
    import tempfile

    from bench_window_kv import build_model
    path = build_model(Path(args.model_dir or "/tmp/tpserve-bench") / "gemma3-1b-shape", ignored=False)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    n, lo, hi = WINDOW_THROUGHPUT
    prompts, outs = workload(args.requests or n, vocab, lo=lo, hi=hi)
    outs = [o // 8 for o in outs]  # 64-128 output tokens
    args.dtype_name = dtype
    tp_tps, tp_tokens, _ = run_tpserve(path, prompts, outs, args)
    with tempfile.TemporaryDirectory(prefix="tpserve-bench-") as tmp:
        v_tps, v_tokens = run_vllm_peer(args.peer_vllm, path, prompts, outs, dtype, tmp)
    tp2_tps, _, _ = run_tpserve(path, prompts, outs, args)
    mean_tps = (tp_tps + tp2_tps) / 2
    print(f"throughput shape=gemma3-1b isa={isa} dtype={dtype} requests={len(prompts)} in={lo}-{hi} "
          f"out={min(outs)}-{max(outs)} tpserve={mean_tps:.1f} tok/s (runs {tp_tps:.1f}, {tp2_tps:.1f}) "
          f"vllm-cpu={v_tps:.1f} tok/s ratio={mean_tps / v_tps:.2f}x (target >= 1.5x) "
          f"token-agreement={agreement(tp_tokens, v_tokens):.0%}", flush=True)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--as-vllm-peer":
        return vllm_peer_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES) + list(WINDOW_SHAPES), default="40m")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (40m), 16 (0.6b)")
    ap.add_argument("--model-dir", default=None,
                    help="default: /tmp/tpserve-bench/qwen3-40m or qwen3-0.6b-shape")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--peer-vllm", metavar="PYTHON",
                    help="interpreter of a virtualenv with vllm-cpu (scripts/peer_vllm_cpu.sh)")
    ap.add_argument("--skip-hf-padded", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="compute dtype of every engine; auto = bf16 only where the CPU has it natively")
    ap.add_argument("--quick", action="store_true", help="8 requests of 16-48 tokens (smoke run)")
    ap.add_argument("--skip-controls", action="store_true",
                    help="skip the second tpserve run with penalties and logit bias on every request")
    ap.add_argument("--skip-invariant", action="store_true",
                    help="skip the batch-invariant mode's runs (all streams and one stream)")
    ap.add_argument("--context", type=int, default=None, help="gemma3-1b: tokens per sequence (8192)")
    ap.add_argument("--kv-gb", type=float, default=4.0, help="gemma3-1b: KV memory for the capacity line")
    ap.add_argument("--streams", type=int, default=16, help="gemma3-1b: decoding streams")
    ap.add_argument("--decode-context", type=int, default=8192,
                    help="gemma3-1b: prompt + output tokens per stream of the decode line (0: skip it)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="gemma3-1b: tokens each stream decodes")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.shape in WINDOW_SHAPES:
        from bench_window_kv import main as window_main
        from tpserve.workers.model_runner import cpu_has_fast_bf16
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_fast_bf16() else "float32")
        # The throughput runs first, in a process no other engine has run in yet (as vLLM's, in
        # a process of its own): after the window lines' engines (4 GiB pools, 16 x 8k prompts)
        # the first tpserve run measured 314-327 tok/s where the run after vLLM's gave 360-367,
        # and three runs in a fresh process 349-353.
        if args.peer_vllm:
            window_against_vllm(args, cpu_isa(), dtype)
        window_main(args, cpu_isa(), dtype)
        return 0
    from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES
    path = build_bench_model(args.model_dir or f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}",
                             **SHAPE_OVERRIDES[args.shape])
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    n, lo, hi = SHAPES[args.shape]
    if args.quick:
        n, lo, hi = 8, 16, 48
    prompts, outs = workload(args.requests or n, vocab, lo=lo, hi=hi)
    from tpserve.workers.model_runner import cpu_has_fast_bf16
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    args.dtype_name = args.dtype
    dtype = getattr(torch, args.dtype)
    params = count_params(path)
    flops_per_token = 2 * (params["layers"] + params["lm_head"])
    peak = matmul_peak(dtype)
    roofline = peak / flops_per_token
    isa = cpu_isa()
    print(f"shape {args.shape}: {len(prompts)} requests, {lo}-{hi} in/out; isa {isa}, dtype "
          f"{args.dtype}; matmul peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads) "
          f"-> roofline {roofline:.0f} output tok/s for {sum(params.values()) / 1e6:.1f}M params")

    tp_tps, tp_tokens, stats = run_tpserve(path, prompts, outs, args)
    print(f"tpserve LLM.generate        {tp_tps:8.1f} output tok/s  "
          f"({stats['num_preemptions']} preemptions, {tp_tps / roofline:.1%} of roofline)")
    if not args.skip_controls:
        c_tps, _, _ = run_tpserve(path, prompts, outs, args, CONTROLS)
        print(f"throughput-controls shape={args.shape} isa={isa} dtype={args.dtype} "
              f"tpserve+penalties+bias={c_tps:.1f} tok/s plain={tp_tps:.1f} tok/s ratio={c_tps / tp_tps:.2f}x",
              flush=True)
    invariant = None
    if not args.skip_invariant:
        invariant = run_invariant(path, prompts, outs, args, tp_tps, tp_tokens)
    v_tps = None
    if args.peer_vllm:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="tpserve-bench-") as tmp:
            v_tps, v_tokens = run_vllm_peer(args.peer_vllm, path, prompts, outs, args.dtype, tmp)
        print(f"vLLM-CPU (default)          {v_tps:8.1f} output tok/s  "
              f"(token agreement with tpserve {agreement(tp_tokens, v_tokens):.0%})")
        tp2_tps, _, _ = run_tpserve(path, prompts, outs, args)
        print(f"tpserve LLM.generate (again){tp2_tps:8.1f} output tok/s")
        mean_tps = (tp_tps + tp2_tps) / 2
        print(f"throughput shape={args.shape} isa={isa} dtype={args.dtype} tpserve={mean_tps:.1f} "
              f"tok/s (runs {tp_tps:.1f}, {tp2_tps:.1f}) vllm-cpu={v_tps:.1f} tok/s "
              f"ratio={mean_tps / v_tps:.2f}x roofline-fraction={mean_tps / roofline:.1%}")
    if invariant is not None:
        print(invariant + (f" vs-vllm-cpu={invariant_tps[0] / v_tps:.2f}x" if v_tps else ""), flush=True)
    if not args.skip_hf:
        cb_tps, cb_tokens = run_hf_continuous(path, prompts, outs, dtype)
        print(f"transformers continuous     {cb_tps:8.1f} output tok/s  "
              f"(token agreement with tpserve {agreement(tp_tokens, cb_tokens):.0%})")
        best = cb_tps
        if not args.skip_hf_padded:
            pad_tps = run_hf_padded(path, prompts, outs, dtype)
            print(f"transformers padded (bs16)  {pad_tps:8.1f} output tok/s")
            best = max(best, pad_tps)
        print(f"throughput shape={args.shape} isa={isa} dtype={args.dtype} tpserve={tp_tps:.1f} "
              f"tok/s best-transformers={best:.1f} tok/s ratio={tp_tps / best:.2f}x "
              f"roofline-fraction={tp_tps / roofline:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
