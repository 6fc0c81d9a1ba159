"""store_kvcache_torch: write new tokens' K/V into the paged cache with plain torch indexing.

The CPU counterpart of the Triton kernel in ``store_kvcache.py`` (and its reference in tests).
Slot s addresses row s of the cache viewed as ``[num_blocks * block_size, Hkv, D]``; slot -1
means "do not store" (e.g. a prefix-cache hit whose K/V is already there). An int8 cache
(``kv_scales``) stores each head's row quantized with its scale (kv_quant.py).
"""
from __future__ import annotations

import torch

from tpserve.kernels.checks import check_store_args
from tpserve.kernels.kv_quant import quantize_int8


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales=None) -> None:
    """k_cache[slot] = key[t], v_cache[slot] = value[t] for every token t with slot >= 0.

    key/value ``[T, Hkv, D]``; caches ``[num_blocks, block_size, Hkv, D]`` (contiguous);
    slot_mapping int32/int64 ``[T]``. Slots must be distinct (each token owns its slot).
    ``kv_scales``: an int8 cache's (k_scale, v_scale), each ``[num_blocks, block_size, Hkv]``.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping, kv_scales)
    n = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(n, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(n, v_cache.shape[2], v_cache.shape[3])
    # index_copy_ writes rows in place without materialising a gathered copy of the cache.
    if kv_scales is None:
        k_flat.index_copy_(0, slots, key[keep])
        v_flat.index_copy_(0, slots, value[keep])
        return
    for flat, scale, x in ((k_flat, kv_scales[0], key), (v_flat, kv_scales[1], value)):
        codes, scales = quantize_int8(x[keep])
        flat.index_copy_(0, slots, codes)
        scale.view(n, scale.shape[2]).index_copy_(0, slots, scales)
