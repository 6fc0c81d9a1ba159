"""KVTransfer: the worker side of the KV tiers on one rank (tpserve/kv_tiers/connector.py).

It holds this rank's host tier (block hash -> a CPU tensor of the block's K and V, every layer)
and writes and reads this rank's files of the disk tier (tpserve/kv_tiers/files.py). The tiers
store what the pool stores: a block is the bytes of its slice of every tensor of every layer (K
and V; with an int8 cache also their scales, kernels/kv_quant.py), in layer order. The
scheduler side decides everything; ``handle`` runs one plan's commands before its forward:

1. **save**: gather the listed blocks out of the KV tensors now (the forward may overwrite
   them), keep them in the host tier and/or queue them for the writer thread;
2. **drop_host** / **drop_disk**: free host entries; queue file deletions (the writer thread
   runs writes and deletions in order, so a deletion never overtakes its write);
3. **load**: start a job on the loader thread: each block is read from the host tier, the
   writer's queue (not written yet) or its file (header, tokens and checksum verified), then
   all are copied into their blocks of the KV tensors. A block that cannot be read is reported
   missing, never copied;
4. **poll**: the jobs finished on this rank (``wait``: wait for them); with tensor parallelism
   an all-reduce (MIN) makes the ranks agree on which jobs are done and which blocks arrived on
   every rank. Rank 0 returns ``{job_id: [1/0 per block]}``.
5. **flush**: wait until every queued write is on disk (before a shutdown).

The blocks a job writes belong to one waiting sequence, which no forward reads, so the loader
thread and the serving loop never touch the same block.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tpserve.kv_tiers import files
from tpserve.kv_tiers.connector import DISK, KVConnectorWorker

log = logging.getLogger("tpserve.kv_tiers")


def kv_layout(config, runner_dtype: torch.dtype, tp_size: int, num_layers: int, kv_heads: int,
              head_dim: int, kv_dtype: torch.dtype | None = None, groups=None) -> dict:
    """What a disk tier's files are made for (files.fingerprint hashes it). ``groups``: the
    KV-cache groups (kv_groups.py) when a block holds one group's layers."""
    kv = str(kv_dtype or runner_dtype).replace("torch.", "")
    layout = {**files.model_identity(config.model_path), "dtype": str(runner_dtype).replace("torch.", ""),
              "kv_cache_dtype": kv,
              "block_size": config.block_size, "tensor_parallel_size": tp_size, "num_layers": num_layers,
              "kv_heads_per_rank": kv_heads, "head_dim": head_dim, "quantization": config.quantization}
    if groups:
        layout["kv_groups"] = [[g.kind, g.window, list(g.layers)] for g in groups]
    return layout


class KVTransfer(KVConnectorWorker):
    def __init__(self, config, rank: int, tp_group, layout: dict):
        self.rank = rank
        self.group = tp_group  # None: one rank
        self.fingerprint = files.fingerprint(layout)
        self.block_size = config.block_size
        self.dir = None
        if config.kv_offload_dir:
            self.dir = files.rank_dir(config.kv_offload_dir, self.fingerprint, rank)
            self.dir.mkdir(parents=True, exist_ok=True)
        self.host: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}  # queued for writing, not on disk yet
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue()
        self._writer = None
        if self.dir is not None:
            self._writer = threading.Thread(target=self._write_loop, name="tpserve-kv-writer", daemon=True)
            self._writer.start()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tpserve-kv-loader")
        self.jobs: dict[int, Future] = {}
        self.num_corrupt = 0
        self.num_write_errors = 0
        self.kv_caches: list = []

    def register_kv_caches(self, kv_caches: list) -> None:
        """Per layer a tuple of tensors indexed by block on dim 0: (K, V), or (K, V, K scales,
        V scales) for an int8 cache. A block's bytes: each tensor's block slice, layer by layer.
        With KV-cache groups the layers of several groups share a tensor (a slab,
        workers/kv_group_runner.py): each is stored once, and a block holds its group's layers."""
        self.kv_caches = kv_caches
        seen: set[int] = set()
        self.tensors = []
        for layer in kv_caches:
            for t in layer:
                if id(t) not in seen:
                    seen.add(id(t))
                    self.tensors.append(t)
        self.slice_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.slice_bytes)

    # ---- one plan's commands -------------------------------------------------------------
    def handle(self, meta: dict) -> dict | None:
        if meta.get("save"):
            self._save(meta["save"])
        for h in meta.get("drop_host", ()):
            self.host.pop(h, None)
        for h in meta.get("drop_disk", ()):
            self._writes.put(("delete", h, None))
        for job_id, items in meta.get("load", ()):
            self.jobs[job_id] = self._loader.submit(self._load, items)
        if meta.get("flush"):
            self.flush()
        if meta.get("poll"):
            return self._poll(meta["poll"], bool(meta.get("wait")))
        return None

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """uint8 [n, block_bytes] copies of the blocks."""
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        out = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        pos = 0
        for t, size in zip(self.tensors, self.slice_bytes):
            out[:, pos:pos + size] = t.index_select(0, idx).cpu().reshape(n, -1).view(torch.uint8)
            pos += size
        return out

    def _save(self, saves: list) -> None:
        data = self._gather([s[0] for s in saves])
        for i, (_, h, parent, tokens, to_host, to_disk) in enumerate(saves):
            block = data[i].clone()
            if to_host:
                self.host[h] = block
            if to_disk and self._writer is not None:
                with self._lock:
                    self.pending[h] = block
                self._writes.put(("write", h, (parent, tokens, block)))

    # ---- disk writes (writer thread) -------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            op, h, arg = self._writes.get()
            try:
                if op == "stop":
                    return
                path = self.dir / files.block_name(h)
                if op == "write":
                    parent, tokens, block = arg
                    payload = block.reshape(-1).view(torch.uint8).numpy()
                    try:
                        files.write_atomic(path, b"".join(files.encode_block(
                            self.fingerprint, h, parent, self.rank, tokens, memoryview(payload))))
                    except OSError as e:
                        self.num_write_errors += 1
                        log.warning("KV disk tier: could not write %s (%s)", path, e)
                    with self._lock:
                        if self.pending.get(h) is block:
                            del self.pending[h]
                else:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        log.warning("KV disk tier: could not delete %s (%s)", path, e)
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        if self._writer is not None:
            self._writes.join()

    # ---- loads (loader thread) ---------------------------------------------------------------
    def _read(self, h: int, parent: int, tokens, source: int) -> torch.Tensor | None:
        block = self.host.get(h) if source != DISK else None
        if block is not None:
            return block
        with self._lock:
            block = self.pending.get(h)
        if block is not None:
            return block
        if self.dir is None:
            return None
        path = self.dir / files.block_name(h)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            self.num_corrupt += 1
            log.warning("KV disk tier: block file %s unreadable (%s): recomputing", path, e)
            return None
        nbytes = self.block_bytes
        payload, why = files.decode_block(data, self.fingerprint, h, parent, self.rank, tokens, nbytes)
        if payload is None:
            self.num_corrupt += 1
            log.warning("KV disk tier: block file %s %s: recomputing (deleted)", path, why)
            self._writes.put(("delete", h, None))
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _load(self, items: list) -> list[int]:
        oks, ids, blocks = [], [], []
        for block_id, h, parent, tokens, source in items:
            try:
                block = self._read(h, parent, tokens, source)
            except Exception as e:  # a tier is a cache: anything unexpected is a miss
                log.warning("KV tier: loading block %016x failed (%s)", h, e)
                block = None
            oks.append(int(block is not None))
            if block is not None:
                ids.append(block_id)
                blocks.append(block)
        if ids:
            data = torch.stack(blocks)
            device = self.tensors[0].device
            idx = torch.tensor(ids, dtype=torch.long, device=device)
            data = data.to(device)
            pos = 0
            for t, size in zip(self.tensors, self.slice_bytes):
                part = data[:, pos:pos + size].contiguous().view(t.dtype).view(len(ids), *t.shape[1:])
                t.index_copy_(0, idx, part)
                pos += size
        return oks

    def _poll(self, job_ids: list[int], wait: bool) -> dict | None:
        done = []
        for j in job_ids:
            fut = self.jobs.get(j)
            if fut is not None and wait:
                fut.exception()
            done.append(int(fut is not None and fut.done()))
        if self.group is not None:
            t = torch.tensor(done, dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            done = t.tolist()
        finished = [j for j, d in zip(job_ids, done) if d]
        if not finished:
            return None
        results = {}
        for j in finished:
            fut = self.jobs.pop(j)
            try:
                results[j] = fut.result()
            except Exception as e:
                log.warning("KV tier: load job %d failed (%s)", j, e)
                results[j] = None
        if self.group is not None:
            sizes = [len(r) if r is not None else -1 for r in results.values()]
            t = torch.tensor(sizes, dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flat = []
            for (j, r), n in zip(results.items(), t.tolist()):
                flat += r if r is not None and len(r) == n else [0] * max(n, 0)
            f = torch.tensor(flat, dtype=torch.int32)
            dist.all_reduce(f, op=dist.ReduceOp.MIN, group=self.group)
            flat, pos = f.tolist(), 0
            for j, n in zip(list(results), t.tolist()):
                results[j] = flat[pos:pos + max(n, 0)]
                pos += max(n, 0)
        return {j: (r if r is not None else []) for j, r in results.items()}

    def close(self) -> None:
        """Finish the queued disk writes and stop the threads."""
        self._loader.shutdown(wait=True)
        if self._writer is not None:
            self._writes.put(("stop", 0, None))
            self._writer.join(timeout=60)
            self._writer = None
