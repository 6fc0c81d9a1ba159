"""int8 KV-cache blocks: the quantization the KV stores apply and the attention kernels undo.

``--kv-cache-dtype int8`` keeps each layer's K and V caches as int8 codes
``[num_blocks, block_size, Hkv, D]`` plus one float32 scale per slot and KV head
``[num_blocks, block_size, Hkv]`` for each of K and V. Quantization is symmetric per token and
head: ``scale = absmax / 127`` of the head's row, ``code = round(x * 127 / absmax)`` (half to
even; a zero row has scale 0 and codes 0), so ``x ~= code * scale``. The C++ store
(``csrc/cpu_ops.cpp``, ``quantize_row``) computes the same bits as :func:`quantize_int8`.

A block of D = 64 holds its tokens in 2 * 64 + 2 * 4 = 136 bytes per head and layer against
256 in bf16: the pool keeps 1.88x the tokens in the same memory (3.8x against fp32).
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 codes [..., D], float32 scales [...])."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # A true division (``127.0 / t`` is a reciprocal times 127 in torch): the C++ store's bits.
    inv = torch.where(amax > 0, amax.new_full(amax.shape, INT8_MAX).div(amax), torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, amax / INT8_MAX


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D] int8, scales [...] float32 -> values [..., D] in ``dtype``."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def check_kv_scales(k_cache: torch.Tensor, kv_scales) -> None:
    """An int8 cache's ``(k_scale, v_scale)``: float32 ``[num_blocks, block_size, Hkv]``,
    contiguous, on the cache's device. Raises ValueError naming the argument."""
    if k_cache.dtype != torch.int8:
        raise ValueError(f"kv_scales: only an int8 KV cache has scales, the cache is {k_cache.dtype}")
    if not (isinstance(kv_scales, (tuple, list)) and len(kv_scales) == 2):
        raise ValueError("kv_scales: expected a (k_scale, v_scale) pair")
    shape = tuple(k_cache.shape[:3])
    for name, s in zip(("k_scale", "v_scale"), kv_scales):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != shape \
                or not s.is_contiguous() or s.device != k_cache.device:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"kv_scales: {name} must be a contiguous float32 tensor of shape {list(shape)} "
                             f"on {k_cache.device}, got {got}")
