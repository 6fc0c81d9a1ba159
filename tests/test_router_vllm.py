"""A real KV-index router reading tpserve's KV-cache events: vllm-router's kv_aware policy
(from PyPI in its own virtualenv: scripts/peer_vllm_router.sh, which `make test` runs)
subscribed to two replicas' --kv-events-endpoint sends a request to the replica whose cache
holds its prefix, which it can only know from the events."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_router_smg import BUNDLED, post

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_router  # noqa: E402

VLLM_ROUTER = (Path(os.environ.get("TPSERVE_VLLM_ROUTER_VENV") or ROOT / ".peers" / "vllm-router")
               / "bin" / "vllm-router")
# Drives vllm-router: in the marked set that `make test-peers` and CI run (setup.cfg).
pytestmark = pytest.mark.peers


@pytest.fixture(scope="module")
def replicas():
    assert VLLM_ROUTER.exists(), f"no vllm-router at {VLLM_ROUTER}: run scripts/peer_vllm_router.sh (make test does)"
    args = SimpleNamespace(block_size=16, max_num_seqs=8, dtype="float32", startup_timeout=200.0)
    started = bench_router.start_replicas(BUNDLED, 64, args, 2)
    yield started
    for r in started:
        r.stop()


def hits(replica) -> float:
    return bench_router.scrape(replica.url)["tpserve:prefix_cache_hits_total"]


def complete(url: str, prompt: list[int]) -> dict:
    return post(url + "/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0})


def test_kv_aware_routes_each_prefix_to_the_replica_its_events_named(replicas):
    router = bench_router.VllmRouter(str(VLLM_ROUTER), replicas, "kv_aware")
    try:
        # Four prefixes of 8 blocks, each computed on one replica directly (the router does not
        # see these requests, only the events they cause).
        placed = [(k, replicas[k % 2]) for k in range(4)]
        prefixes = {k: [(97 * k + 13 * j) % 4000 + 3 for j in range(128)] for k, _ in placed}
        for k, r in placed:
            complete(r.url, prefixes[k])
        time.sleep(1.0)  # the events of the last step reach the router's subscribers
        for k, r in placed:
            before = [hits(x) for x in replicas]
            complete(router.url, prefixes[k] + [5, 6, 7])
            after = [hits(x) for x in replicas]
            gained = [a - b for a, b in zip(after, before)]
            assert gained[replicas.index(r)] >= 128, (k, gained)
            assert gained[1 - replicas.index(r)] == 0, (k, gained)
    finally:
        router.stop()
