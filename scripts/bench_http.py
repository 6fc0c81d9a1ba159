"""HTTP front overhead: the same streams through the OpenAI HTTP API and through the ZMQ client.

    python scripts/bench_http.py [--model DIR] [--streams 8] [--max-tokens 32] [--rounds 2]

One daemon (`tpserve start --http-port 0`) serves both paths in the same run. After a warm-up
round of each, every round sends ``--streams`` concurrent greedy streaming completions
(ignore_eos, token-id prompts never sent before) first through ``tpserve.AsyncClient`` over
ZMQ, then through ``openai.AsyncOpenAI`` over HTTP.
Prints one line: tokens/s and median time to first token of each path, and their ratio.
Default model: the bundled one.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TPSERVE = [sys.executable, "-m", "tpserve"]


def prompts(n: int, salt: int) -> list[list[int]]:
    """Distinct prompts per (round, path): no run is served from another's prefix cache."""
    return [[(17 * i + 5 * j + 131 * salt) % 4000 + 1 for j in range(24)] for i in range(n)]


async def zmq_round(address, ps, max_tokens):
    from tpserve.client.client import AsyncClient
    async with AsyncClient(address, timeout=600) as c:
        async def one(p):
            start, first, n = time.perf_counter(), None, 0
            async for d in c.stream(p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True):
                first = first or time.perf_counter() - start
                n += len(d.token_ids)
            return n, first
        return await _timed(one, ps)


async def http_round(url, ps, max_tokens):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    try:
        async def one(p):
            start, first = time.perf_counter(), None
            stream = await client.completions.create(model="bench", prompt=p, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            n = 0
            async for chunk in stream:
                # The first chunk with a choice (its text is empty for a model without a tokenizer).
                if chunk.choices and first is None:
                    first = time.perf_counter() - start
                if chunk.usage:
                    n = chunk.usage.completion_tokens
            return n, first
        return await _timed(one, ps)
    finally:
        await client.close()


async def _timed(one, ps):
    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in ps))
    wall = time.perf_counter() - start
    return sum(n for n, _ in results) / wall, [t for _, t in results if t is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rd = tempfile.mkdtemp(prefix="tpb-", dir="/tmp")
    cmd = TPSERVE + ["start", "--runtime-dir", rd, "--http-port", "0", "--served-model-name", "bench"]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        shutil.rmtree(rd, ignore_errors=True)
        print(out.stderr, file=sys.stderr)
        return 1
    address, url = out.stdout.split()
    try:
        zmq_tps, http_tps, zmq_ttft, http_ttft = [], [], [], []
        asyncio.run(zmq_round(address, prompts(args.streams, 0), args.max_tokens))  # warm-up
        asyncio.run(http_round(url, prompts(args.streams, 1), args.max_tokens))
        for r in range(args.rounds):
            tps, ttft = asyncio.run(zmq_round(address, prompts(args.streams, 2 + 2 * r), args.max_tokens))
            zmq_tps.append(tps)
            zmq_ttft += ttft
            tps, ttft = asyncio.run(http_round(url, prompts(args.streams, 3 + 2 * r), args.max_tokens))
            http_tps.append(tps)
            http_ttft += ttft
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = "avx512_bf16" if "avx512_bf16" in flags else ("avx512f" if "avx512f" in flags else platform.machine())
    z, h = statistics.median(zmq_tps), statistics.median(http_tps)
    print(f"bench_http model={os.path.basename(args.model or 'default-model')} isa={isa} dtype=auto "
          f"streams={args.streams} max_tokens={args.max_tokens} zmq_tok_s={z:.1f} http_tok_s={h:.1f} "
          f"ratio={h / z:.3f} zmq_ttft_ms={statistics.median(zmq_ttft) * 1e3:.1f} "
          f"http_ttft_ms={statistics.median(http_ttft) * 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
