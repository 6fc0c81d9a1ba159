"""Sliding window, sinks and soft-cap in the C++ CPU attention (cpu_attention.py, cpu_ops.cpp)
against the dense reference: decode, tiled prompt, general and batch-invariant paths."""
from __future__ import annotations

import pytest
import torch
from test_attention_window import CASES, OPTIONS, check_backend, sinks_for

from tpserve.kernels import cpu_extension
from tpserve.kernels.cpu_attention import CpuAttention
from tpserve.kernels.reference import random_paged_batch, reference_attention
from tpserve.kernels.torch_attention import TorchAttention


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_backend_options_match_reference(case, option, block_size):
    check_backend(CpuAttention(block_size), case, option)


@pytest.mark.parametrize("option", ["window13", "sinks", "all"])
@pytest.mark.parametrize("case", ["prefill_context", "decode", "mixed"])
@pytest.mark.parametrize("dtype, head_dim, heads", [
    (torch.bfloat16, 64, (8, 2)),   # the vector paths' constant head_dim, bf16 cache
    (torch.float32, 128, (4, 1)),   # MQA
    (torch.float16, 16, (4, 2)),    # the general kernel (decode rows) and torch (prompt rows)
    (torch.float32, 24, (4, 2)),    # head_dim % 16 != 0: the general kernel
])
def test_cpu_backend_options_other_dtypes_and_heads(case, option, dtype, head_dim, heads):
    atol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    check_backend(CpuAttention(16), case, option, heads=heads, head_dim=head_dim, dtype=dtype, atol=atol)


@pytest.mark.parametrize("option", ["window4", "window13", "all"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_invariant_rows_take_the_options(case, option):
    backend = CpuAttention(16)
    backend.set_batch_invariant(torch.float32, 16)
    check_backend(backend, case, option)


def _freed_batch(block_size, window, ctx, new, heads=(4, 2), d=16, dtype=torch.float32):
    """A batch whose blocks before each sequence's first window are freed: table entry -1 and the
    block's slots NaN (as if reused), so reading one shows in the output or fails."""
    batch = random_paged_batch(ctx, new, num_heads=heads[0], num_kv_heads=heads[1], head_dim=d,
                               block_size=block_size, dtype=dtype, is_prefill=any(n > 1 for n in new))
    tables = batch.meta.block_tables
    freed = 0
    for b, (c, n) in enumerate(zip(ctx, new)):
        first_key = max(0, c - window + 1)  # the first row (position c) sees keys from here
        for col in range(first_key // block_size):
            batch.k_cache[tables[b, col]] = float("nan")
            batch.v_cache[tables[b, col]] = float("nan")
            tables[b, col] = -1
            freed += 1
    assert freed > 0
    return batch


@pytest.mark.parametrize("backend_cls", [CpuAttention, TorchAttention])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_keys_outside_the_window_are_never_read(backend_cls, block_size, shape):
    window = 9
    ctx, new = ([40, 75, 23], [1, 1, 1]) if shape == "decode" else ([40, 75, 23], [5, 33, 1])
    batch = _freed_batch(block_size, window, ctx, new)
    out = backend_cls(block_size).forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                                          batch.meta, 0.25, window=window)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.25, window=window)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 16), (torch.float32, 24)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_general_kernel_reads_no_key_outside_the_window(dtype, head_dim, block_size):
    """The operator's general kernel (fp16, head_dim % 16 != 0) starts at the window too."""
    window, ctx, new = 9, [40, 75, 23], [1, 1, 1]
    batch = _freed_batch(block_size, window, ctx, new, d=head_dim, dtype=dtype)
    out = CpuAttention(block_size).forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                                           batch.meta, 0.25, window=window, sinks=sinks_for(4), softcap=3.0)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.25, window=window,
                              sinks=sinks_for(4), softcap=3.0)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=0)


def test_table_check_needs_the_blocks_of_every_window():
    ops = cpu_extension.ops()
    batch = _freed_batch(4, 9, [40], [1])
    m = batch.meta
    ops.check_block_tables(m.block_tables, m.cu_seqlens_q, m.context_lens, batch.k_cache.shape[0], 4, 9)
    for window in (0, 40):  # every block, or a window reaching into the freed ones
        with pytest.raises(ValueError, match="block_tables"):
            ops.check_block_tables(m.block_tables, m.cu_seqlens_q, m.context_lens,
                                   batch.k_cache.shape[0], 4, window)


@pytest.mark.parametrize("field, kwargs", [
    ("window", {"window": -1}), ("softcap", {"softcap": -1.0}),
    ("sinks", {"sinks": torch.zeros(3)}), ("sinks", {"sinks": torch.zeros(4, dtype=torch.float64)}),
])
def test_operator_rejects_bad_options(field, kwargs):
    batch = random_paged_batch([3], [1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                               is_prefill=False)
    m = batch.meta
    with pytest.raises(ValueError, match=field):
        cpu_extension.ops().paged_attention(torch.empty_like(batch.q), batch.q, batch.k_cache, batch.v_cache,
                                            m.block_tables, m.cu_seqlens_q, m.context_lens, 0.25,
                                            **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_windowed_prompt_rows_do_not_depend_on_the_split(dtype, block_size):
    """With a window, sinks and a soft-cap a prompt row still computes the same bits whether the
    rows before it are new in this call or read from the cache (docs/protocol.md)."""
    ops = cpu_extension.ops()
    n, d = 75, 64
    whole = random_paged_batch([0], [n], num_heads=8, num_kv_heads=2, head_dim=d,
                               block_size=block_size, dtype=dtype, seed=3)
    m = whole.meta
    CpuAttention(block_size).store(whole.k, whole.v, whole.k_cache, whole.v_cache, m.slot_mapping)
    sinks = sinks_for(8)

    def attend(q, cu, ctx):
        out = torch.empty_like(q)
        ops.paged_attention(out, q, whole.k_cache, whole.v_cache, m.block_tables,
                            torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                            d ** -0.5, True, window=21, sinks=sinks, softcap=2.0)
        return out

    all_new = attend(whole.q, [0, n], [n])
    for cached in (1, 16, 31, 47, 74):
        assert torch.equal(attend(whole.q[cached:], [0, n - cached], [n]), all_new[cached:]), cached
    ref = reference_attention(whole.q, whole.keys, whole.values, [n], d ** -0.5, window=21,
                              sinks=sinks, softcap=2.0)
    torch.testing.assert_close(all_new.double(), ref, atol=3e-2 if dtype == torch.bfloat16 else 2e-5,
                               rtol=0)


def test_batch_invariant_rows_equal_the_decode_path_with_a_window():
    """The rows path computes a prompt row with the decode arithmetic: the same bits as decoding it."""
    ops = cpu_extension.ops()
    n, d = 30, 64
    whole = random_paged_batch([0], [n], num_heads=4, num_kv_heads=2, head_dim=d, block_size=16, seed=5)
    m = whole.meta
    CpuAttention(16).store(whole.k, whole.v, whole.k_cache, whole.v_cache, m.slot_mapping)
    rows = torch.empty_like(whole.q)
    ops.paged_attention(rows, whole.q, whole.k_cache, whole.v_cache, m.block_tables, m.cu_seqlens_q,
                        m.context_lens, 0.125, rows=True, window=7, sinks=sinks_for(4))
    for pos in (0, 6, 7, 29):
        one = torch.empty_like(whole.q[pos:pos + 1])
        ops.paged_attention(one, whole.q[pos:pos + 1], whole.k_cache, whole.v_cache, m.block_tables,
                            torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([pos + 1], dtype=torch.int32), 0.125, window=7, sinks=sinks_for(4))
        assert torch.equal(one, rows[pos:pos + 1]), pos
