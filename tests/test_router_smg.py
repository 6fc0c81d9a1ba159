"""Two tpserve daemons behind a real smg (SGLang's router, from PyPI in its own virtualenv:
scripts/peer_smg.sh, which `make test` runs): smg identifies the engine, reads its limits and
live load, and routes completions to both replicas.

Uses scripts/bench_router.py's Replica and Smg at small size on the bundled model."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_router  # noqa: E402

SMG = Path(os.environ.get("TPSERVE_SMG_VENV") or ROOT / ".peers" / "smg") / "bin" / "smg"
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
# Drives smg: in the marked set that `make test-peers` and CI run (setup.cfg).
pytestmark = pytest.mark.peers
BLOCKS, BLOCK_SIZE = 64, 16


def first_completion(url: str, deadline_s: float = 60.0) -> None:
    """One short completion through smg, repeated while smg answers 503: its channel to a gRPC
    worker can still be connecting after the worker passed its health check (seen once as a
    503 on the first request of a run); any other answer, or a 503 past the deadline, fails."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            post(url + "/v1/completions", {"model": "bench", "prompt": "warm", "max_tokens": 1, "temperature": 0})
            return
        except AssertionError as e:
            if ": HTTP 503:" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the status alone does not say which side refused
        raise AssertionError(f"POST {url}: HTTP {e.code}: {e.read()[:2000]!r}") from None


@pytest.fixture(scope="module")
def replicas():
    assert SMG.exists(), f"no smg at {SMG}: run scripts/peer_smg.sh (make test does)"
    args = SimpleNamespace(block_size=BLOCK_SIZE, max_num_seqs=8, dtype="float32", startup_timeout=200.0)
    started = bench_router.start_replicas(BUNDLED, BLOCKS, args, 2)
    yield started
    for r in started:
        r.stop()


def test_smg_identifies_the_replicas_reads_their_load_and_routes_to_both(replicas):
    smg = bench_router.Smg(str(SMG), [r.url for r in replicas], "round_robin")
    try:
        workers = smg.workers()
        assert {w["url"] for w in workers} == {r.url for r in replicas}
        for w in workers:
            # /version made it a vLLM-like backend; /v1/models gave the served name and context.
            assert w["runtime_type"] == "vllm" and w["labels"]["version"] == "0.1.0"
            assert w["labels"]["served_model_name"] == "bench"
        deadline = time.monotonic() + 30
        while not all(w.get("engine_load") for w in smg.workers()):  # polled every second
            assert time.monotonic() < deadline, "smg never read the replicas' /v1/loads"
            time.sleep(0.2)
        for w in smg.workers():
            (load,) = w["engine_load"]["loads"]
            assert load["max_total_num_tokens"] == BLOCKS * BLOCK_SIZE
            assert load["max_running_requests"] == 8
        before = [bench_router.scrape(r.url)["tpserve:prompt_tokens_total"] for r in replicas]
        for i in range(4):
            out = post(smg.url + "/v1/completions", {"model": "bench", "prompt": f"def f{i}(x):",
                                                     "max_tokens": 4, "temperature": 0})
            assert out["choices"][0]["finish_reason"] in ("length", "stop")
            assert out["usage"]["completion_tokens"] >= 1
        after = [bench_router.scrape(r.url)["tpserve:prompt_tokens_total"] for r in replicas]
        assert all(a > b for a, b in zip(after, before)), "round robin did not reach both replicas"
    finally:
        smg.stop()


def test_least_load_sees_a_busy_replica_through_its_live_load(replicas):
    """Requests kept running on one replica; smg's view of it (from /v1/loads) says so.

    One request can end between two of smg's polls on a fast machine, so the replica is kept
    busy with back-to-back requests until smg has seen one of them."""
    smg = bench_router.Smg(str(SMG), [r.url for r in replicas], "least_load")
    busy = replicas[0]
    seen = threading.Event()
    served = []

    def keep_busy():
        while not seen.is_set():
            served.append(post(busy.url + "/v1/completions",
                               {"model": "bench", "prompt": "x = 1", "max_tokens": 200,
                                "ignore_eos": True, "temperature": 0}))

    t = threading.Thread(target=keep_busy)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            loads = {w["url"]: w.get("engine_load", {}).get("loads", [{}])[0].get("num_running_reqs")
                     for w in smg.workers()}
            if loads.get(busy.url) == 1:
                break
            assert t.is_alive(), "the request keeping the replica busy failed"
            assert time.monotonic() < deadline, f"smg never saw the running request: {loads}"
            time.sleep(0.1)
        assert loads[replicas[1].url] == 0
    finally:
        seen.set()
        t.join(120)
        smg.stop()
    assert served and all(o["usage"]["completion_tokens"] == 200 for o in served)


@pytest.fixture(scope="module")
def grpc_replicas():
    assert SMG.exists(), f"no smg at {SMG}: run scripts/peer_smg.sh (make test does)"
    args = SimpleNamespace(block_size=BLOCK_SIZE, max_num_seqs=8, dtype="float32", startup_timeout=200.0)
    started = bench_router.start_replicas(BUNDLED, BLOCKS, args, 2, grpc=True)
    yield started
    for r in started:
        r.stop()


def _counter(replica, name: str) -> float:
    return bench_router.scrape(replica.url).get(name, 0.0)


def test_smg_routes_to_grpc_fronts_and_follows_their_kv_events_to_the_replica_holding_a_prefix(grpc_replicas):
    """smg in front of the replicas' gRPC fronts: it detects vLLM's service, subscribes to
    both replicas' KV events, serves completions (whole and streamed), and sends requests
    sharing a prefix to the replica whose cache holds it now: one that evicted it and one that
    cached it without smg knowing, so only the replicas' events can have told it. Then a chat
    completion with a JSON schema: smg renders the chat, the replica applies the schema."""
    smg = bench_router.Smg(str(SMG), [r.grpc_url for r in grpc_replicas], "cache_aware", log_level="info")
    try:
        smg.wait_for_kv_events(2)
        workers = smg.workers()
        assert {w["url"] for w in workers} == {r.grpc_url for r in grpc_replicas}
        assert all(w["connection_mode"] == "grpc" and w["runtime_type"] == "vllm" for w in workers)
        prefix = "def add(x, y):\n    return x + y\n\n" * 24  # ~15 blocks of the bundled tokenizer

        def complete(url, prompt, max_tokens=3):
            out = post(url + "/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == max_tokens
        first_completion(smg.url)
        # Through smg, the prefix lands on one replica: smg's text tree and its event index agree.
        before = [_counter(r, "tpserve:prompt_tokens_total") for r in grpc_replicas]
        complete(smg.url, prefix + "# 0")
        grew = [_counter(r, "tpserve:prompt_tokens_total") > b for r, b in zip(grpc_replicas, before)]
        assert grew.count(True) == 1
        first, holder = (grpc_replicas[0], grpc_replicas[1]) if grew[0] else (grpc_replicas[1], grpc_replicas[0])
        # Behind smg's back: the first replica evicts the prefix (prompts that fill its pool) and
        # the other caches it. A router that guesses from what it routed would still pick the
        # first; the KV events say where the blocks are now.
        for k in range(3):
            complete(first.url, f"unrelated text number {k} " * 150)
        complete(holder.url, prefix + "# 1")
        other = first
        # Until smg's index has applied every batch both replicas published.
        deadline = time.monotonic() + 60
        while True:
            applied = smg.applied_kv_batches()
            published = {r.grpc_url: bench_router.http_json(r.url + "/server_info")["kv_events"]["published"]
                         for r in grpc_replicas}
            if all(applied.get(u, 0) >= n for u, n in published.items()):
                break
            assert time.monotonic() < deadline, (applied, published)
            time.sleep(0.05)
        hits = _counter(holder, "tpserve:prefix_cache_hits_total")
        other_prompts = _counter(other, "tpserve:prompt_tokens_total")
        for i in range(2, 6):
            body = {"model": "bench", "prompt": prefix + f"# {i}", "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True, "stream": i % 2 == 0}
            req = urllib.request.Request(smg.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
            if body["stream"]:
                assert text.rstrip().endswith("data: [DONE]") and '"text"' in text
        assert _counter(other, "tpserve:prompt_tokens_total") == other_prompts, "a request left the prefix's replica"
        assert _counter(holder, "tpserve:prefix_cache_hits_total") - hits >= 4 * 10 * BLOCK_SIZE
        # smg renders the chat template itself; a JSON schema reaches the replica as the
        # constraint of vLLM's SamplingParams, and the output follows it.
        schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                  "additionalProperties": False}
        out = post(smg.url + "/v1/chat/completions", {
            "model": "bench", "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}})
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", out
        assert json.loads(choice["message"]["content"]) in ({"a": "x"}, {"a": "y"})
    finally:
        smg.stop()
