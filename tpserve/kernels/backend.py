"""AttentionBackend: the attention interface the model layers call, and ``get_backend``.

One backend object serves every layer. ``forward`` stores the new tokens' K/V into that
layer's paged cache, then attends. Backends:

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

Backend modules are imported only when selected, so that importing ``tpserve.kernels`` never
decorates Triton kernels (the interpreter is chosen at decoration time) nor imports flash-attn.
"""
from __future__ import annotations

import abc
import importlib.util
import os

import torch

from tpserve.config import ATTENTION_BACKENDS
from tpserve.kernels.checks import check_attention_args, has_cache
from tpserve.kernels.metadata import AttentionMetadata

# The names are the engine option's (--attention-backend); one list, in the config.
BACKEND_NAMES = ATTENTION_BACKENDS
FLASH_PAGE_MULTIPLE = 256
TRITON_BLOCK_MULTIPLE = 16
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackend(abc.ABC):
    """Base class: argument checks, the KV store, then the backend's attention.

    Subclasses implement ``store`` and ``attend``; ``forward`` is the contract callers use.
    """

    name: str = "base"
    # Whether a decode forward can be captured in a CUDA graph: no host synchronisation and no
    # per-step index tensors cached on the metadata (a graph replays with new metadata values).
    supports_cuda_graphs: bool = False

    def __init__(self, block_size: int = 16):
        self.block_size = block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens (already rotary-embedded).

        Stores k/v into the cache at meta.slot_mapping, then returns attention output
        [T, Hq, D] (a new tensor, q's dtype). Hq % Hkv == 0 (GQA: query head h reads KV head
        h // (Hq // Hkv)). If k_cache is None/empty (profiling/warm-up run without a cache),
        attends over the new k/v only (plain causal varlen attention on cu_seqlens_q).
        Raises ValueError naming an argument whose shape, dtype or device is wrong.
        """
        check_attention_args(q, k, v, k_cache, v_cache, meta, scale)
        # Metadata built directly (not via from_arrays) is validated once per step, not per layer.
        meta.derived("validated", lambda: meta.validate() or True)
        if not has_cache(k_cache, v_cache):
            return self.attend(q, k, v, None, None, meta, float(scale))
        if k_cache.shape[1] != self.block_size:
            raise ValueError(f"k_cache: block_size {k_cache.shape[1]} differs from the "
                             f"{self.name} backend's block_size {self.block_size}")
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, float(scale))

    __call__ = forward

    @abc.abstractmethod
    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write the new tokens' K/V rows to their slots (slot -1: skip)."""

    @abc.abstractmethod
    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Attention after the store; k_cache/v_cache are None when running without a cache."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


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
