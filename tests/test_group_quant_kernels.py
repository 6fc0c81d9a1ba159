"""The C++ group-quantized linear kernels (tpserve/kernels/csrc/quant_ops.cpp) against the
plain-torch reference of their arithmetic (``group_quant.w4a8_reference``: activations
quantized to int8 per row and group the same way, exact integer dots, fp32/fp64 sums): 4- and
8-bit codes, groups 16/32/128, fp16 and fp32 scales, odd shapes, 1..64 rows, fp32 and bf16,
with and without bias; symmetric weights (mins = -c * scales, as GGUF's Q4_0 / Q6_K / Q8_0: no
mins read, the offset subtracted from the integer dots); rows independent of the call's row count;
int8 sub-scales of an fp32 scale per 16 groups (GGUF's Q6_K: d * sc) bit for bit as their fp32
products; on this machine's ISA path and on an AVX2-only build (``TPSERVE_CPU_ARCH=haswell``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.models.group_quant import (GROUP4, GROUP8, PackedWeight, code_bits, dequantize, is_symmetric,
                                        pack_group_weight, packed_groups, packed_rows, packed_rows_reference,
                                        quantize_groups, sub_scales, symmetric_offset, w4a8_reference)

CASES = [  # (N, K, group, bits): bits 5 and 6 are held in 6 bits (GROUP8)
    (67, 160, 32, 4), (64, 256, 128, 4), (130, 384, 128, 8), (33, 96, 32, 8), (5, 48, 16, 4),
    (48, 128, 32, 6), (70, 96, 16, 5),
]
ROWS = (1, 2, 3, 5, 17, 64)
SYM_CASES = [  # (N, K, group, bits, offset, fp16 scales): Q4_0, Q6_K, Q8_0, Q5_0-like, no mins
    (67, 160, 32, 4, 8, True), (40, 96, 16, 6, 32, False), (33, 64, 32, 8, 128, True),
    (70, 64, 32, 5, 16, True), (20, 64, 32, 4, 0, True), (9, 48, 16, 8, 32, False),
]


def check_rows(packed, codes, scales, mins) -> None:
    """The C++ row read-back (quant_rows.cpp) equals the torch one and the weight's own rows."""
    n = codes.shape[0]
    ids = torch.tensor([0, n - 1, n // 2, 0, min(n - 1, 33)])
    got = packed_rows(packed, ids)
    for a, b, ref in zip(got, packed_rows_reference(packed, ids), (codes, scales, mins)):
        assert torch.equal(a, b) and torch.equal(a, ref[ids])


def _symmetric_weights(n, k, g, bits, offset, fp16, seed):
    """Codes of ``bits`` (every value up to 2**bits - 1), scales of either sign (some zero), mins =
    -offset * scales: GGUF's symmetric blocks."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    scales = torch.randn(n, k // g) * 0.02
    scales[0, 0] = 0.0
    scales = scales.half().float() if fp16 else scales * 1.0001
    return codes, scales, -float(offset) * scales


def check_symmetric_kernels() -> None:
    for n, k, g, bits, offset, fp16 in SYM_CASES:
        codes, scales, mins = _symmetric_weights(n, k, g, bits, offset, fp16, seed=n + k)
        packed = pack_group_weight(codes, scales, mins)
        assert packed.kind == (GROUP4 if bits == 4 else GROUP8) and is_symmetric(packed)
        assert code_bits(packed) == {4: 4, 5: 6, 6: 6, 8: 8}[bits]
        assert packed.colsum.tolist() == [offset]
        assert packed.scales.dtype == (torch.float16 if fp16 else torch.float32)
        check_rows(packed, codes, scales, mins)
        for x, bias in _row_inputs(n, k, g):
            got = packed.matmul(x, bias)
            err = _relative_error(got, w4a8_reference(x, codes, scales, mins, bias), x.dtype)
            assert err is None, f"symmetric N={n} K={k} g={g} bits={bits} c={offset} rows={len(x)} " \
                                f"{x.dtype}: {err}"


SUB_CASES = [  # (N, K, group, bits, offset): Q6_K (6-bit codes, group 16), and others of that form
    (70, 256, 16, 6, 32), (64, 512, 16, 6, 32), (33, 512, 32, 4, 8), (20, 256, 16, 8, 128),
]


def _sub_scale_weights(n, k, g, bits, offset, seed):
    """Q6_K-like scales: per run of 16 groups an fp16 d of either sign times int8 sub-scales
    (one of them -128, as llama.cpp's quantizer writes; a run of zeros too)."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    runs = k // g // 16
    d = (torch.randn(n, runs) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (n, runs, 16)).float()
    sc[..., 3] = -128
    sc[0, 0] = 0
    scales = (d[..., None] * sc).reshape(n, k // g)
    return codes, scales, -float(offset) * scales


def _fp32_scales_pack(packed, scales):
    """``packed`` with its scales held as plain fp32 ``[N/P][G][P]`` instead."""
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    n, groups = scales.shape
    n_pad = -(-n // panel) * panel
    padded = torch.cat([scales, scales.new_zeros(n_pad - n, groups)])
    flat = padded.view(n_pad // panel, panel, groups).permute(0, 2, 1).contiguous().view(-1)
    return PackedWeight(data=packed.data, kind=packed.kind, n=packed.n, k=packed.k, scales=flat,
                        colsum=packed.colsum)


def _row_inputs(n: int, k: int, g: int):
    """(x, bias) for every row count of ROWS in fp32 and bf16: the first row's first group all
    zero, a bias on odd row counts."""
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, k) * 2).to(dtype)
            x[0, :g] = 0
            yield x, (torch.randn(n).to(dtype) if rows % 2 else None)


def _relative_error(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The largest error relative to the largest reference value when past the dtype's tolerance,
    else None."""
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    return err if err >= (1e-4 if dtype == torch.float32 else 1e-2) else None


def check_sub_scale_kernels() -> None:
    for n, k, g, bits, offset in SUB_CASES:
        codes, scales, mins = _sub_scale_weights(n, k, g, bits, offset, seed=n + k)
        packed = pack_group_weight(codes, scales, mins)
        assert packed.scales.dtype == torch.int8 and is_symmetric(packed)
        assert packed_groups(packed) == k // g
        check_rows(packed, codes, scales, mins)
        plain = _fp32_scales_pack(packed, scales)
        for x, bias in _row_inputs(n, k, g):
            got = packed.matmul(x, bias)
            assert torch.equal(got, plain.matmul(x, bias)), f"sub-scales N={n} K={k} rows={len(x)} {x.dtype}"
            err = _relative_error(got, w4a8_reference(x, codes, scales, mins, bias), x.dtype)
            assert err is None, f"sub-scales N={n} K={k} g={g} rows={len(x)} {x.dtype}: {err}"


def _weights(n, k, g, bits, seed):
    torch.manual_seed(seed)
    w = torch.randn(n, k)
    codes, scales, mins = quantize_groups(w, g, bits)
    if bits == 8:  # the whole byte range, and codes above 127 (signedness mistakes show)
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    return codes, scales, mins


def check_kernels() -> None:
    """Every case against the reference; raises AssertionError with the case on a mismatch."""
    for n, k, g, bits in CASES:
        codes, scales, mins = _weights(n, k, g, bits, seed=n + k)
        if n % 2:  # scales that are not fp16 values: the kernels read fp32 ones
            scales = scales * 1.0001
        packed = pack_group_weight(codes, scales, mins)
        assert packed.kind == (GROUP4 if bits == 4 else GROUP8), (packed.kind, bits)
        assert code_bits(packed) == {4: 4, 5: 6, 6: 6, 8: 8}[bits]
        assert packed.scales.dtype == (torch.float32 if n % 2 else torch.float16)
        check_rows(packed, codes, scales, mins)
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, k) * 2).to(dtype)
                x[0, :g] = 0  # a zero group: scale 1, all codes 0
                bias = torch.randn(n).to(dtype) if rows % 2 else None
                got = packed.matmul(x, bias)
                want = w4a8_reference(x, codes, scales, mins, bias)
                assert got.dtype == dtype and got.shape == (rows, n)
                tol = 1e-4 if dtype == torch.float32 else 1e-2
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                assert err < tol, f"N={n} K={k} g={g} bits={bits} rows={rows} {dtype}: {err}"
        # the reference itself is close to the float matmul of the dequantized weight
        x = torch.randn(3, k)
        dense = x @ dequantize(codes, scales, mins).T
        err = (w4a8_reference(x, codes, scales, mins) - dense).abs().max() / dense.abs().max()
        assert err.item() < 0.05
    check_symmetric_kernels()
    check_sub_scale_kernels()


def test_kernels_match_the_reference():
    assert cpu_extension.available()
    flags = cpu_extension._cpu_flags()
    want = 2 if "avx512_vnni" in flags and "avx512bw" in flags else 1 if "avx2" in flags else 0
    assert torch.ops.tpserve_cpu.group_linear_path() == want
    check_kernels()


def test_strided_rows_and_the_linear_op_checks():
    assert cpu_extension.available()
    codes, scales, mins = _weights(40, 64, 32, 4, seed=1)
    packed = pack_group_weight(codes, scales, mins)
    x = torch.randn(4, 100)[:, 10:74]  # rows 100 apart
    torch.testing.assert_close(packed.matmul(x, None), packed.matmul(x.contiguous(), None))
    out = torch.empty(4, 40)
    with pytest.raises(ValueError, match="packed codes"):
        torch.ops.tpserve_cpu.linear(out, x.contiguous(), packed.data[:-1], packed.kind, 40, packed.scales,
                                     packed.colsum, None)
    with pytest.raises(ValueError, match="mins"):
        torch.ops.tpserve_cpu.linear(out, x.contiguous(), packed.data, packed.kind, 40, packed.scales,
                                     None, None)


def test_symmetric_offsets_are_found_exactly():
    scales = torch.rand(6, 4).half().float() + 0.01
    assert symmetric_offset(scales, -8 * scales) == 8
    assert symmetric_offset(scales, -128 * scales) == 128
    assert symmetric_offset(scales, torch.zeros_like(scales)) == 0
    assert symmetric_offset(torch.zeros_like(scales), torch.zeros_like(scales)) == 0
    mins = -8 * scales
    mins[5, 3] = mins[5, 3] * 1.5  # one group with a min of its own: asymmetric
    assert symmetric_offset(scales, mins) is None
    assert symmetric_offset(scales, -7.5 * scales) is None  # not an integer
    assert symmetric_offset(scales, -256 * scales) is None  # beyond the kernels' offsets
    assert symmetric_offset(scales, 8 * scales) is None  # negative
    assert symmetric_offset(torch.zeros_like(scales), torch.ones_like(scales)) is None


def test_symmetric_packs_read_back_and_refuse_bad_offsets():
    assert cpu_extension.available()
    codes, scales, mins = _symmetric_weights(70, 96, 32, 4, 8, True, seed=3)
    packed = pack_group_weight(codes, scales, mins)
    # q4_0 at group 32: 16 bytes of codes and 2 of scale per group and channel, no mins
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    n_pad = -(-70 // panel) * panel
    assert packed.data.nbytes + packed.scales.nbytes + packed.colsum.nbytes == n_pad * 3 * 18 + 4
    ids = torch.tensor([0, 5, 64, 69])
    got = packed_rows(packed, ids)
    for g, ref in zip(got, (codes, scales, mins)):
        assert torch.equal(g, ref[ids])
    x = torch.randn(2, 96)
    out = torch.empty(2, 70)
    for bad in (-1, 256):
        with pytest.raises(ValueError, match="offset"):
            torch.ops.tpserve_cpu.linear(out, x, packed.data, packed.kind, 70, packed.scales,
                                         torch.tensor([bad], dtype=torch.int32), None)


def test_huge_page_gathering_moves_scales_and_mins_too():
    """prepack_model's arena holds each weight's codes, then its scales and mins (or offset),
    each 64-byte aligned, and the products do not move."""
    from tpserve.models.packed_gemm import _gather_in_huge_pages

    assert cpu_extension.available()
    packs = [pack_group_weight(*quantize_groups(torch.randn(70, 96), 32, 4)),
             pack_group_weight(*_symmetric_weights(33, 64, 32, 8, 128, True, seed=2))]
    x = torch.randn(3, 96), torch.randn(3, 64)

    def products():
        out = []
        for p, xi in zip(packs, x):
            o = torch.empty(3, p.n)
            torch.ops.tpserve_cpu.linear(o, xi, p.data, p.kind, p.n, p.scales, p.colsum, None)
            out.append(o)
        return out

    before = products()
    _gather_in_huge_pages(packs)
    storage = packs[0].data.untyped_storage().data_ptr()
    for p in packs:
        for t in (p.data, p.scales, p.colsum):
            assert t.untyped_storage().data_ptr() == storage and t.data_ptr() % 64 == 0
    assert packs[1].colsum.numel() == 1 and int(packs[1].colsum) == 128  # the offset, kept
    assert all(torch.equal(a, b) for a, b in zip(before, products()))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits,group", [(4, 16), (4, 32), (4, 128), (8, 32), (8, 64), (6, 16)])
def test_many_rows_equal_one_row_at_a_time(symmetric, bits, group):
    """From 16 rows 4- and 8-bit codes run on the AMX tiles where the CPU has them (quant_ops.cpp):
    the same exact group dots and the same fold, so each row of a 40-row call equals that row
    alone (the vector path) bit for bit, fp32 and bf16, with a bias; 6-bit codes stay on the
    vector path."""
    assert cpu_extension.available()
    k = 384
    if symmetric:
        offset = {4: 8, 6: 32, 8: 128}[bits]
        codes, scales, mins = _symmetric_weights(130, k, group, bits, offset, True, seed=5)
    else:
        codes, scales, mins = _weights(130, k, group, bits, seed=5)
    packed = pack_group_weight(codes, scales, mins)
    assert is_symmetric(packed) == symmetric and code_bits(packed) == bits
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(40, k).to(dtype)
        bias = torch.randn(130).to(dtype)
        full = packed.matmul(x, bias)
        assert torch.equal(packed.matmul(x[:17], bias), full[:17])
        for m in (0, 15, 16, 31, 39):
            assert torch.equal(packed.matmul(x[m:m + 1], bias), full[m:m + 1]), (m, dtype)


@pytest.mark.parametrize("symmetric", [False, True])
def test_rows_do_not_depend_on_the_calls_row_count(symmetric):
    """Each row of an M-row call equals, bit for bit, that row alone (every tile size, bf16)."""
    assert cpu_extension.available()
    if symmetric:
        codes, scales, mins = _symmetric_weights(130, 256, 32, 4, 8, True, seed=7)
    else:
        codes, scales, mins = _weights(130, 256, 32, 4, seed=7)
    packed = pack_group_weight(codes, scales, mins)
    assert is_symmetric(packed) == symmetric
    x = torch.randn(11, 256).bfloat16()
    full = packed.matmul(x, None)
    for m in range(11):
        assert torch.equal(packed.matmul(x[m:m + 1], None), full[m:m + 1]), m
    assert torch.equal(packed.matmul(x[3:8], None), full[3:8])


AVX2_CHECK = r"""
import sys
import torch
from tpserve.kernels import cpu_extension
assert cpu_extension.available(), cpu_extension._state.get("error")
assert torch.ops.tpserve_cpu.group_linear_path() == 1
sys.path.insert(0, TESTS_DIR)
from test_group_quant_kernels import (check_kernels, test_many_rows_equal_one_row_at_a_time,
                                      test_rows_do_not_depend_on_the_calls_row_count)
check_kernels()
for symmetric in (False, True):
    test_rows_do_not_depend_on_the_calls_row_count(symmetric)
    for bits, group in ((4, 128), (6, 16), (6, 32)):
        test_many_rows_equal_one_row_at_a_time(symmetric, bits, group)
print("ok")
"""


def test_an_avx2_build_runs_the_kernels():
    """The AVX2 path (vpmaddubsw; 8-float vectors, panels of 32) on the operators built for an
    AVX2-only CPU (runs on any x86-64 CPU with AVX2; the build test_kernels_cpu's AVX2 test uses):
    against the reference, and each row of a call equal to that row alone (tiles of 4, 2 and 1
    rows of 4- and 6-bit codes)."""
    env = dict(os.environ, TPSERVE_CPU_ARCH="haswell")
    check = AVX2_CHECK.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_sub_scales_factor_exactly_or_not_at_all():
    _, scales, _ = _sub_scale_weights(9, 512, 16, 6, 32, seed=4)
    sub, top = sub_scales(scales)
    assert sub.dtype == torch.int8 and top.dtype == torch.float32 and top.shape == (9, 2)
    assert torch.equal(sub.float() * top.repeat_interleave(16, dim=1), scales)
    assert torch.equal(top[0, 0], torch.tensor(0.0)) and not sub[0, :16].any()  # the zero run
    assert sub_scales(scales[:, :24]) is None  # not a whole number of runs of 16 groups
    assert sub_scales(scales * 1.0001) is None  # no longer int8 multiples of one value
    ratio = torch.rand(4, 16) + 0.5  # any 16 fp32 values: not int8 multiples of +-amax/128 or /127
    assert sub_scales(ratio) is None


def test_sub_scale_packs_are_smaller_and_read_back_exactly():
    """Q6_K's form: 1.25 bytes of scales per group and channel instead of 4; the rows an embedding
    gathers from a tied head's pack dequantize to the table's rows bit for bit."""
    assert cpu_extension.available()
    codes, scales, mins = _sub_scale_weights(70, 256, 16, 6, 32, seed=5)
    packed = pack_group_weight(codes, scales, mins)
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    n_pad = -(-70 // panel) * panel
    assert packed.scales.nbytes == n_pad * 16 * 5 // 4
    assert packed.data.nbytes == n_pad * 256 * 3 // 4  # 6-bit codes
    ids = torch.tensor([0, 1, 5, 63, 64, 69, 5])
    got = packed_rows(packed, ids)
    for g, ref in zip(got, (codes, scales, mins)):
        assert torch.equal(g, ref[ids])
    assert torch.equal(dequantize(*got), dequantize(codes, scales, mins)[ids])
    x = torch.randn(2, 256)
    out = torch.empty(2, 70)
    with pytest.raises(ValueError, match="sub-scales"):  # int8 sub-scales with mins of their own
        torch.ops.tpserve_cpu.linear(out, x, packed.data, packed.kind, 70, packed.scales,
                                     torch.zeros(n_pad * 16), None)


def test_row_read_back_refuses_bad_ids():
    assert cpu_extension.available()
    codes, scales, mins = _weights(40, 64, 32, 4, seed=2)
    packed = pack_group_weight(codes, scales, mins)
    for bad in (40, -1):
        with pytest.raises(ValueError, match="outside"):
            packed_rows(packed, torch.tensor([0, bad]))
    empty = packed_rows(packed, torch.tensor([], dtype=torch.int64))
    assert [tuple(t.shape) for t in empty] == [(0, 64), (0, 2), (0, 2)]
