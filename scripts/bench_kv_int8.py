"""int8 KV-cache blocks (``--kv-cache-dtype int8``, docs/kv_int8.md) against a bf16 cache.

Lines, each with the CPU's ISA and the threads:

* ``kv_int8 pool``: the KV pool's tokens for ``--kv-gb`` of memory, int8 against bf16, as the
  runner sizes it (target: >= 1.8x).
* ``kv_int8 decode``: decode tok/s of ``--streams`` sequences at ``--context`` tokens of context,
  the whole model's decode step (the fused decode, as serving runs it) over a pool filled with
  random keys and values, int8 against bf16 (target at 32 streams of 4k: >= 1.2x). The pool is
  filled directly, so no prefill is timed; each timed step rewrites the same slots.
* ``kv_int8 accuracy``: the benchmark model (random weights) and, with ``--smollm``, the real
  SmolLM2-135M (tests/gguf_models.py fetches it): greedy agreement of int8 with bf16 tokens,
  teacher-forced top-1 agreement and the mean |difference| of log-probabilities over the prompts
  followed by the bf16 cache's greedy tokens (target: < 0.05 nats). ``--smollm-quantization
  none`` runs SmolLM2 with its weights dequantized (bf16 activations) instead of the file's W4A8
  kernels, whose int8 activations amplify any change of the keys and values (docs/kv_int8.md).

The machine these run on may be shared and noisy: compare the two sides of one line.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_daemon_run import isa  # noqa: E402
from bench_models import TINY, build_bench_model  # noqa: E402


def pool_tokens(path: Path, kv: str, kv_gb: float) -> int:
    from tpserve import LLM
    with LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gb=kv_gb,
             max_num_seqs=256) as llm:
        return llm.engine.config.num_kv_blocks * llm.engine.config.block_size


def decode_tok_s(path: Path, kv: str, streams: int, context: int, steps: int) -> float:
    """Output tok/s of decode steps of ``streams`` rows at ``context`` keys each."""
    import torch
    from tpserve.kernels.backend_factory import get_backend
    from tpserve.kernels.metadata import AttentionMetadata
    from tpserve.models.loader import load_model
    from tpserve.models.packed_gemm import prepack_model
    from tpserve.models.parallel import TPContext

    bs = 16
    model = load_model(path, TPContext(), dtype=torch.bfloat16, backend=get_backend("cpu", block_size=bs))
    prepack_model(model)
    width = -(-(context + 1) // bs)
    shape = (streams * width, bs, model.num_kv_heads_per_rank, model.head_dim)
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(model.num_layers):
        if kv == "int8":
            caches.append((torch.randint(-127, 128, shape, dtype=torch.int8, generator=g),
                           torch.randint(-127, 128, shape, dtype=torch.int8, generator=g),
                           torch.rand(shape[:3], generator=g) / 127,
                           torch.rand(shape[:3], generator=g) / 127))
        else:
            caches.append((torch.randn(shape, generator=g).to(torch.bfloat16),
                           torch.randn(shape, generator=g).to(torch.bfloat16)))
    model.set_kv_caches(caches)
    assert model.enable_fused_decode() is None
    tables = torch.arange(streams * width, dtype=torch.int32).view(streams, width)
    slots = tables[:, context // bs] * bs + context % bs
    meta = AttentionMetadata.from_arrays(
        is_prefill=False, has_context=False, cu_seqlens_q=torch.arange(streams + 1),
        cu_seqlens_k=torch.arange(streams + 1) * (context + 1), context_lens=[context + 1] * streams,
        block_tables=tables, slot_mapping=slots)
    ids = torch.randint(3, 1000, (streams,), generator=g)
    pos = torch.full((streams,), context)
    times = []
    with torch.inference_mode():
        for i in range(steps + 1):
            t = time.perf_counter()
            model.compute_logits(model(ids, pos, meta))
            if i:  # the first step warms up
                times.append(time.perf_counter() - t)
    return streams / statistics.median(times)


def accuracy(model: str, prompts, new_tokens: int, **kw) -> str:
    """Greedy agreement, teacher-forced top-1 agreement and mean |d logprob| of int8 vs bf16."""
    from tpserve import LLM, SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for kv in ("auto", "int8"):
        with LLM(model, dtype="bfloat16", kv_cache_dtype=kv, **kw) as llm:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if kv == "auto":
                full = [list(o.prompt_token_ids) + t for o, t in zip(outs, tokens)]
            scored = llm.generate(full, forced, use_tqdm=False)
        rows = []
        for o in scored:
            for tok, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
                top = next(t for t, lp in d.items() if lp.rank == 1)
                rows.append((top, d[tok].logprob))
        runs[kv] = (tokens, rows)
    (ref, ref_rows), (got, rows) = runs["auto"], runs["int8"]
    pairs = [(a, b) for x, y in zip(ref, got) for a, b in zip(x, y)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    top1 = sum(a[0] == b[0] for a, b in zip(ref_rows, rows)) / len(rows)
    diffs = [abs(a[1] - b[1]) for a, b in zip(ref_rows, rows)]
    return (f"greedy agreement {agree:.1%} of {len(pairs)} tokens, teacher-forced top-1 {top1:.1%} of "
            f"{len(rows)} positions, logprob |d| mean {statistics.mean(diffs):.4f} nats "
            f"(max {max(diffs):.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("40m", "tiny"), default="40m")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps (median)")
    ap.add_argument("--kv-gb", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the accuracy line")
    ap.add_argument("--smollm", action="store_true", help="also the accuracy line on SmolLM2-135M")
    ap.add_argument("--smollm-quantization", choices=("file", "none"), default="file",
                    help="SmolLM2's linear layers: the file's W4A8 kernels, or dequantized weights")
    args = ap.parse_args(argv)

    import torch
    tag = f"isa={isa()} threads={torch.get_num_threads()}"
    with tempfile.TemporaryDirectory() as tmp:
        # The benchmark model's weights; positions up to 8k (rotary: no weights change).
        path = build_bench_model(Path(tmp) / args.shape, **(TINY if args.shape == "tiny" else {}),
                                 max_position_embeddings=max(8192, args.context + 1))
        bf16, int8 = (pool_tokens(path, kv, args.kv_gb) for kv in ("auto", "int8"))
        print(f"kv_int8 pool shape={args.shape} kv_gb={args.kv_gb}: bf16 {bf16} tokens, int8 {int8} tokens "
              f"({int8 / bf16:.2f}x) {tag}", flush=True)
        speeds = {kv: decode_tok_s(path, kv, args.streams, args.context, args.steps)
                  for kv in ("auto", "int8")}
        print(f"kv_int8 decode shape={args.shape} streams={args.streams} context={args.context}: "
              f"bf16 KV {speeds['auto']:.1f} tok/s, int8 KV {speeds['int8']:.1f} tok/s "
              f"({speeds['int8'] / speeds['auto']:.2f}x) {tag}", flush=True)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 30000) for _ in range(rng.randrange(64, 256))]
                   for _ in range(args.prompts)]
        print(f"kv_int8 accuracy shape={args.shape}: "
              f"{accuracy(str(path), prompts, 32, num_kv_blocks=256, max_num_seqs=16)} {tag}", flush=True)
    if args.smollm:
        sys.path.insert(0, str(ROOT / "tests"))
        from gguf_models import smollm2_gguf
        from test_gguf_smollm import PROMPTS
        quant = {} if args.smollm_quantization == "file" else {"quantization": "none"}
        print(f"kv_int8 accuracy model=SmolLM2-135M-Q4_1 quantization={args.smollm_quantization}: "
              f"{accuracy(str(smollm2_gguf()), PROMPTS, 32, num_kv_blocks=256, **quant)} {tag}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
