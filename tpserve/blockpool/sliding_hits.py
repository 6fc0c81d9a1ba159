"""The prefix-cache hit a sliding-window group can serve.

A sliding group (window W) can take a hit of k full blocks when it holds every block the next
query (at position k * block_size) may read: blocks ``window_start(W, k * block_size)`` to k - 1,
all cached, each computed after the one before it (the serial chain: a block records the
serial of its parent, or -1 when the parent had already left the window when it was hashed;
then its parent hash, compared at lookup, is the link). The blocks before the window may be
gone: that is what lets a sliding group free them.
"""
from __future__ import annotations

from tpserve.kv_groups import window_start


def sliding_hit_length(ids: list[int], blocks, limit: int, window: int, block_size: int) -> int:
    """The largest e <= ``limit`` such that ``ids[window_start(window, e * block_size) : e]``
    is a chain of cached blocks (``ids[i]`` the cached block holding block i, or -1)."""
    run = 0  # length of the chain of cached blocks ending at block i
    runs = []
    for i in range(limit):
        b = ids[i]
        if b == -1:
            run = 0
        elif run and blocks[b].parent_serial in (-1, blocks[ids[i - 1]].serial):
            run += 1
        else:
            run = 1
        runs.append(run)
    for e in range(limit, 0, -1):
        if runs[e - 1] >= e - window_start(window, e * block_size, block_size):
            return e
    return 0
