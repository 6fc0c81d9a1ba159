"""KV tiers below the pool (tpserve/kv_tiers, workers/kv_transfer.py), end to end on tiny
random-weight models: a prefix evicted from the pool comes back from host RAM, then from disk,
then from disk after a restart, with the same tokens and log-probabilities as when it was in
the pool; broken files and foreign directories are misses; nothing leaks."""
from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, SamplingParams
from tpserve.blockpool.kv_events import BlockStored
from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.kv_tiers import files
from tpserve.scheduler.sequence import SequenceStatus
from tpserve.workers.kv_transfer import KVTransfer

BS = 4           # tokens per block
POOL = 16        # blocks in the pool: one 40-token prompt (10 blocks) and a bit
P = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(40)] for _ in range(6)]


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3")


def block_bytes(dtype: str) -> int:
    """One block of the tiny model (2 layers, 2 KV heads of 16) on one rank."""
    return 2 * 2 * BS * 2 * 16 * (4 if dtype == "float32" else 2)


def gen(llm, prompt, params=P):
    """(token ids, [(token, logprob, rank)...] per position, cached prompt tokens)."""
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in c.logprobs or []]
    return list(c.token_ids), lps, out.num_cached_tokens


def tier_stats(llm) -> dict:
    return {k[len("kv_offload_"):]: v for k, v in llm.engine.stats().items() if k.startswith("kv_offload_")}


def evict(llm, *prompts):
    for p in prompts:
        gen(llm, p)


def check_exact(llm, tmp_dir: Path | None = None) -> None:
    """Every tier's accounting is exact: the index, the worker's host tier and the files agree."""
    eng = llm.engine
    eng.check_integrity()
    tiers = eng.scheduler.kv_tiers
    assert not tiers.jobs and not tiers._pins
    worker = eng.executor.runner.kv_tiers
    assert set(worker.host) == set(tiers.host)
    if tmp_dir is not None:
        worker.flush()
        d = files.rank_dir(tmp_dir, tiers.fingerprint, 0)
        on_disk = {int(p.name[:16], 16) for p in d.glob("*.kv")}
        assert on_disk == set(tiers.disk)
        assert all(p.stat().st_size == tiers.file_bytes for p in d.glob("*.kv"))
        assert not list(d.glob(".*.tmp"))
    s = tier_stats(llm)
    assert s["host_bytes"] == len(tiers.host) * tiers.block_bytes
    assert s["disk_bytes"] == len(tiers.disk) * tiers.file_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_evicted_prefix_comes_back_from_host_then_disk_then_after_a_restart(model, tmp_path, dtype):
    a, others = PROMPTS[0], PROMPTS[1:]
    kw = dict(dtype=dtype, num_kv_blocks=POOL, block_size=BS)
    with LLM(str(model), **kw) as ref:  # no tiers: the prompt computed from nothing
        want_tokens = gen(ref, a)[0]
    host_gb = 24 * block_bytes(dtype) / (1 << 30)  # 24 blocks: two prompts, not five
    with LLM(str(model), kv_offload_host_gb=host_gb, kv_offload_dir=str(tmp_path), **kw) as llm:
        tokens, lps, cached = gen(llm, a)
        assert tokens == want_tokens and cached == 0
        pool_tokens, pool_lps, cached = gen(llm, a)  # the prefix cache: the reference path
        assert cached == 39 and pool_tokens == want_tokens
        evict(llm, others[0], others[1])
        before = tier_stats(llm)
        assert before["host_saves"] >= 10
        got = gen(llm, a)
        s = tier_stats(llm)
        # The blocks the pool lost (it may keep a few head blocks) come from the host tier.
        assert s["host_loads"] - before["host_loads"] >= 5 and s["disk_loads"] == before["disk_loads"]
        assert got == (pool_tokens, pool_lps, 39)  # bit-identical logprobs, cached tokens counted
        evict(llm, *others[1:5])  # the host tier (24 blocks) lets go of it; the disk keeps it
        before = tier_stats(llm)
        got = gen(llm, a)
        s = tier_stats(llm)
        assert s["disk_loads"] - before["disk_loads"] >= 1
        assert got == (pool_tokens, pool_lps, 39)
        assert s["hit_tokens"] >= 80 and s["disk_corrupt"] == 0
        check_exact(llm, tmp_path)
    with LLM(str(model), kv_offload_dir=str(tmp_path), **kw) as llm:  # a restart: disk only
        assert tier_stats(llm)["disk_blocks"] >= 10
        got = gen(llm, a)
        s = tier_stats(llm)
        assert s["disk_loads"] == 10 and s["disk_corrupt"] == 0
        assert got == (pool_tokens, pool_lps, 39)
        check_exact(llm, tmp_path)


def test_tensor_parallel_ranks_store_and_load_their_own_shards(model, tmp_path):
    a, others = PROMPTS[0], PROMPTS[1:3]
    kw = dict(dtype="float32", num_kv_blocks=POOL, block_size=BS, tensor_parallel_size=2,
              kv_offload_dir=str(tmp_path))
    with LLM(str(model), kv_offload_host_gb=0.001, **kw) as llm:
        first = gen(llm, a)
        pool = gen(llm, a)
        evict(llm, *others)
        got = gen(llm, a)
        assert tier_stats(llm)["host_loads"] == 10
        assert got == pool and got[0] == first[0]
        llm.engine.check_integrity()
        fp = llm.engine.scheduler.kv_tiers.fingerprint
    for rank in (0, 1):
        assert len(list(files.rank_dir(tmp_path, fp, rank).glob("*.kv"))) >= 10
    with LLM(str(model), **kw) as llm:
        got = gen(llm, a)
        assert tier_stats(llm)["disk_loads"] == 10
        assert got == pool


def _write_dir(model, tmp_path, prompts, **kw):
    with LLM(str(model), dtype="float32", num_kv_blocks=POOL, block_size=BS,
             kv_offload_dir=str(tmp_path), **kw) as llm:
        want = [gen(llm, p) for p in prompts]
        fp = llm.engine.scheduler.kv_tiers.fingerprint
    return want, fp


def test_corrupt_truncated_and_foreign_files_are_misses(model, tmp_path):
    a = PROMPTS[0]
    want, fp = _write_dir(model, tmp_path, [a])
    tokens = want[0][0]
    d = files.rank_dir(tmp_path, fp, 0)
    from tpserve.blockpool.prefix_hash import chain_hash
    hashes, h = [], -1
    for i in range(10):
        h = chain_hash(a[i * BS:(i + 1) * BS], h)
        hashes.append(h)
    paths = [d / files.block_name(h) for h in hashes]
    assert all(p.is_file() for p in paths)
    data = bytearray(paths[7].read_bytes())
    data[-5] ^= 0xFF  # a flipped payload bit: the checksum fails
    paths[7].write_bytes(bytes(data))
    paths[8].write_bytes(paths[8].read_bytes()[:-100])  # truncated: its size gives it away at start-up
    paths[5].write_bytes(paths[3].read_bytes())  # another block's file under this name
    kw = dict(dtype="float32", num_kv_blocks=POOL, block_size=BS, kv_offload_dir=str(tmp_path))
    with LLM(str(model), **kw) as llm:
        got_tokens, _, cached = gen(llm, a)
        s = tier_stats(llm)
        assert got_tokens == tokens
        assert cached == 5 * BS and s["disk_loads"] == 6  # blocks 0-4 and 6; 5 on are computed
        assert s["disk_corrupt"] == 3  # the truncated one at start-up, two when read
        check_exact(llm, tmp_path)
    with LLM(str(model), **kw) as llm:  # the recomputed blocks were written again
        got_tokens, _, cached = gen(llm, a)
        s = tier_stats(llm)
        assert got_tokens == tokens and cached == 39
        assert s["disk_loads"] == 10 and s["disk_corrupt"] == 0


def test_another_models_directory_is_ignored(model, tiny_models_root, tmp_path):  # noqa: F811
    a = PROMPTS[0]
    _, fp = _write_dir(model, tmp_path, [a])
    other = make_tiny_model(tiny_models_root, arch="qwen3", seed=3)
    with LLM(str(other), dtype="float32", num_kv_blocks=POOL, block_size=BS) as ref:
        want = gen(ref, a)[0]
    with LLM(str(other), dtype="float32", num_kv_blocks=POOL, block_size=BS,
             kv_offload_dir=str(tmp_path)) as llm:
        tiers = llm.engine.scheduler.kv_tiers
        assert tiers.fingerprint != fp and not tiers.disk
        got, _, cached = gen(llm, a)
        assert got == want and cached == 0 and tier_stats(llm)["disk_loads"] == 0
    # Another block size is another layout too; and a manifest that does not match is ignored.
    manifest = tmp_path / fp / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"block_size": 4', '"block_size": 8'))
    with LLM(str(model), dtype="float32", num_kv_blocks=POOL, block_size=BS,
             kv_offload_dir=str(tmp_path)) as llm:
        tiers = llm.engine.scheduler.kv_tiers
        assert tiers.foreign_dirs == 1 and not tiers.disk
        assert gen(llm, a)[2] == 0


def test_a_full_disk_budget_keeps_what_fits(model, tmp_path):
    fb = files.file_size(BS, block_bytes("float32"))
    kw = dict(dtype="float32", num_kv_blocks=POOL, block_size=BS, kv_offload_dir=str(tmp_path),
              kv_offload_disk_gb=3.5 * fb / (1 << 30))
    with LLM(str(model), **kw) as llm:
        want = [gen(llm, p)[0] for p in PROMPTS[:4]]
        got = [gen(llm, p)[0] for p in PROMPTS[:4]]
        assert got == want
        tiers = llm.engine.scheduler.kv_tiers
        assert tiers.disk_capacity == 3 and len(tiers.disk) <= 3
        check_exact(llm, tmp_path)
    with LLM(str(model), **kw) as llm:
        assert [gen(llm, p)[0] for p in PROMPTS[:4]] == want
        check_exact(llm, tmp_path)


def test_loads_run_off_the_serving_loop_and_a_loading_block_is_never_reused(model, monkeypatch):
    gate = threading.Event()
    real = KVTransfer._load

    def slow_load(self, items):
        gate.wait(30)
        return real(self, items)

    monkeypatch.setattr(KVTransfer, "_load", slow_load)
    with LLM(str(model), dtype="float32", num_kv_blocks=24, block_size=BS, kv_offload_host_gb=0.001) as llm:
        eng = llm.engine
        a = PROMPTS[0]
        want = gen(llm, a)[0]
        evict(llm, PROMPTS[1], PROMPTS[2])
        eng.add_request("long", PROMPTS[3][:8],
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        for _ in range(3):
            eng.step()
        eng.add_request("a", a, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        eng.add_request("a2", a, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        seq = eng.scheduler.get("a")
        produced = 0
        for _ in range(5):  # the long request keeps decoding while "a" loads
            produced += sum(len(o.new_token_ids) for o in eng.step() if o.request_id == "long")
            assert seq.status is SequenceStatus.LOADING
            eng.check_integrity()
        assert produced == 5
        eng.abort_request("a2")  # ended while loading: its blocks stay held until the load is done
        assert eng.scheduler._orphans
        eng.check_integrity()
        gate.set()
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            eng.check_integrity()
        assert outs["a"] == want
        assert not eng.scheduler._orphans and eng.stats()["kv_blocks_used"] == 0
        check_exact(llm)


def test_stress_every_tier_accounting_is_exact(model, tmp_path):
    rng = random.Random(1)
    system = [[rng.randrange(3, 380) for _ in range(24)] for _ in range(3)]
    fb = files.file_size(BS, block_bytes("float32"))
    with LLM(str(model), dtype="float32", num_kv_blocks=32, block_size=BS, max_num_seqs=4,
             kv_offload_host_gb=20 * block_bytes("float32") / (1 << 30), kv_offload_dir=str(tmp_path),
             kv_offload_disk_gb=40 * fb / (1 << 30)) as llm:
        eng = llm.engine
        eng.enable_kv_events()
        n = 0
        for round_ in range(6):
            for _ in range(5):
                prompt = rng.choice(system) + [rng.randrange(3, 380) for _ in range(rng.randrange(1, 16))]
                eng.add_request(f"r{n}", prompt,
                                SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 6),
                                               ignore_eos=True))
                n += 1
            steps = 0
            while eng.has_unfinished():
                eng.step()
                steps += 1
                if steps == 2 and round_ % 2:
                    eng.abort_request(f"r{n - 1}")
                eng.check_integrity()
        s = tier_stats(llm)
        assert s["host_loads"] + s["disk_loads"] > 0 and s["host_saves"] > 0
        check_exact(llm, tmp_path)
        events = eng.drain_kv_events()
        media = {e.medium for e in events if isinstance(e, BlockStored)}
        assert {"GPU", "CPU", "STORAGE"} <= media
        # Replaying a medium's events gives exactly that tier's index.
        for medium, tier in (("CPU", eng.scheduler.kv_tiers.host), ("STORAGE", eng.scheduler.kv_tiers.disk)):
            live = set()
            for e in events:
                if getattr(e, "medium", None) == medium:
                    (live.update if isinstance(e, BlockStored) else live.difference_update)(e.block_hashes)
            assert live == set(tier)
        resync = eng.drain_kv_events(resync=True)  # a reader's full view includes the tiers
        for medium, tier in (("CPU", eng.scheduler.kv_tiers.host), ("STORAGE", eng.scheduler.kv_tiers.disk)):
            assert {e.block_hashes[0] for e in resync if isinstance(e, BlockStored) and e.medium == medium} \
                == set(tier)


@pytest.mark.parametrize("kw,field", [
    (dict(kv_offload_host_gb=-1), "kv_offload_host_gb"),
    (dict(kv_offload_host_gb=True), "kv_offload_host_gb"),
    (dict(kv_offload_disk_gb="big"), "kv_offload_disk_gb"),
    (dict(kv_offload_dir="/tmp/x", kv_offload_disk_gb=0), "kv_offload_disk_gb"),
    (dict(kv_offload_dir=""), "kv_offload_dir"),
    (dict(kv_offload_dir=3), "kv_offload_dir"),
    (dict(kv_offload_host_gb=1.0, enable_prefix_caching=False), "kv_offload_host_gb"),
])
def test_options_are_validated(kw, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert e.value.field == field


def test_a_file_as_the_directory_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="kv_offload_dir"):
        EngineConfig(kv_offload_dir=str(f))
    assert EngineConfig(kv_offload_dir=os.fspath(tmp_path)).kv_offload_dir == str(tmp_path)


def test_status_and_metrics_show_every_tier(model, tmp_path):
    from tpserve.cli.control_cmds import _STATUS_LINES
    from tpserve.server.metrics import ServingMetrics
    with LLM(str(model), dtype="float32", num_kv_blocks=POOL, block_size=BS, kv_offload_host_gb=0.001,
             kv_offload_dir=str(tmp_path)) as llm:
        a = PROMPTS[0]
        gen(llm, a)
        evict(llm, *PROMPTS[1:3])
        gen(llm, a)
        stats = llm.engine.stats()
        text = ServingMetrics("m", lambda: stats).render()
    assert stats["kv_offload_host_loads"] > 0 and stats["kv_offload_hit_tokens"] > 0
    for name in ("blocks", "bytes", "capacity_bytes"):
        for tier in ("host", "disk"):
            assert f'tpserve:kv_offload_{name}{{model_name="m",tier="{tier}"}}' in text
    loads = (f'tpserve:kv_offload_loads_total{{model_name="m",tier="host"}} '
             f'{float(stats["kv_offload_host_loads"])}')
    assert loads in text
    for name in ("hits", "misses", "saves", "corrupt_files", "load_seconds", "load_jobs"):
        assert f'tpserve:kv_offload_{name}_total{{model_name="m",tier="disk"}}' in text
    rows = {label: keys for label, keys, _ in _STATUS_LINES}
    for label, tier in (("KV host tier", "host"), ("KV disk tier", "disk")):
        assert all(k in stats for k in rows[label]) and f"kv_offload_{tier}_corrupt" in rows[label]


@pytest.mark.parametrize("args,env,option,reason", [
    (["--kv-offload-host-gb", "-1"], {}, "--kv-offload-host-gb", "must be a number of GiB >= 0"),
    (["--kv-offload-dir", "/tmp", "--kv-offload-disk-gb", "0"], {}, "--kv-offload-disk-gb", "must be > 0"),
    (["--no-prefix-caching"], {"TPSERVE_KV_OFFLOAD_HOST_GB": "1"}, "--kv-offload-host-gb",
     "need the prefix cache on"),
])
def test_the_cli_names_a_bad_tier_option(args, env, option, reason):
    from click.testing import CliRunner
    from tpserve.cli.main import main
    result = CliRunner().invoke(main, ["serve", *args], env=env)
    assert result.exit_code == 2
    assert option in result.output and reason in result.output
