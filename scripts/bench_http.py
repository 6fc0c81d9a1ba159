"""HTTP front overhead: the same streams through the OpenAI HTTP API and through the ZMQ client.

    python scripts/bench_http.py [--model DIR] [--streams 8] [--max-tokens 32] [--rounds 2]

One daemon (`tpserve start --http-port 0`) serves both paths in the same run. After a warm-up
round of each, every round sends ``--streams`` concurrent greedy streaming completions
(ignore_eos, token-id prompts never sent before) first through ``tpserve.AsyncClient`` over
ZMQ, then through ``openai.AsyncOpenAI`` over HTTP.
Prints one line: tokens/s and median time to first token of each path, and their ratio.
Default model: the bundled one.

    python scripts/bench_http.py --apis [--model DIR] [--max-tokens 32] [--rounds 20]

The agent APIs' translation cost instead: the same conversation (a system prompt, four function
tools, one user message; greedy) streamed one at a time through ``/v1/chat/completions``,
``/v1/responses`` and ``/v1/messages`` of one daemon, the three alternating, ``--rounds`` times
after a warm-up round. Prints one line per API: its median time to the first output event and
time per further token, end to end, and the front's own work measured in this process (no
daemon, no network: free of a loaded machine's noise): per request, the body to its prompt
token ids; per token, a Delta to its server-sent events. Each beside chat completions' (``vs
chat``): the translation's cost per request and per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TPSERVE = [sys.executable, "-m", "tpserve"]
BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"


def cpu_flags() -> str:
    return open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""


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


# ---- --apis: the agent APIs' translation cost against chat completions ----------------------
APIS = ("chat", "responses", "messages")
ASK = "Read the main module and tell me what it does."
SYSTEM = ("You are a command line tool that helps users with software engineering tasks. Use the "
          "tools to read files, search the code and run commands. Keep answers short. ") * 4
TOOLS = [(name, f"{what} Use it when the task needs it.",
          {"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
         for name, what, props in (
             ("Read", "Reads a file.", {"file_path": {"type": "string"}}),
             ("Grep", "Searches file contents.",
              {"pattern": {"type": "string"}, "path": {"type": "string"}}),
             ("Bash", "Runs a shell command.", {"command": {"type": "string"}}),
             ("Edit", "Replaces a string in a file.", {"file_path": {"type": "string"},
                                                     "old_string": {"type": "string"},
                                                     "new_string": {"type": "string"}}))]


def api_bodies(max_tokens: int) -> dict:
    """The same conversation as each API spells it, streamed: a system prompt, four function tools
    (``tool_choice`` auto: a call the model starts is constrained and parsed, alike on the three)
    and one user message; each renders the same prompt through the chat template."""
    msg = [{"role": "user", "content": ASK}]
    chat_tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                  for n, d, p in TOOLS]
    return {"chat": ("/v1/chat/completions", {
                "model": "bench", "messages": [{"role": "system", "content": SYSTEM}, *msg],
                "tools": chat_tools, "tool_choice": "auto", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}),
            "responses": ("/v1/responses", {
                "model": "bench", "instructions": SYSTEM, "input": msg,
                "tools": [{"type": "function", "name": n, "description": d, "parameters": p}
                          for n, d, p in TOOLS],
                "tool_choice": "auto", "max_output_tokens": max_tokens, "temperature": 0, "stream": True,
                "store": False}),
            "messages": ("/v1/messages", {
                "model": "bench", "system": SYSTEM, "messages": msg,
                "tools": [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS],
                "tool_choice": {"type": "auto"}, "max_tokens": max_tokens, "temperature": 0,
                "stream": True})}


def _output_tokens(api: str, data: str) -> int | None:
    """The output token count of a stream's usage event, or None (another event)."""
    import json
    if api == "chat" and '"usage":{' in data:
        return json.loads(data)["usage"]["completion_tokens"]
    if api == "responses" and ('"type":"response.completed"' in data[-80:]  # the type comes last
                               or '"type":"response.incomplete"' in data[-80:]):
        return json.loads(data)["response"]["usage"]["output_tokens"]
    if api == "messages" and data.startswith('{"type":"message_delta"'):
        return json.loads(data)["usage"]["output_tokens"]
    return None


def _is_output(api: str, data: str) -> bool:
    """Whether an event of the stream carries output (its first one: the time to first token)."""
    if api == "chat":
        return ('"content":"' in data and '"content":""' not in data) or '"tool_calls":[' in data
    if api == "responses":
        return '"type":"response.output_item.added"' in data[-80:]
    return data.startswith('{"type":"content_block_start"')


def stream_once(client, api: str, route: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first output event, seconds to the end, output tokens) of one stream."""
    start, first, n = time.perf_counter(), None, None
    with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{route} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if first is None and _is_output(api, data):
                first = time.perf_counter() - start
            got = _output_tokens(api, data)
            n = got if got is not None else n
    return first or 0.0, time.perf_counter() - start, n or 0


def front_work(path: str, max_len: int, tokens: int, rounds: int) -> dict:
    """Per API, in this process (no daemon, no network, none of a loaded machine's noise): the
    front's own work on one request (body to prompt token ids) and per streamed token (a Delta
    to its server-sent events), median seconds."""
    import asyncio
    import json

    from tpserve.client.client import Delta, GenerateResult
    from tpserve.fronts.http import openai_api as O, structured_api
    from tpserve.fronts.http.agent_common import render_prompt
    from tpserve.fronts.http.app import Front
    from tpserve.fronts.http.chat_output import Response
    from tpserve.fronts.http.messages_input import prepare as messages_prepare
    from tpserve.fronts.http.messages_output import Message
    from tpserve.fronts.http.response_store import ResponseStore
    from tpserve.fronts.http.responses_input import prepare as responses_prepare, translate
    from tpserve.fronts.http.responses_items import TemplateTraits
    from tpserve.fronts.http.responses_output import Output
    from tpserve.tokenizer import load_tokenizer

    front = Front("ipc:///unused", path, "bench", max_len, tokenizer=load_tokenizer(path))
    store, traits = ResponseStore(), TemplateTraits.of(front.tokenizer)
    bodies = {api: body for api, (_, body) in api_bodies(tokens).items()}
    words = [Delta("r", w, [7]) for w in (" the", " keeper", " watched", " waves", ",") * tokens][:tokens]
    words[0].prompt_tokens, words[0].cached_tokens = 20, 0
    result = GenerateResult("r", "", [7] * tokens, "length", 20, tokens)

    async def chat_request():
        b = json.loads(json.dumps(bodies["chat"]))
        job = O.parse_chat(b, "bench")
        await structured_api.prepare(job, b, O.build_request)
        ids = await front.chat_prompt(job.messages, job.chat_options, tools=job.tools.tools)
        return lambda: Response(front, job, [ids]), ids

    async def responses_request():
        tr = translate(json.loads(json.dumps(bodies["responses"])), front, store, traits)
        await responses_prepare(tr)
        ids = await render_prompt(front, tr.job, "input")
        return lambda: Output(tr, front, "resp_x", True), ids

    async def messages_request():
        job, ids, t = await messages_prepare(front, json.loads(json.dumps(bodies["messages"])))
        return lambda: Message(front, job, t, len(ids)), ids

    def stream_chat(reply):
        for d in words:
            reply.chunks(0, d)
        reply.chunks(0, result)
        reply.final_chunks()

    def stream_responses(out):
        for d in words:
            out.feed(d)
            out.take()

    def stream_messages(m):
        m.start(words[0])
        for d in words:
            m.events(d.text)
        m.end(result)

    paths = {"chat": (chat_request, stream_chat), "responses": (responses_request, stream_responses),
             "messages": (messages_request, stream_messages)}

    async def run():
        request_s = {api: [] for api in APIS}
        token_s = {api: [] for api in APIS}
        prompts = {}
        for i in range(rounds + 2):
            for api in (APIS if i % 2 else APIS[::-1]):
                make, stream = paths[api]
                start = time.perf_counter()
                reply, ids = await make()
                mid = time.perf_counter()
                r = reply()
                stream(r)
                if api == "responses":
                    await r.finish(result)
                end = time.perf_counter()
                prompts[api] = len(ids)
                if i >= 2:  # two warm-up rounds
                    request_s[api].append(mid - start)
                    token_s[api].append((end - mid) / tokens)
        return ({api: (statistics.median(request_s[api]), statistics.median(token_s[api]), prompts[api])
                 for api in APIS})
    try:
        return asyncio.run(run())
    finally:
        asyncio.run(front.close())


def apis_main(args, url: str, path: str, max_len: int) -> list[str]:
    """The ``--apis`` lines: per API, end to end (streams through the daemon, the APIs alternating)
    and the front's own work in this process, each against chat completions."""
    import httpx
    bodies = api_bodies(args.max_tokens)
    ttft = {api: [] for api in APIS}
    per_token = {api: [] for api in APIS}
    counts = {api: [] for api in APIS}
    with httpx.Client(base_url=url, timeout=600, headers={"anthropic-version": "2023-06-01"}) as client:
        for i in range(args.rounds + 1):  # round 0 warms up
            for api in (APIS if i % 2 else APIS[::-1]):
                route, body = bodies[api]
                first, total, n = stream_once(client, api, route, body)
                if i:
                    ttft[api].append(first)
                    counts[api].append(n)
                    if n > 1:
                        per_token[api].append((total - first) / (n - 1))
    work = front_work(path, max_len, args.max_tokens, max(10, args.rounds))
    lines = []
    c_ttft, c_tok = statistics.median(ttft["chat"]), statistics.median(per_token["chat"] or [0.0])
    c_req, c_stream, _ = work["chat"]
    for api in APIS:
        t, tok = statistics.median(ttft[api]), statistics.median(per_token[api] or [0.0])
        req, stream, prompt = work[api]
        lines.append(
            f"bench_http api={api} rounds={args.rounds} max_tokens={args.max_tokens} "
            f"output_tokens={statistics.median(counts[api]):.0f} prompt_tokens={prompt} "
            f"e2e ttft_ms={t * 1e3:.2f} (vs chat {(t - c_ttft) * 1e3:+.2f}) "
            f"per_token_ms={tok * 1e3:.3f} (vs chat {(tok - c_tok) * 1e3:+.3f}); "
            f"front's work request_ms={req * 1e3:.3f} (vs chat {(req - c_req) * 1e3:+.3f}) "
            f"per_token_us={stream * 1e6:.1f} (vs chat {(stream - c_stream) * 1e6:+.1f})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=None, help="default: 2 (20 with --apis)")
    ap.add_argument("--apis", action="store_true",
                    help="the Responses and Messages APIs' cost against chat completions")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 20 if args.apis else 2
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
    if args.apis:
        path = args.model or str(BUNDLED)
        max_len = json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"]
        try:
            lines = apis_main(args, url, path, max_len)
        finally:
            subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
            shutil.rmtree(rd, ignore_errors=True)
        for line in lines:
            isa = "+".join(f for f in ("amx_bf16", "avx512_bf16", "avx2") if f in cpu_flags().split())
            print(f"{line} isa={isa or platform.machine()}")
        return 0
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
    flags = cpu_flags()
    isa = "avx512_bf16" if "avx512_bf16" in flags else ("avx512f" if "avx512f" in flags else platform.machine())
    z, h = statistics.median(zmq_tps), statistics.median(http_tps)
    print(f"bench_http model={os.path.basename(args.model or 'default-model')} isa={isa} dtype=auto "
          f"streams={args.streams} max_tokens={args.max_tokens} zmq_tok_s={z:.1f} http_tok_s={h:.1f} "
          f"ratio={h / z:.3f} zmq_ttft_ms={statistics.median(zmq_ttft) * 1e3:.1f} "
          f"http_ttft_ms={statistics.median(http_ttft) * 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
