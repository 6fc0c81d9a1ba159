"""Replicas behind a real router: smg's routing policies in front of two tpserve daemons.

    python scripts/bench_router.py [--policies round_robin cache_aware cache_aware_events prefix_hash kv_aware least_load]
        [--scenarios shared-prefix skewed] [--model DIR] [--system-tokens 1500] [--turns 6]
        [--smg VENV/bin/smg]

Each (scenario, policy) starts two fresh replicas (``tpserve start --http-port``, on the
~40M-parameter benchmark model of scripts/bench_models.py unless ``--model``), one
``smg launch --worker-urls ... --policy POLICY`` in front of them, streams the scenario's
requests through smg's ``/v1/completions``, and prints one line:

    bench_router scenario=S router=smg policy=P done=N/N prefix_hit_rate=H ttft_ms p50=A p99=B req_s=R out_tok_s=T ...

For the shared-prefix scenario a first line gives the hit rates its request order allows
(``prefix_hit_ceilings``: without eviction, with each prompt pinned to one replica, and the
offline optimum), the scale to read the policies' rates on.

``prefix_hit_rate`` is the replicas' own count from their ``/metrics`` (prompt tokens whose KV
came from the prefix cache over all prompt tokens looked up, both replicas, the warm-up
request excluded); TTFT is measured by the client at the first streamed token; throughput
is completed requests and streamed tokens over the wall time of the scenario.

Scenarios (all prompts are text: the replicas read the id tokenizer of bench_models, so
``"t5 t7"`` is exactly the ids [5, 7], and smg's text-based policies see the prefixes):

* ``shared-prefix``: 8 system prompts of ``--system-tokens`` tokens, each followed by
  ``--turns`` short user turns (16-48 tokens), all in random order, ``--concurrency``
  requests in flight. Each replica's KV pool holds about ``--pool-prompts`` (5) system
  prompts, so a policy that spreads one prompt's turns over both replicas evicts.
* ``skewed``: Poisson arrivals (``--rate``/s) of short requests (64 tokens) with one long
  one (``--long-tokens``) in six: a load-blind policy stacks short requests behind long
  prefills; ``least_load`` reads each replica's live load (``/v1/loads``) every second.

Policy ``cache_aware_events`` is smg's ``cache_aware`` in front of the replicas' gRPC fronts
(``--grpc-port``; grpc_front.py) instead of their HTTP ones: smg tokenizes, and its index is
fed by each replica's KV-cache events (``SubscribeKvEvents``), so it routes to the replica whose
cache really holds the longest prefix, evictions included (``--kv-index``: positional by
default). Text ``cache_aware`` guesses from the prompts it routed, and cannot see evictions.
The index learns a prefix only when a replica has computed it; ``cache_aware_events_booked``
adds smg's optimistic bookings (``--selection-accounting-ttl-ms 5000``: a routed request's
prefix counts as placed on its replica until that replica's events report it, 5 s at most,
above the prefill time of a queued 1,500-token prompt here) and a lower match threshold
(``--cache-threshold 0.05``: a prefix of which eviction left only the head still pins its
replica instead of falling back to the least loaded one). ``least_load_grpc`` is smg's
``least_load`` over the gRPC fronts (load from ``GetLoads``).

Policy ``kv_aware`` is vllm-router's (``--vllm-router``; scripts/peer_vllm_router.sh): it
subscribes to both replicas' KV-cache events (``--kv-events-endpoint``, with replay) and routes
each request to the replica whose cache really holds the longest prefix of it, evictions
included; it needs token ids, so its requests carry the same tokens as ids instead of text.

Everything runs on 127.0.0.1 and is stopped when its turn ends, also on errors. Timings on a
shared machine are noisy: the header says how many CPUs the run had.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
PEERS = Path(__file__).resolve().parent.parent / ".peers"  # where scripts/peer_*.sh install
from bench_serving import HOST, TPSERVE, OpenAIDriver, Record, free_port, machine, pct, summarize  # noqa: E402

POLICIES = ("round_robin", "cache_aware", "cache_aware_events", "cache_aware_events_booked", "prefix_hash",
            "kv_aware", "least_load", "least_load_grpc")
EVENT_POLICIES = ("kv_aware",)  # vllm-router's, fed by the replicas' KV events
# smg's policies in front of the replicas' gRPC fronts: the event-driven index, and load from GetLoads.
# Each maps to (smg's policy, more `smg launch` arguments).
BOOKED = ["--selection-accounting-ttl-ms", "5000", "--cache-threshold", "0.05"]
GRPC_POLICIES = {"cache_aware_events": ("cache_aware", []),
                 "cache_aware_events_booked": ("cache_aware", BOOKED),
                 "least_load_grpc": ("least_load", [])}
NUM_SYSTEM_PROMPTS = 8


def http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value of a replica's /metrics (one model, so one sample per name)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


class Replica:
    """One ``tpserve start --http-port`` daemon on a private runtime directory."""

    def __init__(self, model: Path, num_kv_blocks: int, args, kv_events: bool = True, grpc: bool = False):
        self.rd = tempfile.mkdtemp(prefix="tpserve-bench-router-")
        self.port = free_port()
        self.grpc_url = f"grpc://{HOST}:{free_port()}" if grpc else None
        self.kv_endpoint = f"tcp://{HOST}:{free_port()}" if kv_events else None
        self.kv_replay = f"tcp://{HOST}:{free_port()}" if kv_events else None
        cmd = TPSERVE + ["start", "--runtime-dir", self.rd, "--log-level", "warning", "--model", str(model),
                         "--http-port", str(self.port), "--num-kv-blocks", str(num_kv_blocks),
                         "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                         "--dtype", args.dtype, "--served-model-name", "bench",
                         "--startup-timeout", str(args.startup_timeout)]
        if self.kv_endpoint:
            cmd += ["--kv-events-endpoint", self.kv_endpoint, "--kv-events-replay-endpoint", self.kv_replay]
        if self.grpc_url:
            cmd += ["--grpc-port", self.grpc_url.rsplit(":", 1)[1]]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.startup_timeout + 30)
        if out.returncode != 0:
            log = Path(self.rd, "tpserve.log")
            self.stop()
            raise RuntimeError(f"tpserve start failed: {out.stderr.strip()[-2000:]}"
                               + (f"\n{log.read_text()[-2000:]}" if log.exists() else ""))
        self.url = f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", self.rd], capture_output=True, timeout=120)
        shutil.rmtree(self.rd, ignore_errors=True)


def start_replicas(model: Path, num_kv_blocks: int, args, n: int, grpc: bool = False) -> list[Replica]:
    """``n`` replicas started side by side (a start is mostly waiting for the model to load);
    ``grpc``: each with a gRPC front too (smg's event-driven index reads its KV events)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(Replica, model, num_kv_blocks, args, True, grpc) for _ in range(n)]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for r in started:
            r.stop()
        raise errors[0]
    return started


class Smg:
    """``smg launch`` in front of ``urls`` with ``policy``; waits until it routes to all of them."""

    def __init__(self, smg: str, urls: list[str], policy: str, startup_timeout: float = 120.0,
                 extra: list[str] | None = None, log_level: str = "warn"):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="bench-router-smg-", suffix=".log", delete=False)
        prometheus_port = free_port()
        self.prometheus_url = f"http://{HOST}:{prometheus_port}/metrics"
        cmd = [smg, "launch", "--host", HOST, "--port", str(self.port), "--worker-urls", *urls,
               "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
               "--load-monitor-interval", "1", "--log-level", log_level, *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait(len(urls), startup_timeout)
        except BaseException:
            self.stop()
            raise

    def workers(self) -> list[dict]:
        return http_json(self.url + "/workers")["workers"]

    def _wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                ready = [w for w in self.workers() if w.get("status") == "ready" and w.get("is_healthy")]
                if len(ready) == n:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg did not route to {n} workers within {timeout:g} s: "
                                   f"{self.log_text()[-3000:]}")
            time.sleep(0.2)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def applied_kv_batches(self) -> dict[str, float]:
        """KV-event batches smg has applied to its index, by worker URL (its metrics)."""
        with urllib.request.urlopen(self.prometheus_url, timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("smg_kv_event_batches_total{") and 'disposition="applied"' in line:
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                out[worker] = out.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def wait_for_kv_events(self, n: int, timeout: float = 60.0) -> None:
        """Until smg has subscribed to the KV events of ``n`` gRPC workers (its log says so)."""
        deadline = time.monotonic() + timeout
        while self.log_text().count("KV event stream connected") < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg did not subscribe to {n} workers' KV events: {self.log_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, self.log)


def stop_process(proc: subprocess.Popen, log) -> None:
    """SIGTERM, SIGKILL after 15 s; closes and removes the log."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    os.unlink(log.name)


class VllmRouter:
    """``vllm-router --policy kv_aware`` subscribed to every replica's KV events; waits until it
    answers (it starts listening once all workers are healthy)."""

    def __init__(self, binary: str, replicas: list[Replica], policy: str, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="bench-router-vllm-router-", suffix=".log", delete=False)
        cmd = [binary, "--host", HOST, "--port", str(self.port), "--worker-urls", *[r.url for r in replicas],
               "--policy", policy, "--kv-event-model", "bench", "--log-level", "warning",
               "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.kv_endpoint}",
                    "--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm-router exited with {self.proc.returncode}: "
                                       f"{Path(self.log.name).read_text(errors='replace')[-3000:]}")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm-router not up within {startup_timeout:g} s")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc, self.log)


def id_text(ids) -> str:
    from bench_models import id_text as text
    return text(ids)


def serving_model(args) -> Path:
    """The model directory the replicas load: the benchmark checkpoint with the id tokenizer."""
    from bench_models import build_bench_model, write_id_tokenizer
    cache = Path(args.cache_dir)
    src = Path(args.model).resolve() if args.model else build_bench_model(cache / "qwen3-40m-bf16")
    out = cache / f"{src.name}-router-text"
    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
                target = out / f.name
                if not target.exists():
                    target.symlink_to(f)
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        write_id_tokenizer(out, vocab)
    return out


# ---- scenarios -------------------------------------------------------------------------------

def shared_prefix_requests(args, vocab: int, rng: random.Random) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, max_tokens): every turn of every system prompt, shuffled; arrival 0
    (they are sent ``--concurrency`` at a time)."""
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(NUM_SYSTEM_PROMPTS)]
    reqs = [(0.0, s + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))], args.max_tokens)
            for s in systems for _ in range(args.turns)]
    rng.shuffle(reqs)
    return reqs


def skewed_requests(args, vocab: int, rng: random.Random) -> list[tuple[float, list[int], int]]:
    t, out = 0.0, []
    for i in range(args.skewed_requests):
        t += rng.expovariate(args.rate)
        n = args.long_tokens if i % 6 == 3 else 64
        out.append((t, [rng.randrange(3, vocab) for _ in range(n)], args.max_tokens))
    return out


def prefix_hit_ceilings(reqs, system_tokens: int, block_size: int, pool_prompts: float) -> dict[str, float]:
    """What the shared-prefix scenario's request order allows two replicas to hit, as a fraction
    of all prompt tokens, in a model that serves the requests one at a time, caches whole system
    prompts (their full blocks) and nothing else, and holds ``int(pool_prompts)`` of them per
    replica:

    * ``no_eviction``: every system prompt's turns after its first hit;
    * ``split_lru``: each prompt pinned to one replica (all 4 + 4 splits of the 8, averaged),
      least recently used evicted. A router that does not know the order in advance can expect
      little more in this model: any placement caches at most 2 x pool distinct prompts, the
      next request's prompt is about as likely to be any of the 8, and a prompt cached on both
      replicas is a slot lost;
    * ``offline_optimum``: the 2 x pool slots filled knowing the whole order in advance (Belady:
      evict the prompt needed again last), any prompt on any replica: a bound no router reaches.
    """
    from itertools import combinations
    ids: dict[tuple, int] = {}
    order = [ids.setdefault(tuple(p[:system_tokens]), len(ids)) for _, p, _ in reqs]
    cap = int(pool_prompts)
    per_hit = system_tokens // block_size * block_size
    total = sum(len(p) for _, p, _ in reqs)

    def split_lru(home: list[int]) -> int:
        caches: list[list[int]] = [[], []]
        hits = 0
        for q in order:
            cache = caches[home[q]]
            if q in cache:
                hits += 1
                cache.remove(q)
            elif len(cache) >= cap:
                cache.pop(0)
            cache.append(q)
        return hits

    def belady(slots: int) -> int:
        cache: set[int] = set()
        hits = 0
        for i, q in enumerate(order):
            if q in cache:
                hits += 1
                continue
            if len(cache) >= slots:
                later = order[i + 1:]
                cache.remove(max(cache, key=lambda c: later.index(c) if c in later else len(later)))
            cache.add(q)
        return hits

    n = len(ids)
    splits = [split_lru([int(q in half) for q in range(n)]) for half in combinations(range(n), n // 2)]
    return {name: hits * per_hit / total for name, hits in (
        ("no_eviction", len(order) - n), ("split_lru", sum(splits) / len(splits)),
        ("offline_optimum", belady(2 * cap)))}


async def run_requests(url_port: int, reqs, concurrency: int | None, text: bool = True
                       ) -> tuple[list[Record], float]:
    """Stream every request (text prompts, or token ids when ``text`` is False)."""
    driver = OpenAIDriver(url_port, "bench", detok=id_text if text else None, extra={"ignore_eos": True})
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    records = [Record() for _ in reqs]
    start = time.perf_counter()

    async def one(i, arrival, prompt, max_tokens):
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        async with gate or contextlib.nullcontext():
            rec = records[i]
            rec.sent = time.perf_counter()
            try:
                await driver.stream(prompt, max_tokens, rec)
                rec.done = time.perf_counter()
            except Exception as e:  # counted as not done, reported below
                rec.error = f"{type(e).__name__}: {e}"
    await asyncio.gather(*(one(i, *r) for i, r in enumerate(reqs)))
    return records, time.perf_counter() - start


def scenario_requests(scenario: str, model: Path, args) -> list[tuple[float, list[int], int]]:
    """The scenario's requests for ``model``'s vocabulary, the same for every policy of a seed."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    make = shared_prefix_requests if scenario == "shared-prefix" else skewed_requests
    return make(args, vocab, random.Random(args.seed))


def run_one(scenario: str, policy: str, model: Path, args) -> str:
    reqs = scenario_requests(scenario, model, args)
    if scenario == "shared-prefix":
        concurrency = args.concurrency
        blocks = int(args.pool_prompts * args.system_tokens / args.block_size)
    else:
        concurrency = None
        blocks = int(4 * args.long_tokens / args.block_size)
    replicas: list[Replica] = []
    smg = None
    events = policy in EVENT_POLICIES
    grpc = policy in GRPC_POLICIES
    try:
        replicas += start_replicas(model, blocks, args, 2, grpc=grpc)
        if events:
            smg = VllmRouter(args.vllm_router, replicas, policy)
        elif grpc:
            smg_policy, smg_extra = GRPC_POLICIES[policy]
            smg = Smg(args.smg, [r.grpc_url for r in replicas], smg_policy,
                      extra=smg_extra + args.smg_args.split(), log_level="info")  # its subscriptions are logged at info
            if smg_policy == "cache_aware":  # smg subscribes for cache_aware only
                smg.wait_for_kv_events(len(replicas))
        else:
            smg = Smg(args.smg, [r.url for r in replicas], policy, extra=args.smg_args.split())
        # Warm-up through each replica directly (first calls are slow), not measured.
        for r in replicas:
            asyncio.run(run_requests(r.port, [(0.0, [5, 6, 7, 8], 2)], None))
        before = [scrape(r.url) for r in replicas]
        # vllm-router's kv_aware needs token ids (it has no tokenizer for text): the replicas
        # see the same tokens either way.
        records, wall = asyncio.run(run_requests(smg.port, reqs, concurrency, text=not events))
        after = [scrape(r.url) for r in replicas]
        batches = []
        for r in replicas:
            with contextlib.suppress(OSError, ValueError):
                batches.append(http_json(r.url + "/server_info")["kv_events"]["published"])
    finally:
        if smg is not None:
            smg.stop()
        for r in replicas:
            r.stop()

    def delta(name):
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))
    hits, queries = delta("tpserve:prefix_cache_hits_total"), delta("tpserve:prefix_cache_queries_total")
    per_replica = [a.get("tpserve:prompt_tokens_total", 0) - b.get("tpserve:prompt_tokens_total", 0)
                   for a, b in zip(after, before)]
    s = summarize(records)
    errors = sorted({r.error for r in records if r.error})
    router = "vllm-router" if events else "smg-grpc" if grpc else "smg"
    line = (f"bench_router scenario={scenario} router={router} policy={policy} done={s['done']}/{len(reqs)} "
            f"prefix_hit_rate={hits / queries if queries else 0.0:.3f} hit_tokens={hits:.0f} "
            f"ttft_ms p50={pct(s['ttft'], 50) * 1e3:.0f} p99={pct(s['ttft'], 99) * 1e3:.0f} "
            f"req_s={s['done'] / wall:.2f} out_tok_s={s['tok_s']:.1f} "
            f"preemptions={delta('tpserve:num_preemptions_total'):.0f} "
            f"prompt_tokens_per_replica={'/'.join(f'{p:.0f}' for p in per_replica)} "
            f"kv_event_batches={'/'.join(map(str, batches))} wall_s={wall:.1f}")
    if errors:
        line += f" errors={errors[:3]}"
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory [default: the 40M benchmark model]")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tpserve-bench-models"))
    smg_venv = os.environ.get("TPSERVE_SMG_VENV") or PEERS / "smg"
    ap.add_argument("--smg", default=os.path.join(smg_venv, "bin", "smg"),
                    help="the smg launcher (scripts/peer_smg.sh installs it)")
    ap.add_argument("--smg-args", default="", help="more `smg launch` arguments, one string")
    router_venv = os.environ.get("TPSERVE_VLLM_ROUTER_VENV") or PEERS / "vllm-router"
    ap.add_argument("--vllm-router", default=os.path.join(router_venv, "bin", "vllm-router"),
                    help="vllm-router, for the KV-event policy kv_aware (scripts/peer_vllm_router.sh)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--scenarios", nargs="+", choices=("shared-prefix", "skewed"),
                    default=["shared-prefix", "skewed"])
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=6, help="user turns per system prompt")
    ap.add_argument("--pool-prompts", type=float, default=5.0,
                    help="system prompts one replica's KV pool holds (sizes --num-kv-blocks)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--skewed-requests", type=int, default=36)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=2.0, help="skewed scenario: arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if not os.path.exists(args.smg):
        raise SystemExit(f"no smg at {args.smg}: run scripts/peer_smg.sh (or pass --smg)")
    model = serving_model(args)
    version = subprocess.run([str(Path(args.smg).parent / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('smg'))"],
                             capture_output=True, text=True).stdout.strip() or "?"
    print(f"bench_router model={model.name} dtype={args.dtype} {machine()} smg={version} replicas=2 "
          f"system_tokens={args.system_tokens} turns={args.turns} pool_prompts={args.pool_prompts:g} "
          f"(timings on a shared machine are noisy)", flush=True)
    for scenario in args.scenarios:
        if scenario == "shared-prefix":
            ceilings = prefix_hit_ceilings(scenario_requests(scenario, model, args), args.system_tokens,
                                           args.block_size, args.pool_prompts)
            print(f"bench_router scenario=shared-prefix seed={args.seed} prefix_hit_ceilings "
                  + " ".join(f"{k}={v:.3f}" for k, v in ceilings.items())
                  + " (requests one at a time; prefix_hit_ceilings' doc)", flush=True)
        policies = args.policies if scenario == "shared-prefix" else \
            [p for p in args.policies if p in ("round_robin", "least_load", "least_load_grpc", "power_of_two")] \
            or args.policies
        for policy in policies:
            try:
                print(run_one(scenario, policy, model, args), flush=True)
            except Exception as e:
                print(f"bench_router scenario={scenario} policy={policy} unavailable: {type(e).__name__}: "
                      f"{str(e)[-500:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
