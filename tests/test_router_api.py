"""The endpoints routers probe (router_api.py) and the model-server protocol's metric names,
over the HTTP app in front of a daemon loop with a fake engine."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from test_daemon import FakeEngine, ServerThread
from tpserve.client.client import Client
from tpserve.fronts.http.app import Front, create_app
from tpserve.server.metrics import ServingMetrics
from tpserve.fronts.http.router_api import load_snapshot
from tpserve.server.server import ServerOptions
from tpserve.sampling import SamplingParams


class LoadedEngine(FakeEngine):
    """A fake engine whose stats carry the scheduler's load fields."""

    def stats(self):
        s = super().stats()
        s.update(num_waiting=3, num_waiting_tokens=1200, block_size=16, max_num_seqs=8,
                 tokens_per_s=250.0, prefix_cache_hit_rate=0.5, kv_blocks_used=25, kv_blocks_total=100)
        return s


@pytest.fixture
def served(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}')

    def make(engine=None, options=None, api_key=None):
        server = ServerThread(engine or LoadedEngine(), options)
        front = Front(server.address, str(tmp_path), "served-name", 4096, api_key=api_key, tokenizer=object())
        made.append(server)
        return server, TestClient(create_app(front))
    made: list[ServerThread] = []
    yield make
    for s in made:
        if s.thread.is_alive():
            s.stop()


def test_version_server_and_model_info_name_what_the_engine_has(served):
    _, http = served()
    with http:
        assert http.get("/version").json() == {"version": "0.1.0"}
        for path in ("/server_info", "/get_server_info"):
            info = http.get(path).json()
            assert info["served_model_name"] == "served-name" and info["tp_size"] == 1
            assert (info["context_length"], info["max_total_tokens"], info["page_size"],
                    info["max_running_requests"], info["state"]) == (4096, 1600, 16, 8, "running")
        for path in ("/model_info", "/get_model_info"):
            info = http.get(path).json()
            assert info["is_generation"] is True and info["model_type"] == "qwen3"
            assert info["architectures"] == ["Qwen3ForCausalLM"]


def test_loads_follow_sglangs_schema_and_refuse_unknown_sections(served):
    _, http = served()
    with http:
        body = http.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
        assert body["dp_rank_count"] == 1 and body["timestamp"]
        (load,) = body["loads"]
        assert load == {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 3,
                        "num_waiting_uncached_tokens": 1200, "num_total_reqs": 3, "num_used_tokens": 400,
                        "max_total_num_tokens": 1600, "token_usage": 0.25, "gen_throughput": 250.0,
                        "cache_hit_rate": 0.5, "utilization": 0.25, "max_running_requests": 8}
        r = http.get("/v1/loads", params={"include": "core,gpu"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include"
        assert "gpu" in r.json()["error"]["message"]


def test_loads_see_running_requests(served):
    engine = FakeEngine(step_delay=0.02)
    server, http = served(engine)
    with http, Client(server.address, timeout=30) as c:
        done = threading.Thread(target=c.generate, args=([1, 2, 3], SamplingParams(max_tokens=60)))
        done.start()
        deadline = time.monotonic() + 10
        while http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] != 1:
            assert time.monotonic() < deadline, "the running request never showed"
            time.sleep(0.01)
        done.join(30)
        assert http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0


def test_health_is_503_while_draining_and_when_the_daemon_is_gone(served):
    engine = FakeEngine(step_delay=0.02)
    server, http = served(engine, ServerOptions(shutdown_grace=30.0))
    with http, Client(server.address, timeout=30) as c:
        assert http.get("/health").status_code == 200 and http.get("/health").json()["ready"] is True
        assert http.get("/ready").status_code == 200 and http.get("/ready").json() == {"ready": True}
        t = threading.Thread(target=c.generate, args=([1, 2, 3], SamplingParams(max_tokens=100)))
        t.start()
        deadline = time.monotonic() + 10
        while not engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.server.request_shutdown()  # the grace lets the request finish: the daemon drains
        deadline = time.monotonic() + 10
        while (r := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "health never turned unhealthy while draining"
            time.sleep(0.01)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        body = r.json()
        assert (body["status"], body["ready"]) == ("draining", False) and body["drain_left_s"] > 0
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False, "state": "shutting_down"}
        t.join(30)
        server.thread.join(30)
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "daemon_unavailable"
        assert http.get("/ready").status_code == 503


def test_an_api_key_guards_everything_but_health_and_version(served):
    _, http = served(api_key="k")
    with http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        assert http.get("/version").status_code == 200
        for path in ("/v1/loads", "/server_info", "/model_info"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path


def test_load_snapshot_of_an_empty_pool_is_zero_not_an_error():
    assert load_snapshot({})["token_usage"] == 0.0


def test_metrics_carry_the_model_server_protocols_names():
    stats = LoadedEngine().stats()
    families = {f.name: f for f in text_string_to_metric_families(ServingMetrics("m", lambda: stats).render())}
    value = {name: families[name].samples[0].value
             for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    assert value == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 3.0,
                     "vllm:kv_cache_usage_perc": 0.25}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels == {"model_name": "m", "block_size": "16", "num_gpu_blocks": "100", "cache_dtype": ""}
    assert not any("lora" in name for name in families)
    assert "tpserve:kv_cache_usage_perc" in families  # tpserve's own stay
