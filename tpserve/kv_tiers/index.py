"""KVTierIndex: the scheduler side of the KV tiers (numpy-free, torch-free bookkeeping).

It knows which chained block hashes the host-RAM tier and the disk tier hold (an LRU each,
bounded in blocks by their byte budgets per rank), and turns the block manager's evictions and
the scheduler's admissions into the commands of the next StepPlan (``build_connector_meta``):

- **save**: a full, hashed block the block manager is about to reuse (``on_evict``) is copied
  to the host tier and written behind to the disk tier (``to_host`` / ``to_disk`` per block);
- **drop_host** / **drop_disk**: entries the LRUs let go (RAM freed, files deleted);
- **load**: a job of blocks a new sequence found in a tier past its pool hit
  (``get_num_new_matched_tokens``, then ``update_state_after_alloc``), copied into the fresh
  blocks the sequence was allocated; **poll**: jobs in flight whose completion is asked for.

Invariants (``check_integrity``):

- the worker of every rank holds exactly the host entries listed here (it applies the same
  saves and drops in the same order); after a flush the disk directory of every rank holds
  exactly the disk entries;
- an entry a job in flight reads is pinned (``_pins`` counts the jobs reading it) and is never
  dropped; the LRUs exceed their capacity only by pinned entries;
- every block a job writes belongs to that job's sequence alone (ref_count 1, no hash until
  the load is done), so nothing reads it or evicts it while the load runs.

A tier is a cache: a block that does not arrive (a corrupt, truncated or foreign file, a write
that failed) is a miss, counted, dropped from the index, and recomputed.

KV-cache groups (a model with sliding-window layers, tpserve/kv_groups.py): a pool block holds
one group's layers, so the tiers keep each group's blocks apart, under the key
``tier_key(hash, group)`` (the chained hash itself for group 0). A hit is planned over every
group at once (``match_groups``, with ``BlockManager.tiered_hits``): each group needs the blocks
its next query reads (a full group every block of the prefix, a sliding group only the
window's), from the pool's prefix cache or from a tier. Such a load is all or nothing: if a
block does not arrive, the sequence gives its blocks back and is admitted again (a sliding
group holds no blocks before the window of the planned hit, so a shorter hit is no use).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tpserve.blockpool.block_manager import LOAD
from tpserve.blockpool.kv_events import BlockRemoved, BlockStored
from tpserve.blockpool.prefix_hash import block_hashes, chain_hash
from tpserve.kv_tiers import files
from tpserve.kv_tiers.connector import DISK, HOST, MEDIUM_DISK, MEDIUM_HOST, KVConnectorScheduler

log = logging.getLogger("tpserve.kv_tiers")

_TIER_NAMES = ("host", "disk")


def tier_key(block_hash: int, group: int) -> int:
    """The tiers' key of KV-cache group ``group``'s block with chained hash ``block_hash``."""
    return block_hash if group == 0 else chain_hash([group], block_hash)


@dataclass
class _Entry:
    parent: int                   # hash of the block before (-1: a first block)
    tokens: tuple | None          # the block's token ids; None for a file found at start-up
    group: int = 0                # the KV-cache group whose layers the block holds
    hash: int | None = None       # the chained hash (None: the key, group 0's)


@dataclass
class GroupPlan:
    """A hit over KV-cache groups (``match_groups``): ``end`` blocks, per group the pool's
    cached block ids, -1 (before a window) or LOAD (``BlockManager.tiered_hits``), and the
    (group, block index) and tier of each block to load."""
    end: int
    hits: list
    loads: list
    sources: list


@dataclass
class LoadJob:
    job_id: int
    seq: object
    first: int                    # index of the first loaded block in the sequence
    items: list                   # [block_id, hash, parent, token_ids, source] per block
    started: float
    orphan: bool = False          # the sequence ended while the job ran: free its blocks after
    results: list = field(default_factory=list)
    where: list | None = None     # with groups: (group, block index) per item, all or nothing
    end: int = 0                  # with groups: the blocks of the hit


class KVTierIndex(KVConnectorScheduler):
    """Host and disk tiers of one engine. ``block_bytes``: one block of one rank's shard;
    ``host_bytes`` / ``disk_bytes``: the budgets of all ranks together (each rank gets its
    share); ``disk_dir`` None: no disk tier; ``layout``: what the disk files were made for
    (files.fingerprint)."""

    def __init__(self, block_size: int, block_bytes: int, host_bytes: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0, layout: dict | None = None, tp_size: int = 1, clock=time.monotonic):
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.tp_size = tp_size
        self.clock = clock
        self.host: OrderedDict[int, _Entry] = OrderedDict()
        self.disk: OrderedDict[int, _Entry] = OrderedDict()
        self.host_capacity = max(int(host_bytes) // tp_size // block_bytes, 0)
        self.disk_dir = disk_dir
        self.file_bytes = files.file_size(block_size, block_bytes)
        self.disk_capacity = max(int(disk_bytes) // tp_size // self.file_bytes, 0) if disk_dir else 0
        self.layout = dict(layout or {})
        self.fingerprint = files.fingerprint(self.layout)
        self.hash_fn = chain_hash
        self.block_manager = None  # for its KV-event sink (attached by the scheduler)
        self._pins: dict[int, int] = {}
        self._save: list = []
        # Drops not yet sent, in order (dicts: a save of a hash cancels its pending drop, since
        # the worker applies a plan's saves before its drops).
        self._drop_host: dict[int, None] = {}
        self._drop_disk: dict[int, None] = {}
        self._load: list = []
        self._flush = False
        self.jobs: dict[int, LoadJob] = {}
        self._next_job = 1
        self.counters = {f"{t}_{c}": 0 for t in _TIER_NAMES
                         for c in ("hits", "misses", "loads", "saves", "corrupt", "load_s", "load_jobs")}
        self.hit_tokens = 0
        self.foreign_dirs = 0
        if disk_dir:
            self._open_disk()

    # ---- disk at start-up --------------------------------------------------------------------
    def _open_disk(self) -> None:
        """Adopt the files a daemon with the same layout left (least recently written first)."""
        try:
            if not files.check_manifest(self.disk_dir, self.fingerprint, self.layout):
                self.foreign_dirs += 1
                return
            good, bad = files.scan(files.rank_dir(self.disk_dir, self.fingerprint, 0), self.file_bytes)
        except OSError as e:
            log.warning("KV disk tier %s unusable (%s): running without it", self.disk_dir, e)
            self.disk_capacity = 0
            return
        for h in bad:
            self.counters["disk_corrupt"] += 1
            self._drop_disk[h] = None
        if bad:
            log.warning("KV disk tier: %d block file(s) of the wrong size, deleted", len(bad))
        for h in good:
            self.disk[h] = _Entry(-1, None)
        self._trim()
        if self.disk:
            log.info("KV disk tier: %d block(s) from %s", len(self.disk), self.disk_dir)

    # ---- lookups and loads (scheduler side of the seam) ------------------------------------
    def _find(self, h: int, parent: int, tokens: list[int], group: int = 0) -> int:
        """The tier holding block ``h`` (a tier key) with this parent, these tokens and group:
        HOST, DISK or -1."""
        e = self.host.get(h)
        if e is not None and e.parent == parent and e.tokens == tuple(tokens) and e.group == group:
            return HOST
        e = self.disk.get(h)
        if e is not None and (e.tokens is None or (e.parent == parent and e.tokens == tuple(tokens)
                                                   and e.group == group)):
            return DISK
        return -1

    def match(self, seq, num_computed_blocks: int) -> list[int]:
        """The tiers (HOST / DISK) of ``seq``'s full blocks from ``num_computed_blocks`` on, up
        to the first block no tier holds. Counts hits and misses."""
        bs = self.block_size
        num_full = len(seq.token_ids) // bs
        if num_computed_blocks >= num_full or not (self.host or self.disk):
            return []
        hashes = block_hashes(seq, num_full, self.hash_fn)
        out = []
        for i in range(num_computed_blocks, num_full):
            src = self._find(hashes[i], hashes[i - 1] if i else -1, seq.block(i))
            if src == -1:
                break
            out.append(src)
        c = self.counters
        hosts, short = out.count(HOST), len(out) < num_full - num_computed_blocks
        if self.host_capacity:
            c["host_hits"] += hosts
            c["host_misses"] += len(out) - hosts + short
        if self.disk_capacity:
            c["disk_hits"] += len(out) - hosts
            c["disk_misses"] += short
        return out

    def match_groups(self, seq, block_manager) -> GroupPlan | None:
        """With KV-cache groups: the longest hit of ``seq`` that the pool's prefix cache and the
        tiers serve together in every group, or None when it needs no tier block."""
        if not (self.host or self.disk):
            return None
        bs = self.block_size
        hashes = block_hashes(seq, len(seq.token_ids) // bs, self.hash_fn)
        found: dict[tuple[int, int], int] = {}

        def loadable(g: int, i: int) -> bool:
            src = self._find(tier_key(hashes[i], g), hashes[i - 1] if i else -1, seq.block(i), g)
            found[g, i] = src
            return src != -1

        end, hits = block_manager.tiered_hits(seq, loadable)
        loads = [(g, i) for g, ids in enumerate(hits) for i, b in enumerate(ids) if b == LOAD]
        if not loads:
            return None
        return GroupPlan(end, hits, loads, [found[w] for w in loads])

    def load_groups(self, seq, plan: GroupPlan) -> LoadJob:
        """Pin ``plan``'s tier entries (before the allocation: see ``reserve``)."""
        hashes = block_hashes(seq, plan.end, self.hash_fn)
        items = []
        for (g, i), src in zip(plan.loads, plan.sources):
            key = tier_key(hashes[i], g)
            self._pins[key] = self._pins.get(key, 0) + 1
            (self.host if src == HOST else self.disk).move_to_end(key)
            items.append([-1, key, hashes[i - 1] if i else -1, seq.block(i) if src == DISK else None, src])
        hosts = plan.sources.count(HOST)
        c = self.counters
        if self.host_capacity:
            c["host_hits"] += hosts
            c["host_misses"] += len(items) - hosts
        if self.disk_capacity:
            c["disk_hits"] += len(items) - hosts
        return LoadJob(0, seq, min(i for _, i in plan.loads), items, self.clock(), where=list(plan.loads),
                       end=plan.end)

    def start_group_load(self, job: LoadJob, block_manager) -> None:
        """``seq`` got its blocks (``BlockManager.allocate`` with the plan): queue the load."""
        tables = block_manager.tables(job.seq)
        for it, (g, i) in zip(job.items, job.where):
            it[0] = tables[g][i]
        job.job_id = self._next_job
        self._next_job += 1
        job.started = self.clock()
        self.jobs[job.job_id] = job
        self._load.append([job.job_id, job.items])

    def get_num_new_matched_tokens(self, seq, num_computed_blocks: int) -> int:
        return len(self.match(seq, num_computed_blocks)) * self.block_size

    def reserve(self, seq, first_block: int, sources: list[int]) -> None:
        """Pin the entries ``match`` found for ``seq`` before its blocks are allocated: the
        evictions that allocation causes save blocks into the tiers, and must not push out
        what is about to be loaded."""
        hashes = block_hashes(seq, first_block + len(sources), self.hash_fn)
        for k, src in enumerate(sources):
            h = hashes[first_block + k]
            self._pins[h] = self._pins.get(h, 0) + 1
            (self.host if src == HOST else self.disk).move_to_end(h)

    def update_state_after_alloc(self, seq, first_block: int, num_blocks: int, sources=None) -> LoadJob:
        """Load blocks ``first_block .. + num_blocks`` of ``seq`` (allocated, fresh) from the
        tiers ``sources`` (``match``'s answer, already ``reserve``d; looked up and reserved
        now if None). Returns the job."""
        if sources is None:
            sources = self.match(seq, first_block)[:num_blocks]
            self.reserve(seq, first_block, sources)
        hashes = block_hashes(seq, first_block + num_blocks, self.hash_fn)
        items = []
        for k, src in enumerate(sources):
            i = first_block + k
            h = hashes[i]
            items.append([seq.block_table[i], h, hashes[i - 1] if i else -1,
                          seq.block(i) if src == DISK else None, src])
        job = LoadJob(self._next_job, seq, first_block, items, self.clock())
        self._next_job += 1
        self.jobs[job.job_id] = job
        self._load.append([job.job_id, items])
        return job

    def update_connector_output(self, results: dict | None) -> list[tuple[LoadJob, int]]:
        """Apply the answer to this step's polls (job id -> per-block 1/0 on every rank);
        returns (job, number of leading blocks that arrived) per finished job."""
        done = []
        for job_id, oks in (results or {}).items():
            job = self.jobs.pop(int(job_id), None)
            if job is None:
                continue
            now = self.clock()
            oks = list(oks or ())[:len(job.items)]
            oks += [0] * (len(job.items) - len(oks))  # a job that failed on some rank: nothing arrived
            good = 0
            while good < len(oks) and oks[good]:
                good += 1
            deepest = max((it[4] for it in job.items), default=HOST)
            name = _TIER_NAMES[deepest]
            self.counters[f"{name}_load_s"] += now - job.started
            self.counters[f"{name}_load_jobs"] += 1
            for it, ok in zip(job.items, oks):
                h, src = it[1], it[4]
                self._unpin(h)
                tier = _TIER_NAMES[src]
                if ok:
                    self.counters[f"{tier}_loads"] += 1
                else:
                    self.counters[f"{tier}_corrupt" if src == DISK else f"{tier}_misses"] += 1
                    self._forget(h, src)
            done.append((job, good))
        self._trim()
        return done

    def request_finished(self, seq) -> bool:
        """True (blocks must stay held) when a load into ``seq``'s blocks is in flight."""
        for job in self.jobs.values():
            if job.seq is seq:
                job.orphan = True
                return True
        return False

    def loading(self, seq) -> bool:
        return any(job.seq is seq for job in self.jobs.values())

    # ---- saves (block evictions) -----------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: int, parent_hash: int, token_ids: list[int],
                 group: int = 0) -> None:
        """Block ``block_id`` (hash ``block_hash``, of KV-cache group ``group``) is about to be
        reused: keep its KV."""
        key = tier_key(block_hash, group)
        to_host = self.host_capacity > 0 and key not in self.host
        to_disk = self.disk_capacity > 0 and key not in self.disk
        if key in self.host:
            self.host.move_to_end(key)
        if key in self.disk:
            self.disk.move_to_end(key)
        if not (to_host or to_disk):
            return
        self._save.append([block_id, key, parent_hash, list(token_ids), to_host, to_disk])
        entry = _Entry(parent_hash, tuple(token_ids), group, block_hash)
        for on, tier, drops, name, medium in ((to_host, self.host, self._drop_host, "host", MEDIUM_HOST),
                                              (to_disk, self.disk, self._drop_disk, "disk", MEDIUM_DISK)):
            if on:
                drops.pop(key, None)
                tier[key] = entry
                self.counters[f"{name}_saves"] += 1
                self._event(BlockStored([block_hash], None if parent_hash == -1 else parent_hash,
                                        list(token_ids), self.block_size, medium, *self._spec(group)))
        self._trim()

    def _spec(self, group: int) -> tuple:
        """The KV-event fields naming ``group`` (group_idx, kind, window)."""
        bm = self.block_manager
        if bm is None or not group:
            return ()
        g = bm.groups[group]
        return group, g.kind, g.window

    def flush(self, block_manager) -> None:
        """Before a shutdown: write every cached pool block the disk tier lacks, and ask the
        workers to finish their writes (the next plan's ``flush``)."""
        if self.disk_capacity <= 0:
            return
        for g, index in enumerate(block_manager.group_hashes):
            for h, b in list(index.items()):
                key = tier_key(h, g)
                if key not in self.disk:
                    block = block_manager.blocks[b]
                    self._save.append([b, key, block.parent_hash, list(block.token_ids), False, True])
                    self._drop_disk.pop(key, None)
                    self.disk[key] = _Entry(block.parent_hash, tuple(block.token_ids), g, h)
                    self.counters["disk_saves"] += 1
        self._trim()
        self._flush = True

    def clear(self) -> None:
        """Forget every unpinned entry of both tiers (the weights changed)."""
        for h in [h for h in self.host if h not in self._pins]:
            self._forget(h, HOST)
        for h in [h for h in self.disk if h not in self._pins]:
            self._forget(h, DISK)

    # ---- the plan's commands -------------------------------------------------------------------
    def has_work(self) -> bool:
        """Commands wait for a plan, or loads are in flight."""
        return bool(self._save or self._drop_host or self._drop_disk or self._load or self.jobs
                    or self._flush)

    def build_connector_meta(self, wait: bool = False) -> dict | None:
        """This step's commands (the plan's ``args["kv"]``), or None; ``wait``: the workers
        wait for the polled loads (nothing else is runnable)."""
        meta = {}
        for key, lst in (("save", self._save), ("drop_host", self._drop_host),
                         ("drop_disk", self._drop_disk), ("load", self._load)):
            if lst:
                meta[key] = list(lst)
                lst.clear()
        if self.jobs:
            meta["poll"] = list(self.jobs)
            if wait:
                meta["wait"] = True
        if self._flush:
            meta["flush"] = True
            self._flush = False
        return meta or None

    # ---- LRU -----------------------------------------------------------------------------------
    def _unpin(self, h: int) -> None:
        n = self._pins[h] - 1
        if n:
            self._pins[h] = n
        else:
            del self._pins[h]

    def _forget(self, h: int, src: int) -> None:
        tier = self.host if src == HOST else self.disk
        e = tier.pop(h, None)
        if e is None:
            return
        (self._drop_host if src == HOST else self._drop_disk)[h] = None
        medium = MEDIUM_HOST if src == HOST else MEDIUM_DISK
        self._event(BlockRemoved([h if e.hash is None else e.hash], medium, *self._spec(e.group)))

    def _trim(self) -> None:
        for src, tier, cap in ((HOST, self.host, self.host_capacity), (DISK, self.disk, self.disk_capacity)):
            if len(tier) <= cap:
                continue
            victims = []
            for h in tier:  # least recently used first
                if len(tier) - len(victims) <= cap:
                    break
                if h not in self._pins:
                    victims.append(h)
            for h in victims:
                self._forget(h, src)

    def _event(self, event) -> None:
        sink = self.block_manager.kv_events if self.block_manager is not None else None
        if sink is not None:
            sink.add(event)

    # ---- views -----------------------------------------------------------------------------------
    def tier_blocks(self) -> list[tuple]:
        """(hash, parent, token ids, medium) of every tier entry, for a KV-events resync; a
        block of KV-cache group g > 0 adds (g, kind, window)."""
        out = []
        for tier, medium in ((self.host, MEDIUM_HOST), (self.disk, MEDIUM_DISK)):
            for h, e in tier.items():
                out.append((h if e.hash is None else e.hash, None if e.parent == -1 else e.parent,
                            list(e.tokens or ()), medium, *self._spec(e.group)))
        return out

    def stats(self) -> dict:
        c, tp = self.counters, self.tp_size
        s = {"kv_offload_hit_tokens": self.hit_tokens, "kv_offload_loads_in_flight": len(self.jobs)}
        for name, tier, cap, size in (("host", self.host, self.host_capacity, self.block_bytes),
                                      ("disk", self.disk, self.disk_capacity, self.file_bytes)):
            jobs = c[f"{name}_load_jobs"]
            s.update({
                f"kv_offload_{name}_blocks": len(tier),
                f"kv_offload_{name}_bytes": len(tier) * size * tp,
                f"kv_offload_{name}_capacity_bytes": cap * size * tp,
                f"kv_offload_{name}_hits": c[f"{name}_hits"],
                f"kv_offload_{name}_misses": c[f"{name}_misses"],
                f"kv_offload_{name}_loads": c[f"{name}_loads"],
                f"kv_offload_{name}_saves": c[f"{name}_saves"],
                f"kv_offload_{name}_corrupt": c[f"{name}_corrupt"],
                f"kv_offload_{name}_load_seconds_total": c[f"{name}_load_s"],
                f"kv_offload_{name}_load_jobs": jobs,
                f"kv_offload_{name}_load_ms_avg": 1000 * c[f"{name}_load_s"] / jobs if jobs else 0.0,
            })
        return s

    def check_integrity(self, block_manager, holders) -> None:
        """Raise AssertionError naming the first broken invariant (module docstring).
        ``holders``: sequence -> its block table, for every live sequence."""
        pins: dict[int, int] = {}
        for job in self.jobs.values():
            tables = block_manager.tables(job.seq)
            where = job.where or [(0, job.first + k) for k in range(len(job.items))]
            for (g, i), it in zip(where, job.items):
                pins[it[1]] = pins.get(it[1], 0) + 1
                b = it[0]
                assert tables[g][i] == b, f"load job {job.job_id}: block {b} left its sequence"
                assert block_manager.blocks[b].group == g, f"load job {job.job_id}: block {b} changed group"
                block = block_manager.blocks[b]
                assert block.ref_count == 1 and block.hash == -1, \
                    f"block {b} is being loaded but is shared or hashed ({block!r})"
                assert b in block_manager.used_block_ids, f"block {b} is being loaded but is free"
        assert pins == self._pins, f"tier pins {self._pins} differ from the loads in flight {pins}"
        for name, tier, cap in (("host", self.host, self.host_capacity),
                                ("disk", self.disk, self.disk_capacity)):
            over = len(tier) - cap
            assert over <= 0 or over <= sum(1 for h in tier if h in pins), \
                f"{name} tier holds {len(tier)} blocks, capacity {cap}"
