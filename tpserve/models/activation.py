"""Gated activations of the MLP: SiLU (Llama, Qwen, Mistral, Phi-3) and GELU-tanh (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.kernels import cpu_extension


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` laid out as ``[gate | up]``.

    Works on a tensor-parallel shard as is: MergedColumnParallelLinear puts this rank's gate
    slice before its up slice.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_extension.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            ops.silu_and_mul(out, x)  # one pass, no gate/up temporaries
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``), same ``[gate | up]`` layout as
    :class:`SiluAndMul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_extension.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            ops.gelu_tanh_and_mul(out, x)  # gemma_ops.cpp: one pass
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gated activation module for a ModelSpec's ``hidden_act`` ("silu" or "gelu_tanh")."""
    return GeluTanhAndMul() if name == "gelu_tanh" else SiluAndMul()
