"""store_kvcache: Triton kernel writing new tokens' K/V into the paged cache.

One program per token copies that token's ``[Hkv, D]`` key and value rows to slot
``slot_mapping[t]`` of the caches (viewed as ``[num_blocks * block_size, Hkv * D]``); slot -1
skips the token. The torch equivalent is ``torch_store.store_kvcache_torch``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.kernels.checks import check_store_args


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          key_stride, value_stride,
                          ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    # int64: slot * ROW overflows int32 for pools of more than 2**31 elements.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + t.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k_cache[slot] = key[t], v_cache[slot] = value[t] for every token t with slot >= 0.

    key/value ``[T, Hkv, D]`` whose per-token ``[Hkv, D]`` rows are contiguous (the token
    stride may be anything, e.g. a slice of a fused qkv projection); caches
    ``[num_blocks, block_size, Hkv, D]`` contiguous; slot_mapping int32/int64 ``[T]``,
    contiguous. Slot values are not range-checked (that would synchronise the device); they
    come from the block manager.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    _, h, d = key.shape
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"{name}: each token's [{h}, {d}] rows must be contiguous "
                             f"(strides (*, {d}, 1)), got strides {x.stride()}")
    if slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping: must be contiguous, got stride {slot_mapping.stride()}")
    t = key.shape[0]
    if t == 0:
        return
    row = h * d
    _store_kvcache_kernel[(t,)](key, value, k_cache, v_cache, slot_mapping,
                                key.stride(0), value.stride(0),
                                ROW=row, BLOCK=triton.next_power_of_2(row))
