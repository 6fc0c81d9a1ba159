"""KV-cache tiers below the paged pool: host RAM and a disk directory that outlives the daemon.

``connector``: the seam, shaped like vLLM's KV connector (a scheduler side and a worker side);
``index``: the scheduler side (numpy, no torch): which block hashes each tier holds, the loads
and saves of a step; ``files``: the disk format (manifest, block files, checksums).
The worker side, which copies blocks between the KV tensors and the tiers, is
``tpserve/workers/kv_transfer.py``. docs/kv_tiers.md describes the whole.
"""
from tpserve.kv_tiers.connector import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_POOL
from tpserve.kv_tiers.index import KVTierIndex

__all__ = ["KVTierIndex", "MEDIUM_DISK", "MEDIUM_HOST", "MEDIUM_POOL"]
