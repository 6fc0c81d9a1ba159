"""The grouped-expert GPU path (tpserve/kernels/triton_moe.py) under TRITON_INTERPRET=1 on CPU,
and its torch fallback, against a plain per-token float64 reference.

Shapes are tiny because the interpreter runs every program in numpy. The kernels are imported
inside the tests: tests/conftest.py has chosen the interpreter before they are decorated.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def reference(x, topk_ids, topk_weights, w13, w2, expert_start=0):
    """float64 [T, H]: token by token, expert by expert."""
    t, h = x.shape
    inter = w2.shape[2]
    out = torch.zeros(t, h, dtype=torch.float64)
    for row in range(t):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[row, j]) - expert_start
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = w13[e].double() @ x[row].double()
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[row] += float(topk_weights[row, j]) * (w2[e].double() @ hidden)
    return out


def make_case(t, h, inter, experts, k, seed=0, dtype=torch.float32, unused=()):
    """Random inputs; every token's top-k are distinct experts, none of them in ``unused``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=g) * inter ** -0.5).to(dtype)
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return x, ids, weights, w13, w2


SHAPES = {
    # name: (T, H, I, E, K, unused experts)
    "decode": (3, 32, 24, 8, 2, (1, 6)),      # few tokens, experts with no tokens
    "ragged": (7, 48, 40, 5, 3, (4,)),        # H and I not multiples of the tiles
    "many_rows": (40, 32, 16, 3, 2, ()),      # several row tiles per expert, a 32-row tile
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference_fp32(name):
    from tpserve.kernels.triton_moe import fused_experts, fused_experts_triton
    t, h, inter, e, k, unused = SHAPES[name]
    x, ids, w, w13, w2 = make_case(t, h, inter, e, k, unused=unused)
    want = reference(x, ids, w, w13, w2)
    got = fused_experts_triton(x, ids, w, w13, w2)
    assert got.shape == (t, h) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # Under the interpreter fused_experts picks the Triton path on CPU tensors.
    assert torch.equal(fused_experts(x, ids, w, w13, w2), got)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_triton_half_precision(dtype, tol):
    from tpserve.kernels.triton_moe import fused_experts_triton
    x, ids, w, w13, w2 = make_case(6, 32, 24, 6, 2, seed=3, dtype=dtype, unused=(2,))
    got = fused_experts_triton(x, ids, w, w13, w2)
    assert got.dtype == dtype and torch.isfinite(got).all()
    want = reference(x, ids, w, w13, w2)
    assert want.abs().max() > 0.3  # a scale at which the tolerance means something
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


def test_torch_fallback_matches_reference():
    from tpserve.kernels.triton_moe import fused_experts_torch
    for name, (t, h, inter, e, k, unused) in SHAPES.items():
        x, ids, w, w13, w2 = make_case(t, h, inter, e, k, seed=1, unused=unused)
        got = fused_experts_torch(x, ids, w, w13, w2)
        torch.testing.assert_close(got.double(), reference(x, ids, w, w13, w2), atol=2e-5, rtol=0,
                                   msg=name)


def test_expert_parallel_ranks_sum_to_the_whole():
    """A token routed to experts held by different ranks: each rank adds its own experts only,
    and the ranks' results sum to the unsharded layer (the all-reduce of expert parallelism)."""
    from tpserve.kernels.triton_moe import fused_experts_torch, fused_experts_triton
    x, ids, w, w13, w2 = make_case(4, 32, 16, 6, 3, seed=2)
    whole = reference(x, ids, w, w13, w2)
    parts = []
    for start, stop in ((0, 2), (2, 5), (5, 6)):
        assert any(((ids >= start) & (ids < stop)).any(1) & ((ids < start) | (ids >= stop)).any(1))
        got = fused_experts_triton(x, ids, w, w13[start:stop], w2[start:stop], expert_start=start)
        want = reference(x, ids, w, w13[start:stop], w2[start:stop], expert_start=start)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
        torch.testing.assert_close(fused_experts_torch(x, ids, w, w13[start:stop], w2[start:stop],
                                                       expert_start=start).double(), want,
                                   atol=2e-5, rtol=0)
        parts.append(got.double())
    torch.testing.assert_close(sum(parts), whole, atol=5e-5, rtol=0)
    # A rank holding none of the tokens' experts returns zeros.
    none = make_case(2, 32, 16, 6, 2, seed=4, unused=(4, 5))
    x2, ids2, w2_, w13b, w2b = none
    assert torch.equal(fused_experts_triton(x2, ids2, w2_, w13b[4:], w2b[4:], expert_start=4),
                       torch.zeros(2, 32))


def test_align_groups_assignments_by_expert_with_no_tile_for_unused_experts():
    from tpserve.kernels.triton_moe import align, padded_length
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [7, 1]])  # expert 2 and 4 unused; 7 is remote
    block_m, experts, start = 16, 6, 0
    sorted_ids, block_expert = align(ids, experts, start, block_m)
    n = ids.numel()
    assert sorted_ids.numel() == padded_length(n, experts, block_m) == block_expert.numel() * block_m
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = [a for a in sorted_ids[b * block_m:(b + 1) * block_m].tolist() if a < n]
        if e < 0:
            assert rows == []
            continue
        assert rows and all(int(ids.flatten()[a]) == e for a in rows)  # one expert per tile
        seen += rows
    # Every local assignment exactly once, in token order within its expert; the remote one never.
    assert sorted(seen) == [a for a in range(n) if int(ids.flatten()[a]) < experts]
    assert sorted(e for e in block_expert.tolist() if e >= 0) == [0, 1, 3, 5]


def test_empty_batch_and_argument_errors():
    from tpserve.kernels.triton_moe import fused_experts
    x, ids, w, w13, w2 = make_case(2, 32, 16, 4, 2)
    assert fused_experts(x[:0], ids[:0], w[:0], w13, w2).shape == (0, 32)
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, ids, w, w13[:, :-1], w2)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, ids, w, w13, w2[:, :, :-1])
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, ids, w[:, :1], w13, w2)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, ids.float(), w, w13, w2)
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, ids, w, w13.double(), w2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_matches_the_models_experts_reference(dtype, tol):
    """What FusedMoE.experts runs on a CUDA device (fused_experts) against what it runs without
    a kernel (models/moe.py's experts_reference), routing by the model's own ``route``, on a
    full layer and on an expert-parallel shard."""
    from tpserve.kernels.triton_moe import fused_experts
    from tpserve.models.moe import experts_reference, route
    x, _, _, w13, w2 = make_case(9, 32, 24, 8, 2, seed=5, dtype=dtype)
    weights, ids = route(torch.randn(9, 8, generator=torch.Generator().manual_seed(6)) * 2, 3, True)
    assert torch.unique(ids).numel() >= 6  # the router spreads the tokens
    for start, stop in ((0, 8), (3, 6)):
        got = fused_experts(x, ids, weights, w13[start:stop], w2[start:stop], start)
        want = experts_reference(x, ids, weights, w13[start:stop], w2[start:stop], start)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
