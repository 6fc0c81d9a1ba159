"""Packed linear layers on CPU (tpserve's kernels, every weight kind): what gets packed, that the
results equal the dense math (fp32 within rounding, bf16 within its precision, int8 the exact
integer math), and that a row's result does not depend on the rows that share its call."""
from __future__ import annotations

import pytest
import torch

from model_factory import make_tiny_model
from tpserve.models import packed_gemm
from tpserve.models.linear import ColumnParallelLinear, RowParallelLinear
from tpserve.models.packed_gemm import BFLOAT16, FLOAT32, INT8, INT8_DYNAMIC
from tpserve.models.parallel import TPContext

# (rows, out, in): one row, a partial panel of outputs, more rows than a work item's block.
SHAPES = ((1, 64, 64), (3, 100, 72), (7, 385, 128), (70, 130, 256))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, kind: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The math each kind promises, in float64 (before the output's rounding)."""
    xd = x.double()
    if kind == INT8_DYNAMIC:
        xs = xd.abs().amax(1).clamp(min=1e-30) / 127
        xd = torch.round(xd / xs[:, None]).clamp(-127, 127) * xs[:, None]
    wd = w.double() * (scale.double()[:, None] if scale is not None else 1)
    out = xd @ wd.t()
    return out + bias.double() if bias is not None else out


def check_linear_kinds() -> None:
    """Every kind against ``reference``, bias or not, fp32 and bf16 activations (also run on
    an AVX2 build of the operators, tests/test_kernels_cpu.py)."""
    torch.manual_seed(0)
    for kind, dtype in ((FLOAT32, torch.float32), (BFLOAT16, torch.bfloat16), (INT8, torch.float32),
                        (INT8, torch.bfloat16), (INT8_DYNAMIC, torch.float32),
                        (INT8_DYNAMIC, torch.bfloat16)):
        for m, n, k in SHAPES:
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            w = torch.randn(n, k)
            if kind in (INT8, INT8_DYNAMIC):
                q, scale = packed_gemm.quantize_int8(w)
                packed, ref = packed_gemm.pack_weight(q, kind, scale), reference(x, q, bias, kind, scale)
            else:
                w = w.to(dtype)
                packed, ref = packed_gemm.pack_weight(w, kind), reference(x, w, bias, kind)
            out = packed.matmul(x, bias)
            assert out.dtype == dtype and out.shape == (m, n)
            tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, (kind, dtype, m, n, k, err)


def test_every_kind_computes_the_dense_math():
    check_linear_kinds()


@pytest.mark.parametrize("kind", [FLOAT32, BFLOAT16, INT8, INT8_DYNAMIC])
def test_a_row_does_not_depend_on_the_rows_beside_it(kind):
    torch.manual_seed(1)
    dtype = torch.float32 if kind == FLOAT32 else torch.bfloat16
    w = torch.randn(200, 128)
    if kind in (INT8, INT8_DYNAMIC):
        q, scale = packed_gemm.quantize_int8(w)
        packed = packed_gemm.pack_weight(q, kind, scale)
    else:
        packed = packed_gemm.pack_weight(w.to(dtype), kind)
    x = torch.randn(75, 128).to(dtype)
    together = packed.matmul(x, None)
    for i in (0, 3, 70, 74):
        assert torch.equal(packed.matmul(x[i:i + 1], None), together[i:i + 1])
        assert torch.equal(packed.matmul(x[i:], None), together[i:])


@pytest.mark.parametrize("kind", [BFLOAT16, INT8_DYNAMIC])
def test_rows_past_a_chunk_do_not_depend_on_the_chunks(kind):
    """A call's rows are computed in chunks of 512 (every panel passes one chunk before the next):
    a row's bits are those it gets alone or in any other call."""
    torch.manual_seed(4)
    w = torch.randn(96, 64)
    if kind == INT8_DYNAMIC:
        q, scale = packed_gemm.quantize_int8(w)
        packed = packed_gemm.pack_weight(q, kind, scale)
    else:
        packed = packed_gemm.pack_weight(w.bfloat16(), kind)
    x = torch.randn(1100, 64).bfloat16()
    together = packed.matmul(x, None)
    for i in (0, 511, 512, 700, 1023, 1024, 1099):
        assert torch.equal(packed.matmul(x[i:i + 1], None), together[i:i + 1]), i
    assert torch.equal(packed.matmul(x[300:900], None), together[300:900])


def test_bf16_rows_across_tile_boundaries():
    """bf16 weights with K a multiple of 32 run on the AMX tile unit where the CPU has it (tiles
    of 16 rows, two at a time): every row count around those sizes, rows read in place from a
    strided view, equals the dense math and the same rows computed together."""
    torch.manual_seed(2)
    w = torch.randn(130, 96).bfloat16()
    bias = torch.randn(130).bfloat16()
    packed = packed_gemm.pack_weight(w, BFLOAT16)
    x = torch.randn(70, 160).bfloat16()[:, 32:128]  # rows 160 elements apart
    together = packed.matmul(x, bias)
    for m in (1, 15, 16, 17, 31, 32, 33, 48, 65, 70):
        out = packed.matmul(x[:m], bias)
        ref = reference(x[:m], w, bias, BFLOAT16)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3, m
        assert torch.equal(out, together[:m]), m
        assert torch.equal(packed.matmul(x[70 - m:], bias), together[70 - m:]), m


@pytest.mark.parametrize("kind", [BFLOAT16, INT8_DYNAMIC])
def test_long_rows_in_ranges_of_input_features(kind):
    """On the tile unit an item's blocks of rows take the input features in ranges (8 tile steps:
    256 bf16 or 512 int8 features), their sums kept between ranges: K of 2 ranges and a part,
    every row count around the blocks, against the dense math and the rows computed together."""
    torch.manual_seed(5)
    k = 2 * 8 * (32 if kind == BFLOAT16 else 64) + 3 * 64
    w = torch.randn(70, k)
    if kind == INT8_DYNAMIC:
        q, scale = packed_gemm.quantize_int8(w)
        packed = packed_gemm.pack_weight(q, kind, scale)
        w_ref = q.float() * scale.reshape(-1, 1)
    else:
        packed = packed_gemm.pack_weight(w.bfloat16(), kind)
        w_ref = w.bfloat16().float()
    x = torch.randn(150, k).bfloat16()
    together = packed.matmul(x, None)
    for m in (1, 9, 16, 17, 33, 64, 65, 130, 150):
        out = packed.matmul(x[:m], None)
        ref = x[:m].double() @ w_ref.double().T
        tol = 8e-3 if kind == BFLOAT16 else 3e-2  # int8: the activations' quantization
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tol, m
        assert torch.equal(out, together[:m]), m
        assert torch.equal(packed.matmul(x[150 - m:], None), together[150 - m:]), m


AMX_CHECK = r"""
import sys
import torch
from tpserve.kernels import cpu_extension
from tpserve.models import packed_gemm
assert cpu_extension.available()
torch.manual_seed(3)
out = {"amx": torch.ops.tpserve_cpu.linear_amx()}
for n, k in ((130, 192), (64, 64), (100, 96)):
    w, b = torch.randn(n, k), torch.randn(n)
    q, scale = packed_gemm.quantize_int8(w)
    for m in (1, 7, 8, 17, 33, 70):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            out["int8", n, k, m, str(dtype)] = packed_gemm.pack_weight(
                q, packed_gemm.INT8_DYNAMIC, scale).matmul(x, b.to(dtype))
        out["bf16", n, k, m] = packed_gemm.pack_weight(w.bfloat16(), packed_gemm.BFLOAT16).matmul(
            x.bfloat16(), b.bfloat16())
torch.save(out, sys.argv[1])
"""


def test_tile_and_vector_kernels_agree(tmp_path):
    """Where the CPU has AMX, bf16 and int8 weights run on its tiles (TPSERVE_AMX=0: the vector
    kernels): int8's exact sums give the same bits either way, bf16 agrees within rounding."""
    import os
    import subprocess
    import sys
    runs = {}
    for amx in ("1", "0"):
        path = tmp_path / f"amx{amx}.pt"
        proc = subprocess.run([sys.executable, "-c", AMX_CHECK, str(path)], capture_output=True, text=True,
                              env=dict(os.environ, TPSERVE_AMX=amx), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[amx] = torch.load(path)
    assert runs["0"].pop("amx") is False
    runs["1"].pop("amx")
    assert runs["1"].keys() == runs["0"].keys()
    for key, tiles in runs["1"].items():
        vector = runs["0"][key]
        if key[0] == "int8":
            assert torch.equal(tiles, vector), key
        else:
            err = ((tiles.float() - vector.float()).abs().max() / vector.float().abs().max()).item()
            assert err < 8e-3, key


def test_quantize_int8_is_symmetric_per_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.03]])
    q, scale = packed_gemm.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.abs().amax(1).tolist() == [127, 0, 127]
    assert scale.tolist() == pytest.approx([1 / 127, 1.0, 3 / 127])
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7


def _layers(dtype):
    torch.manual_seed(0)
    tp = TPContext()
    col = ColumnParallelLinear(48, 80, tp, bias=True).to(dtype)
    row = RowParallelLinear(80, 48, tp).to(dtype)
    with torch.no_grad():
        for p in (*col.parameters(), *row.parameters()):
            p.normal_(0, 0.1)
    return torch.nn.Sequential(col, row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_agree_with_f_linear(dtype):
    model = _layers(dtype)
    x = torch.randn(7, 48).to(dtype)
    want = model(x)
    assert packed_gemm.prepack_model(model) == 2
    assert model[0].weight.numel() == 0 and model[0].packed is not None  # dense copy freed
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for rows in (7, 1, 0):  # decode batches of any size, the empty batch included
        torch.testing.assert_close(model(x[:rows]), want[:rows], **tol)


def test_what_is_packed(monkeypatch):
    F32, B16 = torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.bfloat16)
    assert packed_gemm.packable(F32, FLOAT32) and packed_gemm.packable(B16, BFLOAT16)
    assert not packed_gemm.packable(torch.zeros(4, 3, dtype=torch.bfloat16), BFLOAT16)  # odd K
    assert not packed_gemm.packable(torch.zeros(4, 6, dtype=torch.int8), INT8_DYNAMIC)  # K % 4
    assert packed_gemm.packable(torch.zeros(4, 6, dtype=torch.int8), INT8)
    assert packed_gemm.float_kind(torch.float16) is None  # fp16 stays on F.linear
    assert not packed_gemm.packable(torch.zeros(4), FLOAT32)  # not a matrix
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    model = _layers(torch.bfloat16)
    assert packed_gemm.prepack_model(model) == 0 and model[0].packed is None
    assert model[0].weight.shape == (80, 48)


def test_a_shared_weight_stays_dense():
    model = _layers(torch.float32)
    model[1].weight = torch.nn.Parameter(torch.randn(48, 80), requires_grad=False)
    model[0].weight = torch.nn.Parameter(model[1].weight.data.t().contiguous(), requires_grad=False)
    shared = model[1].weight
    model.add_module("twin", RowParallelLinear(80, 48, TPContext()))
    model.twin.weight = shared  # the two layers share one parameter (a tied LM head)
    assert packed_gemm.prepack_model(model) == 3
    assert shared.shape == (48, 80)  # still dense: the other user reads it
    assert model[1].packed is not None and model.twin.packed is not None


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_model_generates_the_same_with_and_without_packing(tmp_path, monkeypatch, tie):
    """Packed kernels and F.linear sum in different orders: tokens agree, logprobs stay within
    bf16's precision."""
    from tpserve import LLM, SamplingParams
    path = make_tiny_model(tmp_path, tie_word_embeddings=tie)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 11, 3, 8], [7, 2]]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TPSERVE_PREPACK", flag)
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_gb=0.05)
        res = llm.generate(prompts, params)
        outs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
        llm.shutdown()
    for (tok0, lp0), (tok1, lp1) in zip(outs["0"], outs["1"]):
        assert tok0 == tok1
        for t, a, b in zip(tok0, lp0, lp1):
            assert abs(a[t].logprob - b[t].logprob) < 5e-2


def test_packed_weights_share_one_huge_page_buffer():
    model = _layers(torch.bfloat16)
    x = torch.randn(3, 48).bfloat16()
    want = model(x)
    assert packed_gemm.prepack_model(model) == 2
    a, b = model[0].packed.data, model[1].packed.data
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one buffer
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    torch.testing.assert_close(model(x), want, rtol=2e-2, atol=2e-2)
    buf = packed_gemm.huge_page_buffer(5 << 20)
    assert buf.numel() == 5 << 20 and buf.data_ptr() % (2 << 20) == 0
