"""Rotary position embedding, "neox" layout (as in Hugging Face Llama / Qwen2 / Qwen3).

The head dimension is split into halves ``(x1, x2)`` rotated pairwise by angle
``position * inv_freq[i]``. cos/sin are precomputed in float32 for positions
``[0, max_position)`` and cast to the activations' dtype when applied, as Hugging Face does.

Supported ``rope_type``: "default" (plain ``rope_theta``), "linear" (positions divided by
``factor``), "llama3" (Llama 3.1 frequency-dependent scaling: ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``) and "longrope" (Phi-3: per-frequency
``short_factor`` / ``long_factor`` divisors, cos/sin scaled by ``attention_factor``) and "yarn"
(YaRN, gpt-oss: frequencies between ``beta_fast`` and ``beta_slow`` rotations over
``original_max_position_embeddings`` blend linearly from kept to divided by ``factor``; the blend's
bounds are floored/ceiled when ``truncate`` (default true) and left fractional when false; cos/sin
scaled by ``attention_factor``, else ``0.1 ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim``
ratio).

LongRoPE rotates a token at position p with the short factors while p <
``original_max_position_embeddings`` and with the long ones from there on: the table's rows
switch at that position. That is transformers' Phi-3 forward fed one token at a time (its
factors follow the largest position of the pass) and keeps every cached key a function of its
position and prefix alone, so output does not depend on chunking, preemption or prefix-cache
hits. transformers' ``generate`` instead rotates a whole pass with the long factors once the
sequence is longer than that, and recomputes the cache with them when a sequence first crosses
it; beyond ``original_max_position_embeddings`` tokens the two differ. With a partial rotary
dimension (Phi's ``partial_rotary_factor``) only the first ``rotary_dim`` features of a head are
rotated; the rest pass through.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.kernels import cpu_extension
from tpserve.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def _require(scaling: dict, key: str, rope_type: str):
    if key not in scaling:
        raise UnsupportedModelError("rope_scaling", f"rope_type {rope_type!r} needs {key!r}; got keys {sorted(scaling)}")
    return scaling[key]


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32) for ``rope_theta=base`` and a scaling dict
    (``long``: LongRoPE's long factors instead of its short ones)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":
        key = "long_factor" if long else "short_factor"
        factors = _require(scaling, key, rope_type)
        if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
            raise UnsupportedModelError(f"rope_scaling.{key}", f"must be a list of rotary_dim / 2 = "
                                                               f"{rotary_dim // 2} numbers")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
    inv_freq = 1.0 / (base ** exponents)
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
    if rope_type == "yarn":
        return _yarn_inv_freq(base ** exponents, rotary_dim, base, scaling)
    raise UnsupportedModelError(
        "rope_scaling.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn_factor(scaling: dict, max_position: int | None = None) -> float:
    factor = scaling.get("factor")
    if factor is None:
        old_len = float(_require(scaling, "original_max_position_embeddings", "yarn"))
        if max_position is None:
            raise UnsupportedModelError("rope_scaling", "rope_type 'yarn' needs 'factor'")
        return max_position / old_len
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise UnsupportedModelError("rope_scaling.factor", f"must be a positive number, got {factor!r}")
    return float(factor)


def _yarn_inv_freq(pos_freqs: torch.Tensor, rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's blend of the plain frequencies and the ones divided by ``factor`` (``pos_freqs``:
    ``base ** (2i / rotary_dim)``; ``scaling["_max_position"]`` gives a missing factor)."""
    factor = _yarn_factor(scaling, scaling.get("_max_position"))
    old_len = float(_require(scaling, "original_max_position_embeddings", "yarn"))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the feature index that turns `rotations` times
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by factor
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def yarn_attention_factor(scaling: dict, max_position: int) -> float:
    """YaRN's cos/sin multiplier, as transformers derives it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def longrope_attention_factor(scaling: dict, max_position: int) -> float:
    """LongRoPE's cos/sin multiplier: ``attention_factor``, else derived from the context extension
    ``factor`` (default ``max_position / original_max_position_embeddings``) as transformers does."""
    old_len = float(_require(scaling, "original_max_position_embeddings", "longrope"))
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor")
    factor = max_position / old_len if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to flat query/key rows given their absolute positions.

    ``rotary_dim`` (default ``head_dim``): how many leading features of a head rotate.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.float32)[:, None]
        # LongRoPE: positions from here on rotate with the long factors.
        self.long_from: int | None = None
        if (scaling or {}).get("rope_type") == "longrope":
            self.long_from = int(_require(scaling, "original_max_position_embeddings", "longrope"))
            mscale = longrope_attention_factor(scaling, max_position)
            short, long = (positions * rope_inv_freq(self.rotary_dim, base, scaling, long=flag)[None, :]
                           for flag in (False, True))
            freqs = torch.cat((short[:self.long_from], long[self.long_from:]))
            cos, sin = freqs.cos() * mscale, freqs.sin() * mscale
        elif (scaling or {}).get("rope_type") == "yarn":
            scaling = dict(scaling, _max_position=max_position)  # factor's default
            freqs = positions * rope_inv_freq(self.rotary_dim, base, scaling)[None, :]
            mscale = yarn_attention_factor(scaling, max_position)
            cos, sin = freqs.cos() * mscale, freqs.sin() * mscale
        else:
            freqs = positions * rope_inv_freq(self.rotary_dim, base, scaling)[None, :]
            cos, sin = freqs.cos(), freqs.sin()
        # Not persistent: derived from config, never part of a checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``q [T, Hq, D]``, ``k [T, Hk, D]`` -> rotated ``(q, k)``.

        On CPU (the C++ operator) q and k are rotated in place and returned; callers must use
        the returned tensors and not rely on the inputs keeping their values.
        """
        if self.rotary_dim < self.head_dim:
            # Rotate the leading features (views: in place on CPU), the rest pass through.
            rd = self.rotary_dim
            q_rot, k_rot = self._rotate_qk(positions, q[..., :rd], k[..., :rd])
            return torch.cat((q_rot, q[..., rd:]), -1), torch.cat((k_rot, k[..., rd:]), -1)
        return self._rotate_qk(positions, q, k)

    def _rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        ops = cpu_extension.ops_for(q)
        if (ops is not None and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1
                and k.stride(2) == 1 and k.dtype == q.dtype):
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class NoRotary(nn.Module):
    """A layer without rotary embedding (SmolLM3's ``no_rope_layers``): q and k pass unchanged.
    Its ``cos``/``sin`` tables have no rows, which the C++ operators take as "no rotary"."""

    rotary_dim = 0

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("cos", torch.empty(0, head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim // 2, dtype=torch.float32), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
