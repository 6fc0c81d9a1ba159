"""RMSNorm with an optional fused residual add.

Decoder layers keep the residual stream separate from the normalised activations:
``norm(x, residual)`` first forms ``x + residual`` (the new residual) and normalises that, which
saves a separate add and keeps the un-normalised stream in one tensor passed layer to layer.
Numerics follow Hugging Face's Llama/Qwen RMSNorm: statistics in float32, the result cast back to
the input dtype before scaling by the weight.
"""
from __future__ import annotations

import torch
from torch import nn

from tpserve.models.weights import new_param


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
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
