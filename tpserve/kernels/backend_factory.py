"""``get_backend``: which attention backend runs, for a device, a block size and a dtype.

The interface every backend implements is ``attention_backend.AttentionBackend``. Backends:

    cpu     CPU, any block size: C++ kernels reading the paged cache in place
            (``cpu_attention.py``); needs tpserve's C++ CPU operators, built on first use
    torch   any device, any block size; plain torch, the CPU fallback and reference
            (``torch_attention.py``)
    triton  our paged Triton kernels; CUDA, or CPU under TRITON_INTERPRET=1 (tests);
            block_size % 16 == 0 (``triton_attention.py``)
    flash   flash-attn 2; CUDA with ``flash_attn`` installed; block_size % 256 == 0 because
            flash-attn's paged KV cache needs pages of a multiple of 256 tokens
            (``flash_attention.py``)

CUDA defaults: block size 16 (``EngineConfig``) and therefore Triton under ``auto``; flash-attn
when the block size is a multiple of 256 and the package is installed. Why not 256 and flash
by default: (1) the prefix cache shares whole blocks only, so at 256 a shared prompt shorter
than 256 tokens is never reused and longer ones lose up to 255 tokens each; (2) the last block
of every running sequence is on average half empty: 128 tokens x 256 sequences at block 256
against 8 x 256 at block 16; (3) flash-attn is optional and often absent (no wheel for the
installed torch/CUDA). The cost block 16 used to carry, one block-table load per 16 keys and a
grid too small for the GPU at small batch, is gone: the Triton decode and prefill kernels load
a 64-key tile's table entries as one vector, and decode splits long contexts across programs
(split-K, see ``paged_decode.py``). ``scripts/gpu_check.sh`` measures both backends where flash-attn is
installed, so this choice can be revisited with figures.

Backend modules are imported only when selected (the imports inside ``get_backend``), so that
importing ``tpserve.kernels`` never decorates Triton kernels (the interpreter is chosen at
decoration time) nor imports flash-attn. Those imports are one way: a backend module imports
``attention_backend``, never this module.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from tpserve.config import ATTENTION_BACKENDS
from tpserve.kernels.attention_backend import (FLASH_DTYPES, FLASH_PAGE_MULTIPLE, TRITON_BLOCK_MULTIPLE,
                                               AttentionBackend)

# The names are the engine option's (--attention-backend); one list, in the config.
BACKEND_NAMES = ATTENTION_BACKENDS


def flash_attn_available() -> bool:
    """Whether the optional ``flash_attn`` package is installed (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def _why_not(name: str, device: torch.device, block_size: int,
             dtype: torch.dtype | None) -> str | None:
    """None if backend ``name`` can run on ``device`` with ``block_size``, else the reason."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"the cpu backend runs on CPU tensors, got device {device}"
        from tpserve.kernels import cpu_extension
        if not cpu_extension.available():
            return "tpserve's C++ CPU operators could not be built on this machine"
        return None
    if name == "triton":
        if block_size % TRITON_BLOCK_MULTIPLE:
            return (f"the triton backend needs block_size to be a multiple of "
                    f"{TRITON_BLOCK_MULTIPLE}, got {block_size}")
        if device.type == "cuda":
            return None
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return (f"the triton backend runs on CUDA devices (or on CPU only with "
                f"TRITON_INTERPRET=1 set, for tests), got device {device}")
    if name == "flash":
        if device.type != "cuda":
            return f"the flash backend needs a CUDA device, got {device}"
        if not flash_attn_available():
            return "the flash backend needs the flash_attn package, which is not installed"
        if block_size % FLASH_PAGE_MULTIPLE:
            return (f"the flash backend needs block_size to be a multiple of "
                    f"{FLASH_PAGE_MULTIPLE} (flash-attn's paged KV cache), got {block_size}")
        if dtype is not None and dtype not in FLASH_DTYPES:
            return f"the flash backend computes in float16/bfloat16 only, got {dtype}"
        return None
    raise AssertionError(name)


def get_backend(name: str = "auto", device: torch.device | str = "cpu",
                block_size: int = 16, dtype: torch.dtype | None = None) -> AttentionBackend:
    """Return the attention backend ``name`` for ``device`` and the cache's ``block_size``.

    ``auto`` picks flash when it can run (CUDA, flash_attn installed, block_size % 256 == 0,
    and ``dtype``, the model's compute dtype if given, fp16/bf16), else triton on CUDA when
    block_size % 16 == 0, else torch; on CPU, cpu when its C++ operators build, else torch
    (after one logged warning). An explicit name that cannot run on the device / block
    size / dtype raises ValueError saying why.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"name: unknown attention backend {name!r}; allowed: "
                         f"{', '.join(BACKEND_NAMES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: not a torch device: {device!r} ({e})") from None
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating torch.dtype or None, got {dtype!r}")
    if name == "auto":
        if device.type == "cuda":
            candidates = ("flash", "triton", "torch")
        else:
            candidates = ("cpu", "torch")
        name = next(c for c in candidates if _why_not(c, device, block_size, dtype) is None)
    else:
        reason = _why_not(name, device, block_size, dtype)
        if reason is not None:
            raise ValueError(f"name: cannot use attention backend {name!r}: {reason}")
    if name == "cpu":
        from tpserve.kernels.cpu_attention import CpuAttention
        return CpuAttention(block_size)
    if name == "torch":
        from tpserve.kernels.torch_attention import TorchAttention
        return TorchAttention(block_size)
    if name == "triton":
        from tpserve.kernels.triton_attention import TritonAttention
        return TritonAttention(block_size)
    from tpserve.kernels.flash_attention import FlashAttention
    return FlashAttention(block_size)
