"""AttentionBackend: the attention interface the model layers call, and what each backend needs.

One backend object serves every layer. ``forward`` stores the new tokens' K/V into that
layer's paged cache, then attends. The backends (``cpu_attention.py``, ``torch_attention.py``,
``triton_attention.py``, ``flash_attention.py``) subclass it; ``backend_factory.get_backend``
picks one. This module imports no backend and no factory, so a backend module and the factory
both import it without either importing the other back.
"""
from __future__ import annotations

import abc

import torch

from tpserve.kernels.attention_options import PLAIN, AttentionOptions, attention_options
from tpserve.kernels.checks import check_attention_args, has_cache
from tpserve.kernels.metadata import AttentionMetadata

# What the backends require (checked by backend_factory before one is chosen).
FLASH_PAGE_MULTIPLE = 256  # flash-attn's paged KV cache: pages of a multiple of 256 tokens
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
    #: the ``forward`` keywords (attention_options.py) this backend implements; others are refused
    options: frozenset[str] = frozenset()
    #: whether ``store`` and ``attend`` take ``kv_scales`` (an int8 KV cache, kv_quant.py)
    int8_kv: bool = False

    def __init__(self, block_size: int = 16):
        self.block_size = block_size

    def set_batch_invariant(self, dtype: torch.dtype, head_dim: int) -> None:
        """Put the backend in the batch-invariant mode (a row's attention independent of the
        other rows of its step, docs/protocol.md "Reproducibility"), or refuse with ValueError.
        Backends that have the mode (cpu, triton) override this."""
        why = {"torch": "its padded SDPA runs over the batch's longest sequence, so a row's sums "
                        "follow the batch",
               "flash": "flash-attn chooses its split of the keys by batch size"}.get(self.name, "")
        raise ValueError(f"the {self.name} attention backend has no batch-invariant mode"
                         + (f" ({why})" if why else "") + "; use the cpu backend on CPU or triton")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float, *, window: int | None = None,
                sinks: torch.Tensor | None = None, softcap: float | None = None,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                stored: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens (already rotary-embedded).

        Stores k/v into the cache at meta.slot_mapping, then returns attention output
        [T, Hq, D] (a new tensor, q's dtype). Hq % Hkv == 0 (GQA: query head h reads KV head
        h // (Hq // Hkv)). If k_cache is None/empty (profiling/warm-up run without a cache),
        attends over the new k/v only (plain causal varlen attention on cu_seqlens_q).
        ``window`` (sliding window), ``sinks`` ([Hq] sink logits) and ``softcap`` (logit
        soft-cap): see attention_options.py; a backend refuses one it lacks (``options``).
        ``kv_scales`` (k_scale, v_scale): the caches are int8 codes with these scales
        (kv_quant.py); a backend without ``int8_kv`` refuses them.
        ``stored``: the new tokens' keys and values are already in the cache (``store_qkv`` wrote
        them); k/v then only give the shapes, and the backend attends without storing.
        Raises ValueError naming an argument whose shape, dtype or device is wrong.
        """
        if kv_scales is not None and not self.int8_kv:
            raise ValueError(f"kv_scales: the {self.name} attention backend does not read an int8 KV "
                             "cache (the cpu and torch backends do)")
        check_attention_args(q, k, v, k_cache, v_cache, meta, scale, kv_scales)
        opts = attention_options(window, sinks, softcap, q)
        lacking = opts.names() - self.options
        if lacking:
            raise ValueError(f"{'/'.join(sorted(lacking))}: the {self.name} attention backend does "
                             f"not implement {' or '.join(sorted(lacking))}")
        # Metadata built directly (not via from_arrays) is validated once per step, not per layer.
        meta.derived("validated", lambda: meta.validate() or True)
        if not has_cache(k_cache, v_cache):
            if stored:
                raise ValueError("stored: the keys and values were to be in the cache, but there is none")
            return self.attend(q, k, v, None, None, meta, float(scale), opts=opts)
        if k_cache.shape[1] != self.block_size:
            raise ValueError(f"k_cache: block_size {k_cache.shape[1]} differs from the "
                             f"{self.name} backend's block_size {self.block_size}")
        if kv_scales is not None:
            if not stored:
                self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales=kv_scales)
            return self.attend(q, k, v, k_cache, v_cache, meta, float(scale), opts=opts, kv_scales=kv_scales)
        if not stored:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, float(scale), opts=opts)

    __call__ = forward

    def fuses_qkv_store(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the backend has a fused QKV store for a layer of this dtype and head size: a
        method ``store_qkv(qkv, num_heads, num_kv_heads, k_cache, v_cache, meta, positions, rope,
        qk_norm, kv_scales)`` that takes the QKV projection's output to the cache in one pass
        (cpu_attention.py's), after which ``forward`` with ``stored=True`` attends over what it
        stored. Backends without one (this default): False, and nobody calls it."""
        return False

    @abc.abstractmethod
    def store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write the new tokens' K/V rows to their slots (slot -1: skip)."""

    @abc.abstractmethod
    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
        """Attention after the store; k_cache/v_cache are None when running without a cache.
        ``opts`` holds only options named in ``options``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"
