"""FreeBlocks: the free block ids of a pool, kept in eviction order.

Two classes, allocated in this order:

1. *plain*: free blocks that carry no reachable hash (never hashed, or their entry was dropped
   or taken over by another block), in the order they were freed;
2. *cached*: free blocks still in the prefix cache, least recently freed first.

So a fresh allocation destroys a cached prefix only when no worthless block is left, and then
the one unused for longest. Every operation is O(1) except ``order`` and ``uncache_all``.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain


class FreeBlocks:
    def __init__(self, num_blocks: int):
        self.plain: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.plain) + len(self.cached)

    def order(self) -> deque[int]:
        """Every free id in the order ``pop`` would return them (a fresh copy)."""
        return deque(chain(self.plain, self.cached))

    def pop(self) -> int:
        """The next block to hand out fresh. The pool must not be empty."""
        if self.plain:
            return self.plain.popleft()
        return self.cached.popitem(last=False)[0]

    def push(self, block_id: int, cached: bool, evict_first: bool = False) -> None:
        """A block became free; ``cached`` when it is still reachable from the prefix cache.
        ``evict_first``: a cached block goes to the front of its class (the least recently
        used end), as if unused for longest (a pooling request's prefix nobody shared yet)."""
        if cached:
            self.cached[block_id] = None
            if evict_first:
                self.cached.move_to_end(block_id, last=False)
        else:
            self.plain.append(block_id)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.cached

    def take_cached(self, block_id: int) -> None:
        """Remove a cached block from the free list (a prefix-cache hit reuses it)."""
        del self.cached[block_id]

    def uncache(self, block_id: int) -> None:
        """A cached free block lost its hash entry: it moves to the back of the plain class."""
        del self.cached[block_id]
        self.plain.append(block_id)

    def uncache_all(self) -> list[int]:
        """Move every cached free block to the plain class; returns their ids."""
        ids = list(self.cached)
        self.plain.extend(ids)
        self.cached.clear()
        return ids
