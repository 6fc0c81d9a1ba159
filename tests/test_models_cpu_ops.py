"""The model layers' C++ CPU paths (RMSNorm + residual, Gemma's RMSNorm, rotary, SiLU- and
GELU-tanh-and-mul) against their plain-torch code, which is the reference (it matches Hugging
Face's numerics)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels import cpu_extension
from tpserve.models.activation import GeluTanhAndMul, SiluAndMul
from tpserve.models.norm import GemmaRMSNorm, RMSNorm
from tpserve.models.rotary import RotaryEmbedding, _rotate

# The install builds the C++ operators (make install); a machine where that build failed
# fails these tests rather than skipping them: the fallback has tests of its own.

# fp32: summation order differs (a few ulps); bf16/fp16: at most one rounding step apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOL)


def _torch_only(monkeypatch):
    monkeypatch.setattr(cpu_extension, "ops_for", lambda t: None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    res_before = res.clone()
    out = norm(x)
    fused, fused_res = norm(x, res)
    assert torch.equal(res, res_before)  # the caller's residual is not modified
    _torch_only(monkeypatch)
    torch.testing.assert_close(out, norm(x), **TOL[dtype])
    ref, ref_res = norm(x, res)
    assert torch.equal(fused_res, ref_res)  # one rounded add: identical bits
    torch.testing.assert_close(fused, ref, **TOL[dtype])


def test_rms_norm_of_strided_heads(monkeypatch):
    """q/k norm runs on head views sliced out of the fused QKV output (non-contiguous rows)."""
    norm = RMSNorm(16)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16)
    q = qkv[:, :64].view(5, 4, 16)
    assert not q.is_contiguous()
    fused = norm(q)
    _torch_only(monkeypatch)
    torch.testing.assert_close(fused, norm(q), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, monkeypatch):
    x = (torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    fused = SiluAndMul()(x)
    assert fused.shape == (6, 40)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 20])  # the vector rows and the scalar ones
def test_gemma_rms_norm_with_and_without_residual(dtype, hidden, monkeypatch):
    g = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))  # the offset from 1, of either sign
    norm = norm.to(dtype)
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(7, hidden, generator=g).to(dtype)
    res_before = res.clone()
    out = norm(x)
    fused, fused_res = norm(x, res)
    assert torch.equal(res, res_before)
    _torch_only(monkeypatch)
    ref = norm(x)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    ref_fused, ref_res = norm(x, res)
    assert torch.equal(fused_res, ref_res)
    torch.testing.assert_close(fused, ref_fused, **TOL[dtype])
    if dtype == torch.bfloat16:  # fp32 scaling rounded once, unlike RMSNorm's two roundings
        assert (out.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7


def test_gemma_rms_norm_of_strided_heads(monkeypatch):
    """Gemma 3's q/k norms run on head views of the fused QKV output."""
    norm = GemmaRMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_()
    qkv = torch.randn(5, 4 * 32 + 2 * 32)
    k = qkv[:, 128:160].view(5, 1, 32)
    q = qkv[:, :128].view(5, 4, 32)
    fused_q, fused_k = norm(q), norm(k)
    _torch_only(monkeypatch)
    torch.testing.assert_close(fused_q, norm(q), **TOL[torch.float32])
    torch.testing.assert_close(fused_k, norm(k), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    """Gemma's MLP activation over inputs from deep negative to large positive (tanh's tails)."""
    x = (torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(4)) * 6).to(dtype)
    x[0, :40] = torch.linspace(-30, 30, 40).to(dtype)
    fused = GeluTanhAndMul()(x)
    assert fused.shape == (6, 40)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused, F.gelu(gate, approximate="tanh") * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_torch(dtype):
    rope = RotaryEmbedding(32, max_position=300, base=10_000.0)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, (4 + 2 + 2) * 32, generator=g).to(dtype)
    q = qkv[:, :128].view(9, 4, 32)  # strided views, as the attention layer passes them
    k = qkv[:, 128:192].view(9, 2, 32)
    positions = torch.tensor([0, 1, 2, 150, 151, 299, 7, 8, 9], dtype=torch.int32)
    cos = rope.cos[positions.long()].unsqueeze(1).to(dtype)
    sin = rope.sin[positions.long()].unsqueeze(1).to(dtype)
    q_ref, k_ref = _rotate(q, cos, sin), _rotate(k, cos, sin)
    q_out, k_out = rope(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


def test_bad_arguments_raise_value_errors():
    ops = cpu_extension.ops()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight: expected a contiguous \\[hidden\\]"):
        ops.rms_norm(torch.empty(4, 8), x, None, None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual_out: given exactly when residual is"):
        ops.rms_norm(torch.empty(4, 8), x, x, None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x: expected \\[N, 2I\\]"):
        ops.silu_and_mul(torch.empty(4, 3), torch.randn(4, 7))
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos = torch.ones(10, 4)
    with pytest.raises(ValueError, match="positions: outside \\[0, max_position\\)"):
        ops.rotary_embedding(torch.tensor([0, 10]), q, k, cos, cos)
    with pytest.raises(ValueError, match="x: expected float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.empty(4, 4, dtype=torch.float64), torch.randn(4, 8).double())
