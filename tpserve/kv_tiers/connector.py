"""The KV-connector seam, shaped like vLLM's (``KVConnectorBase_V1``): a scheduler side that
decides, and a worker side on every rank that moves bytes.

Scheduler side (rank 0, numpy, no torch; :class:`KVConnectorScheduler`):

- ``get_num_new_matched_tokens(seq, num_computed_blocks)``: how many tokens past the pool's
  prefix-cache hit the connector can supply (whole blocks, in order);
- ``update_state_after_alloc(seq, first_block, num_blocks)``: the sequence got its blocks; the
  connector loads the ``num_blocks`` blocks from ``first_block`` of its block table;
- ``on_evict(block_id, hash, parent_hash, token_ids, group)``: the block manager is about to
  reuse a full, hashed block (of KV-cache group ``group``): what the connector wants of it must
  be saved in this step;
- ``build_connector_meta()``: this step's commands, which travel in the StepPlan's args under
  ``"kv"`` (so every rank sees them; plain msgpack values, no pickle);
- ``update_connector_output(results)``: rank 0's answer to those commands: the loads done on
  every rank and, per block, whether it arrived (a block that did not is recomputed);
- ``request_finished(seq)``: a sequence ended; True when its blocks must stay allocated until
  a load into them is done (the scheduler frees them later).

Worker side (every rank, torch; :class:`KVConnectorWorker`, tpserve/workers/kv_transfer.py):

- ``register_kv_caches(kv_caches)``: the rank's per-layer (K, V) tensors (with an int8 cache also
  their scales);
- ``handle(meta)``: run one step's commands before the forward: saves (copied out of the KV
  tensors at once, as the next forward may overwrite the blocks), drops, loads (started on a
  background thread: the serving loop does not wait) and polls (loads finished on every rank;
  with tensor parallelism the ranks agree through two small all-reduces);
- ``close()``: finish pending disk writes.

Each rank stores and loads only its own shard; block ids and hashes are the same on every rank.
Block-medium names are vLLM's KV-event media.
"""
from __future__ import annotations

import abc

MEDIUM_POOL = "GPU"      # vLLM's name for the engine's KV pool (on CPU too)
MEDIUM_HOST = "CPU"      # the host-RAM tier
MEDIUM_DISK = "STORAGE"  # the disk tier
HOST, DISK = 0, 1  # where a load command's block comes from, as the plan carries it


class KVConnectorScheduler(abc.ABC):
    """Scheduler side of the seam (see the module docstring). The defaults supply nothing."""

    def get_num_new_matched_tokens(self, seq, num_computed_blocks: int) -> int:
        return 0

    @abc.abstractmethod
    def update_state_after_alloc(self, seq, first_block: int, num_blocks: int) -> None:
        """Load the blocks the connector supplies into the sequence's new blocks."""

    def on_evict(self, block_id: int, block_hash: int, parent_hash: int, token_ids: list[int],
                 group: int = 0) -> None:
        pass

    def build_connector_meta(self) -> dict | None:
        return None

    def update_connector_output(self, results: dict | None) -> list:
        return []

    def request_finished(self, seq) -> bool:
        return False


class KVConnectorWorker(abc.ABC):
    """Worker side of the seam (see the module docstring)."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list) -> None:
        """The rank's KV tensors, once allocated."""

    @abc.abstractmethod
    def handle(self, meta: dict) -> dict | None:
        """Run one step's commands; rank 0's results (or None)."""

    def close(self) -> None:
        pass
