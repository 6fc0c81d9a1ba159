"""paged_decode_attention: Triton kernel for decode (one new token per sequence).

Grid ``(B, Hkv, splits)``: a program owns one sequence, one KV head and one contiguous share of
the sequence's keys (split-K), and computes the outputs of all ``GROUP = Hq // Hkv`` query
heads that share that KV head, so each key/value tile is read from memory once per group, not
once per query head. The group's queries are padded to ``BLOCK_G >= 16`` rows (the smallest
``tl.dot`` tile; padding rows are zeros and dropped).

Tiles: a program walks its keys in tiles of ``BLOCK_N`` positions (64 for bf16/fp16, 32 for
fp32) whatever the cache's block size: each tile loads the block-table entries of its keys as
one vector (4 entries per tile at block size 16), so small blocks no longer mean one table
round trip per 16 keys.

Split-K: at small batch a (sequence, KV head) grid has a few dozen programs, far fewer than a
GPU has SMs (132 on an H100/H200), and each walks the whole context alone. ``decode_splits``
(``tiles.py``) divides every sequence's keys into up to ``splits`` equal shares of whole tiles
so the grid reaches about ``DECODE_TARGET_PROGRAMS`` programs. Each share writes its unnormalised
partial state (row max, row sum, output, fp32); a second pass in torch rescales the shares to
the common max and sums them. With one split the kernel normalises and writes the output
directly (large batches: the grid is already full). The split count depends only on shapes
known on the host (batch, heads, block-table width), so it is fixed inside a CUDA graph. It is
the grid's third dimension, not a compile-time constant: whether there are partials to write
(``PARTIAL``) is, so the kernel has two compiled variants per dtype and head shape, not one per
split count an eager step happens to need.

In the batch-invariant mode (``invariant=True``) the split count is ``INVARIANT_DECODE_SPLITS``
whatever the shapes (the default count follows the batch and the block-table width, so a row's
sums changed with what shared its step), and the shares are merged in split order with
element-wise operations only (``_combine_ordered``), no reduction whose order torch may choose by
shape. A row's result is then a function of its query, its keys and their count.

A sliding window (``window`` > 0) narrows a row's keys to its last ``window`` ones: the shares
divide those keys only, so blocks before the window are never read. A sink (``sinks`` [Hq]) is
split 0's starting maximum and sum (one term e^sink in the denominator, no value); soft-capping
is ``online_softmax.py``'s.

Softmax is online (running max and sum in fp32, exp2 with log2(e) folded into the scale);
keys past ``context_lens[b]`` are masked with -inf and loaded as 0, so stale or uninitialised
cache contents never reach the output. Cache offsets are int64 (caches over 2^31 elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.kernels.checks import check_paged_args
from tpserve.kernels.online_softmax import online_softmax_tile
from tpserve.kernels.tiles import INVARIANT_DECODE_SPLITS, LOG2E, decode_splits, dot_options, max_tile


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes from step to step
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                         block_tables_ptr, context_lens_ptr, sinks_ptr, qk_scale, window, softcap,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_cs, stride_ch, stride_bt,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    k_len = tl.load(context_lens_ptr + b)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(k_len - window, 0)  # the row's window: keys first .. k_len - 1
    # This program's keys: a share of whole tiles, so every share but the last is full.
    share = tl.cdiv(tl.cdiv(k_len - first, splits), BLOCK_N) * BLOCK_N
    lo = first + split * share
    hi = tl.minimum(lo + share, k_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:  # counted once, by split 0
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        kpos = start + n
        k_mask = kpos < hi
        blocks = tl.load(table + kpos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        rows = blocks[:, None] * stride_cb + (kpos % BLOCK_SIZE)[:, None] * stride_cs
        offs = rows + kvh * stride_ch + d[None, :]
        tile_mask = k_mask[:, None] & d_mask[None, :]
        m_i, l_i, acc = online_softmax_tile(q, k_cache_ptr + offs, v_cache_ptr + offs, tile_mask,
                                            k_mask[None, :], m_i, l_i, acc, qk_scale, softcap,
                                            DOT_PRECISION, UPCAST, HAS_SOFTCAP)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if not PARTIAL:
        acc = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partial state, laid out [B, Hq, splits] (m, l) and [B, Hq, splits, HEAD_DIM] (acc).
        row = (b * (tl.num_programs(1) * GROUP) + heads) * splits + split
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)
        tl.store(acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + d[None, :], acc, mask=out_mask)


def _combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split partials into ``out``: rescale each share to the common max (log2 units)."""
    m_max = m.amax(dim=-1, keepdim=True)
    w = torch.exp2(m - m_max)                       # empty shares: exp2(-inf) = 0
    total = (l * w).sum(dim=-1)
    merged = (acc * w.unsqueeze(-1)).sum(dim=-2) / total.unsqueeze(-1)
    out.copy_(merged.to(out.dtype))


def _combine_ordered(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> None:
    """``_combine`` with every sum over the shares taken in split order, element-wise (the
    batch-invariant mode): no torch reduction, whose blocking may follow the tensor's shape."""
    splits = m.shape[-1]
    m_max = m[..., 0]
    for s in range(1, splits):
        m_max = torch.maximum(m_max, m[..., s])
    total = torch.zeros_like(m_max)
    merged = torch.zeros_like(acc[..., 0, :])
    for s in range(splits):
        w = torch.exp2(m[..., s] - m_max)           # empty shares: exp2(-inf) = 0
        total = total + l[..., s] * w
        merged = merged + acc[..., s, :] * w.unsqueeze(-1)
    out.copy_((merged / total.unsqueeze(-1)).to(out.dtype))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None,
                           invariant: bool = False, window: int | None = None,
                           sinks: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys.

    q ``[B, Hq, D]`` (token b is sequence b's last token, already stored in the cache);
    caches ``[num_blocks, block_size, Hkv, D]`` contiguous with block_size % 16 == 0;
    block_tables int32 ``[B, W]``; context_lens int32 ``[B]`` (>= 1, keys per sequence,
    the new token included). ``num_splits`` None chooses split-K from the shapes
    (``tiles.decode_splits``); an int >= 1 forces it. ``invariant`` (the batch-invariant mode)
    fixes it to ``INVARIANT_DECODE_SPLITS`` and merges the shares in order (see the module
    docstring). ``window`` / ``sinks`` (float32 [Hq]) / ``softcap``: attention_options.py.
    Returns ``[B, Hq, D]`` in q's dtype.
    """
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"q: decode has one token per sequence, got {q.shape[0]} tokens for "
                         f"{context_lens.shape[0]} sequences")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits!r}")
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    b, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if b == 0:
        return out
    group = hq // hkv
    tile = max_tile(q.dtype)
    if invariant:
        splits = INVARIANT_DECODE_SPLITS
    else:
        splits = num_splits or decode_splits(b, hkv, block_tables.shape[1] * block_size, tile)
    if splits > 1:
        f32 = dict(dtype=torch.float32, device=q.device)
        m = torch.empty((b, hq, splits), **f32)
        l = torch.empty((b, hq, splits), **f32)
        acc = torch.empty((b, hq, splits, d), **f32)
    else:
        m = l = acc = out  # unused by the one-split kernel
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, out, m, l, acc, block_tables, context_lens,
        q if sinks is None else sinks, scale * LOG2E, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size, BLOCK_N=tile,
        PARTIAL=splits > 1, **dot_options(q), HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None)
    if splits > 1:
        (_combine_ordered if invariant else _combine)(m, l, acc, out)
    return out
