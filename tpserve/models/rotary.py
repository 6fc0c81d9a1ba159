"""Rotary position embedding, "neox" layout (as in Hugging Face Llama / Qwen2 / Qwen3).

The head dimension is split into halves ``(x1, x2)`` rotated pairwise by angle
``position * inv_freq[i]``. cos/sin are precomputed in float32 for positions
``[0, max_position)`` and cast to the activations' dtype when applied, as Hugging Face does.

Supported ``rope_type``: "default" (plain ``rope_theta``), "linear" (positions divided by
``factor``) and "llama3" (Llama 3.1 frequency-dependent scaling: ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.kernels import cpu_extension
from tpserve.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _require(scaling: dict, key: str, rope_type: str):
    if key not in scaling:
        raise UnsupportedModelError("rope_scaling", f"rope_type {rope_type!r} needs {key!r}; got keys {sorted(scaling)}")
    return scaling[key]


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32) for ``rope_theta=base`` and a scaling dict."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(_require(scaling, "factor", rope_type))
    if rope_type == "llama3":
        factor = float(_require(scaling, "factor", rope_type))
        low = float(_require(scaling, "low_freq_factor", rope_type))
        high = float(_require(scaling, "high_freq_factor", rope_type))
        old_len = float(_require(scaling, "original_max_position_embeddings", rope_type))
        # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept;
        # the band in between interpolates smoothly between the two.
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(
        "rope_scaling.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to flat query/key rows given their absolute positions."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :]
        # Not persistent: derived from config, never part of a checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``q [T, Hq, D]``, ``k [T, Hk, D]`` -> rotated ``(q, k)``.

        On CPU (the C++ operator) q and k are rotated in place and returned; callers must use
        the returned tensors and not rely on the inputs keeping their values.
        """
        ops = cpu_extension.ops_for(q)
        if (ops is not None and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1
                and k.stride(2) == 1 and k.dtype == q.dtype):
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
