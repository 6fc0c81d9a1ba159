"""RMSNorm with an optional fused residual add.

Decoder layers keep the residual stream separate from the normalised activations:
``norm(x, residual)`` first forms ``x + residual`` (the new residual) and normalises that, which
saves a separate add and keeps the un-normalised stream in one tensor passed layer to layer.
Numerics follow Hugging Face's Llama/Qwen RMSNorm: statistics in float32, the result cast back to
the input dtype before scaling by the weight. On CPU the C++ operator (``rms_norm`` of
``tpserve/kernels/csrc/cpu_ops.cpp``) computes the same in one pass, rounding where torch does.
"""
from __future__ import annotations

import torch
from torch import nn

from tpserve.kernels import cpu_extension
from tpserve.models.weights import new_param


def _cpu_norm(op, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """A C++ norm operator's call (``rms_norm`` or ``gemma_rms_norm``: the same arguments) with
    the outputs it writes: ``norm(x)``, or ``(norm(x + residual), x + residual)``."""
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        op(out, x, None, None, weight, eps)
        return out
    new_residual = torch.empty(x.shape, dtype=x.dtype)
    op(out, x, residual.contiguous(), new_residual, weight, eps)
    return out, new_residual


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (replicated weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when residual is given."""
        ops = cpu_extension.ops_for(x)
        if ops is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            # One pass in C++ (add, statistics, scale) instead of ~8 torch ops.
            return _cpu_norm(ops.rms_norm, x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class Fp32ScaleRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: the weight scales the float32 statistics' result and the product is cast
    to the input dtype once (transformers keeps these weights in float32; a bf16 checkpoint's
    values are the same). Same ``forward(x, residual=None)`` contract as :class:`RMSNorm`, in
    torch only (the C++ operator rounds before scaling)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when residual is given."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and cast to the
    input dtype once at the end (transformers' Gemma2/Gemma3 numerics; the checkpoint's weight is
    the offset from 1). Same ``forward(x, residual=None)`` contract as :class:`RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size)
        with torch.no_grad():
            self.weight.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when residual is given."""
        ops = cpu_extension.ops_for(x)
        if ops is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            # One pass in C++ (gemma_ops.cpp) instead of ~8 torch ops and their fp32 temporaries.
            return _cpu_norm(ops.gemma_rms_norm, x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
