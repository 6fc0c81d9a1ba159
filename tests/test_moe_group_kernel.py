"""Group-quantized experts on the C++ grouped-expert kernel (``moe_kernel.pack_group_experts``,
``csrc/moe_ops.cpp`` over ``csrc/quant_ops.cpp``'s group kernels): 4-bit asymmetric codes
(``--quantization int4``), GGUF-like symmetric 4-bit, 6-bit with int8 sub-scales (Q6_K) and 8-bit
codes, and a stack whose experts would each pack differently alone. Each token's result equals,
bit for bit, its experts run through the group linear layers one by one; every result is close to
a float64 reference with the activations quantized per group as the kernels quantize them; the
stacked layout is the one every expert can take. The AVX2 build runs the same checks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from test_moe_kernel import run_on_an_avx2_build

from tpserve.kernels import cpu_extension
from tpserve.models import moe_kernel
from tpserve.models.group_quant import (GROUP4, GROUP8, dequantize, group_layout, pack_group_weight,
                                        quantize_activations, quantize_groups)

H, I = 256, 48  # hidden, one expert's intermediate size (a partial panel of gate/up outputs)


def _symmetric(n: int, k: int, g: int, top: int, offset: int, gen, sub: bool = False):
    """Codes below ``top`` with mins = -offset * scales; fp16 scales, or with ``sub`` Q6_K's
    form (an fp16 d per 16 groups times int8 sub-scales)."""
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    if sub:
        d = (torch.rand(n, k // g // 16, generator=gen) * 0.002 + 0.001).half().float()
        sc = torch.randint(-128, 128, (n, k // g), generator=gen).float()
        scales = d.repeat_interleave(16, 1) * sc
    else:
        scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.005).half().float()
    return codes, scales, -offset * scales


def make_stack(layout: str, num_local: int, n: int, k: int, seed: int):
    """``(codes [E, n, k], scales, mins)`` of one projection in the named layout."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for e in range(num_local):
        if layout == "int4":  # --quantization int4's round-to-nearest, fp16 scales and mins
            parts.append(quantize_groups(torch.randn(n, k, generator=gen) / 6, 16, 4))
        elif layout == "q4_0":
            parts.append(_symmetric(n, k, 16, 16, 8, gen))
        elif layout == "q6_k":
            parts.append(_symmetric(n, k, 16, 64, 32, gen, sub=k % 256 == 0))  # (w13: 16 groups of 16)
        elif layout == "q8_0":
            parts.append(_symmetric(n, k, 16, 256, 128, gen))
        else:  # "mixed": expert 0's codes 4-bit asymmetric, the others 6-bit symmetric
            parts.append(quantize_groups(torch.randn(n, k, generator=gen) / 6, 16, 4) if e == 0
                         else _symmetric(n, k, 16, 64, 32, gen))
    return tuple(torch.stack([p[i] for p in parts]) for i in range(3))


LAYOUTS = {"int4": GROUP4, "q4_0": GROUP4, "q6_k": GROUP8, "q8_0": GROUP8, "mixed": GROUP8}


def _quantized(x: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of x as the kernels read them: int8 per group times its scale (float64)."""
    q, s, _ = quantize_activations(x, g)
    return (q.double().view(x.shape[0], -1, g) * s.double()[..., None]).view(x.shape)


def reference(x, ids, weights, w13, w2, start: int) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    num_local = w13[0].shape[0]
    xq = _quantized(x.float(), 16)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if 0 <= e < num_local:
                gu = dequantize(*(p[e] for p in w13)).double() @ xq[t]
                h = (F.silu(gu[:I]) * gu[I:]).to(x.dtype).float()[None]
                down = dequantize(*(p[e] for p in w2)).double()
                out[t] += float(weights[t, j]) * (down @ _quantized(h, 16)[0])
    return out


def check_group_experts() -> None:
    """Every layout: bits of the group linear layers, closeness to the reference (also run on an
    AVX2 build of the operators)."""
    ops = cpu_extension.ops()
    for name, kind in LAYOUTS.items():
        for dtype in (torch.float32, torch.bfloat16):
            num_local, start, num_experts = 5, 2, 9
            w13 = make_stack(name, num_local, 2 * I, H, seed=1)
            w2 = make_stack(name, num_local, H, I, seed=2)
            packed = moe_kernel.pack_group_experts(w13, w2, num_experts, start)
            assert packed.w13.kind == kind and packed.w2.kind == kind, name
            T, k = 70, 2
            gen = torch.Generator().manual_seed(3)
            ids = torch.randint(0, num_experts, (T, k), generator=gen)
            ids[:, 0] = start + torch.arange(T) % 3  # experts with many rows (more than a row block)
            weights = torch.rand(T, k, generator=gen) + 0.1
            x = torch.randn(T, H, generator=gen).to(dtype)
            out = packed.forward(x, ids, weights)
            ref = reference(x, ids, weights, w13, w2, start)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < (2e-2 if dtype == torch.bfloat16 else 1e-3), (name, dtype, err)
            # k=1, weight 1: a token's result is its expert through the group linear layers (in
            # the stack's layout) bit for bit, whatever the other tokens of the call
            one = packed.forward(x, ids[:, :1], torch.ones(T, 1))
            l13 = group_layout(*(p.reshape(-1, p.shape[-1]) for p in w13))
            l2 = group_layout(*(p.reshape(-1, p.shape[-1]) for p in w2))
            for t in (0, 1, 37, 69):
                e = int(ids[t, 0]) - start
                gu = pack_group_weight(*(p[e] for p in w13), layout=l13).matmul(x[t:t + 1], None)
                act = torch.empty(1, I, dtype=dtype)
                ops.silu_and_mul(act, gu)
                y = pack_group_weight(*(p[e] for p in w2), layout=l2).matmul(act, None)
                assert torch.equal(one[t:t + 1], y), (name, dtype, t)


# The C++ operators are under test: `make test` builds them, so their absence is a failure.
assert cpu_extension.available(), cpu_extension._state.get("error")


def test_every_layout_runs_with_the_bits_of_the_group_linear_layers():
    check_group_experts()


def test_a_stack_takes_one_layout_every_expert_can_take():
    """Alone, expert 0 of the mixed stack packs as 4-bit asymmetric and the others as 6-bit
    symmetric with fp16 scales; stacked, all are 6-bit with their mins held, and the packed rows
    give back every expert's exact weights."""
    from tpserve.models.group_quant import packed_rows_reference
    from tpserve.models.packed_gemm import PackedWeight
    w13 = make_stack("mixed", 3, 2 * I, H, seed=4)
    alone = [group_layout(*(p[e] for p in w13)) for e in range(3)]
    assert alone[0].bits == 4 and alone[0].offset is None
    assert alone[1].bits == 6 and alone[1].offset == 32 and alone[1].fp16
    packed = moe_kernel.pack_group_experts(w13, make_stack("mixed", 3, H, I, seed=5), 3, 0)
    stack = packed.w13
    assert stack.kind == GROUP8 and stack.colsum.dtype != torch.int32  # mins held, not an offset
    for e in range(3):
        one = PackedWeight(data=stack.data[e], kind=stack.kind, n=stack.n, k=stack.k,
                           scales=stack.scales[e], colsum=stack.colsum[e])
        codes, scales, mins = packed_rows_reference(one, torch.arange(2 * I))
        assert torch.equal(dequantize(codes, scales, mins), dequantize(*(p[e] for p in w13)))
    # bytes read per selected expert: 6-bit codes, fp16 scales and mins per group of 16 (output
    # channels padded to whole panels)
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    rows = [-(-n // panel) * panel for n in (2 * I, H)]
    assert packed.bytes_per_expert() == sum(r * k * 3 // 4 + r * (k // 16) * 4 for r, k in zip(rows, (H, I)))


def test_what_the_kernel_cannot_take_is_left_to_the_torch_path(monkeypatch):
    w13, w2 = make_stack("int4", 2, 2 * I, H, seed=6), make_stack("int4", 2, H, I, seed=7)
    odd = tuple(t[..., :40] if t.dtype == torch.uint8 else t[..., :5] for t in w13)  # group 8: not packable
    assert moe_kernel.pack_group_experts(odd, w2, 2, 0) is None
    one = tuple(t if t.dtype == torch.uint8 else t[..., :1] for t in w13)  # a group of 256: the largest
    assert moe_kernel.pack_group_experts(one, w2, 2, 0) is not None
    from tpserve.models.group_quant import group_packable
    assert not group_packable(1024, 512)  # beyond the kernels' groups
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    assert moe_kernel.pack_group_experts(w13, w2, 2, 0) is None


def test_an_avx2_build_runs_the_group_experts():
    """The same checks on the operators built for an AVX2-only CPU (vpmaddubsw group kernels)."""
    run_on_an_avx2_build("test_moe_group_kernel", "check_group_experts")
