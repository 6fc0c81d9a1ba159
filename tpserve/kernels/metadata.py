"""AttentionMetadata: what every attention backend needs to know about one forward pass.

The model passes one metadata object to every attention layer of a step (no module-level
"current context"). It describes a batch of B sequences whose new tokens are laid out flat:

    tokens of sequence i     = rows cu_seqlens_q[i] : cu_seqlens_q[i+1] of q/k/v  (q_len_i rows)
    key length of sequence i = context_lens[i] = cu_seqlens_k[i+1] - cu_seqlens_k[i]

The new tokens are the LAST q_len_i tokens of their sequence, so query j of sequence i sits at
absolute position ``context_lens[i] - q_len_i + j`` and attends causally to keys
``0 .. context_lens[i] - q_len_i + j``. Keys of a sequence live in the paged KV cache at slots
``block_tables[i, p // block_size] * block_size + p % block_size``.

Invariants (checked by ``validate``, which reads only shapes and dtypes, never values, so it
costs no device synchronisation):
    * every index tensor is int32 and on one device;
    * cu_seqlens_q, cu_seqlens_k have B+1 entries, context_lens B, block_tables B rows;
    * slot_mapping has one entry per new token (-1 = do not store this token's K/V);
    * decode (``is_prefill`` False) means q_len == 1 for every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

_INDEX_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_tables", "slot_mapping")


@dataclass
class AttentionMetadata:
    is_prefill: bool
    has_context: bool            # some prefill sequence attends to KV already in the cache
    cu_seqlens_q: torch.Tensor   # int32 [B+1], query (new-token) lengths prefix sums
    cu_seqlens_k: torch.Tensor   # int32 [B+1], key lengths (context + new) prefix sums
    max_seqlen_q: int
    max_seqlen_k: int
    context_lens: torch.Tensor   # int32 [B], key length per sequence (== diff(cu_seqlens_k))
    block_tables: torch.Tensor   # int32 [B, W], padded with -1
    slot_mapping: torch.Tensor   # int32 [T], -1 = do not write this token's K/V
    # Leading sequences with one query row each (a mixed step's decode rows; B for decode), as
    # the plan states it; None: backends count them from cu_seqlens_q (a host read).
    num_decodes: int | None = None
    # With KV-cache groups (workers/kv_group_runner.py): one metadata per group, each with its
    # group's block tables and slot mapping; the layers of group g read ``groups[g]``.
    groups: list | None = field(default=None, repr=False, compare=False)
    # Index tensors a backend derives from the fields above, computed once per step and shared
    # by all layers (see ``derived``). Not part of the contract.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def derived(self, key: Any, compute: Callable[[], Any]) -> Any:
        """Return ``compute()``, computed on the first call for ``key`` and cached on this object.

        Backends use it for per-step index tensors (token -> sequence maps, masks) so that a
        model with many layers builds them once per step, not once per layer.
        """
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = compute()
            return value

    def validate(self) -> None:
        """Check dtypes, devices and shapes agree; raises ValueError naming the field."""
        if not isinstance(self.is_prefill, bool):
            raise ValueError(f"is_prefill: expected bool, got {type(self.is_prefill).__name__}")
        if not isinstance(self.has_context, bool):
            raise ValueError(f"has_context: expected bool, got {type(self.has_context).__name__}")
        device = self.slot_mapping.device if isinstance(self.slot_mapping, torch.Tensor) else None
        for name in _INDEX_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
            if t.device != device:
                raise ValueError(f"{name}: on {t.device} but slot_mapping is on {device}; "
                                 "all index tensors must share one device")
        for name in ("max_seqlen_q", "max_seqlen_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        b = self.context_lens.shape[0] if self.context_lens.dim() == 1 else -1
        if self.context_lens.dim() != 1:
            raise ValueError(f"context_lens: expected shape [B], got {tuple(self.context_lens.shape)}")
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            t = getattr(self, name)
            if tuple(t.shape) != (b + 1,):
                raise ValueError(f"{name}: expected shape [{b + 1}] (B+1 with B={b}), "
                                 f"got {tuple(t.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables: expected shape [{b}, W], "
                             f"got {tuple(self.block_tables.shape)}")
        if self.slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping: expected shape [T], got {tuple(self.slot_mapping.shape)}")
        if not self.is_prefill and self.slot_mapping.shape[0] != b:
            raise ValueError(f"slot_mapping: decode has one token per sequence, so T must equal "
                             f"B={b}, got T={self.slot_mapping.shape[0]}")
        if not self.is_prefill and self.has_context:
            raise ValueError("has_context: only meaningful for prefill; must be False for decode")

    @classmethod
    def from_arrays(cls, *, is_prefill: bool, has_context: bool, cu_seqlens_q, cu_seqlens_k,
                    context_lens, block_tables, slot_mapping, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None,
                    device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build metadata from host arrays (numpy or tensors) and move it to ``device``.

        ``max_seqlen_q`` / ``max_seqlen_k`` default to the largest length in the cu_seqlens
        arrays (computed on the host, before the copy, so no device synchronisation).
        Arrays are converted to int32. Raises ValueError naming a field that is inconsistent.
        """
        host = {}
        for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("context_lens", context_lens), ("block_tables", block_tables),
                            ("slot_mapping", slot_mapping)):
            t = torch.as_tensor(value)
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{name}: expected integers, got {t.dtype}")
            host[name] = t.to(torch.int32)
        if max_seqlen_q is None:
            max_seqlen_q = _max_len("cu_seqlens_q", host["cu_seqlens_q"])
        if max_seqlen_k is None:
            max_seqlen_k = _max_len("cu_seqlens_k", host["cu_seqlens_k"])
        device = torch.device(device)
        pin = device.type == "cuda"
        moved = {n: (t.pin_memory() if pin else t).to(device, non_blocking=pin)
                 for n, t in host.items()}
        meta = cls(is_prefill=bool(is_prefill), has_context=bool(has_context),
                   max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), **moved)
        meta.validate()
        return meta

    def __repr__(self) -> str:  # tensors summarised by shape: steps are logged, not dumped
        parts = []
        for f in fields(self):
            if f.name == "_derived":
                continue
            v = getattr(self, f.name)
            parts.append(f"{f.name}={tuple(v.shape)}" if isinstance(v, torch.Tensor)
                         else f"{f.name}={v!r}")
        return f"AttentionMetadata({', '.join(parts)})"


def _max_len(name: str, cu: torch.Tensor) -> int:
    if cu.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D prefix-sum array, got shape {tuple(cu.shape)}")
    return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0
