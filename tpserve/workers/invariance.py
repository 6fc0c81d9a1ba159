"""The batch-invariant mode (``EngineConfig.batch_invariant``): a rank's paths put in it, or refused.

In the mode a token's logits are a function of its own sequence alone: not of the other rows of
its step, of how its prompt was chunked, of whether its prefix came from the cache, of a
preemption's recomputation or of a speculative verification. docs/protocol.md
("Reproducibility") states the guarantee; this module is where a rank's model is checked
against it once loaded. Each computation of a row and where its invariance comes from:

- Linear layers (LM head included): tpserve's packed kernels (``csrc/linear_ops.cpp``) sum each
  row in the order of its input features whatever the row count, tile or thread split; int8
  activations are quantized per row. Only packed layers qualify: ``F.linear`` (MKL / oneDNN)
  chooses its blocking by the row count, so a layer left unpacked (``TPSERVE_PREPACK=0``, no C++
  operators, fp16, an input size the packing cannot take) is refused.
- Attention: every row, prompt or decode, takes the decode arithmetic over exactly its keys
  (``CpuAttention`` with ``rows``; ``TritonAttention`` through its decode kernel with a fixed
  split count). The fused decode stack calls the same decode arithmetic, so fused and
  layer-by-layer steps agree. The torch and flash backends have no such form and are refused.
- Norms, rotary, SiLU-and-mul, embedding, argmax: row by row in the C++ operators.
- Tensor parallelism: ``TPContext.fixed_order`` sums every element in rank order.
- Sampling: the counter-based race (a draw is a function of seed, position and token) and the
  log-softmax of logprobs are row by row.

CUDA is refused: its matmuls (cuBLAS) and torch's reductions (RMSNorm, log-softmax) choose
their algorithms, split-K included, by the batch's shape. The Triton attention kernels have the
mode (tests run them under ``TRITON_INTERPRET=1`` on CPU tensors).
"""
from __future__ import annotations

import dataclasses

import torch

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.kernels import cpu_extension
from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.models.packed_gemm import PackableLinear
from tpserve.models.parallel import TPContext


def tp_context(config: EngineConfig, tp: TPContext) -> TPContext:
    """``tp`` with the fixed-order all-reduce when the engine runs in the mode."""
    return dataclasses.replace(tp, fixed_order=True) if config.batch_invariant else tp


def unpacked_layers(model: torch.nn.Module) -> list[str]:
    """Names of the linear layers (and expert sets) of ``model`` that run through torch, not the
    packed kernels."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, PackableLinear) and m.packed is None:
            names.append(name)
        elif callable(getattr(m, "prepack_experts", None)) and getattr(m, "packed", None) is None:
            names.append(name)
    return names


def enable(config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
           device: torch.device, dtype: torch.dtype) -> None:
    """Put a loaded (and prepacked) model's paths in the batch-invariant mode, or raise
    ConfigError naming what has no invariant form. A no-op unless ``config.batch_invariant``."""
    if not config.batch_invariant:
        return
    if device.type != "cpu":
        raise ConfigError("batch_invariant",
                          f"is supported on CPU only: on {device.type} the matrix library's and torch's "
                          f"reductions choose their algorithm (split-K included) by the batch's shape")
    status = cpu_extension.status()
    if not cpu_extension.available():
        raise ConfigError("batch_invariant",
                          f"needs tpserve's C++ CPU operators ({status.get('cpu_ops')}: "
                          f"{status.get('cpu_ops_reason') or 'not loaded'})")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError("dtype", f"batch_invariant runs float32 or bfloat16 on CPU, got {dtype}")
    unpacked = unpacked_layers(model)
    if unpacked:
        more = f" and {len(unpacked) - 3} more" if len(unpacked) > 3 else ""
        raise ConfigError("batch_invariant",
                          f"layers {', '.join(unpacked[:3])}{more} are not packed for tpserve's kernels "
                          f"(torch's F.linear blocks its sums by the row count)")
    try:
        backend.set_batch_invariant(dtype, model.head_dim)
    except ValueError as e:
        raise ConfigError("attention_backend", str(e)) from None
