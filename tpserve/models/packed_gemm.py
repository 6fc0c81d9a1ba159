"""Prepacked oneDNN weights for the bf16 and fp32 matmuls of a model on CPU.

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain ``[out, in]`` weight, which oneDNN
reorders into its blocked layout on every call: at decode batch sizes that reorder reads and
writes the whole weight once more per matmul. Packing each weight once, after loading, and
calling oneDNN's linear on the packed tensor removes it. Measured on the 40M benchmark model's
33 matmuls per decode step (AVX512-BF16 CPU, 2 threads, distinct weights so they stream from
memory): batch 1 6.8 -> 4.4 ms, batch 12 9.3 -> 5.2 ms, batch 64 18.8 -> 15.0 ms, batch 256
55 -> 52 ms; the results are bit-identical to ``F.linear``.

fp32 weights are packed too: ``F.linear`` in fp32 goes to MKL, which on the AMD CPUs measured
here runs 2-4x slower than oneDNN's packed fp32 kernels (2 threads, 40M model shapes: LM head
[32768, 512] at batch 32 19.1 -> 6.1 ms, gate/up [3072, 512] 1.00 -> 0.46 ms, at batch 2048
66.6 -> 33.4 ms; with every library capped to AVX2, 19.1 -> 8.1 ms and 0.99 -> 0.49 ms).
MKL's own packed fp32 path was no faster. oneDNN's fp32 sums differ from MKL's in the last bits
(about 1e-4 on values of size 20). bf16 is packed only on a CPU with native bf16 support, and
accelerators have their own GEMM libraries. ``TPSERVE_PREPACK=0`` turns packing off.

A packed layer frees its dense weight (its memory would otherwise double), so the dense
``weight`` of a packed layer is an empty tensor; a weight shared with another module (a tied
LM head) stays dense and is packed beside it.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets a packed copy: an fp32 CPU tensor, or a bf16 one on a CPU with
    native bf16."""
    if (weight.device.type != "cpu" or weight.dim() != 2
            or os.environ.get("TPSERVE_PREPACK", "1") == "0"
            or not torch.backends.mkldnn.is_available()):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed form of an ``[out, in]`` weight (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``, through the packed weight when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackableLinear(nn.Module):
    """Mixin of a layer whose ``weight`` may be packed: ``forward`` calls ``self.matmul``."""

    packed: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, bias, self.packed)

    def prepack(self, shared: bool) -> bool:
        """Pack ``weight`` if :func:`can_prepack`; free the dense copy unless it is ``shared``."""
        if self.packed is not None or not can_prepack(self.weight):
            return False
        self.packed = pack(self.weight)
        if not shared:
            self.weight.data = self.weight.data.new_empty(0)
        return True


def prepack_model(model: nn.Module) -> int:
    """Pack every packable layer's weight (after loading); returns how many were packed."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    packed = 0
    for m in model.modules():
        if isinstance(m, PackableLinear):
            packed += m.prepack(shared=counts.get(id(m.weight), 0) > 1)
    return packed
