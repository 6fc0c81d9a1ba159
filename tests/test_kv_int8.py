"""int8 KV-cache blocks (kernels/kv_quant.py): the C++ and torch stores write the same codes and
scales; the C++ decode, prompt and batch-invariant paths and the torch backend read them, with
windows, sinks and soft-caps, and agree with float64 attention over the dequantized keys."""
from __future__ import annotations

import math

import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.cpu_attention import CpuAttention
from tpserve.kernels.kv_quant import dequantize_int8, quantize_int8
from tpserve.kernels.reference import random_paged_batch, reference_attention
from tpserve.kernels.torch_attention import TorchAttention
from tpserve.kernels.torch_store import store_kvcache_torch

assert cpu_extension.available(), cpu_extension._state.get("error")


def test_quantize_round_trip_and_zero_rows():
    x = torch.randn(7, 3, 64)
    x[2, 1] = 0.0
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (7, 3)
    assert int(codes.abs().max()) == 127 and scales[2, 1] == 0 and not codes[2, 1].any()
    err = (dequantize_int8(codes, scales) - x).abs()
    assert (err <= scales.unsqueeze(-1) / 2 + 1e-7).all()  # half a step at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_store_writes_the_torch_stores_bits(dtype, block_size):
    gen = torch.Generator().manual_seed(0)
    t, h, d = 9, 2, 64
    qkv = (torch.randn(t, 3, h, d, generator=gen) * 3).to(dtype)  # strided key/value views
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, -1, 17, 63, 0, -1, 32, 40, 1], dtype=torch.int32)
    nb = 64 // block_size
    caches = []
    for _ in range(2):
        caches.append((torch.zeros(nb, block_size, h, d, dtype=torch.int8),
                       torch.zeros(nb, block_size, h, d, dtype=torch.int8),
                       torch.full((nb, block_size, h), -1.0), torch.full((nb, block_size, h), -1.0)))
    cpu_extension.ops().store_kvcache(key, value, *caches[0][:2], slots, *caches[0][2:])
    store_kvcache_torch(key, value, *caches[1][:2], slots, tuple(caches[1][2:]))
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    ks = caches[0][2].view(-1, h)
    assert (ks[slots[slots >= 0].long()] > 0).all()
    assert int((ks == -1).all(-1).sum()) == 64 - 7  # the two -1 tokens stored nothing


def test_store_refuses_missing_or_misshaped_scales():
    key = torch.randn(2, 2, 16)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    ks = torch.zeros(2, 4, 2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        cpu_extension.ops().store_kvcache(key, key, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        cpu_extension.ops().store_kvcache(key, key, kc, kc.clone(), slots, ks[:, :2], ks.clone())
    with pytest.raises(ValueError, match="kv_scales"):
        store_kvcache_torch(key, key, kc, kc.clone(), slots, (ks, ks[:1]))


def int8_batch(context_lens, new_lens, *, heads, head_dim, block_size, dtype, is_prefill, seed=0):
    """random_paged_batch with its context stored into an int8 cache; scales of unused slots are
    NaN, so a kernel reading a slot it must not shows NaN. Returns (batch, caches, keys, values):
    the keys and values the attention sees, dequantized."""
    batch = random_paged_batch(context_lens, new_lens, num_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=head_dim, block_size=block_size, dtype=dtype,
                               is_prefill=is_prefill, seed=seed)
    nb, bs, hkv, d = batch.k_cache.shape
    caches = (torch.zeros(nb, bs, hkv, d, dtype=torch.int8), torch.zeros(nb, bs, hkv, d, dtype=torch.int8),
              torch.full((nb, bs, hkv), float("nan")), torch.full((nb, bs, hkv), float("nan")))
    keys, values = [], []
    for i, (kk, vv) in enumerate(zip(batch.keys, batch.values)):
        c = context_lens[i]
        pos = torch.arange(c)
        slot = (batch.meta.block_tables[i, pos // bs].long() * bs + pos % bs).to(torch.int32)
        store_kvcache_torch(kk[:c], vv[:c], caches[0], caches[1], slot, caches[2:])
        keys.append(dequantize_int8(*quantize_int8(kk)))
        values.append(dequantize_int8(*quantize_int8(vv)))
    return batch, caches, keys, values


SHAPES = {  # name: (context_lens, new_lens, is_prefill)
    "decode": ([37, 5, 70, 16], [1, 1, 1, 1], False),
    "prefill": ([0, 0], [45, 19], True),
    "prefill-with-context": ([33, 8], [20, 3], True),
    "mixed": ([40, 9, 21], [1, 1, 30], True),
}
OPTIONS = {"plain": {}, "window": dict(window=9), "sinks+softcap": dict(sinks=True, softcap=5.0),
           "all": dict(window=16, sinks=True, softcap=8.0)}


def _run(backend, shape, option, dtype, heads=(4, 2), head_dim=64, seed=0):
    ctx, new, is_prefill = SHAPES[shape]
    batch, caches, keys, values = int8_batch(ctx, new, heads=heads, head_dim=head_dim,
                                             block_size=backend.block_size, dtype=dtype,
                                             is_prefill=is_prefill, seed=seed)
    opts = dict(OPTIONS[option])
    if opts.pop("sinks", False):
        opts["sinks"] = torch.linspace(-1.0, 2.0, heads[0])
    scale = 1 / math.sqrt(head_dim)
    out = backend.forward(batch.q, batch.k, batch.v, caches[0], caches[1], batch.meta, scale,
                          kv_scales=caches[2:], **opts)
    ref = reference_attention(batch.q, keys, values, new, scale, **opts)
    return out, ref, caches


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_int8_attention_matches_the_dequantized_reference(shape, option, block_size):
    for dtype in (torch.float32, torch.bfloat16):
        out, ref, caches = _run(CpuAttention(block_size), shape, option, dtype)
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("option", ["plain", "all"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_int8_attention_matches_the_dequantized_reference(shape, option):
    out, ref, _ = _run(TorchAttention(16), shape, option, torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,head_dim", [((8, 1), 128), ((2, 2), 16)])
def test_cpu_int8_other_head_sizes_and_the_batch_invariant_rows(heads, head_dim):
    for invariant in (False, True):
        backend = CpuAttention(16)
        if invariant:
            backend.set_batch_invariant(torch.float32, head_dim)
        out, ref, _ = _run(backend, "mixed", "all", torch.float32, heads=heads, head_dim=head_dim)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_cpu_int8_fp16_rows_go_through_the_torch_backend():
    out, ref, _ = _run(CpuAttention(16), "mixed", "window", torch.float16)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_backends_without_int8_refuse_scales_by_name():
    class Plain(TorchAttention):
        name, int8_kv = "plain", False
    with pytest.raises(ValueError, match="kv_scales: the plain attention backend"):
        _run(Plain(16), "decode", "plain", torch.float32)
    backend = CpuAttention(16)
    batch, caches, _, _ = int8_batch([4], [1], heads=(2, 2), head_dim=16, block_size=16,
                                     dtype=torch.float32, is_prefill=False)
    with pytest.raises(ValueError, match="k_cache: expected dtype"):  # int8 caches, no scales
        backend.forward(batch.q, batch.k, batch.v, caches[0], caches[1], batch.meta, 0.25)
    with pytest.raises(ValueError, match="kv_scales"):
        backend.forward(batch.q, batch.k, batch.v, caches[0], caches[1], batch.meta, 0.25,
                        kv_scales=(caches[2], caches[3][:, :1]))
