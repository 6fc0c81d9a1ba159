"""Argument checks shared by the kernel wrappers and the attention backends.

Each check reads shapes, dtypes, devices and strides only (never tensor values, which would
synchronise a GPU) and raises ValueError naming the offending argument and what is allowed.
"""
from __future__ import annotations

import torch

from tpserve.kernels.metadata import AttentionMetadata


def check_tensor(name: str, t, ndim: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    return t


def has_cache(k_cache, v_cache) -> bool:
    """A run without a KV cache (profiling, warm-up) passes None or empty tensors."""
    return (k_cache is not None and k_cache.numel() > 0
            and v_cache is not None and v_cache.numel() > 0)


def check_cache(k_cache, v_cache, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> None:
    """k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 4, dtype, device)
        if c.shape[2] != num_kv_heads or c.shape[3] != head_dim:
            raise ValueError(f"{name}: expected shape [num_blocks, block_size, {num_kv_heads}, "
                             f"{head_dim}] to match the keys, got {tuple(c.shape)}")
        if not c.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (slots are addressed as a flat array), "
                             f"got strides {c.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache "
                         f"{tuple(k_cache.shape)}")


def _cache_dtype(k_cache, dtype: torch.dtype, kv_scales) -> torch.dtype:
    """The dtype the caches must have: ``dtype``, or int8 with scales (kv_quant.py)."""
    if kv_scales is None:
        return dtype
    from tpserve.kernels.kv_quant import check_kv_scales
    check_tensor("k_cache", k_cache, 4, torch.int8)
    check_kv_scales(k_cache, kv_scales)
    return torch.int8


def check_store_args(key, value, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
    """key/value [T, Hkv, D]; caches [N, block_size, Hkv, D] (int8 with ``kv_scales``);
    slot_mapping int [T]."""
    check_tensor("key", key, 3)
    check_tensor("value", value, 3, key.dtype, key.device)
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    check_cache(k_cache, v_cache, key.shape[1], key.shape[2], _cache_dtype(k_cache, key.dtype, kv_scales),
                key.device)
    check_tensor("slot_mapping", slot_mapping, 1, device=key.device)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected dtype torch.int32 or torch.int64, "
                         f"got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected {key.shape[0]} entries (one per token of key), "
                         f"got {slot_mapping.shape[0]}")


def check_attention_args(q, k, v, k_cache, v_cache, meta, scale, kv_scales=None) -> None:
    """The contract of ``AttentionBackend.forward``; see its docstring."""
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(f"meta: expected AttentionMetadata, got {type(meta).__name__}")
    check_tensor("q", q, 3)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q: expected a floating dtype, got {q.dtype}")
    check_tensor("k", k, 3, q.dtype, q.device)
    check_tensor("v", v, 3, q.dtype, q.device)
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k: expected shape [{t}, num_kv_heads, {d}] to match q, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: num_kv_heads={hkv} must divide q's num_heads={hq} (grouped-query "
                         "attention)")
    if meta.num_tokens != t:
        raise ValueError(f"meta: slot_mapping has {meta.num_tokens} tokens but q has {t}")
    if meta.device != q.device:
        raise ValueError(f"meta: index tensors are on {meta.device} but q is on {q.device}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    if has_cache(k_cache, v_cache):
        check_cache(k_cache, v_cache, hkv, d, _cache_dtype(k_cache, q.dtype, kv_scales), q.device)


def check_paged_args(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Checks shared by the paged kernels' wrappers; raises ValueError naming the argument."""
    check_tensor("q", q, 3)
    if q.stride(2) != 1:
        raise ValueError(f"q: the head_dim axis must be contiguous, got strides {q.stride()}")
    check_tensor("k_cache", k_cache, 4, q.dtype, q.device)
    hkv = k_cache.shape[2]
    if hkv == 0 or q.shape[1] % hkv:
        raise ValueError(f"k_cache: num_kv_heads={hkv} must divide q's num_heads={q.shape[1]}")
    check_cache(k_cache, v_cache, hkv, q.shape[2], q.dtype, q.device)
    if k_cache.shape[1] % 16:
        raise ValueError(f"k_cache: block_size must be a multiple of 16 for the Triton kernels, "
                         f"got {k_cache.shape[1]}")
    check_tensor("block_tables", block_tables, 2, torch.int32, q.device)
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: rows must be contiguous, got strides {block_tables.stride()}")
    check_tensor("context_lens", context_lens, 1, torch.int32, q.device)
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows but context_lens has "
                         f"{context_lens.shape[0]} sequences")
