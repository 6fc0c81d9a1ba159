"""gpu_check: the checks of tpserve's GPU path, one or more sections per process.

    scripts/gpu_check.sh [--dry-run] [--sections env,kernels,...] [--out DIR] ...   (all sections,
                                                         one process and one timeout each)
    scripts/gpu_check.py --sections NAME[,NAME] [--dry-run] [--workdir DIR] [--requests N]

Prints PASS / FAIL / SKIP lines and figures, then one summary line; exit 1 on any FAIL.

Sections (each independent; a failure is reported and the next section runs):
    env      torch / Triton / CUDA / flash-attn versions, GPU names and memory.
    kernels  Triton store + decode (auto and forced split-K) + prefill (with and without cached
             context) against the float64 reference, Qwen3-0.6B heads (16 q, 8 KV, dim 128),
             block sizes 16 and 256, bf16/fp16/fp32; flash-attn too when installed; the same
             with a 128-key sliding window, sinks and a soft-cap (bf16/fp32); and a cache of
             more than 2^31 elements whose sequence sits in its last blocks.
    graphs   CUDA-graph decode against eager decode on the same plan, batch 1, 3, 37, 64, 256
             (padded and exact sizes), fp32 Qwen3-0.6B-shaped model; graphs captured for
             2048-token tables, so the small batches run split-K inside the graph.
    start    a default ``LLM(model)`` start on a random-weight Qwen3-0.6B-shaped checkpoint:
             start time, KV blocks, free memory after sizing against 1 - gpu_memory_utilization;
             then a second engine in the same process, which must size the same.
    hf       greedy tokens of tpserve (fp32, CUDA graphs) against transformers' on the GPU.
    e2e      nano-vllm's benchmark workload at TP=1 (256 requests, input and output lengths
             drawn from 100-1024 with seed 0, temperature 0.6, ignore_eos): output tok/s.
    tp       with >= 2 GPUs: TP=2 greedy equals TP=1 greedy (fp32), and the same through torchrun.
    spec     speculative decoding (ngram drafts): greedy equals the plain run, drafts accepted.
    moe      the grouped-expert Triton kernel (``fused_experts``) against the float64 reference
             at Qwen3-30B-A3B's expert shape (hidden 2048, 128 experts of 768, top-8), 1, 37
             and 512 tokens, bf16/fp16/fp32, one expert-parallel shard; its time per call; and
             greedy tokens of a small random Qwen3-MoE model (fp32) against transformers'.

``--dry-run`` runs every section on the CPU at tiny shapes (a tiny random model, Triton under
TRITON_INTERPRET=1, a host accelerator standing in for CUDA graphs, two CPU ranks for TP): it
checks the script itself, not the GPU path, and is what the test suite runs.

Nothing here downloads anything: checkpoints are built from random weights (transformers), and
the script uses the installed torch and Triton. Every function takes its device as an argument
so that the CPU test suite runs the same code at tiny shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
# tpserve is used from this checkout, also by the torchrun ranks this script starts.
if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                               if p)

SECTIONS = ("env", "kernels", "graphs", "start", "hf", "e2e", "tp", "spec", "moe")
# Modules each section imports beyond torch (the engine's runtime dependencies for the rest).
_ENGINE_MODULES = ("triton", "numpy", "transformers", "tokenizers", "safetensors", "msgpack",
                   "xxhash", "tqdm")
NEEDS = {"env": ("triton",), "kernels": ("triton",), "graphs": _ENGINE_MODULES,
         "start": _ENGINE_MODULES, "hf": _ENGINE_MODULES, "e2e": _ENGINE_MODULES,
         "tp": _ENGINE_MODULES, "spec": _ENGINE_MODULES, "moe": _ENGINE_MODULES}


def missing_modules(names) -> list[str]:
    """The modules of ``names`` that are not installed (checked without importing them)."""
    import importlib.util
    return [n for n in names if importlib.util.find_spec(n) is None]


GRAPH_BATCHES = (1, 3, 37, 64, 256)
# Qwen3-0.6B's shape (its config.json), with random weights.
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0, bos_token_id=151643, eos_token_id=151645)
QWEN3_06B_HEADS = (16, 8, 128)
# The --dry-run model: tiny, but with room for block tables wide enough for split-K.
DRY_RUN_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                     max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
# The --dry-run experts: (hidden, moe_intermediate_size, experts, top-k).
DRY_RUN_EXPERTS = (32, 24, 8, 2)
# Absolute error allowed against the float64 reference (inputs ~N(0, 1), outputs O(1)).
TOLERANCE = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 3e-2}


# ---- reporting ------------------------------------------------------------------------------------
@dataclass
class Report:
    """Collects PASS / FAIL / SKIP lines and figures; ``lines`` is what was printed."""

    out: object = None
    counts: dict = field(default_factory=lambda: {"PASS": 0, "FAIL": 0, "SKIP": 0})
    lines: list = field(default_factory=list)

    def _emit(self, line: str) -> None:
        self.lines.append(line)
        print(line, file=self.out or sys.stdout, flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        status = "PASS" if ok else "FAIL"
        self.counts[status] += 1
        self._emit(f"{status} {name}" + (f": {detail}" if detail else ""))
        return ok

    def skip(self, name: str, why: str) -> None:
        self.counts["SKIP"] += 1
        self._emit(f"SKIP {name}: {why}")

    def figure(self, name: str, text: str) -> None:
        self._emit(f"     {name}: {text}")

    def crashed(self, name: str, exc: BaseException) -> None:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        self.check(name, False, f"raised {last}")
        for line in traceback.format_exc().rstrip().splitlines()[-12:]:
            self._emit(f"       | {line}")

    def summary(self, seconds: float) -> str:
        c = self.counts
        line = f"gpu_check: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP in {seconds:.0f} s"
        self._emit(line)
        return line

    @property
    def ok(self) -> bool:
        return self.counts["FAIL"] == 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--workdir", default=os.environ.get("TPSERVE_GPU_CHECK_DIR", "/tmp/tpserve-gpu-check"),
                    help="where random-weight checkpoints are built (reused across runs)")
    ap.add_argument("--requests", type=int, default=256, help="e2e requests (nano-vllm: 256)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip sections that would start after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="every section on the CPU at tiny shapes (checks the script, not a GPU)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.requests < 1:
        ap.error(f"--requests: must be >= 1, got {args.requests}")
    args.sections = sections
    return args


# ---- checkpoints and workloads -----------------------------------------------------------------
def build_checkpoint(path: Path, dtype: str = "bfloat16", **overrides) -> Path:
    """A random-weight Qwen3 checkpoint of Qwen3-0.6B's shape (``overrides`` shrink it)."""
    from bench_models import build_bench_model
    return build_bench_model(path, dtype=dtype, **dict(QWEN3_06B, **overrides))


def nano_vllm_workload(num_requests: int = 256, seed: int = 0, max_input: int = 1024,
                       max_output: int = 1024, vocab: int = 10000, min_len: int = 100):
    """nano-vllm's bench.py workload: (prompts as token-id lists, output lengths), lengths
    uniform in [min_len, max_input] / [min_len, max_output], token ids uniform in [0, vocab]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab) for _ in range(rng.randint(min_len, max_input))]
               for _ in range(num_requests)]
    outputs = [rng.randint(min_len, max_output) for _ in range(num_requests)]
    return prompts, outputs


def free_fraction_ok(free: int, total: int, utilization: float) -> tuple[bool, str]:
    """After sizing, free memory should be about ``1 - utilization`` of the card: at least that
    minus 2% (the KV pool may not overshoot), at most plus 6% (graph pools, rounding)."""
    frac = free / total
    want = 1.0 - utilization
    ok = want - 0.02 <= frac <= want + 0.06
    return ok, f"free {free / 2**30:.1f} of {total / 2**30:.1f} GiB = {frac:.3f} (want ~{want:.3f})"


# ---- kernels ------------------------------------------------------------------------------------
KERNEL_CASES = {
    # name: (context lengths, new lengths, is_prefill)
    "decode": ([0, 17, 300, 1500, 4000], [1, 1, 1, 1, 1], False),
    "prefill": ([0, 0, 0], [5, 200, 33], True),
    "prefill_context": ([40, 0, 700], [9, 100, 300], True),
}


def _max_err(out, want) -> float:
    return float((out.double().cpu() - want).abs().max())


def _can_run(name, device, block_size, dtype) -> bool:
    from tpserve.kernels.backend_factory import get_backend
    try:
        get_backend(name, device, block_size, dtype=dtype)
        return True
    except ValueError:
        return False


def check_kernels(report: Report, device, dtypes=("bfloat16", "float16", "float32"),
                  block_sizes=(16, 256), heads=QWEN3_06B_HEADS, cases=None, splits=(None, 1, 4)):
    """Triton (and flash-attn where it can run) against the reference, every case x dtype x
    block size; decode also with split-K forced off and forced on."""
    import torch

    from tpserve.kernels.backend_factory import get_backend
    from tpserve.kernels.paged_decode import paged_decode_attention
    from tpserve.kernels.reference import random_paged_batch, reference_attention
    from tpserve.kernels.store_kvcache import store_kvcache

    device = torch.device(device)
    cases = cases or KERNEL_CASES
    hq, hkv, d = heads
    scale = d ** -0.5
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        tol = TOLERANCE[dtype_name]
        for bs in block_sizes:
            backends = [n for n in ("triton", "flash") if _can_run(n, device, bs, dtype)]
            for case, (ctx, new, is_prefill) in cases.items():
                batch = random_paged_batch(ctx, new, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=bs, dtype=dtype, device=device,
                                           is_prefill=is_prefill, seed=11)
                want = reference_attention(batch.q.cpu(), batch.keys, batch.values, new, scale)
                for name in backends:
                    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
                    out = get_backend(name, device, bs, dtype=dtype).forward(
                        batch.q, batch.k, batch.v, kc, vc, batch.meta, scale)
                    err = _max_err(out, want)
                    report.check(f"kernels {name} {case} {dtype_name} block {bs}", err <= tol,
                                 f"max abs err {err:.2e} (tol {tol:.0e})")
                if not is_prefill:
                    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
                    store_kvcache(batch.k, batch.v, kc, vc, batch.meta.slot_mapping)
                    for n in splits:
                        if n is None:
                            continue
                        out = paged_decode_attention(batch.q, kc, vc, batch.meta.block_tables,
                                                     batch.meta.context_lens, scale, num_splits=n)
                        err = _max_err(out, want)
                        report.check(f"kernels triton decode splits={n} {dtype_name} block {bs}",
                                     err <= tol, f"max abs err {err:.2e}")
                del batch
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_kernel_options(report: Report, device, dtypes=("bfloat16", "float32"), block_sizes=(16, 256),
                         heads=QWEN3_06B_HEADS, cases=None, window: int = 128):
    """Triton (and flash-attn where it can run) with a sliding window, attention sinks and a
    logit soft-cap (gpt-oss / Gemma 2 layers) against the reference, every case x dtype x block
    size: the window shorter than the longer contexts, so blocks before it are skipped."""
    import torch

    from tpserve.kernels.backend_factory import get_backend
    from tpserve.kernels.reference import random_paged_batch, reference_attention

    device = torch.device(device)
    cases = cases or KERNEL_CASES
    hq, hkv, d = heads
    scale = d ** -0.5
    sinks = torch.linspace(-2.0, 3.0, hq)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        tol = TOLERANCE[dtype_name]
        for bs in block_sizes:
            backends = [n for n in ("triton", "flash") if _can_run(n, device, bs, dtype)]
            for case, (ctx, new, is_prefill) in cases.items():
                batch = random_paged_batch(ctx, new, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=bs, dtype=dtype, device=device,
                                           is_prefill=is_prefill, seed=12)
                want = reference_attention(batch.q.cpu(), batch.keys, batch.values, new, scale,
                                           window=window, sinks=sinks, softcap=30.0)
                for name in backends:
                    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
                    try:
                        out = get_backend(name, device, bs, dtype=dtype).forward(
                            batch.q, batch.k, batch.v, kc, vc, batch.meta, scale, window=window,
                            sinks=sinks.to(device), softcap=30.0)
                        err = _max_err(out, want)
                    except TypeError as e:  # a flash-attn without window_size / softcap
                        report.check(f"kernels {name} {case} window+sinks+softcap", False, str(e))
                        continue
                    report.check(f"kernels {name} {case} window+sinks+softcap {dtype_name} block {bs}",
                                 err <= tol, f"max abs err {err:.2e} (tol {tol:.0e})")
                del batch
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_big_cache(report: Report, device, dtype_name: str = "bfloat16", block_size: int = 16,
                    heads=QWEN3_06B_HEADS, min_elements: int = 2**31 + 1, context: int = 300):
    """A KV cache of more than ``min_elements`` elements per tensor, the checked sequence in its
    last blocks (offsets past 2^31): store, decode and prefill-with-context vs the reference."""
    import torch

    from tpserve.kernels.backend_factory import get_backend
    from tpserve.kernels.metadata import AttentionMetadata
    from tpserve.kernels.reference import reference_attention

    device = torch.device(device)
    dtype = getattr(torch, dtype_name)
    hq, hkv, d = heads
    per_block = block_size * hkv * d
    num_blocks = -(-min_elements // per_block) + 2
    gen = torch.Generator().manual_seed(5)
    total = context + 8
    nblk = -(-total // block_size)
    table = torch.arange(num_blocks - 1, num_blocks - 1 - nblk, -1, dtype=torch.int32)
    keys = torch.randn(total, hkv, d, generator=gen).to(dtype)
    values = torch.randn(total, hkv, d, generator=gen).to(dtype)
    pos = torch.arange(total)
    slots = (table[pos // block_size].long() * block_size + pos % block_size).to(torch.int32)
    name = (f"kernels big cache ({num_blocks * per_block / 2**31:.2f} x 2^31 elements) "
            f"{dtype_name} block {block_size}")
    kc = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    backend = get_backend("triton", device, block_size, dtype=dtype)
    scale = d ** -0.5
    try:
        # Prefill with context: the first `context` tokens are stored, the last 8 are new.
        new = total - context
        backend.store(keys[:context].to(device), values[:context].to(device), kc, vc,
                      slots[:context].to(device))
        q = torch.randn(new, hq, d, generator=gen).to(dtype)
        meta = AttentionMetadata.from_arrays(
            is_prefill=True, has_context=True, cu_seqlens_q=[0, new], cu_seqlens_k=[0, total],
            context_lens=[total], block_tables=table[None, :], slot_mapping=slots[context:],
            device=device)
        out = backend.forward(q.to(device), keys[context:].to(device), values[context:].to(device),
                              kc, vc, meta, scale)
        want = reference_attention(q, [keys], [values], [new], scale)
        err = _max_err(out, want)
        tol = TOLERANCE[dtype_name]
        report.check(name + " prefill", err <= tol, f"max abs err {err:.2e}")
        # Decode of the last token against everything now in the cache.
        meta = AttentionMetadata.from_arrays(
            is_prefill=False, has_context=False, cu_seqlens_q=[0, 1], cu_seqlens_k=[0, total],
            context_lens=[total], block_tables=table[None, :], slot_mapping=slots[-1:],
            device=device)
        q1 = torch.randn(1, hq, d, generator=gen).to(dtype)
        out = backend.forward(q1.to(device), keys[-1:].to(device), values[-1:].to(device),
                              kc, vc, meta, scale)
        err = _max_err(out, reference_attention(q1, [keys], [values], [1], scale))
        report.check(name + " decode", err <= tol, f"max abs err {err:.2e}")
    finally:
        del kc, vc
        if device.type == "cuda":
            torch.cuda.empty_cache()


def time_decode(report: Report, device, batches=(1, 8, 64), context: int = 8192,
                heads=QWEN3_06B_HEADS, dtype_name: str = "bfloat16", iters: int = 20):
    """Figures for the decode defaults: Triton decode with split-K (auto) against one program
    per (sequence, KV head), at block 16, and flash-attn at block 256 where it can run."""
    import torch

    from tpserve.kernels.backend_factory import get_backend
    from tpserve.kernels.metadata import AttentionMetadata
    from tpserve.kernels.paged_decode import paged_decode_attention
    from tpserve.kernels.tiles import decode_splits, max_tile
    from tpserve.workers.device import accelerator_for

    accel = accelerator_for(device)
    device = accel.device
    dtype = getattr(torch, dtype_name)
    hq, hkv, d = heads
    scale = d ** -0.5

    def timed(fn) -> float:
        fn()
        accel.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        accel.synchronize()
        return (time.perf_counter() - t) / iters * 1e3

    for b in batches:
        cells = []
        for bs in (16, 256):
            nblk = -(-context // bs)
            kc = torch.randn(b * nblk, bs, hkv, d, device=device).to(dtype)
            vc = torch.randn_like(kc)
            tables = torch.randperm(b * nblk, device=device).to(torch.int32).view(b, nblk)
            lens = torch.full((b,), context, dtype=torch.int32, device=device)
            q = torch.randn(b, hq, d, device=device).to(dtype)
            if bs == 16:
                auto = decode_splits(b, hkv, nblk * bs, max_tile(dtype))
                for n in (1, auto):
                    ms = timed(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, num_splits=n))
                    cells.append(f"triton/16 splits={n} {ms:.3f} ms")
            elif _can_run("flash", device, bs, dtype):
                meta = AttentionMetadata.from_arrays(
                    is_prefill=False, has_context=False, cu_seqlens_q=list(range(b + 1)),
                    cu_seqlens_k=[i * context for i in range(b + 1)], context_lens=lens.cpu(),
                    block_tables=tables.cpu(), slot_mapping=[-1] * b, device=device)
                fa = get_backend("flash", device, bs, dtype=dtype)
                ms = timed(lambda: fa.attend(q, None, None, kc, vc, meta, scale))
                cells.append(f"flash/256 {ms:.3f} ms")
            del kc, vc
        gbytes = 2 * b * context * hkv * d * torch.empty((), dtype=dtype).element_size() / 1e9
        report.figure(f"decode {dtype_name} batch {b} x {context} keys ({gbytes:.2f} GB of K/V)",
                      ", ".join(cells))


# ---- CUDA graphs ----------------------------------------------------------------------------------
def _plan(lens, new, slots_per_seq, tables, vocab, rng, is_prefill):
    """A StepPlan for sequences already holding ``lens`` tokens that add ``new`` each."""
    import numpy as np

    from tpserve.plan import StepPlan
    b = len(lens)
    q_lens = np.array(new, np.int32)
    k_lens = np.array(lens, np.int32) + q_lens
    cu_q = np.zeros(b + 1, np.int32)
    cu_q[1:] = np.cumsum(q_lens)
    cu_k = np.zeros(b + 1, np.int32)
    cu_k[1:] = np.cumsum(k_lens)
    positions = np.concatenate([np.arange(l, l + n, dtype=np.int32) for l, n in zip(lens, new)])
    slots = np.concatenate([slots_per_seq[i][lens[i]:lens[i] + new[i]] for i in range(b)])
    return StepPlan(is_prefill=is_prefill, has_context=False, max_seqlen_q=int(q_lens.max()),
                    max_seqlen_k=int(k_lens.max()),
                    input_ids=rng.integers(0, vocab, int(q_lens.sum()), dtype=np.int32),
                    positions=positions, slot_mapping=slots.astype(np.int32), cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, context_lens=k_lens, block_tables=tables,
                    logits_indices=(cu_q[1:] - 1).astype(np.int32))  # greedy: no SamplePlan


def check_graphs(report: Report, model_dir, device, batch_sizes=GRAPH_BATCHES, max_len: int = 160,
                 dtype: str = "float32", tol: float = 1e-3, attention_backend: str = "auto",
                 max_model_len: int = 2048):
    """For each batch size: prefill B random sequences of up to ``max_len`` tokens, then run the
    same decode plan through the captured graph and eagerly; their hidden states must agree
    (relative max error). Graphs are captured for ``max_model_len``-wide block tables, so small
    batches decode with split-K inside the graph (the eager run of the plan's narrower tables
    splits less or not at all); at least one checked batch must have."""
    import numpy as np
    import torch

    from tpserve.config import EngineConfig
    from tpserve.kernels.tiles import decode_splits, max_tile
    from tpserve.models.parallel import TPContext
    from tpserve.workers.model_runner import ModelRunner

    bs = 16
    per_seq = -(-(max_len + 1) // bs)
    cfg = EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=max(batch_sizes),
                       max_model_len=max(max_model_len, max_len + 1),
                       max_num_batched_tokens=max(batch_sizes) * max_len,
                       num_kv_blocks=max(batch_sizes) * per_seq, block_size=bs,
                       attention_backend=attention_backend).resolve()
    runner = ModelRunner(cfg, TPContext(), device)
    try:
        graphs = runner.graphs
        sizes = graphs.batch_sizes if graphs else None
        if not report.check("graphs captured", graphs is not None,
                            f"backend {runner.backend.name}, sizes {sizes}"):
            return
        rng = np.random.default_rng(0)
        vocab = runner.model.vocab_size
        hkv = runner.model.num_kv_heads_per_rank
        most_splits = 1
        for b in batch_sizes:
            lens = rng.integers(4, max_len, b).tolist()
            tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
            slots = [(tables[i][np.arange(max_len + 1) // bs] * bs + np.arange(max_len + 1) % bs)
                     for i in range(b)]
            runner.execute(_plan([0] * b, lens, slots, tables, vocab, rng, True))
            plan = _plan(lens, [1] * b, slots, tables, vocab, rng, False)
            with torch.inference_mode():
                t = runner.stager.stage(plan)
                eager = runner.model(t["input_ids"], t["positions"],
                                     runner.metadata(plan, t)).float().clone()
                graph = graphs.run(plan, t).float().clone()
            err = float((graph - eager).abs().max() / eager.abs().max().clamp(min=1e-6))
            padded = next(s for s in graphs.batch_sizes if s >= b)
            splits = decode_splits(padded, hkv, graphs.max_blocks * bs, max_tile(runner.dtype))
            most_splits = max(most_splits, splits)
            report.check(f"graphs decode batch {b} (graph {padded}, splits={splits}) vs eager",
                         err <= tol, f"relative max diff {err:.1e}")
        report.check("graphs: split-K inside a captured graph", most_splits > 1,
                     f"most splits {most_splits} (block tables {graphs.max_blocks} blocks wide)")
    finally:
        runner.close()


# ---- start-up, end to end, TP ---------------------------------------------------------------
def check_default_start(report: Report, model_dir, mem_get_info=None, **options):
    """``LLM(model_dir)`` as a user starts it; ``mem_get_info`` () -> (free, total) defaults to
    the current CUDA device's (tests pass their own, and ``options``). Then a second engine in
    the same process, after the first one's shutdown: it must size its KV pool as the first did
    (the first one's memory returned to the device, not held until a garbage collection)."""
    import torch

    from tpserve import LLM
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **options)
    try:
        seconds = time.perf_counter() - t0
        cfg = llm.engine.config
        blocks = cfg.num_kv_blocks
        free, total = (mem_get_info or torch.cuda.mem_get_info)()
        ok, text = free_fraction_ok(free, total, cfg.gpu_memory_utilization)
        runner = llm.engine.executor.runner
        report.figure("default start", f"{seconds:.1f} s, backend {runner.backend.name}, "
                      f"block {cfg.block_size}, {blocks} KV blocks "
                      f"({blocks * cfg.block_size} tokens), graphs "
                      f"{'on' if runner.graphs is not None else 'off'}")
        del runner
        report.check("start: free memory after sizing", ok, text)
        out = llm.generate([[1, 2, 3, 4]], _params(0.0, 8), use_tqdm=False)
        report.check("start: generates", len(out[0].outputs[0].token_ids) == 8)
    finally:
        llm.shutdown()
        del llm
    t0 = time.perf_counter()
    second = LLM(str(model_dir), **options)
    try:
        again = second.engine.config.num_kv_blocks
        report.check("start: a second engine in the process sizes like the first",
                     abs(again - blocks) <= 0.02 * blocks,
                     f"{again} vs {blocks} KV blocks, started in {time.perf_counter() - t0:.1f} s")
    finally:
        second.shutdown()


def _params(temperature, max_tokens):
    from tpserve import SamplingParams
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)


def run_e2e(report: Report, model_dir, num_requests: int = 256, tp: int = 1,
            max_model_len: int = 4096, workload=None, **options):
    """nano-vllm's benchmark at ``tp`` (its LLM has max_model_len 4096): prints output tokens
    per second. ``workload`` overrides ``nano_vllm_workload``'s arguments (tests shrink it)."""
    from tpserve import LLM
    prompts, outputs = nano_vllm_workload(num_requests, **(workload or {}))
    params = [_params(0.6, n) for n in outputs]
    with LLM(str(model_dir), tensor_parallel_size=tp, max_model_len=max_model_len,
             **options) as llm:
        llm.generate([[1, 2, 3]], _params(0.6, 4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    report.check(f"e2e TP={tp}: every request got its tokens", produced == sum(outputs),
                 f"{produced} of {sum(outputs)}")
    report.figure(f"e2e TP={tp}", f"{num_requests} requests, {produced} output tokens in "
                  f"{seconds:.1f} s = {produced / seconds:.0f} tok/s "
                  f"(input {sum(map(len, prompts))} tokens)")
    return produced / seconds


HF_PROMPTS = ([5, 6, 7, 8, 9], list(range(100, 180)), [42] * 33)
# A reference whose best two logits are closer than this is a tie fp32 rounding may break
# either way; a divergence there is not a defect.
HF_TIE = 1e-3


def hf_greedy(model, prompt, max_tokens: int, device):
    """transformers' greedy continuation of ``prompt`` (full recompute each step) and, per
    token, the gap between its best and second-best logit."""
    import torch
    ids = torch.tensor([prompt], device=device)
    tokens, gaps = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            top = model(ids).logits[0, -1].float().topk(2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, ids.new_tensor([[tokens[-1]]])], dim=1)
    return tokens, gaps


def check_hf_greedy(report: Report, model_dir, device, prompts=HF_PROMPTS, max_tokens: int = 16,
                    max_model_len: int = 512, **options):
    """tpserve's greedy tokens (fp32, graphs on where the device has them) equal transformers'
    on the same weights and device; a divergence counts only where the reference had a
    near-tie (``HF_TIE``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tpserve import LLM
    with LLM(str(model_dir), dtype="float32", max_model_len=max_model_len, **options) as llm:
        ours = [o.outputs[0].token_ids
                for o in llm.generate(list(prompts), _params(0.0, max_tokens), use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().to(device).eval()
    try:
        for i, (prompt, got) in enumerate(zip(prompts, ours)):
            want, gaps = hf_greedy(hf, prompt, max_tokens, device)
            name = f"hf greedy prompt {i} ({len(prompt)} tokens)"
            j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if j is None and len(got) == len(want):
                report.check(name, True, f"{len(want)} tokens equal, {len(set(want))} distinct")
            elif j is not None and gaps[j] < HF_TIE:
                report.check(name, True, f"equal up to token {j}, a near-tie there "
                             f"(transformers' top-2 gap {gaps[j]:.1e})")
            else:
                report.check(name, False, f"token {j}: tpserve {got[j] if j is not None else got}"
                             f", transformers {want[j] if j is not None else want} "
                             f"(top-2 gap {gaps[j] if j is not None else 0:.2e})")
    finally:
        del hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_tp(report: Report, model_dir, gpus: int, max_model_len: int = 512):
    if gpus < 2:
        report.skip("tp", f"{gpus} GPU(s); TP=2 needs 2")
        return
    from tpserve import LLM
    prompts = [[5, 6, 7, 8, 9], list(range(100, 180)), [42] * 33]
    greedy = _params(0.0, 16)
    ref = {}
    for tp in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=tp, dtype="float32",
                 max_model_len=max_model_len, gpu_memory_utilization=0.4) as llm:
            ref[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    report.check("tp: TP=2 greedy equals TP=1 (fp32)", ref[1] == ref[2],
                 "" if ref[1] == ref[2] else f"{ref[1]} vs {ref[2]}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "tpserve.launch", "--model", str(model_dir), "--max-tokens", "16",
           "--ignore-eos", "--dtype", "float32"]
    for p in prompts:
        cmd += ["--token-ids", ",".join(map(str, p))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    got = [json.loads(line.split("=", 1)[1]) for line in proc.stdout.splitlines()
           if line.startswith("token_ids=")]
    report.check("tp: torchrun TP=2 greedy equals TP=1", proc.returncode == 0 and got == ref[1],
                 f"exit {proc.returncode}" + ("" if proc.returncode == 0 else
                                              f"; stderr tail: {proc.stderr[-400:]!r}"))


def check_spec(report: Report, model_dir, max_tokens: int = 32, max_model_len: int = 512, **options):
    """Speculative decoding on the device: rows verifying drafts are prefill rows over cached
    context (the prefill kernel, eager) beside plain decode rows (captured graphs). Greedy
    tokens (fp32) equal those without drafts; a divergence counts only at a near-tie of the
    plain run's top two (``HF_TIE``). Drafts must be accepted."""
    from tpserve import LLM, SamplingParams
    prompts = [[42] * 64, [5, 6, 7, 8] * 8, list(range(100, 180)), [7, 9] * 20]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    runs = {}
    for name, config in (("plain", None), ("spec", spec)):
        with LLM(str(model_dir), dtype="float32", max_model_len=max_model_len,
                 speculative_config=config, **options) as llm:
            runs[name] = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            stats = llm.stats()
    for i, (a, b) in enumerate(zip(runs["plain"], runs["spec"])):
        j = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if j is None:
            report.check(f"spec: prompt {i} greedy equals the plain run", True, f"{len(a.token_ids)} tokens")
        else:
            top = sorted(a.logprobs[j].values(), key=lambda e: e.rank)  # vLLM's dict: ranks 1, 2, ...
            gap = top[0].logprob - top[1].logprob
            report.check(f"spec: prompt {i} greedy equals the plain run", gap < HF_TIE,
                         f"token {j}: {a.token_ids[j]} vs {b.token_ids[j]} (plain top-2 gap {gap:.1e})")
    report.check("spec: drafts accepted", stats["spec_decode_num_accepted_tokens"] > 0,
                 f"mean acceptance length {stats['spec_decode_mean_acceptance_length']:.2f}")


# ---- mixture of experts ---------------------------------------------------------------------------
# Qwen3-30B-A3B's experts: (hidden, moe_intermediate_size, experts, top-k).
QWEN3_30B_A3B_EXPERTS = (2048, 768, 128, 8)
MOE_TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _moe_inputs(tokens: int, shape, dtype, device, seed: int = 0):
    """x [T, H] ~N(0, 1), routing as a Qwen3-MoE router does it (softmax, top-k, renormalised),
    expert weights scaled so that every stage's output is O(1)."""
    import torch

    from tpserve.models.moe import route
    h, inter, experts, k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen) * 2.0
    weights, ids = route(logits, k, True)
    w13 = (torch.randn(experts, 2 * inter, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=gen) * inter ** -0.5).to(dtype)
    return [t.to(device) for t in (x, ids, weights, w13, w2)]


def check_moe_kernel(report: Report, device, dtypes=("bfloat16", "float16", "float32"),
                     tokens=(1, 37, 512), shape=QWEN3_30B_A3B_EXPERTS):
    """``fused_experts`` (Triton) against ``experts_reference`` in float64 on the same device,
    every token count x dtype; then one expert-parallel shard (a quarter of the experts,
    tokens routed to experts on other shards too)."""
    import torch

    from tpserve.kernels.triton_moe import fused_experts_triton
    from tpserve.models.moe import experts_reference
    h, inter, experts, k = shape
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        tol = MOE_TOLERANCE[dtype_name]
        for t in tokens:
            x, ids, weights, w13, w2 = _moe_inputs(t, shape, dtype, device, seed=t)
            want = experts_reference(x.double(), ids, weights, w13.double(), w2.double())
            out = fused_experts_triton(x, ids, weights, w13, w2)
            err = _max_err(out, want.cpu())
            used = int(torch.unique(ids).numel())
            report.check(f"moe fused_experts {dtype_name} tokens {t}", bool(err <= tol),
                         f"max abs err {err:.2e} (tol {tol:.0e}), {used} of {experts} experts used, "
                         f"max |out| {float(want.abs().max()):.2f}")
            del x, ids, weights, w13, w2, want, out
    dtype = torch.bfloat16
    x, ids, weights, w13, w2 = _moe_inputs(max(tokens), shape, dtype, device, seed=99)
    start, stop = experts // 4, experts // 2
    want = experts_reference(x.double(), ids, weights, w13[start:stop].double(), w2[start:stop].double(),
                             start)
    out = fused_experts_triton(x, ids, weights, w13[start:stop], w2[start:stop], start)
    err = _max_err(out, want.cpu())
    report.check(f"moe fused_experts bfloat16 expert shard {start}..{stop - 1}",
                 bool(err <= MOE_TOLERANCE["bfloat16"]), f"max abs err {err:.2e}")
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def time_moe(report: Report, device, tokens=(1, 8, 64, 512), shape=QWEN3_30B_A3B_EXPERTS,
             dtype_name: str = "bfloat16", iters: int = 20):
    """Figures: fused_experts' time per call, and the expert weights it reads per second (each
    used expert's w13 and w2 once)."""
    import torch

    from tpserve.kernels.triton_moe import fused_experts_triton
    from tpserve.workers.device import accelerator_for
    accel = accelerator_for(device)
    h, inter, experts, k = shape
    dtype = getattr(torch, dtype_name)
    cells = []
    for t in tokens:
        x, ids, weights, w13, w2 = _moe_inputs(t, shape, dtype, accel.device, seed=t)
        fused_experts_triton(x, ids, weights, w13, w2)
        accel.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fused_experts_triton(x, ids, weights, w13, w2)
        accel.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        read = int(torch.unique(ids).numel()) * 3 * h * inter * w13.element_size()
        cells.append(f"{t} tokens {seconds * 1e3:.3f} ms ({read / seconds / 1e9:.1f} GB/s of experts)")
    report.figure(f"moe fused_experts {dtype_name} {experts} experts of {inter}, top-{k}", "; ".join(cells))


def build_moe_checkpoint(path: Path) -> Path:
    """A small random Qwen3-MoE checkpoint (scripts/bench_moe.py's tiny shape: 8 experts of 32,
    top-2, routers spread over the experts), bf16 weights (read as fp32 by the greedy check)."""
    from bench_moe import build_moe_model
    return build_moe_model(path, "tiny")


def check_moe_model(report: Report, workdir: Path, device, **options):
    """tpserve's greedy tokens on a MoE model (its experts through ``fused_experts`` on a GPU)
    against transformers' (``check_hf_greedy``)."""
    path = build_moe_checkpoint(Path(workdir) / "qwen3-moe-tiny")
    check_hf_greedy(report, path, device, **options)


def host_graphs_accelerator():
    """The host accelerator with the device path on (--dry-run): decode graphs are captured
    through the seam and replay by re-running their function."""
    from tpserve.workers.device import Accelerator

    class HostGraphs(Accelerator):
        is_accelerator = True
    return HostGraphs("cpu")


def environment(report: Report, dry_run: bool = False) -> int:
    """Report versions and devices; the number of GPUs (in a dry run: 2, the CPU ranks that
    stand in for them)."""
    import torch
    import triton

    from tpserve.kernels.backend_factory import flash_attn_available
    report.figure("torch", f"{torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
                  f"flash-attn {'installed' if flash_attn_available() else 'absent'}")
    if dry_run:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        report.check("env: dry run on the CPU", interpreted,
                     "Triton interpreted" if interpreted else "TRITON_INTERPRET is not 1")
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        p = torch.cuda.get_device_properties(i)
        report.figure(f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
                      f"{p.multi_processor_count} SMs")
    report.check("env: CUDA available", gpus > 0, f"{gpus} device(s)")
    return gpus


def gpu_steps(report: Report, args, gpus: int, checkpoint) -> dict:
    """What each section runs on the GPU; ``checkpoint(dtype)`` builds or reuses the model."""
    return {
        "kernels": lambda: (check_kernels(report, "cuda"), check_kernel_options(report, "cuda"),
                            [check_big_cache(report, "cuda", "bfloat16", bs) for bs in (16, 256)],
                            time_decode(report, "cuda")),
        "graphs": lambda: check_graphs(report, checkpoint("float32"), "cuda"),
        "start": lambda: check_default_start(report, checkpoint("bfloat16")),
        "hf": lambda: check_hf_greedy(report, checkpoint("float32"), "cuda"),
        "e2e": lambda: run_e2e(report, checkpoint("bfloat16"), args.requests),
        "tp": lambda: check_tp(report, checkpoint("float32"), gpus),
        "spec": lambda: check_spec(report, checkpoint("float32")),
        "moe": lambda: (check_moe_kernel(report, "cuda"), time_moe(report, "cuda"),
                        check_moe_model(report, args.workdir, "cuda")),
    }


def dry_run_steps(report: Report, args, tiny) -> dict:
    """The same sections on the CPU at tiny shapes; ``tiny()`` builds or reuses the model."""
    heads = (4, 2, 16)
    return {
        "kernels": lambda: (
            check_kernels(report, "cpu", dtypes=("float32",), block_sizes=(16,), heads=heads,
                          cases={"decode": ([0, 40, 70], [1, 1, 1], False),
                                 "prefill_context": ([20, 0], [5, 9], True)}, splits=(None, 1, 3)),
            check_kernel_options(report, "cpu", dtypes=("float32",), block_sizes=(16,), heads=heads,
                                 cases={"decode": ([0, 40], [1, 1], False),
                                        "prefill_context": ([20, 0], [5, 9], True)}, window=13),
            check_big_cache(report, "cpu", "float32", 16, heads=heads, min_elements=5000, context=40),
            time_decode(report, "cpu", batches=(1, 2), context=40, heads=heads,
                        dtype_name="float32", iters=1)),
        "graphs": lambda: check_graphs(report, tiny(), host_graphs_accelerator(), batch_sizes=(1, 3, 4),
                                       max_len=40, attention_backend="triton", max_model_len=600),
        "start": lambda: check_default_start(report, tiny(), max_model_len=64,
                                             mem_get_info=lambda: (11 << 30, 100 << 30)),
        "hf": lambda: check_hf_greedy(report, tiny(), "cpu", max_tokens=8, max_model_len=128),
        "e2e": lambda: run_e2e(report, tiny(), min(args.requests, 3), max_model_len=64,
                               workload=dict(min_len=2, max_input=20, max_output=6, vocab=500)),
        "tp": lambda: check_tp(report, tiny(), gpus=2, max_model_len=128),
        "spec": lambda: check_spec(report, tiny(), max_tokens=8, max_model_len=128),
        "moe": lambda: (check_moe_kernel(report, "cpu", dtypes=("float32", "bfloat16"), tokens=(1, 5),
                                         shape=DRY_RUN_EXPERTS),
                        time_moe(report, "cpu", tokens=(1, 5), shape=DRY_RUN_EXPERTS, iters=1),
                        check_moe_model(report, args.workdir, "cpu", max_tokens=8, max_model_len=128)),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # before any Triton kernel is decorated
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = Report()
    t0 = time.perf_counter()
    workdir = Path(args.workdir)
    gpus = 0
    # Only the env section prints the environment; the others need its GPU count.
    env_report = report if "env" in args.sections else Report(out=open(os.devnull, "w"))
    try:
        gpus = environment(env_report, args.dry_run)
    except Exception as e:  # noqa: BLE001 - every failure becomes a FAIL line
        report.crashed("env", e)
    if gpus == 0:
        if "env" not in args.sections:
            report.check("env: CUDA available", False, "0 device(s)")
        report.summary(time.perf_counter() - t0)
        return 1
    ckpt = {}

    def checkpoint(dtype):
        if dtype not in ckpt:
            t = time.perf_counter()
            if args.dry_run:
                ckpt[dtype] = build_checkpoint(workdir / "dry-run-tiny", dtype="float32",
                                               **DRY_RUN_MODEL)
            else:
                ckpt[dtype] = build_checkpoint(workdir / f"qwen3-0.6b-random-{dtype}", dtype=dtype)
            report.figure("checkpoint", f"{ckpt[dtype]} ready in {time.perf_counter() - t:.0f} s")
        return ckpt[dtype]

    steps = (dry_run_steps(report, args, lambda: checkpoint("float32")) if args.dry_run
             else gpu_steps(report, args, gpus, checkpoint))
    for name in args.sections:
        if name == "env":
            continue
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            report.skip(name, f"time budget spent ({elapsed:.0f} s > {args.budget_s:.0f} s)")
            continue
        missing = missing_modules(NEEDS[name])
        if missing:
            report.skip(name, f"missing Python packages: {', '.join(missing)} "
                        "(scripts/gpu_check.sh installs them from TPSERVE_WHEELS)")
            continue
        report.figure("section", f"{name} (at {elapsed:.0f} s)")
        try:
            steps[name]()
        except Exception as e:  # noqa: BLE001
            report.crashed(name, e)
    report.summary(time.perf_counter() - t0)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
