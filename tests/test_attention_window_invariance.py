"""The batch-invariant mode with a sliding window, sinks and a soft-cap: one sequence's row comes
out with the same bits alone, beside other rows and as a prompt chunk's last row (the harness of
tests/test_batch_invariance_kernels.py), on the C++ operator and the Triton backend."""
from __future__ import annotations

import pytest
import torch
from test_batch_invariance_kernels import BLOCK, HQ, SITUATIONS, Cache

from tpserve.kernels import cpu_extension
from tpserve.kernels.attention_options import AttentionOptions

OPTS = AttentionOptions(window=13, sinks=torch.linspace(-1.0, 1.5, HQ), softcap=1.7)


def _a_last_row(backend, cache, rows, opts):
    q, meta = cache.step(rows)
    out = backend.attend(q, None, None, cache.k, cache.v, meta, 0.25, opts)
    end = 0
    for name, n in rows:
        end += n
        if name == "a":
            return out[end - 1].clone()
    raise AssertionError("no row of a")


def _moved(backend, cache, situations, opts=OPTS):
    outs = {name: _a_last_row(backend, cache, rows, opts) for name, rows in situations.items()}
    return [name for name, o in outs.items() if not torch.equal(o, outs["alone"])], outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rows_with_options_are_invariant(dtype):
    assert cpu_extension.available(), cpu_extension.status()
    from tpserve.kernels.cpu_attention import CpuAttention
    cache = Cache(dtype, head_dim=64)
    default = CpuAttention(BLOCK)
    if dtype == torch.float32:
        assert _moved(default, cache, SITUATIONS)[0], "the default paths should differ"
    invariant = CpuAttention(BLOCK)
    invariant.set_batch_invariant(dtype, 64)
    moved, outs = _moved(invariant, cache, SITUATIONS)
    assert moved == []
    # equal to the default decode path's (the fused decode stack's) row alone, and to no-window's not
    alone = _a_last_row(default, cache, SITUATIONS["alone"], OPTS)
    assert torch.equal(outs["alone"], alone)
    plain = _a_last_row(default, cache, SITUATIONS["alone"], AttentionOptions())
    assert not torch.equal(alone, plain)


def test_triton_rows_with_options_are_invariant():
    from tpserve.kernels.triton_attention import TritonAttention
    cache = Cache(torch.float32, head_dim=16, seed=1)
    situations = {k: SITUATIONS[k] for k in ("alone", "beside a long decode", "as a prompt chunk's last row")}
    invariant = TritonAttention(BLOCK)
    invariant.set_batch_invariant(torch.float32, 16)
    assert _moved(invariant, cache, situations)[0] == []
