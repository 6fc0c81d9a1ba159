"""Triton kernel: the sampler's exponential race in one pass over each row (the GPU's fused
version of ``workers/sampler.race``).

    out[r] = argmax_i  x[r, i] - log(-log(u(seed[r], step[r], i)))

u is ``sampler.uniform``'s counter-based uniform (splitmix64's finalizer over the seed, the step
and the index; 23 random bits), recomputed in registers: the torch version materialises ~20
int64/float32 [S, V] tensors for it (3-4 ms per step at 256 x 151,936 on a GPU), this kernel
reads each logit once. One program per row walks the vocabulary in BLOCK-wide tiles, keeping
the best score and its first index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _mix64(x):
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _race_kernel(x_ptr, x_stride, seeds_ptr, steps_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    step = tl.load(steps_ptr + row).to(tl.uint64)
    base = _mix64(_mix64(seed * 0x9E3779B97F4A7C15 + step) + 1)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < V
        x = tl.load(x_ptr + row * x_stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
        bits = _mix64(base ^ (idx.to(tl.uint64) * 0x9E3779B97F4A7C15))
        u = ((bits >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        score = x - tl.log(-tl.log(u))
        # Strictly greater keeps the earlier index on ties (tiles advance left to right).
        better = score > best
        best = tl.where(better, score, best)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best, axis=0)
    # The first index among lanes holding the maximum; a row without a finite logit gives 0.
    first = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    first = tl.where(top == float("-inf"), 0, first)
    tl.store(out_ptr + row, first.to(tl.int64))


def race_argmax(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int64 [S]: the race winner of each row of the float32 logits ``x`` [S, V] (contiguous rows)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [S, V] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    s, v = x.shape
    if seeds.shape != (s,) or steps.shape != (s,):
        raise ValueError(f"seeds and steps: expected [{s}], got {tuple(seeds.shape)} and {tuple(steps.shape)}")
    out = torch.empty(s, dtype=torch.int64, device=x.device)
    if s:
        _race_kernel[(s,)](x, x.stride(0), seeds.long().contiguous(), steps.long().contiguous(), out, v,
                           BLOCK=min(_BLOCK, triton.next_power_of_2(max(v, 1))))
    return out
