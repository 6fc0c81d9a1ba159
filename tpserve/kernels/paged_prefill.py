"""Prefill attention Triton kernel: query tiles x key tiles, causal with a context offset.

Grid ``(cdiv(max_seqlen_q, BLOCK_M), B, Hq)``: a program owns ``BLOCK_M`` consecutive new
tokens of one sequence and one query head. Query row ``i`` of sequence ``b`` sits at absolute
position ``ctx + i`` with ``ctx = k_len - q_len`` (the new tokens are the sequence's last
ones), and attends to keys ``0 .. ctx + i``. The program walks key tiles of ``BLOCK_N`` only up
to the tile's last query position (keys later than that are masked for every row), with an
online softmax in fp32.

Variants: each distinct set of constexprs (``prefill_tiles``: BLOCK_M 16 for chunks of at
most 16 tokens, else the dtype's largest tile; PAGED or not) is compiled on its first launch.
The runner launches every variant at start (``workers/warmup.py``), so no serving step pays
the compile. The block-table stride is not specialised on (it is the table width, which changes
from step to step and would otherwise select other compiled variants).

Keys come from one of two places, fixed at compile time by ``PAGED``:

* ``PAGED=True`` (prefill with context): the paged cache, through the block table, after the
  new tokens were stored. A key tile is ``BLOCK_N`` positions (64 for bf16/fp16, 32 for fp32)
  whatever the block size: it loads its keys' block-table entries as one vector, as the
  decode kernel does, so block size 16 no longer means 16-key tiles and one table round trip
  per 16 keys. A tile may span several blocks or start inside one (block size 48, say).
* ``PAGED=False`` (prefill without context, or any run without a cache): the new tokens'
  own flat ``k``/``v`` rows ``cu_seqlens_q[b] + j``; the keys are exactly the new tokens.

A sliding window (``window`` > 0) starts a program's key loop at its first row's first window key
(earlier blocks are never read) and masks each row's keys older than its window. A sink
(``sinks`` [Hq]) is the starting maximum and sum of its head's softmax; soft-capping is
``online_softmax.py``'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.checks import check_paged_args, check_tensor
from tpserve.kernels.online_softmax import online_softmax_tile
from tpserve.kernels.tiles import LOG2E, dot_options, max_tile


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                    block_tables_ptr, sinks_ptr, qk_scale, window, softcap,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    # Without PAGED, k_ptr/v_ptr are [T, Hkv, D] and stride_kb is unused, stride_ks the token
    # stride; with PAGED, they are caches [N, BLOCK_SIZE, Hkv, D] (block, slot, head strides).
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    if PAGED:
        k_len = tl.load(context_lens_ptr + b)
    else:
        k_len = q_len
    ctx = k_len - q_len
    kvh = h // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = ctx + m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_end = tl.minimum(k_len, ctx + (tile + 1) * BLOCK_M)
    k_begin = 0
    if HAS_WINDOW:
        k_begin = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)  # the first row's first key
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(k_begin, k_end, BLOCK_N):
        kpos = start + n
        k_mask = kpos < k_len
        score_mask = (kpos[None, :] <= qpos[:, None]) & k_mask[None, :]
        if HAS_WINDOW:
            score_mask = score_mask & (qpos[:, None] - kpos[None, :] < window)
        if PAGED:
            # Masked: entries past the sequence's last block may lie past the table's row.
            blocks = tl.load(table + kpos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
            key_rows = blocks * stride_kb + (kpos % BLOCK_SIZE) * stride_ks
        else:
            key_rows = (q_start + kpos).to(tl.int64) * stride_ks
        offs = key_rows[:, None] + kvh * stride_kh + d[None, :]
        tile_mask = k_mask[:, None] & d_mask[None, :]
        m_i, l_i, acc = online_softmax_tile(q, k_ptr + offs, v_ptr + offs, tile_mask,
                                            score_mask, m_i, l_i, acc, qk_scale, softcap,
                                            DOT_PRECISION, UPCAST, HAS_SOFTCAP)
    # Padding rows past q_len may see no key inside a window: 1, not 0 / 0 (they are not stored).
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_tiles(max_seqlen_q: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a launch: query rows per program (16 for chunks of at most 16
    tokens, which waste less of the tile on padding rows, else the dtype's largest tile) and
    keys per tile (the largest tile, paged or not, whatever the cache's block size)."""
    cap = max_tile(dtype)
    return (16 if max_seqlen_q <= 16 else cap), cap


def _check_cu(cu_seqlens_q, num_seqs: int, device) -> None:
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, torch.int32, device)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q: expected {num_seqs + 1} entries (B+1), "
                         f"got {cu_seqlens_q.shape[0]}")


def _check_max(max_seqlen_q) -> None:
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q: expected an int >= 0, got {max_seqlen_q!r}")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, max_seqlen_q: int,
                            scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
    """Prefill with context: the new tokens attend to all their sequence's keys in the cache.

    q ``[T, Hq, D]`` flat (rows cu_seqlens_q[b]:cu_seqlens_q[b+1] are sequence b's last
    tokens, already stored); caches ``[num_blocks, block_size, Hkv, D]`` contiguous with
    block_size % 16 == 0; cu_seqlens_q int32 ``[B+1]``; context_lens int32 ``[B]`` (keys per
    sequence, new tokens included); block_tables int32 ``[B, W]``; max_seqlen_q bounds the
    query lengths. ``opts``: the layer's window, sinks and soft-cap. Returns ``[T, Hq, D]`` in
    q's dtype.
    """
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    b = context_lens.shape[0]
    _check_cu(cu_seqlens_q, b, q.device)
    _check_max(max_seqlen_q)
    return _launch(q, k_cache, v_cache, cu_seqlens_q, context_lens.contiguous(), block_tables,
                   max_seqlen_q, scale, paged=True, block_size=k_cache.shape[1],
                   k_strides=k_cache.stride()[:3], opts=opts)


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                             scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
    """Prefill without context: each sequence's new tokens attend causally to themselves.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` flat over sequences (head_dim axis contiguous, any
    token/head strides, so slices of a fused qkv projection work); cu_seqlens_q int32
    ``[B+1]``. Returns ``[T, Hq, D]`` in q's dtype.
    """
    check_tensor("q", q, 3)
    check_tensor("k", k, 3, q.dtype, q.device)
    check_tensor("v", v, 3, q.dtype, q.device)
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k: expected shape [{q.shape[0]}, Hkv, {q.shape[2]}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k: num_kv_heads={k.shape[1]} must divide q's num_heads={q.shape[1]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous, got strides {x.stride()}")
    if k.stride() != v.stride():  # the kernel reads both with one set of strides
        k, v = k.contiguous(), v.contiguous()
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, torch.int32, q.device)
    _check_max(max_seqlen_q)
    # The kernel reads no context lengths or block tables when PAGED is off: any int32
    # tensor stands in for those pointers.
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q[None], max_seqlen_q, scale,
                   paged=False, block_size=16, k_strides=(0, k.stride(0), k.stride(1)), opts=opts)


def _launch(q, k, v, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, *,
            paged: bool, block_size: int, k_strides, opts: AttentionOptions) -> torch.Tensor:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    t, hq, d = q.shape
    b = cu_seqlens_q.shape[0] - 1
    if t == 0 or b == 0 or max_seqlen_q == 0:
        return out
    block_m, block_n = prefill_tiles(max_seqlen_q, q.dtype)
    _prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), b, hq)](
        q, k, v, out, cu_seqlens_q, context_lens, block_tables,
        q if opts.sinks is None else opts.sinks_f32(), scale * LOG2E, opts.window or 0, opts.softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_strides[0], k_strides[1], k_strides[2], block_tables.stride(0),
        GROUP=hq // k.shape[2 if paged else 1], HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_SIZE=block_size,
        PAGED=paged, **dot_options(q), HAS_WINDOW=opts.window is not None,
        HAS_SINKS=opts.sinks is not None, HAS_SOFTCAP=opts.softcap is not None)
    return out
