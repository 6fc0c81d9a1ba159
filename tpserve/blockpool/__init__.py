"""The KV-cache block pool: block ids, ref counts and the chained-hash prefix cache."""
from tpserve.blockpool.block import Block
from tpserve.blockpool.block_manager import BlockManager

__all__ = ["Block", "BlockManager"]
