"""KV-cache groups on a runner: cache slabs shared by the groups, each group's metadata.

The block manager (tpserve/kv_groups.py) puts the layers of one attention type into groups
of equal size and hands every group block ids from one pool. The runner therefore allocates
``group_size`` cache tensors ("slabs") of ``num_blocks`` blocks, and the j-th layer of every
group uses slab j: a block id belongs to one group at a time, so the layers sharing a slab never
touch each other's blocks. A KV block then costs ``group_size`` layers' worth of memory
instead of ``num_layers``.

A plan carries the groups' block tables side by side (``block_tables`` [B, G * W], group g in
columns g * W .. (g + 1) * W - 1). Each group's slot mapping follows from the token positions
and its table (a token with slot -1 in the plan, a prefix-cache hit's recomputed last token,
writes nothing in any group). Every layer's backend is a :class:`GroupBackend` that hands the
real backend its group's metadata; group tables hold -1 for blocks before a sliding window,
which no backend reads.
"""
from __future__ import annotations

import dataclasses

import torch

from tpserve.kv_groups import KVCacheGroup, group_size, kv_cache_groups, layer_slabs


def layer_windows(model) -> list[int | None]:
    """Each attention layer's sliding window (None: full attention)."""
    return [layer.self_attn.sliding_window for layer in model.model.layers]


class KVGroupLayout:
    """The groups of a model, the slab of each layer, and the per-group metadata of a step."""

    def __init__(self, model, block_size: int):
        self.groups: list[KVCacheGroup] = kv_cache_groups(layer_windows(model))
        self.num_layers = model.num_layers
        self.block_size = block_size
        # One group: every layer its own tensor, exactly as without groups.
        self.split = len(self.groups) > 1
        self.num_slabs = group_size(self.groups) if self.split else self.num_layers
        self.slab_of = [j for _, j in layer_slabs(self.groups, self.num_layers)] if self.split \
            else list(range(self.num_layers))
        self.group_of = [g for g, _ in layer_slabs(self.groups, self.num_layers)] if self.split \
            else [0] * self.num_layers

    def layer_caches(self, make_slab) -> list:
        """Each layer's cache tuple, from ``make_slab()`` called once per slab."""
        slabs = [make_slab() for _ in range(self.num_slabs)]
        return [slabs[j] for j in self.slab_of]

    def wrap_backends(self, model) -> None:
        """Give each layer a GroupBackend for its group (only with several groups)."""
        if not self.split:
            return
        for layer, g in zip(model.model.layers, self.group_of):
            attn = layer.self_attn
            if not isinstance(attn.backend, GroupBackend):
                attn.backend = GroupBackend(attn.backend, g)

    def with_groups(self, meta, positions: torch.Tensor):
        """``meta`` with ``meta.groups`` set: one metadata per group (only with several groups)."""
        if not self.split:
            return meta
        num = len(self.groups)
        tables = meta.block_tables
        width = tables.shape[1] // num
        if width == 0:  # a cache-less step (the sizing warm-up) reads and writes no block
            return meta
        bs = self.block_size
        qlens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        rows = torch.repeat_interleave(torch.arange(len(qlens), device=tables.device), qlens,
                                       output_size=meta.num_tokens)
        col, off = positions.long() // bs, positions.long() % bs
        skip = meta.slot_mapping < 0
        out = []
        for g in range(num):
            table = tables[:, g * width:(g + 1) * width].contiguous()
            if g == 0:
                slots = meta.slot_mapping
            else:
                slots = (table[rows, col].long() * bs + off).to(torch.int32)
                slots = torch.where(skip, torch.full_like(slots, -1), slots)
            out.append(dataclasses.replace(meta, block_tables=table, slot_mapping=slots))
        meta.groups = out
        return meta


class GroupBackend:
    """An attention backend as one group's layers see it: it passes on that group's metadata."""

    def __init__(self, backend, group: int):
        self.inner = backend
        self.group = group

    def forward(self, q, k, v, k_cache, v_cache, meta, *args, **kwargs):
        groups = getattr(meta, "groups", None)
        return self.inner.forward(q, k, v, k_cache, v_cache, groups[self.group] if groups else meta,
                                  *args, **kwargs)

    def store_qkv(self, qkv, num_heads, num_kv_heads, k_cache, v_cache, meta, *args, **kwargs):
        groups = getattr(meta, "groups", None)
        return self.inner.store_qkv(qkv, num_heads, num_kv_heads, k_cache, v_cache,
                                    groups[self.group] if groups else meta, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)
