"""KV-cache groups: layers of one attention type share one block table per sequence.

A model's attention layers fall into *groups*. Every layer of a group has the same kind of
attention (``"full_attention"``, or ``"sliding_window"`` with one window W: the query at
position p reads keys p - W + 1 .. p) and the same number of layers, so that one physical block
id means the same amount of memory in every group: the runner keeps ``group_size`` cache
tensors ("slabs") of ``num_blocks`` blocks each, and the j-th layer of any group reads and writes
slab j through its own group's block table. A block id belongs to at most one group at a time
(the block manager hands it out from one shared pool), so the layers sharing a slab never see
each other's blocks.

The groups are formed as vLLM's hybrid KV-cache manager forms them: the group size is the
smallest number of layers any attention type has; the layers of each type, in layer order, are
cut into groups of that size (the last one may be short; its slabs past its own layers stay
unused). Full-attention groups come first, then sliding groups by window. A model with one
attention type (every layer full, or every layer the same window) has exactly one group: with
every layer full it is the seed's single block table, unchanged.

A sliding group's sequence needs no block wholly before ``window_start`` of the next query;
such entries of its block table are -1 ("null"), the blocks freed (their prefix-cache entries
kept, so they can be found again until reused).
"""
from __future__ import annotations

from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_window"


@dataclass(frozen=True)
class KVCacheGroup:
    """One group: its attention kind, window (None for full attention) and layer indices."""

    kind: str = FULL
    window: int | None = None
    layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in (FULL, SLIDING):
            raise ValueError(f"kind: expected {FULL!r} or {SLIDING!r}, got {self.kind!r}")
        if (self.kind == SLIDING) != (self.window is not None):
            raise ValueError(f"window: a {self.kind} group has window {self.window!r}")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"window: expected an int >= 1, got {self.window!r}")

    @property
    def sliding(self) -> bool:
        return self.window is not None


def window_start(window: int, next_pos: int, block_size: int) -> int:
    """Index of the first block a sliding group still needs when the next query is at
    ``next_pos``: blocks before it are wholly outside the window of that query and of every later
    one. One token of slack (keys from ``next_pos - window`` kept) covers a prompt whose last
    token is recomputed from a cache hit (its query one position earlier)."""
    return max(0, next_pos - window) // block_size


def max_window_blocks(window: int, block_size: int) -> int:
    """The most blocks a decoding sequence of a sliding group holds: ceil(W / block_size) + 1."""
    return -(-window // block_size) + 1


def kv_cache_groups(layer_windows) -> list[KVCacheGroup]:
    """The groups of a model whose layer i has window ``layer_windows[i]`` (None: full).

    An empty sequence means an unknown layout: one full group (the seed's single table)."""
    windows = list(layer_windows)
    if not windows or all(w is None for w in windows):
        return [KVCacheGroup(FULL, None, tuple(range(len(windows))))]
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_type.setdefault(w, []).append(i)
    size = min(len(v) for v in by_type.values())
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))
    groups = []
    for w in order:
        layers = by_type[w]
        for s in range(0, len(layers), size):
            groups.append(KVCacheGroup(FULL if w is None else SLIDING, w, tuple(layers[s:s + size])))
    return groups


def group_size(groups: list[KVCacheGroup]) -> int:
    """Layers per group: the number of cache slabs the runner allocates."""
    return max(len(g.layers) for g in groups) if groups else 1


def layer_slabs(groups: list[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """(group index, slab index) of each layer 0 .. num_layers - 1."""
    where = [(-1, -1)] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            where[layer] = (g, j)
    assert all(g >= 0 for g, _ in where), f"a layer belongs to no group: {where}"
    return where
