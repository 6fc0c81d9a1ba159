"""The HTTP endpoints that routers probe before and while they route to a replica.

Routers in front of several replicas (smg, vllm-router, llm-d's endpoint picker) identify the
engine, read its limits and poll its load. Each answer is built from the daemon's ``status``
(Server.stats: engine counters plus the daemon's state), so it is what the engine has now:

* ``GET /health``: 200 while the daemon serves; 503 once it is draining (a shutdown: for up to
  ``--shutdown-grace`` the requests in flight still finish), failed, or does not answer.
  Routers take a 503 replica out of rotation before it stops. It keeps answering through the
  drain, and its body says what is going on: ``status`` ("ok", "draining", "failed"),
  ``ready``, and while draining ``requests_in_flight`` and ``drain_left_s``, beside an OpenAI
  error object.
* ``GET /ready``: the readiness view for load balancers: 200 ``{"ready": true}`` while new
  requests are taken, 503 ``{"ready": false, "state": ...}`` from the first moment of a drain
  (or when the daemon failed or does not answer).
* ``GET /version``: ``{"version": ...}`` as vLLM answers it. smg identifies a backend by its
  ``/v1/models`` ``owned_by`` (here "tpserve", no engine it knows), then by ``/version`` (vLLM)
  or ``/server_info`` (SGLang); with both it takes vLLM's metric names, which /metrics has.
* ``GET /server_info`` and ``/model_info`` (also as ``/get_server_info``, ``/get_model_info``,
  SGLang's older names): the fields smg's and vllm-router's metadata discovery read (model
  path, served name, parallel sizes, context length, KV capacity in tokens, page size, ...).
* ``GET /v1/loads``: the live load in the schema of SGLang's ``/v1/loads``, which smg polls for
  its load-aware policies (``least_load``, ``power_of_two``, cache_aware's load balance):
  one rank with running and waiting requests, waiting prompt tokens not yet computed, KV
  tokens used and total, KV usage ratio, generation throughput and prefix-cache hit rate.
  ``include`` may name sections (core, memory, spec, lora, disagg, queues, all); the ones
  tpserve has nothing for are left out, an unknown one is a 400.

With an API key, everything but ``/health``, ``/ready`` and ``/version`` needs it, like ``/v1``.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

import tpserve
from tpserve.fronts.http import openai_api as O
from tpserve.client.client import ClientTimeout, RequestError

log = logging.getLogger("tpserve.http")

LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
_STATUS_TIMEOUT = 5.0


def load_snapshot(stats: dict) -> dict:
    """One rank's load in SGLang's ``/v1/loads`` field names, from the daemon's status."""
    block_size = int(stats.get("block_size") or 0)
    total = int(stats.get("kv_blocks_total") or 0)
    used = int(stats.get("kv_blocks_used") or 0)
    running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": int(stats.get("num_waiting_tokens", 0)),
        "num_total_reqs": running + waiting,
        "num_used_tokens": used * block_size,
        "max_total_num_tokens": total * block_size,
        "token_usage": used / total if total else 0.0,
        "gen_throughput": float(stats.get("tokens_per_s", 0.0)),
        "cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0.0)),
        "utilization": used / total if total else 0.0,
        "max_running_requests": int(stats.get("max_num_seqs", 0)),
    }


def model_json(model_path: str, name: str = "config.json") -> dict:
    """A JSON file of the model directory (config.json by default); {} when unreadable."""
    try:
        with open(os.path.join(model_path, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def make_router(front, authorize) -> APIRouter:
    """The endpoints above for one front (http_app.Front); ``authorize`` is its API-key check."""
    router = APIRouter()
    private = APIRouter(dependencies=[Depends(authorize)])
    config = model_json(front.model_path)

    async def status() -> dict:
        try:
            return await front.client.status(timeout=_STATUS_TIMEOUT)
        except (ClientTimeout, RequestError) as e:
            raise O.OpenAIError(503, f"the tpserve daemon does not answer: {e}", type_="server_error",
                                code="daemon_unavailable") from None

    @router.get("/health")
    async def health():
        stats = await status()
        state = stats.get("state")
        if state != "running":
            draining = state == "shutting_down"
            why = stats.get("failure") or ("the daemon is shutting down (draining)" if draining
                                           else f"the daemon is {state}")
            e = O.OpenAIError(503, why, type_="server_error", code="draining" if draining else "unhealthy")
            body = {"status": "draining" if draining else "failed", "ready": False, **e.body()}
            if draining:
                body.update(requests_in_flight=stats.get("requests_in_flight"),
                            drain_left_s=stats.get("drain_left_s"))
            return JSONResponse(body, status_code=503)
        # The body says how often the daemon restarted this front (http_front.py).
        return {"status": "ok", "ready": bool(stats.get("ready", True)), "http_front_restarts": front.restarts,
                "http_front_last_exit": front.last_exit}

    @router.get("/ready")
    async def ready():
        try:
            stats = await status()
        except O.OpenAIError as e:
            return JSONResponse({"ready": False, "state": "unreachable", **e.body()}, status_code=503)
        if stats.get("state") == "running" and stats.get("ready", True):
            return {"ready": True}
        return JSONResponse({"ready": False, "state": stats.get("state")}, status_code=503)

    @router.get("/version")
    async def version():
        return {"version": tpserve.__version__}

    async def server_info():
        stats = await status()
        return {
            "engine": "tpserve",
            "version": tpserve.__version__,
            "model_path": front.model_path,
            "served_model_name": front.model_name,
            "tp_size": int(stats.get("tensor_parallel_size", 1)),
            "dp_size": 1,
            "pp_size": 1,
            "is_embedding": False,
            "disaggregation_mode": "null",
            "context_length": front.max_model_len,
            "max_total_tokens": int(stats.get("kv_blocks_total", 0)) * int(stats.get("block_size") or 0),
            "max_running_requests": int(stats.get("max_num_seqs", 0)),
            "page_size": int(stats.get("block_size") or 0),
            "kv_events": {k[len("kv_events_"):]: v for k, v in stats.items() if k.startswith("kv_events_")} or None,
            "state": stats.get("state"),
        }

    async def model_info():
        archs = config.get("architectures") or []
        return {
            "model_path": front.model_path,
            "tokenizer_path": front.model_path,
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": archs,
        }

    for path in ("/server_info", "/get_server_info"):
        private.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        private.add_api_route(path, model_info, methods=["GET"])

    @private.get("/v1/loads")
    async def loads(include: str = "core"):
        sections = {s.strip() for s in include.split(",") if s.strip()}
        unknown = sorted(sections - LOAD_SECTIONS)
        if unknown:
            raise O.bad("include", f"unknown section(s) {', '.join(unknown)}; "
                        f"allowed: {', '.join(sorted(LOAD_SECTIONS))}")
        stats = await status()
        return JSONResponse({"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
                             "loads": [load_snapshot(stats)]})

    router.include_router(private)
    return router
