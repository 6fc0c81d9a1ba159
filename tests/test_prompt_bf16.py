"""The prompt attention on blocks of key pairs (csrc/prompt_bf16.cpp: the AMX tile unit, or
AVX512-BF16 dot products without it): bf16 prompt rows against the float64 reference,
bit-identical rows whatever part of the prompt came from the cache, and no read of a slot a row
must not see. On a CPU with neither the same tests run the vector path."""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.cpu_attention import CpuAttention
from tpserve.kernels.reference import random_paged_batch, reference_attention

assert cpu_extension.available(), "the C++ operators must build for these tests"
ops = cpu_extension.ops()


def _attend(batch, block_size, **opts):
    m = batch.meta
    CpuAttention(block_size).store(batch.k, batch.v, batch.k_cache, batch.v_cache, m.slot_mapping)
    out = torch.empty_like(batch.q)
    scale = batch.q.shape[-1] ** -0.5
    ops.paged_attention(out, batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.cu_seqlens_q,
                        m.context_lens, scale, True, **opts)
    return out, scale


def test_the_tiles_run_where_the_cpu_has_them():
    runs = ops.prompt_attention_amx(128)
    assert runs == ops.linear_amx()  # both need the tile unit and its grant
    assert not ops.prompt_attention_amx(80)  # not a multiple of 32: the vector path
    assert not ops.prompt_attention_amx(512)


def test_key_pairs_run_where_the_cpu_has_avx512_bf16():
    """Without the tiles, dot products (vdpbf16ps) run the same blocks where the build has
    AVX512-BF16 (cpu_extension picks -march=native)."""
    flags = cpu_extension._cpu_flags()
    assert ops.prompt_attention_pairs(128) == ("avx512_bf16" in flags and "avx512bw" in flags)
    assert not ops.prompt_attention_pairs(80) and not ops.prompt_attention_pairs(512)
    if ops.prompt_attention_amx(128):
        assert ops.prompt_attention_pairs(128)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads", [(16, 8), (12, 4), (4, 4), (8, 1)])
def test_prompt_rows_match_the_reference(head_dim, heads):
    # Sequences with and without cached context, one with a row count not a multiple of a tile.
    ctx, new = [0, 170, 45, 3], [150, 90, 1, 77]
    batch = random_paged_batch(ctx, new, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                               block_size=16, dtype=torch.bfloat16, seed=head_dim + heads[0])
    out, scale = _attend(batch, 16)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("opts", [{}, {"window": 37}, {"window": 5, "softcap": 3.0, "sinks": True}])
def test_block_sizes_windows_sinks_and_softcap(block_size, opts):
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.linspace(-1.0, 2.0, 8)
    ctx, new = [90, 0], [70, 101]
    batch = random_paged_batch(ctx, new, num_heads=8, num_kv_heads=2, head_dim=128,
                               block_size=block_size, dtype=torch.bfloat16, seed=block_size)
    out, scale = _attend(batch, block_size, **opts)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, scale, window=opts.get("window"),
                              sinks=opts.get("sinks"), softcap=opts.get("softcap"))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("window", [0, 45])
@pytest.mark.parametrize("block_size", [1, 16])
def test_rows_do_not_depend_on_what_came_from_the_cache(window, block_size):
    """A prompt row computes the same bits whether the rows before it are new in this call or read
    from the cache, and whichever rows share its work item (docs/protocol.md)."""
    n, d = 300, 128
    whole = random_paged_batch([0], [n], num_heads=16, num_kv_heads=8, head_dim=d,
                               block_size=block_size, dtype=torch.bfloat16, seed=7)
    all_new, scale = _attend(whole, block_size, window=window)
    m = whole.meta
    for cached in (1, 31, 32, 100, 129, 250, 299):
        out = torch.empty_like(whole.q[cached:])
        ops.paged_attention(out, whole.q[cached:].contiguous(), whole.k_cache, whole.v_cache, m.block_tables,
                            torch.tensor([0, n - cached], dtype=torch.int32),
                            torch.tensor([n], dtype=torch.int32), scale, True, window=window)
        assert torch.equal(out, all_new[cached:]), cached


def test_freed_blocks_before_the_window_are_not_read():
    """Blocks that left every row's window are freed (table entry -1, slots NaN): the tiles never
    address them, and a block's unused slots (NaN) add nothing."""
    ctx, new, window, bs = [200], [40], 24, 16
    batch = random_paged_batch(ctx, new, num_heads=4, num_kv_heads=2, head_dim=64, block_size=bs,
                               dtype=torch.bfloat16, seed=3)
    tables = batch.meta.block_tables
    for col in range(max(0, ctx[0] - window + 1) // bs):
        batch.k_cache[tables[0, col]] = float("nan")
        batch.v_cache[tables[0, col]] = float("nan")
        tables[0, col] = -1
    out, scale = _attend(batch, bs, window=window)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, scale, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)
