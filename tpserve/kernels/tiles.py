"""Tile sizes and tl.dot options shared by the paged Triton kernels' wrappers (host side)."""
from __future__ import annotations

import torch

# Kernels compute softmax with exp2; folding log2(e) into the scale saves a multiply per score.
LOG2E = 1.4426950408889634


def max_tile(dtype: torch.dtype) -> int:
    """Largest key/query tile: fp32 tiles take twice the shared memory of bf16/fp16 ones, and
    64 x 128 fp32 K and V tiles over the pipeline's stages would not fit an SM's shared memory."""
    return 32 if dtype == torch.float32 else 64


def dot_options(q: torch.Tensor) -> dict:
    """tl.dot settings: exact fp32 products for fp32 inputs (tf32 would cost ~1e-3 accuracy);
    and on CPU, upcast to fp32 before tl.dot, because the Triton interpreter multiplies
    bf16 operands as their raw uint16 bit patterns."""
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    exact = q.dtype == torch.float32 or upcast
    return dict(DOT_PRECISION="ieee" if exact else "tf32", UPCAST=upcast)


# Decode split-K aims at about two waves of programs on a 132-SM GPU (H100/H200).
DECODE_TARGET_PROGRAMS = 264
# A share below this many keys costs more in partial-state traffic than it gains in parallelism.
DECODE_MIN_SHARE_KEYS = 256


def decode_splits(batch: int, kv_heads: int, max_keys: int, tile: int) -> int:
    """How many shares decode splits each sequence's keys into: enough for the (batch x KV
    head x share) grid to reach DECODE_TARGET_PROGRAMS, but no share shorter than
    DECODE_MIN_SHARE_KEYS (nor than one tile) of ``max_keys``, the block-table capacity.
    Depends only on host-known shapes, so it is constant for a captured CUDA graph."""
    programs = max(batch * kv_heads, 1)
    wanted = -(-DECODE_TARGET_PROGRAMS // programs)
    longest = max(max_keys // max(DECODE_MIN_SHARE_KEYS, tile), 1)
    return max(1, min(wanted, longest))


# The batch-invariant mode (docs/protocol.md "Reproducibility") splits every row's keys into this
# many shares whatever the batch, the heads or the block-table width: a share's bounds are then a
# function of the row's key count alone, so are its sums and the merge (paged_decode.py).
INVARIANT_DECODE_SPLITS = 4
