"""KV-cache tiers below the paged pool: host RAM and a disk directory that outlives the daemon.

``connector``: the seam, shaped like vLLM's KV connector (a scheduler side and a worker side);
``files``: the disk format (manifest, block files, checksums); both import nothing of tpserve,
so the workers may use them. ``index``: the scheduler side (no torch): which block hashes each
tier holds, the loads and saves of a step (it imports blockpool: scheduler side only).
The worker side, which copies blocks between the KV tensors and the tiers, is
``tpserve/workers/kv_transfer.py``. docs/kv_tiers.md describes the whole.
"""
