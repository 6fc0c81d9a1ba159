"""Kernel-level decode timing: the 4-bit group kernels (W4A8) against tpserve's int8 (W8A8).

For a benchmark shape (default Qwen3-0.6B's: per layer the merged q/k/v 4096x1024, o 1024x2048,
the merged gate/up 6144x1024 and down 1024x3072) it packs every layer's matrices with random
weights, once as GGUF Q4_0 blocks would be (4-bit codes, an fp16 scale per 32 inputs, min = -8 *
scale), once as Q4_1 (an fp16 min of its own), once as ``--quantization int8`` (int8 per output
channel, activations int8 per row), then times ``torch.ops.tpserve_cpu.linear`` over all layers
at ``--rows`` bf16 rows (a decode step's matrix-vector products: every weight read once, the
layers' weights together larger than the caches): the median of ``--repeats`` passes. With
``--head`` the tied LM head (vocab x hidden) is in each pass too, as llama-quantize writes it
beside Q4_0 / Q4_1 layers: Q6_K (6-bit codes, a scale per 16 that is an int8 times an fp16 d per
256, min = -32 * scale); int8 for int8.
It prints
one line per thread count with each kind's milliseconds per pass and weight bytes read per
second, and the ratio int8 ms / Q4_0 ms (comparable within a line only: the machine is shared).

    python scripts/bench_w4a8_kernels.py [--shape 0.6b|tiny] [--layers N] [--rows 1] [--head]
                                         [--threads 1,2] [--repeats 15] [--kinds q4_0,q4_1,int8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import cpu_isa  # noqa: E402

SHAPES = {  # per layer: (N, K) of each matrix; layers; the LM head's (N, K)
    "0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28, (151936, 1024)),
    "tiny": ([(192, 64), (64, 128), (256, 64), (64, 128)], 2, (1000, 64)),
}
PATHS = {0: "scalar", 1: "avx2-maddubs", 2: "avx512-vnni"}


def packs(shape, layers, head, kind, seed=0):
    import torch

    from tpserve.models.group_quant import pack_group_weight
    from tpserve.models.packed_gemm import INT8_DYNAMIC, pack_weight
    gen = torch.Generator().manual_seed(seed)
    out = []
    mats = [s for _ in range(layers) for s in shape] + ([head] if head else [])
    for n, k in mats:
        if (n, k) == head and kind != "int8":  # Q6_K
            codes = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
            # d * sc: an fp16 d per 256 inputs, int8 sub-scales per 16 (the largest -128, as
            # llama-quantize writes them), packed as such (1.25 bytes per group and channel)
            runs = max(1, k // 256)
            d = (torch.rand(n, runs, 1, generator=gen) * 1e-4 + 1e-5).half().float()
            sc = torch.randint(-128, 128, (n, runs, k // 16 // runs), generator=gen).float()
            sc[..., 0] = -128
            scales = (d * sc).reshape(n, k // 16)
            out.append(pack_group_weight(codes, scales, -32 * scales))
            continue
        if kind == "int8":
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            out.append(pack_weight(q, INT8_DYNAMIC, torch.rand(n, generator=gen) * 0.01 + 1e-3))
            continue
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().float()
        own = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
        mins = -8 * scales if kind == "q4_0" else own
        out.append(pack_group_weight(codes, scales, mins, bits=4))
    return out


def nbytes(ps) -> int:
    return sum(t.nbytes for p in ps for t in (p.data, p.scales, p.colsum) if t is not None)


def time_pass(ps, xs, outs, repeats: int) -> float:
    import torch
    op = torch.ops.tpserve_cpu.linear
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for p, x, o in zip(ps, xs, outs):
            op(o, x, p.data, p.kind, p.n, p.scales, p.colsum, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--head", action="store_true", help="the LM head in each pass too")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--kinds", default="q4_0,q4_1,int8")
    args = ap.parse_args()
    import torch

    from tpserve.kernels import cpu_extension
    if not cpu_extension.available():
        print(f"tpserve CPU operators unavailable: {cpu_extension.status()}", file=sys.stderr)
        return 1
    shape, layers, head = SHAPES[args.shape]
    layers = args.layers or layers
    kinds = args.kinds.split(",")
    weights = {kind: packs(shape, layers, head if args.head else None, kind) for kind in kinds}
    torch.manual_seed(1)
    path = PATHS.get(int(torch.ops.tpserve_cpu.group_linear_path()), "n/a")
    print(f"w4a8-kernels shape={args.shape} layers={layers} head={'yes' if args.head else 'no'} "
          f"rows={args.rows} isa={cpu_isa()} path={path} "
          f"activations=bf16 repeats={args.repeats} load={os.getloadavg()[0]:.2f}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        res = {}
        for kind in kinds:
            ps = weights[kind]
            xs = [torch.randn(args.rows, p.k).bfloat16() for p in ps]
            outs = [torch.empty(args.rows, p.n, dtype=torch.bfloat16) for p in ps]
            s = time_pass(ps, xs, outs, args.repeats)
            res[kind] = (s * 1e3, nbytes(ps) / s / 1e9)
        line = "  ".join(f"{k} ms {ms:7.2f} GB/s {gbs:6.2f}" for k, (ms, gbs) in res.items())
        if "int8" in res and "q4_0" in res:
            line += f"  ratio int8/q4_0 {res['int8'][0] / res['q4_0'][0]:.2f}x"
        print(f"threads={threads} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
