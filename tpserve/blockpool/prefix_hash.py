"""The chained block hash of the prefix cache, and its memo on a sequence.

Hash of full block i = xxh64(hash of block i - 1, token ids of block i), each as a 64-bit
unsigned integer; block 0 hashes its token ids alone. A sequence's full blocks never change,
so their hashes are computed once and kept in ``seq.block_hashes`` (blocks 0, 1, ... in order).
"""
from __future__ import annotations

from array import array
from typing import Callable

import xxhash

HashFn = Callable[[list[int], int], int]


def chain_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxh64 over ``prefix`` (unless -1, meaning no block before) and ``token_ids`` (all >= 0)."""
    if prefix == -1:
        return xxhash.xxh64_intdigest(array("Q", token_ids))
    return xxhash.xxh64_intdigest(array("Q", [prefix, *token_ids]))


def block_hashes(seq, num_blocks: int, hash_fn: HashFn = chain_hash) -> list[int]:
    """``seq.block_hashes``, extended so it covers at least the first ``num_blocks`` blocks
    (which must be full). Tokens come from ``seq.block(i)``."""
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):
        hashes.append(hash_fn(seq.block(i), hashes[i - 1] if i else -1))
    return hashes
