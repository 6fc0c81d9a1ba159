"""Prometheus metrics of the daemon, named after vLLM's with a ``tpserve:`` prefix.

The daemon records them where the timings happen: the server loop sees a request arrive, the
engine's first output for it (time to first token), every later output (inter-token latency)
and its end (end-to-end latency); the engine reports the queue time (arrival to first
scheduled step). Gauges and the engine's cumulative counters (prefix cache, preemptions) are
read from ``engine.stats()`` when the metrics are rendered, so a scrape costs the serving loop
nothing between scrapes. Every series carries the label ``model_name``.

Beside them, the gauges the Gateway API Inference Extension's model-server protocol requires,
under vLLM's names, which its endpoint picker (and smg, llm-d) read by default:
``vllm:num_requests_waiting`` (queue size), ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (KV-cache utilisation, 0..1) and ``vllm:cache_config_info``
(block size and pool size as labels, for prefix-cache scorers). tpserve serves no LoRA
adapters, so ``vllm:lora_requests_info`` is absent, as the protocol allows.

Under pressure: ``tpserve:num_waiting_tokens`` (prompt tokens queued), the counters
``tpserve:requests_refused{reason}`` (max_waiting_requests, max_waiting_tokens: the queue was
full; shutting_down: the daemon was draining; admission: the request could never fit),
``tpserve:requests_timed_out``, ``tpserve:num_priority_preemptions`` (preemptions that admitted a
better priority), and the gauges ``tpserve:draining`` / ``tpserve:ready`` (0 or 1).

With KV tiers (--kv-offload-host-gb, --kv-offload-dir; docs/kv_tiers.md), per tier (label
``tier``: host, disk): ``tpserve:kv_offload_blocks`` / ``_bytes`` / ``_capacity_bytes`` (gauges),
``_hits``, ``_misses``, ``_loads``, ``_saves``, ``_corrupt_files``, ``_load_seconds`` and
``_load_jobs`` (counters: mean load time = seconds / jobs); and ``tpserve:kv_offload_hit_tokens``.

Whether the engine runs tpserve's C++ CPU operators (tpserve/kernels/cpu_extension.py):
``tpserve:cpu_ops_loaded`` (1, or 0 when a CPU engine fell back to the several times slower
plain-torch path; absent when the model runs on an accelerator) and ``tpserve:cpu_ops_info``
(labels ``state``: loaded, unavailable, disabled or unused, and ``reason``: why they are not
loaded, e.g. the compiler's error).

Exposed at ``/metrics`` of the HTTP front and through the ZMQ ``metrics`` request
(``tpserve status --metrics``), both in the Prometheus text format.

With speculative decoding configured, also vLLM's spec_decode counters: drafts (verifications
of one sequence's draft tokens), draft tokens, accepted tokens, and accepted tokens per draft
position (label ``position``, from 0).
"""
from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("tpserve.metrics")

# Buckets in seconds, spanning a fast GPU decode step to a long CPU prefill.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0)

PREFIX = "tpserve:"
REFUSAL_REASONS = ("max_waiting_requests", "max_waiting_tokens", "shutting_down", "admission")
GIE_PREFIX = "vllm:"  # the model-server protocol's default names (vLLM's)


class _EngineCollector:
    """Gauges and engine-cumulative counters, read from ``stats()`` at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        try:
            s = self.stats()
        except Exception:  # a scrape must not take the daemon down
            log.exception("engine stats failed during a metrics scrape")
            return
        labels = ["model_name"]

        def gauge(name, doc, value, prefix=PREFIX):
            g = GaugeMetricFamily(prefix + name, doc, labels=labels)
            g.add_metric([self.model_name], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([self.model_name], float(value))
            return c

        total = s.get("kv_blocks_total") or 0
        hits = s.get("prefix_cache_hit_tokens", 0)
        yield gauge("num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    s.get("kv_blocks_used", 0) / total if total else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      hits + s.get("prompt_tokens_computed", 0))
        yield counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.", hits)
        yield counter("num_preemptions", "Preemptions of running requests (recomputed later).",
                      s.get("num_preemptions", 0))
        yield counter("num_priority_preemptions", "Preemptions that made room for a waiting request of a "
                      "better priority.", s.get("num_priority_preemptions", 0))
        yield counter("requests_timed_out", "Requests ended by their timeout (finish_reason timeout).",
                      s.get("num_timed_out", 0))
        yield gauge("num_waiting_tokens", "Prompt tokens of waiting requests not yet computed.",
                    s.get("num_waiting_tokens", 0))
        if s.get("runner") == "pooling":  # --runner pooling: embed / classify requests answered
            yield counter("pooling_requests", "Pooling requests (embed, classify) answered.",
                          s.get("pooling_requests", 0))
            yield counter("pooling_prompt_tokens", "Prompt tokens of the pooling requests answered.",
                          s.get("pooling_prompt_tokens", 0))
        if "spec_decode_num_drafts" in s:
            yield from self._spec_decode(s, counter)
        if "kv_offload_host_blocks" in s:
            yield from self._kv_offload(s)
        if "cpu_ops" in s:
            yield from self._cpu_ops(s, gauge)
        if "batch_invariant" in s:
            yield gauge("batch_invariant", "1 when the engine runs in the batch-invariant mode "
                        "(--batch-invariant): a token's logits do not depend on what shares its steps.",
                        int(bool(s["batch_invariant"])))
        yield from self._gie(s, gauge, total)

    def _kv_offload(self, s: dict):
        """The KV tiers (--kv-offload-*), one series per tier (label ``tier``: host, disk)."""
        labels = ["model_name", "tier"]
        series = (
            ("kv_offload_blocks", GaugeMetricFamily, "KV blocks the tier holds.", "blocks"),
            ("kv_offload_bytes", GaugeMetricFamily, "Bytes the tier holds (all ranks).", "bytes"),
            ("kv_offload_capacity_bytes", GaugeMetricFamily, "The tier's budget in bytes (all ranks).",
             "capacity_bytes"),
            ("kv_offload_hits", CounterMetricFamily, "Blocks found in the tier past a prefix-cache miss.",
             "hits"),
            ("kv_offload_misses", CounterMetricFamily, "Blocks looked up in the tier and not found there, "
             "or that did not arrive.", "misses"),
            ("kv_offload_loads", CounterMetricFamily, "Blocks loaded from the tier into the KV pool.",
             "loads"),
            ("kv_offload_saves", CounterMetricFamily, "Blocks saved to the tier.", "saves"),
            ("kv_offload_corrupt_files", CounterMetricFamily, "Block files rejected (corrupt, truncated, "
             "foreign): each a miss, recomputed.", "corrupt"),
            ("kv_offload_load_seconds", CounterMetricFamily, "Seconds from a load's start to its "
             "sequence being ready, summed over loads whose deepest block came from the tier.",
             "load_seconds_total"),
            ("kv_offload_load_jobs", CounterMetricFamily, "Loads (jobs) counted in "
             "kv_offload_load_seconds.", "load_jobs"),
        )
        for name, kind, doc, key in series:
            m = kind(PREFIX + name, doc, labels=labels)
            for tier in ("host", "disk"):
                m.add_metric([self.model_name, tier], float(s.get(f"kv_offload_{tier}_{key}", 0)))
            yield m
        c = CounterMetricFamily(PREFIX + "kv_offload_hit_tokens", "Prompt tokens whose KV came from a KV "
                                "tier (also counted in prefix_cache_hits).", labels=["model_name"])
        c.add_metric([self.model_name], float(s.get("kv_offload_hit_tokens", 0)))
        yield c

    def _cpu_ops(self, s: dict, gauge):
        """Whether the C++ CPU operators run, and why not (stats ``cpu_ops``, ``cpu_ops_reason``)."""
        state = str(s["cpu_ops"])
        if state != "unused":  # a CPU engine: alert on 0
            yield gauge("cpu_ops_loaded", "1 if tpserve's C++ CPU operators are loaded; 0 if the engine "
                        "runs the slower plain-torch path (tpserve:cpu_ops_info says why).",
                        1 if state == "loaded" else 0)
        info = GaugeMetricFamily(PREFIX + "cpu_ops_info", "The C++ CPU operators' state (loaded, "
                                 "unavailable, disabled, unused) and why they are not loaded (labels).",
                                 labels=["model_name", "state", "reason"])
        info.add_metric([self.model_name, state, str(s.get("cpu_ops_reason") or "")], 1.0)
        yield info

    def _spec_decode(self, s: dict, counter):
        """Speculative decoding's counters (only when it is configured), vLLM's names."""
        yield counter("spec_decode_num_drafts", "Verifications of a sequence's draft tokens.",
                      s["spec_decode_num_drafts"])
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      s["spec_decode_num_draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s["spec_decode_num_accepted_tokens"])
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([self.model_name, str(pos)], float(n))
        yield per_pos

    def _gie(self, s: dict, gauge, total: int):
        """The model-server protocol's gauges, same values under vLLM's names."""
        yield gauge("num_requests_running", "Requests in the running batch.", s.get("num_running", 0), GIE_PREFIX)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0),
                    GIE_PREFIX)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    s.get("kv_blocks_used", 0) / total if total else 0.0, GIE_PREFIX)
        info = GaugeMetricFamily(GIE_PREFIX + "cache_config_info", "KV-cache configuration (labels).",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype"])
        info.add_metric([self.model_name, str(s.get("block_size", "")), str(total),
                         str(s.get("kv_cache_dtype", ""))], 1.0)
        yield info


class ServingMetrics:
    """The daemon's metric registry; the server calls the ``on_*`` hooks from its loop."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model_name, stats))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.",
                                     **kw).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         **kw).labels(model_name)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Seconds between consecutive tokens of a request.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Seconds from a request's arrival to its end.",
                             buckets=_REQUEST_BUCKETS, **kw).labels(model_name)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "Seconds a request waited before its first scheduled step.",
                               buckets=_REQUEST_BUCKETS, **kw).labels(model_name)
        self._refused = Counter(PREFIX + "requests_refused", "Requests refused at arrival, by reason.",
                                labelnames=["model_name", "reason"], registry=self.registry)
        self.refused: dict[str, int] = {r: 0 for r in REFUSAL_REASONS}
        for reason in REFUSAL_REASONS:  # every series exists from the start, at 0
            self._refused.labels(model_name, reason)
        self.draining = Gauge(PREFIX + "draining", "1 while the daemon drains for a shutdown.",
                              **kw).labels(model_name)
        self.ready = Gauge(PREFIX + "ready", "1 while the daemon takes new requests.", **kw).labels(model_name)
        self.ready.set(1)

    def on_refused(self, reason: str) -> None:
        self.refused[reason] += 1
        self._refused.labels(self.model_name, reason).inc()

    def on_drain(self) -> None:
        self.draining.set(1)
        self.ready.set(0)

    def refused_counts(self) -> dict:
        """``refused_<reason>`` for the status map."""
        return {f"refused_{r}": n for r, n in self.refused.items()}

    def on_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, num_tokens: int, now: float, arrival: float, last_token: float | None,
                  queue_time: float | None) -> None:
        """``num_tokens`` new tokens of one request at ``now``; ``last_token`` is when its
        previous ones came (None: these are its first)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if last_token is None:
            self.ttft.observe(now - arrival)
            if queue_time is not None:
                self.queue.observe(queue_time)
            num_tokens -= 1
            last_token = now
        if num_tokens > 0:  # several tokens in one output share its latency
            gap = (now - last_token) / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(gap)

    def on_finished(self, now: float, arrival: float) -> None:
        self.e2e.observe(now - arrival)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
