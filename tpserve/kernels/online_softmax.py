"""online_softmax_tile: the inner step shared by tpserve's Triton attention kernels.

A device function (``@triton.jit``, called from inside a kernel, never launched). Given a
program's query tile and the addresses of one key/value tile, it loads the tile, scores it, and
folds it into the running softmax state (row max ``m_i``, row sum ``l_i``, unnormalised output
``acc``, all fp32). Scores use exp2, so ``qk_scale`` must already include log2(e). Masked scores
are -inf; masked key/value rows load as 0, so stale cache contents never reach the output.

``HAS_SOFTCAP``: scores become ``softcap * tanh(score / softcap)`` (Gemma 2; ``softcap`` in
natural units, the tanh written with exp2 as the interpreter and every GPU have it) before
masking. A row that sees no key of a tile yet (a sliding window's later rows in an early tile)
keeps its -inf maximum and zero sum rather than turning NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_tile(q, k_ptrs, v_ptrs, tile_mask, score_mask, m_i, l_i, acc, qk_scale, softcap,
                        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    k = tl.load(k_ptrs, mask=tile_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        # s is in log2 units: tanh(x / cap) with x = s / log2(e) is 1 - 2 / (2^(2 s / cap) + 1).
        s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(s * (2.0 / softcap)) + 1.0))
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2(-inf) = 0, not NaN
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=tile_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
