"""The flash backend's sliding window, sinks and soft-cap, through a stand-in for flash-attn 2
(no GPU here): the arguments it passes (``window_size``, ``softcap``, the log-sum-exp it asks for)
and its output, sinks rescaled from that log-sum-exp, against the dense reference."""
from __future__ import annotations

import pytest
import torch
from test_attention_window import CASES, OPTIONS, sinks_for

from tpserve.kernels.flash_attention import FlashAttention
from tpserve.kernels.reference import random_paged_batch, reference_attention
from tpserve.kernels.torch_store import store_kvcache_torch


def _lse(q, keys, q_lens, scale, window, softcap):
    """Each row's log-sum-exp of its visible scores, [Hq, T] float64 (flash-attn's softmax_lse)."""
    out, start = [], 0
    for kk, n in zip(keys, q_lens):
        qi = q[start:start + n].double().transpose(0, 1)
        ki = kk.double().repeat_interleave(qi.shape[0] // kk.shape[1], dim=1).transpose(0, 1)
        s = (qi @ ki.transpose(1, 2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        k_len = kk.shape[0]
        qpos = torch.arange(k_len - n, k_len)[:, None]
        kpos = torch.arange(k_len)[None, :]
        hidden = (kpos > qpos) | (qpos - kpos >= window if window else torch.zeros_like(kpos > qpos))
        out.append(s.masked_fill(hidden, float("-inf")).logsumexp(-1))
        start += n
    return torch.cat(out, dim=1)


class FakeFlashAttn:
    """flash-attn 2's entry points with their window / soft-cap / log-sum-exp arguments as
    documented, in plain torch; records every call's keyword arguments."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _gather(cache, table, n):
        bs = cache.shape[1]
        pos = torch.arange(n)
        return cache[table[pos // bs].long(), pos % bs]

    @staticmethod
    def _window(window_size):
        left, right = window_size
        if (left, right) == (-1, -1):  # the default: no window
            return None
        assert right == 0 and left >= 0  # causal: nothing to the right of the diagonal
        return left + 1

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None):
        self.calls.append(dict(kind="varlen", window_size=window_size, softcap=softcap,
                               lse=return_attn_probs, paged=block_table is not None))
        assert causal and dropout_p == 0.0
        b = cu_seqlens_q.shape[0] - 1
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        q_lens = [cq[i + 1] - cq[i] for i in range(b)]
        k_lens = [ck[i + 1] - ck[i] for i in range(b)]
        if block_table is not None:
            keys = [self._gather(k, block_table[i], k_lens[i]) for i in range(b)]
            values = [self._gather(v, block_table[i], k_lens[i]) for i in range(b)]
        else:
            keys = [k[ck[i]:ck[i + 1]] for i in range(b)]
            values = [v[ck[i]:ck[i + 1]] for i in range(b)]
        window, cap = self._window(window_size), softcap or None
        out = reference_attention(q, keys, values, q_lens, softmax_scale, window=window,
                                  softcap=cap).to(q.dtype)
        if not return_attn_probs:
            return out
        return out, _lse(q, keys, q_lens, softmax_scale, window, cap).float(), None

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                return_softmax_lse=False):
        self.calls.append(dict(kind="kvcache", window_size=window_size, softcap=softcap,
                               lse=return_softmax_lse, paged=block_table is not None))
        assert causal and q.dim() == 4 and q.shape[1] == 1
        lens = cache_seqlens.tolist()
        keys = [self._gather(k_cache, block_table[i], n) for i, n in enumerate(lens)]
        values = [self._gather(v_cache, block_table[i], n) for i, n in enumerate(lens)]
        window, cap = self._window(window_size), softcap or None
        out = reference_attention(q[:, 0], keys, values, [1] * len(lens), softmax_scale, window=window,
                                  softcap=cap).to(q.dtype).unsqueeze(1)
        if not return_softmax_lse:
            return out
        lse = _lse(q[:, 0], keys, [1] * len(lens), softmax_scale, window, cap)  # [Hq, B]
        return out, lse.transpose(0, 1)[:, :, None].float()


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_flash_backend_passes_window_softcap_and_rescales_sinks(case, option):
    ctx, new, is_prefill = CASES[case]
    window, sinks, softcap = OPTIONS[option]
    batch = random_paged_batch(ctx, new, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                               dtype=torch.bfloat16, is_prefill=is_prefill, seed=3)
    store_kvcache_torch(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    backend = FlashAttention(16)
    backend._flash = fake = FakeFlashAttn()
    sink_logits = sinks_for(4) if sinks else None
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, 0.2,
                          window=window, sinks=sink_logits, softcap=softcap)
    (call,) = fake.calls
    assert call["kind"] == ("kvcache" if case == "decode" else "varlen")
    assert call["window_size"] == ((window - 1, 0) if window else (-1, -1))
    assert call["softcap"] == (softcap or 0.0)
    assert call["lse"] == bool(sinks)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.2, window=window,
                              sinks=sink_logits, softcap=softcap)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape


def test_flash_backend_plain_calls_carry_no_option_arguments():
    """A flash-attn without window / soft-cap arguments still runs plain layers."""
    from tpserve.kernels.attention_options import PLAIN, AttentionOptions
    from tpserve.kernels.flash_attention import flash_options
    assert flash_options(PLAIN) == {}
    assert flash_options(AttentionOptions(window=1)) == {"window_size": (0, 0)}
    both = flash_options(AttentionOptions(window=512, softcap=50.0))
    assert both == {"window_size": (511, 0), "softcap": 50.0}
