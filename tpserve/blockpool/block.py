"""Block: one physical KV-cache block of the pool, as the block manager sees it.

A block holds the keys and values of ``block_size`` consecutive tokens of some sequence.
The tensors live on the runners; this object only carries the bookkeeping:

- ``ref_count``: how many live block tables hold the block (0 = free).
- ``hash``: chained hash of the block's tokens and of everything before them, or -1 when the
  block is not (or no longer) part of the prefix cache. Only full blocks whose KV has been
  written are ever hashed.
- ``token_ids``: the tokens of a hashed block, compared on every cache hit so that a hash
  collision can never hand out a block with other contents.
- ``serial``: a number unique to this tenancy of the block, renewed each time the block is
  handed out fresh; ``parent_serial`` is the serial of the block before it in the block table
  of the sequence that hashed it (-1 for a first block). Together they let a cache hit check
  that the block was computed after exactly the blocks already matched, so even a collision of
  the chained hash cannot splice the KV of another prefix into a sequence.
- ``parent_hash``: the hash the block's own was chained from (-1 for a first block), kept
  for a KV-events resync: the parent may have left the cache while the block stays in it.
- ``group``: the KV-cache group (kv_groups.py) whose layers the block's contents belong to,
  set each time the block is handed out fresh; 0 for a model with one group.
"""
from __future__ import annotations


class Block:
    """Bookkeeping of one physical block. Fields are read directly (tests and the manager)."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "serial", "parent_serial", "parent_hash",
                 "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.serial = -1
        self.parent_serial = -1
        self.parent_hash = -1
        self.group = 0

    def update(self, hash: int, token_ids: list[int], parent_serial: int, parent_hash: int = -1) -> None:
        """Record that the block is full and cacheable under ``hash`` (chained from ``parent_hash``)."""
        self.hash = hash
        self.token_ids = token_ids
        self.parent_serial = parent_serial
        self.parent_hash = parent_hash

    def reset(self, serial: int, group: int = 0) -> None:
        """Hand the block out fresh to ``group``: one holder, no hash, no contents yet."""
        self.group = group
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.serial = serial
        self.parent_serial = -1
        self.parent_hash = -1

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, ref_count={self.ref_count}, hash={self.hash}, "
                f"num_tokens={len(self.token_ids)})")
