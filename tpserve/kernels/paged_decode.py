"""paged_decode_attention: Triton kernel for decode (one new token per sequence).

Grid ``(B, Hkv)``: a program owns one sequence and one KV head, and computes the outputs of
all ``GROUP = Hq // Hkv`` query heads that share that KV head, so each key/value block is read
from memory once per group, not once per query head. The group's queries are padded to
``BLOCK_G >= 16`` rows (the smallest ``tl.dot`` tile; padding rows are zeros and dropped).

The program walks the sequence's keys in tiles of ``BLOCK_N`` positions; ``BLOCK_N`` divides
the cache's block size, so a tile lies inside one block and costs one block-table lookup.
Softmax is online (running max and sum in fp32, exp2 with log2(e) folded into the scale);
keys past ``context_lens[b]`` are masked with -inf and loaded as 0, so stale or uninitialised
cache contents never reach the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.kernels.checks import check_paged_args
from tpserve.kernels.online_softmax import online_softmax_tile
from tpserve.kernels.tiles import LOG2E, dot_options, max_tile, tile_for_block_size


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                         context_lens_ptr, qk_scale,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_cs, stride_ch, stride_bt,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    k_len = tl.load(context_lens_ptr + b)

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
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(0, k_len, BLOCK_N):
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        kpos = start + n
        k_mask = kpos < k_len
        rows = block * stride_cb + (start % BLOCK_SIZE + n)[:, None] * stride_cs
        offs = rows + kvh * stride_ch + d[None, :]
        tile_mask = k_mask[:, None] & d_mask[None, :]
        m_i, l_i, acc = online_softmax_tile(q, k_cache_ptr + offs, v_cache_ptr + offs, tile_mask,
                                            k_mask[None, :], m_i, l_i, acc, qk_scale,
                                            DOT_PRECISION, UPCAST)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys.

    q ``[B, Hq, D]`` (token b is sequence b's last token, already stored in the cache);
    caches ``[num_blocks, block_size, Hkv, D]`` contiguous with block_size % 16 == 0;
    block_tables int32 ``[B, W]``; context_lens int32 ``[B]`` (>= 1, keys per sequence,
    the new token included). Returns ``[B, Hq, D]`` in q's dtype.
    """
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"q: decode has one token per sequence, got {q.shape[0]} tokens for "
                         f"{context_lens.shape[0]} sequences")
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    b, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if b == 0:
        return out
    group = hq // hkv
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size,
        BLOCK_N=tile_for_block_size(block_size, max_tile(q.dtype)),
        **dot_options(q))
    return out
