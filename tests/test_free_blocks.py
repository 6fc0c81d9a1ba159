"""FreeBlocks: plain blocks are handed out first (in the order freed), then cached ones, LRU."""
from tpserve.blockpool.free_blocks import FreeBlocks


def test_fresh_pool_hands_out_ids_in_order():
    free = FreeBlocks(3)
    assert list(free.order()) == [0, 1, 2] and len(free) == 3
    assert [free.pop(), free.pop(), free.pop()] == [0, 1, 2] and len(free) == 0


def test_plain_before_cached_and_cached_least_recently_freed_first():
    free = FreeBlocks(6)
    for _ in range(6):
        free.pop()
    free.push(4, cached=True)
    free.push(1, cached=False)
    free.push(2, cached=True)
    free.push(5, cached=False)
    assert list(free.order()) == [1, 5, 4, 2]
    assert [free.pop() for _ in range(4)] == [1, 5, 4, 2]


def test_taking_and_uncaching_cached_blocks():
    free = FreeBlocks(4)
    for _ in range(4):
        free.pop()
    for b in (0, 1, 2):
        free.push(b, cached=True)
    free.take_cached(1)  # a prefix-cache hit reuses it wherever it sits
    assert not free.is_cached(1) and list(free.order()) == [0, 2]
    free.uncache(2)  # lost its hash entry: it joins the plain class, allocated before any cached block
    assert list(free.order()) == [2, 0]
    free.push(3, cached=True)
    assert free.uncache_all() == [0, 3]
    assert list(free.order()) == [2, 0, 3] and not free.cached
