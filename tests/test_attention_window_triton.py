"""Sliding window, sinks and soft-cap in the Triton kernels (TRITON_INTERPRET=1 on CPU, tiny
shapes) against the dense reference: decode (split-K and not), prefill with and without context,
the batch-invariant rows."""
from __future__ import annotations

import pytest
import torch
from test_attention_window import CASES, OPTIONS, check_backend, sinks_for

from tpserve.kernels.reference import random_paged_batch, reference_attention

# Fewer cases than the CPU backends: the interpreter runs each program in numpy.
TRITON_OPTIONS = ["window4", "window13", "window_wide", "sinks", "softcap", "all"]


def _triton(block_size=16):
    from tpserve.kernels.triton_attention import TritonAttention
    return TritonAttention(block_size)


@pytest.mark.parametrize("option", TRITON_OPTIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_options_match_reference(case, option):
    check_backend(_triton(), case, option, atol=1e-5)


@pytest.mark.parametrize("option", ["window13", "all"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_triton_batch_invariant_rows_take_the_options(case, option):
    backend = _triton()
    backend.set_batch_invariant(torch.float32, 16)
    check_backend(backend, case, option, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_splits_share_only_the_window(splits):
    """Split-K over the window's keys: blocks before it are freed (-1, NaN) and never read; the
    sink counts once whatever the split count."""
    from tpserve.kernels.paged_decode import paged_decode_attention
    window, ctx = 40, [150, 70, 20]
    batch = random_paged_batch(ctx, [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16, is_prefill=False)
    _triton().store(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    tables = batch.meta.block_tables
    for b, c in enumerate(ctx):
        for col in range(max(0, c + 1 - window) // 16):
            batch.k_cache[tables[b, col]] = float("nan")
            tables[b, col] = -1
    sinks = sinks_for(4)
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, tables, batch.meta.context_lens,
                                 0.25, num_splits=splits, window=window, sinks=sinks, softcap=1.5)
    ref = reference_attention(batch.q, batch.keys, batch.values, [1, 1, 1], 0.25, window=window,
                              sinks=sinks, softcap=1.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_triton_prefill_bf16_window_and_sinks():
    check_backend(_triton(), "prefill_context", "all", heads=(4, 1), head_dim=32, dtype=torch.bfloat16,
                  atol=3e-2)


def test_gpu_check_option_section_passes_at_tiny_shapes_on_cpu():
    """scripts/gpu_check.py's window / sinks / soft-cap check, as its CPU dry run runs it."""
    import io
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import gpu_check
    report = gpu_check.Report(out=io.StringIO())
    gpu_check.check_kernel_options(report, "cpu", dtypes=("float32",), block_sizes=(16,), heads=(4, 2, 16),
                                   cases={"decode": ([0, 40], [1, 1], False),
                                          "prefill_context": ([20, 0], [5, 9], True)}, window=13)
    assert report.ok and report.counts["PASS"] == 2, report.lines
    assert all("window+sinks+softcap" in line for line in report.lines)


@pytest.mark.parametrize("shape", ["prefill", "mixed"])
def test_triton_prefill_reads_no_key_outside_the_window(shape):
    from test_attention_window_cpu import _freed_batch
    window = 9
    ctx, new = ([40, 75, 23], [5, 33, 1]) if shape == "prefill" else ([40, 75, 23], [1, 1, 20])
    batch = _freed_batch(16, window, ctx, new)
    out = _triton().forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, 0.25,
                            window=window, sinks=sinks_for(4))
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.25, window=window, sinks=sinks_for(4))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
