"""Split-K decode (under TRITON_INTERPRET=1 on CPU) against the dense reference.

Every split count must give the same attention as the reference: shares of whole tiles, empty
shares (more splits than tiles), sequences of one key, block sizes below and above the tile.
"""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels.reference import random_paged_batch, reference_attention
from tpserve.kernels.tiles import DECODE_MIN_SHARE_KEYS, DECODE_TARGET_PROGRAMS, decode_splits

CONTEXTS = [0, 39, 150, 32, 70]  # keys per sequence = context + the new token


def _decode(block_size, splits, dtype=torch.float32, heads=(4, 2, 16)):
    from tpserve.kernels.paged_decode import paged_decode_attention
    from tpserve.kernels.store_kvcache import store_kvcache
    hq, hkv, d = heads
    batch = random_paged_batch(CONTEXTS, [1] * len(CONTEXTS), num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, block_size=block_size, is_prefill=False, seed=3,
                               dtype=dtype)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    store_kvcache(batch.k, batch.v, kc, vc, batch.meta.slot_mapping)
    out = paged_decode_attention(batch.q, kc, vc, batch.meta.block_tables,
                                 batch.meta.context_lens, 0.3, num_splits=splits)
    want = reference_attention(batch.q, batch.keys, batch.values, [1] * len(CONTEXTS), 0.3)
    return out, want


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_decode_matches_reference_fp32(block_size, splits):
    out, want = _decode(block_size, splits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_split_decode_bf16_and_mha():
    out, want = _decode(16, 3, dtype=torch.bfloat16, heads=(2, 2, 32))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)


def test_backend_decode_splits_on_its_own_when_shares_are_long_enough(monkeypatch):
    from tpserve.kernels import tiles
    from tpserve.kernels.backend_factory import get_backend
    monkeypatch.setattr(tiles, "DECODE_MIN_SHARE_KEYS", 32)
    batch = random_paged_batch(CONTEXTS, [1] * len(CONTEXTS), num_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=16, is_prefill=False, seed=4)
    width = batch.meta.block_tables.shape[1]
    assert decode_splits(len(CONTEXTS), 2, width * 16, 32) > 1
    out = get_backend("triton", "cpu", 16).forward(batch.q, batch.k, batch.v, batch.k_cache,
                                                   batch.v_cache, batch.meta, 0.3)
    want = reference_attention(batch.q, batch.keys, batch.values, [1] * len(CONTEXTS), 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_split_count_fills_the_grid_without_tiny_shares():
    # Small batch, long context: enough shares to reach the target grid.
    assert decode_splits(1, 8, 32768, 64) == -(-DECODE_TARGET_PROGRAMS // 8)
    assert decode_splits(1, 8, 32768, 64) * 8 >= DECODE_TARGET_PROGRAMS
    # Short context: no share below the minimum.
    assert decode_splits(1, 8, 2 * DECODE_MIN_SHARE_KEYS, 64) == 2
    assert decode_splits(1, 8, 100, 64) == 1
    # A full grid needs no split.
    assert decode_splits(256, 8, 32768, 64) == 1


def test_num_splits_is_validated():
    from tpserve.kernels.paged_decode import paged_decode_attention
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(torch.zeros(1, 2, 16), torch.zeros(1, 16, 2, 16),
                               torch.zeros(1, 16, 2, 16), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 0.3, num_splits=0)
