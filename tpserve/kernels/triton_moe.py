"""Grouped expert GEMMs of a mixture-of-experts layer on a GPU (Triton), with a torch fallback.

    fused_experts(x, topk_ids, topk_weights, w13, w2, expert_start=0) -> [T, H]

``x`` [T, H]; ``topk_ids`` [T, K] global expert ids and ``topk_weights`` [T, K] their routing
weights; ``w13`` [E_local, 2 * I, H] each local expert's gate rows then up rows, ``w2``
[E_local, H, I]; this rank holds experts ``expert_start .. expert_start + E_local - 1``. The
result is ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over the token's experts
held here (an expert held by another rank adds nothing: expert parallelism combines ranks by an
all-reduce). fp32, bf16 and fp16; products accumulate in fp32.

How (no host synchronisation, so a decode step can be captured in a CUDA graph):

1. ``align``: the T*K (token, expert) assignments sorted by local expert, each expert's run
   padded to a multiple of the row tile BLOCK_M; every tile of rows then belongs to one expert
   (``block_expert``, -1 for tiles past the used length). The padded length has a host-known
   bound, T*K + min(T*K, E_local) * (BLOCK_M - 1), so the grids are fixed by the shapes.
2. ``_gate_up_kernel``: one program per (row tile, column tile of I): the rows' tokens of x
   against the expert's gate and up rows, SiLU(gate) * up written per assignment.
3. ``_down_kernel``: the same tiles against w2, scaled by the routing weight, written per
   assignment; the K rows of a token are summed in fp32 at the end.

An expert without tokens has no tile, so its weights are never read. Where Triton cannot run
(a CPU tensor without ``TRITON_INTERPRET=1``, or no Triton), ``fused_experts_torch`` groups the
assignments by expert on the host and runs one matmul per used expert.
"""
from __future__ import annotations

import os

import torch

from tpserve.kernels.checks import check_tensor

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None


def check_moe_args(x, topk_ids, topk_weights, w13, w2) -> tuple[int, int, int, int, int]:
    """(T, H, K, E_local, I) after checking the shapes, dtypes and devices; ValueError names
    the argument."""
    check_tensor("x", x, 2)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    t, h = x.shape
    check_tensor("topk_ids", topk_ids, 2, device=x.device)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected dtype torch.int32 or torch.int64, got {topk_ids.dtype}")
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected {t} rows (one per token of x), got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, 2, device=x.device)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)} differs from topk_ids "
                         f"{tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
    check_tensor("w13", w13, 3, x.dtype, x.device)
    e, two_i, wh = w13.shape
    if wh != h or two_i % 2:
        raise ValueError(f"w13: expected shape [E_local, 2 * I, {h}] (gate rows then up rows), "
                         f"got {tuple(w13.shape)}")
    i = two_i // 2
    check_tensor("w2", w2, 3, x.dtype, x.device)
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2: expected shape [{e}, {h}, {i}] to match w13, got {tuple(w2.shape)}")
    return t, h, k, e, i


def _use_triton(x: torch.Tensor) -> bool:
    if triton is None:
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """[T, H] in x's dtype: the weighted sum of each token's local experts (module docstring)."""
    check_moe_args(x, topk_ids, topk_weights, w13, w2)
    if _use_triton(x):
        return fused_experts_triton(x, topk_ids, topk_weights, w13, w2, expert_start)
    return fused_experts_torch(x, topk_ids, topk_weights, w13, w2, expert_start)


# ---- torch fallback --------------------------------------------------------------------------

def fused_experts_torch(x, topk_ids, topk_weights, w13, w2, expert_start: int = 0) -> torch.Tensor:
    """The same computation with torch matmuls, one per expert that has tokens (host-side
    grouping: it synchronises a GPU; the fallback where Triton cannot run)."""
    t, h, k, e, i = check_moe_args(x, topk_ids, topk_weights, w13, w2)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    local = topk_ids.reshape(-1).long() - expert_start
    valid = (local >= 0) & (local < e)
    assign = torch.nonzero(valid).flatten()
    if assign.numel():
        experts = local[assign]
        order = torch.argsort(experts, stable=True)
        assign, experts = assign[order], experts[order]
        used, counts = torch.unique_consecutive(experts, return_counts=True)
        weights = topk_weights.reshape(-1).float()
        start = 0
        for ex, n in zip(used.tolist(), counts.tolist()):
            rows = assign[start:start + n]
            start += n
            tok = rows // k
            gate_up = x[tok] @ w13[ex].t()
            hidden = torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]
            y = (hidden @ w2[ex].t()).float() * weights[rows, None]
            out.index_add_(0, tok, y)
    return out.to(x.dtype)


# ---- Triton ----------------------------------------------------------------------------------

def tile_rows(assignments: int, experts: int) -> int:
    """BLOCK_M: the row tile, from the mean number of assignments per local expert (a decode
    step's few tokens per expert waste little of a 16-row tile; a long prefill fills 64)."""
    per_expert = assignments / max(experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def padded_length(assignments: int, experts: int, block_m: int) -> int:
    """Bound on the sorted, per-expert padded assignment list: at most min(assignments,
    experts) experts are used, each padded by fewer than block_m rows; a multiple of block_m."""
    bound = assignments + min(assignments, experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align(topk_ids: torch.Tensor, num_experts: int, expert_start: int, block_m: int):
    """(sorted_ids int32 [P], block_expert int32 [P / block_m]): assignment indices (t * K + k)
    grouped by local expert, each expert's run padded to block_m with T*K (no assignment);
    the local expert of each row tile, -1 where the tile is unused. Device ops only."""
    n = topk_ids.numel()
    dev = topk_ids.device
    p = padded_length(n, num_experts, block_m)
    local = topk_ids.reshape(-1).long() - expert_start
    # Assignments to experts of other ranks go to bucket E, sorted last and dropped.
    bucket = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, ends.new_full((1,), p)])  # bucket E -> the dump slot p
    sorted_bucket, order = torch.sort(bucket, stable=True)
    first = torch.cumsum(counts, 0) - counts  # where each bucket starts in sorted order
    rank = torch.arange(n, device=dev) - first[sorted_bucket]
    dest = torch.where(sorted_bucket < num_experts, starts[sorted_bucket] + rank, p)
    sorted_ids = torch.full((p + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, p, block_m, device=dev)
    block_expert = torch.searchsorted(ends, tile_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:p], block_expert


if triton is not None:
    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                        n_assign, top_k, H, I,
                        sx_t, sx_h, sw_e, sw_n, sw_k, so_a,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(sorted_ids_ptr + rows).to(tl.int64)
        row_ok = assign < n_assign
        tok = assign // top_k
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        w_base = w_ptr + expert * sw_e
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            a = tl.load(x_ptr + tok[:, None] * sx_t + ks[None, :] * sx_h,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_base + cols[None, :] * sw_n + ks[:, None] * sw_k, mask=w_mask, other=0.0)
            wu = tl.load(w_base + (cols + I)[None, :] * sw_n + ks[:, None] * sw_k, mask=w_mask,
                         other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        hidden = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(out_ptr + assign[:, None] * so_a + cols[None, :], hidden.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
                     n_assign, H, I,
                     sh_a, sw_e, sw_n, sw_k, so_a,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(sorted_ids_ptr + rows).to(tl.int64)
        row_ok = assign < n_assign
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        w_base = w_ptr + expert * sw_e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < I
            a = tl.load(h_ptr + assign[:, None] * sh_a + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * sw_n + ks[:, None] * sw_k,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + assign, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(out_ptr + assign[:, None] * so_a + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _tile(n: int, most: int) -> int:
    return max(16, min(most, triton.next_power_of_2(max(n, 1))))


def fused_experts_triton(x, topk_ids, topk_weights, w13, w2, expert_start: int = 0) -> torch.Tensor:
    """``fused_experts`` through the two Triton kernels (CUDA, or CPU under the interpreter)."""
    from tpserve.kernels.tiles import dot_options

    t, h, k, e, i = check_moe_args(x, topk_ids, topk_weights, w13, w2)
    n = t * k
    if n == 0 or e == 0:
        return torch.zeros_like(x)
    block_m = tile_rows(n, e)
    sorted_ids, block_expert = align(topk_ids, e, expert_start, block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    most_k = 32 if x.dtype == torch.float32 else 64
    opts = dot_options(x)
    hidden = torch.empty(n, i, dtype=x.dtype, device=x.device)
    bn, bk = _tile(i, 64), _tile(h, most_k)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(i, bn))](
        x, w13, hidden, sorted_ids, block_expert, n, k, h, i,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), hidden.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, **opts)
    # Assignments to other ranks' experts are never written: they stay zero.
    per_assign = torch.zeros(n, h, dtype=x.dtype, device=x.device)
    bn, bk = _tile(h, 64), _tile(i, most_k)
    _down_kernel[(block_expert.numel(), triton.cdiv(h, bn))](
        hidden, w2, per_assign, sorted_ids, block_expert, weights, n, h, i,
        hidden.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), per_assign.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, **opts)
    return per_assign.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
