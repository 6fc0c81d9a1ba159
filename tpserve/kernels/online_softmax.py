"""online_softmax_tile: the inner step shared by tpserve's Triton attention kernels.

A device function (``@triton.jit``, called from inside a kernel, never launched). Given a
program's query tile and the addresses of one key/value tile, it loads the tile, scores it, and
folds it into the running softmax state (row max ``m_i``, row sum ``l_i``, unnormalised output
``acc``, all fp32). Scores use exp2, so ``qk_scale`` must already include log2(e). Masked scores
are -inf; masked key/value rows load as 0, so stale cache contents never reach the output.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_tile(q, k_ptrs, v_ptrs, tile_mask, score_mask, m_i, l_i, acc, qk_scale,
                        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    k = tl.load(k_ptrs, mask=tile_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=tile_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
