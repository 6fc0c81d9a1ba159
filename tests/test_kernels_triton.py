"""The Triton backend (under TRITON_INTERPRET=1 on CPU) against the torch backend.

Shapes are small because the interpreter runs every program in numpy. Kernels are imported
inside the tests: tests/conftest.py has chosen the interpreter before they are decorated.
"""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.reference import random_paged_batch, reference_attention

CASES = {
    # name: (context_lens, new_lens, is_prefill)
    "prefill": ([0, 0, 0], [5, 17, 1], True),
    "prefill_context": ([3, 0, 20], [4, 18, 9], True),
    "decode": ([0, 16, 38], [1, 1, 1], False),
    # A mixed step: decode rows first, then prefill chunks with and without context.
    "mixed": ([16, 38, 5, 0, 3], [1, 1, 1, 18, 9], True),
}
HEADS = {"gqa": (4, 2, 16), "mha": (2, 2, 32)}  # (Hq, Hkv, head_dim)


def both_backends(batch, block_size, scale=0.3):
    """Run triton and torch on copies of the same batch; return outputs and final caches."""
    results = {}
    for name in ("triton", "torch"):
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        out = get_backend(name, "cpu", block_size).forward(batch.q, batch.k, batch.v, kc, vc,
                                                           batch.meta, scale)
        results[name] = (out, kc, vc)
    return results


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
def test_triton_matches_torch_fp32(case, block_size, heads):
    ctx, new, is_prefill = CASES[case]
    hq, hkv, d = HEADS[heads]
    batch = random_paged_batch(ctx, new, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=block_size, is_prefill=is_prefill, seed=7)
    res = both_backends(batch, block_size)
    out, kc, vc = res["triton"]
    want, kc_want, vc_want = res["torch"]
    assert out.shape == batch.q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), reference_attention(batch.q, batch.keys,
                                                                 batch.values, new, 0.3),
                               atol=1e-5, rtol=0)
    # Same slots written, the rest (NaN) untouched.
    assert torch.equal(kc.nan_to_num(7.0), kc_want.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_want.nan_to_num(7.0))


@pytest.mark.parametrize("block_size", [48, 128])
@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill_context", "decode"])
def test_triton_block_sizes_spanning_several_tiles(block_size, is_prefill):
    """48 = 3 tiles of 16 per block; 128 = 2 tiles of 64: tiles at offsets inside a block."""
    ctx, new = ([70, 2], [9, 30]) if is_prefill else ([130, 40], [1, 1])
    batch = random_paged_batch(ctx, new, num_heads=2, num_kv_heads=1, head_dim=16,
                               block_size=block_size, is_prefill=is_prefill, seed=11)
    res = both_backends(batch, block_size)
    torch.testing.assert_close(res["triton"][0], res["torch"][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["prefill_context", "decode", "mixed"])
def test_triton_matches_torch_bf16(case):
    ctx, new, is_prefill = CASES[case]
    batch = random_paged_batch(ctx, new, num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=16, is_prefill=is_prefill, dtype=torch.bfloat16)
    res = both_backends(batch, 16)
    out, want = res["triton"][0], res["torch"][0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=0)


def test_triton_without_cache_and_with_fused_qkv_strides():
    """No cache (warm-up): causal over the new tokens; q/k/v may be slices of one projection."""
    new = [6, 1, 19]
    batch = random_paged_batch([0, 0, 0], new, num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16, seed=2)
    qkv = torch.cat([batch.q, batch.k, batch.v], dim=1)  # [T, 4 + 2 + 2, D]
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert not q.is_contiguous()
    out = get_backend("triton", "cpu", 16).forward(q, k, v, None, None, batch.meta, 0.25)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_triton_chunked_prefill_then_decode_matches_torch():
    """Two prefill chunks and a decode step through one cache, as the engine runs them."""
    hq, hkv, d, bs = 2, 1, 16, 16
    full = random_paged_batch([0], [27], num_heads=hq, num_kv_heads=hkv, head_dim=d,
                              block_size=bs, seed=5)
    tables, slots = full.meta.block_tables, full.meta.slot_mapping
    steps = [(0, 20, True), (20, 26, True), (26, 27, False)]  # [start, end) of each step
    outs = {}
    for name in ("triton", "torch"):
        be = get_backend(name, "cpu", bs)
        kc, vc = torch.zeros_like(full.k_cache), torch.zeros_like(full.v_cache)
        got = []
        for start, end, is_prefill in steps:
            meta = AttentionMetadata.from_arrays(
                is_prefill=is_prefill, has_context=is_prefill and start > 0,
                cu_seqlens_q=[0, end - start], cu_seqlens_k=[0, end], context_lens=[end],
                block_tables=tables, slot_mapping=slots[start:end])
            got.append(be.forward(full.q[start:end], full.k[start:end], full.v[start:end],
                                  kc, vc, meta, 0.25))
        outs[name] = torch.cat(got)
    ref = reference_attention(full.q, full.keys, full.values, [27], 0.25)
    torch.testing.assert_close(outs["torch"].double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=0)


class _RecordingKernel:
    """Stands in for a Triton kernel object: records each launch's keyword (constexpr)
    arguments, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(kw)
            return self.kernel[grid](*args, **kw)
        return launch


def test_paged_prefill_tiles_are_wide_whatever_the_block_size(monkeypatch):
    """Block size 16: a 32-key fp32 tile spans two blocks and reads both table entries at once."""
    from tpserve.kernels import paged_prefill
    rec = _RecordingKernel(paged_prefill._prefill_kernel)
    monkeypatch.setattr(paged_prefill, "_prefill_kernel", rec)
    ctx, new = [70, 5, 0], [20, 9, 3]  # a tile starting inside a block; tables wider than needed
    batch = random_paged_batch(ctx, new, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16,
                               is_prefill=True, seed=3)
    res = both_backends(batch, 16)
    torch.testing.assert_close(res["triton"][0], res["torch"][0], atol=1e-5, rtol=0)
    (kw,) = rec.launches
    assert kw["PAGED"] and kw["BLOCK_SIZE"] == 16 and kw["BLOCK_N"] == 32
    assert paged_prefill.prefill_tiles(200, torch.bfloat16) == (64, 64)
    assert paged_prefill.prefill_tiles(16, torch.bfloat16) == (16, 64)
    assert paged_prefill.prefill_tiles(17, torch.float32) == (32, 32)


# ---- kernel wrappers' checks -------------------------------------------------------------

def _paged_args():
    batch = random_paged_batch([3, 0], [4, 5], num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16)
    m = batch.meta
    return dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache,
                cu_seqlens_q=m.cu_seqlens_q, context_lens=m.context_lens,
                block_tables=m.block_tables, max_seqlen_q=m.max_seqlen_q, scale=0.25)


@pytest.mark.parametrize("mutate,msg", [
    (lambda a: a.update(k_cache=a["k_cache"][:, :8].contiguous(),
                        v_cache=a["v_cache"][:, :8].contiguous()),
     "k_cache: block_size must be a multiple of 16"),
    (lambda a: a.update(block_tables=a["block_tables"].long()),
     "block_tables: expected dtype torch.int32"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     "q: the head_dim axis must be contiguous"),
    (lambda a: a.update(q=a["q"][:, :3]), "num_kv_heads=2 must divide"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]), r"cu_seqlens_q: expected 3 entries"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]),
     "block_tables: 2 rows but context_lens has 1"),
    (lambda a: a.update(max_seqlen_q=-1), "max_seqlen_q: expected an int >= 0"),
])
def test_prefill_wrapper_rejects_bad_arguments(mutate, msg):
    from tpserve.kernels.paged_prefill import paged_prefill_attention
    args = _paged_args()
    mutate(args)
    with pytest.raises(ValueError, match=msg):
        paged_prefill_attention(**args)


def test_decode_wrapper_rejects_token_count_mismatch():
    from tpserve.kernels.paged_decode import paged_decode_attention
    a = _paged_args()
    with pytest.raises(ValueError, match="q: decode has one token per sequence, got 9 tokens"):
        paged_decode_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"],
                               a["context_lens"], 0.25)


def test_varlen_wrapper_rejects_mismatched_kv():
    from tpserve.kernels.paged_prefill import varlen_prefill_attention
    q, k = torch.zeros(5, 4, 16), torch.zeros(5, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"v: shape \(5, 1, 16\) differs from k"):
        varlen_prefill_attention(q, k, torch.zeros(5, 1, 16), cu, 5, 0.25)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected dtype torch.int32"):
        varlen_prefill_attention(q, k, k, cu.long(), 5, 0.25)


def test_varlen_prefill_takes_k_and_v_of_different_strides():
    """A model without q/k norms hands the backend k as a slice of the fused qkv projection and v
    made contiguous: their strides differ, and the prefill must still attend correctly."""
    from tpserve.kernels.paged_prefill import varlen_prefill_attention
    torch.manual_seed(0)
    t, hq, hkv, d = 7, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).contiguous()
    assert k.stride() != v.stride()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = varlen_prefill_attention(q, k, v, cu, 4, 0.25)
    ref = reference_attention(q, [k[:3], k[3:]], [v[:3], v[3:]], [3, 4], 0.25)
    assert (out.double() - ref).abs().max() < 1e-5


def test_get_backend_triton_on_cpu_under_interpreter():
    be = get_backend("triton", "cpu", 48)
    assert be.name == "triton" and be.block_size == 48
