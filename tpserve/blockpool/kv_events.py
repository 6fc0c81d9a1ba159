"""KV-cache events: what entered and left the prefix cache, for routers that index it.

The BlockManager records three kinds of event into a :class:`KVEventSink` (when one is
attached; without one it records nothing and pays one ``is None`` test per change):

- :class:`BlockStored`: full blocks entered ``hash_to_block_id`` (their hashes, in chain order,
  the hash of the block before the first one, or None for a sequence's first block, and their
  token ids, ``block_size`` per block);
- :class:`BlockRemoved`: hash entries left ``hash_to_block_id`` because their block was handed
  out fresh (evicted) or the cache was reset;
- :class:`AllBlocksCleared`: the prefix cache is empty (a reset that dropped everything).

Replaying the events in order onto an empty set (stored: add the hashes; removed: drop them;
cleared: empty the set) gives exactly the keys of ``hash_to_block_id``. A hash entry taken over
by a newer block with the same contents is not an event: the set of cached hashes is unchanged.

Each event of the pool names its KV-cache group (kv_groups.py), with vLLM's fields:
``group_idx``, ``kv_cache_spec_kind`` ("full_attention" or "sliding_window") and
``kv_cache_spec_sliding_window`` (the window, or None). Each group has its own prefix-cache
index, so the replay rule holds per group; a model with one full group sends group 0 only.

Each event names the ``medium`` that gained or lost the blocks, with vLLM's names: "GPU" for
the engine's KV pool (also on a CPU engine), "CPU" for the host-RAM tier and "STORAGE" for the
disk tier (tpserve/kv_tiers). The replay rule holds per medium; the pool's events are exactly
the changes of ``hash_to_block_id``, the tiers' those of their indexes.

The sink is bounded: a reader that does not drain it for ``capacity`` events loses the oldest
ones, counted in ``num_dropped``; it then rebuilds its view from :meth:`BlockManager.cached_blocks`
(``overflowed`` tells it to). The event classes are plain tuples so they cross threads freely.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple


class BlockStored(NamedTuple):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = "GPU"
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(NamedTuple):
    block_hashes: list[int]
    medium: str = "GPU"
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink:
    """A bounded FIFO of KV events, filled by the BlockManager and drained by one reader."""

    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[KVEvent] = deque()
        self.num_dropped = 0
        #: Set when events were dropped since the last drain; the reader must resync.
        self.overflowed = False

    def __len__(self) -> int:
        return len(self._events)

    def add(self, event: KVEvent) -> None:
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self.num_dropped += 1
            self.overflowed = True
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        """Every event recorded since the last drain, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def take_overflow(self) -> bool:
        """True (once) when events were dropped since the last call: the reader must resync."""
        overflowed, self.overflowed = self.overflowed, False
        return overflowed


def resync_events(cached_blocks: list[tuple[int, int | None, list[int]]], block_size: int,
                  tier_blocks=(), group_blocks=()) -> list[KVEvent]:
    """Events that bring any reader's view to exactly ``cached_blocks`` (BlockManager.cached_blocks,
    parents first), ``tier_blocks`` ((hash, parent, tokens, medium[, group_idx, kind, window])
    of the KV tiers) and
    ``group_blocks`` ((group_idx, kind, window, cached blocks) of KV-cache groups 1..,
    BlockManager.group_cached_blocks): AllBlocksCleared, then one BlockStored per block."""
    return [AllBlocksCleared(), *(BlockStored([h], parent, list(tokens), block_size)
                                  for h, parent, tokens in cached_blocks),
            *(BlockStored([h], parent, list(tokens), block_size, "GPU", g, kind, window)
              for g, kind, window, blocks in group_blocks for h, parent, tokens in blocks),
            *(BlockStored([h], parent, list(tokens), block_size, medium, *spec)
              for h, parent, tokens, medium, *spec in tier_blocks)]
