"""The KV tiers without a model: the disk format (kv_tiers/files.py) and the scheduler side's
index (kv_tiers/index.py): lookups, pins, LRU budgets, failed loads, commands."""
from __future__ import annotations

import os
import time

import pytest

from tpserve.blockpool.block_manager import BlockManager
from tpserve.blockpool.kv_events import BlockRemoved, BlockStored, KVEventSink
from tpserve.blockpool.prefix_hash import chain_hash
from tpserve.kv_tiers import files
from tpserve.kv_tiers.connector import DISK, HOST
from tpserve.kv_tiers.index import KVTierIndex

FP = files.fingerprint({"model": "m", "block_size": 2})


class Seq:
    """The parts of a scheduler Sequence the index reads."""

    def __init__(self, tokens, block_size=2):
        self.token_ids = list(tokens)
        self.block_size = block_size
        self.block_hashes = []
        self.block_table = []

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


def hashes(tokens, bs=2):
    out, h = [], -1
    for i in range(len(tokens) // bs):
        h = chain_hash(tokens[i * bs:(i + 1) * bs], h)
        out.append(h)
    return out


# ---- files -----------------------------------------------------------------------------------
def test_a_block_file_round_trips_and_every_wrong_field_is_refused():
    payload = bytes(range(64))
    data = b"".join(files.encode_block(FP, 7, 5, 1, [3, 4], payload))
    assert len(data) == files.file_size(2, 64)
    got, why = files.decode_block(data, FP, 7, 5, 1, [3, 4], 64)
    assert bytes(got) == payload and why == ""
    assert files.decode_block(data, FP, 7, 5, 1, None, 64)[0] is not None  # tokens unknown: any
    other_fp = files.fingerprint({"model": "other"})
    cases = {
        "truncated": (data[:-1], FP, 7, 5, 1, [3, 4]),
        "short": (data[:10], FP, 7, 5, 1, [3, 4]),
        "written for another model or layout": (data, other_fp, 7, 5, 1, [3, 4]),
        "another block": (data, FP, 8, 5, 1, [3, 4]),
        "parent": (data, FP, 7, -1, 1, [3, 4]),
        "rank": (data, FP, 7, 5, 0, [3, 4]),
        "other token ids": (data, FP, 7, 5, 1, [3, 5]),
    }
    for name, args in cases.items():
        assert files.decode_block(*args, 64)[0] is None, name
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert files.decode_block(bytes(flipped), FP, 7, 5, 1, [3, 4], 64) == (None, "checksum mismatch")
    assert files.decode_block(b"JUNK" + data[4:], FP, 7, 5, 1, [3, 4], 64)[1] == "not a block file"


def test_atomic_writes_and_the_scan_in_write_order(tmp_path):
    size = files.file_size(2, 8)
    for h in (3, 1, 2):
        files.write_atomic(tmp_path / files.block_name(h),
                           b"".join(files.encode_block(FP, h, -1, 0, [1, 2], b"x" * 8)))
        t = time.time_ns() + h * 10**9
        os.utime(tmp_path / files.block_name(h), ns=(t, t))
    (tmp_path / files.block_name(9)).write_bytes(b"short")
    (tmp_path / ".tmpfile.kv").write_bytes(b"x" * size)
    (tmp_path / "notes.txt").write_text("x")
    good, bad = files.scan(tmp_path, size)
    assert good == [1, 2, 3] and bad == [9]
    assert not list(tmp_path.glob(".*.tmp"))
    assert files.scan(tmp_path / "missing", size) == ([], [])


def test_the_manifest_names_the_layout(tmp_path):
    layout = {"model": "m", "block_size": 2}
    fp = files.fingerprint(layout)
    assert files.check_manifest(tmp_path, fp, layout)
    assert files.check_manifest(tmp_path, fp, layout)  # the same layout again
    assert not files.check_manifest(tmp_path, fp, {"model": "m", "block_size": 4})  # rewritten
    assert files.check_manifest(tmp_path, fp, {"model": "m", "block_size": 4})
    assert fp != files.fingerprint({"model": "m", "block_size": 4})


# ---- the index --------------------------------------------------------------------------------
def index(host_blocks=4, disk_dir=None, disk_blocks=0, bb=100):
    fb = files.file_size(2, bb)
    return KVTierIndex(2, bb, host_blocks * bb, disk_dir, disk_blocks * fb, {"model": "m"})


def evict_seq(ix, tokens, first_block_id=0):
    hs = hashes(tokens)
    for i, h in enumerate(hs):
        ix.on_evict(first_block_id + i, h, hs[i - 1] if i else -1, tokens[2 * i:2 * i + 2])
    return hs


def test_evicted_blocks_are_saved_found_and_loaded():
    ix = index(host_blocks=8)
    toks = list(range(10, 20))
    hs = evict_seq(ix, toks)
    meta = ix.build_connector_meta()
    assert [s[1] for s in meta["save"]] == hs and all(s[4] and not s[5] for s in meta["save"])
    assert ix.build_connector_meta() is None  # commands go out once
    seq = Seq(toks + [1])  # 5 full blocks, one more token
    assert ix.match(seq, 0) == [HOST] * 5
    assert ix.match(seq, 3) == [HOST] * 2
    assert ix.get_num_new_matched_tokens(Seq(toks[:4] + [99, 98]), 0) == 4  # stops at a miss
    ix.reserve(seq, 1, [HOST] * 4)
    seq.block_table = [50, 51, 52, 53, 54, 55]
    job = ix.update_state_after_alloc(seq, 1, 4, [HOST] * 4)
    meta = ix.build_connector_meta()
    assert meta["load"] == [[job.job_id, [[51 + k, hs[1 + k], hs[k], None, HOST] for k in range(4)]]]
    assert meta["poll"] == [job.job_id]
    assert ix.build_connector_meta(wait=True) == {"poll": [job.job_id], "wait": True}
    done = ix.update_connector_output({job.job_id: [1, 1, 0, 1]})
    assert done == [(job, 2)] and not ix.jobs and not ix._pins
    assert hs[3] not in ix.host  # a block that did not arrive is forgotten
    assert ix.build_connector_meta() == {"drop_host": [hs[3]]}
    s = ix.stats()
    assert s["kv_offload_host_loads"] == 3 and s["kv_offload_host_misses"] >= 1


def test_the_lru_keeps_its_budget_but_never_drops_a_pinned_entry():
    ix = index(host_blocks=3)
    a = evict_seq(ix, [1, 2, 3, 4, 5, 6])
    seq = Seq([1, 2, 3, 4, 5, 6])
    ix.reserve(seq, 1, [HOST] * 2)  # blocks 1 and 2 pinned, block 0 not
    b = evict_seq(ix, [7, 8, 9, 10], first_block_id=10)
    assert a[1] in ix.host and a[2] in ix.host and a[0] not in ix.host  # the unpinned LRU entry went
    assert len(ix.host) == 3 and b[1] in ix.host and b[0] not in ix.host
    seq.block_table = [0, 1, 2]
    job = ix.update_state_after_alloc(seq, 1, 2, [HOST] * 2)
    ix.update_connector_output({job.job_id: [1, 1]})
    assert list(ix.host) == [a[1], a[2], b[1]]  # reserving made them recent before b came
    meta = ix.build_connector_meta()
    assert meta["drop_host"] == [a[0], b[0]]
    ix.clear()
    assert not ix.host and set(ix.build_connector_meta()["drop_host"]) == {b[1], a[1], a[2]}


def test_a_job_that_failed_on_a_rank_unpins_everything():
    ix = index(host_blocks=4)
    hs = evict_seq(ix, [1, 2, 3, 4])
    seq = Seq([1, 2, 3, 4, 5])
    src = ix.match(seq, 0)
    ix.reserve(seq, 0, src)
    seq.block_table = [0, 1, 2]
    job = ix.update_state_after_alloc(seq, 0, 2, src)
    assert ix.update_connector_output({job.job_id: []}) == [(job, 0)]
    assert not ix._pins and not ix.host and set(ix.build_connector_meta()["drop_host"]) == set(hs)


def test_disk_entries_survive_a_new_index_and_the_budget_holds(tmp_path):
    ix = index(host_blocks=0, disk_dir=str(tmp_path), disk_blocks=2)
    hs = evict_seq(ix, [1, 2, 3, 4, 5, 6])
    meta = ix.build_connector_meta()
    assert all(not s[4] and s[5] for s in meta["save"])
    assert list(ix.disk) == hs[1:] and meta["drop_disk"] == [hs[0]]
    d = files.rank_dir(tmp_path, ix.fingerprint, 0)
    d.mkdir(parents=True, exist_ok=True)
    for h in hs[1:]:  # what the worker would have written
        (d / files.block_name(h)).write_bytes(b"\0" * ix.file_bytes)
    (d / files.block_name(123)).write_bytes(b"\0" * 5)
    again = index(host_blocks=0, disk_dir=str(tmp_path), disk_blocks=2)
    assert set(again.disk) == set(hs[1:]) and again.counters["disk_corrupt"] == 1
    assert again.build_connector_meta() == {"drop_disk": [123]}
    seq = Seq([1, 2, 3, 4, 5, 6])
    assert again.match(seq, 1) == [DISK, DISK]  # tokens unknown until the worker reads the file
    assert again.match(seq, 0) == []  # block 0 is gone


def test_the_block_manager_reports_evictions_and_the_events_carry_the_medium():
    bm = BlockManager(4, 2)
    bm.kv_events = KVEventSink()
    ix = index(host_blocks=8)
    ix.block_manager = bm
    bm.offload = ix

    class S(Seq):
        num_cached_tokens = num_prefix_hit_tokens = num_hashed_blocks = 0
        pooling = None

        @property
        def num_blocks(self):
            return -(-len(self.token_ids) // self.block_size)

    a = S([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = 8
    bm.hash_blocks(a)
    bm.deallocate(a)
    b = S([9, 9, 9, 9, 9, 9])
    bm.allocate(b, bm.can_allocate(b))  # takes three of a's cached blocks
    saved = ix.build_connector_meta()["save"]
    assert len(saved) == 3 and {s[1] for s in saved} <= set(hashes(a.token_ids))
    events = bm.kv_events.drain()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    gone = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert len(cpu) == 3 and len(gone) == 3
    assert {e.block_hashes[0] for e in cpu} == {e.block_hashes[0] for e in gone}


@pytest.mark.parametrize("bb,host_gb_blocks,cap", [(100, 4, 4), (100, 0, 0), (64, 3.5, 3)])
def test_capacities_come_from_the_byte_budgets(bb, host_gb_blocks, cap):
    ix = KVTierIndex(2, bb, int(host_gb_blocks * bb), None, 0, {}, tp_size=1)
    assert ix.host_capacity == cap and ix.disk_capacity == 0
    two = KVTierIndex(2, bb, int(2 * host_gb_blocks * bb), None, 0, {}, tp_size=2)
    assert two.host_capacity == cap  # each rank holds its share


def test_a_worker_applying_the_commands_in_plan_order_holds_exactly_the_index():
    """Saves run before drops in a plan: a hash dropped and saved again in one step must not
    end up dropped on the worker (random evictions from a small set of blocks)."""
    import random
    rng = random.Random(5)
    ix = index(host_blocks=3, disk_dir=None)
    blocks = [[t, t + 1] for t in range(0, 16, 2)]
    worker: set[int] = set()
    for step in range(300):
        for _ in range(rng.randrange(0, 4)):
            toks = rng.choice(blocks)
            ix.on_evict(rng.randrange(8), chain_hash(toks, -1), -1, toks)
        meta = ix.build_connector_meta() or {}
        worker |= {s[1] for s in meta.get("save", ()) if s[4]}
        worker -= set(meta.get("drop_host", ()))
        assert worker == set(ix.host), step
        assert len(ix.host) <= 3
