"""An agent's two turns over Anthropic's Messages API, as Claude Code sends them.

    python scripts/bench_agent_turns.py [--shape 40m] [--context-tokens 3000] [--sessions 3] [--pairs 30]

A daemon (`tpserve start --http-port 0`) on a benchmark shape (scripts/bench_models.py, random
weights; the bundled model's tokenizer and chat template copied beside it, its context raised to
8192) serves sessions of two streamed ``POST /v1/messages``: turn 1 is a long system prompt (text
blocks with ``cache_control``) and a set of tools (~``--context-tokens`` tokens together) and a
user task, answered with a tool call (``tool_choice`` names a tool, so the random model makes
one); turn 2 resends turn 1's whole history plus the assistant's ``tool_use`` and a
``tool_result``. Each session has a system prompt of its own, so its turn 1 starts cold. Time to
first token: from sending the request to its ``message_start`` event (tpserve sends it with the
first generated token). Prints the median of each turn's, their ratio (the second turn should
reuse the shared history from the prefix cache: target <= 0.2) and turn 2's
``cache_read_input_tokens``.

Then the translation's cost: ``--pairs`` pairs of the same request (turn 2's, ``max_tokens`` 1,
not streamed, its prompt cached) through ``/v1/messages`` and, spelled as chat, through
``/v1/chat/completions``, alternating; prints the median time of each, their difference and
whether both rendered the same prompt. On a loaded machine that difference is noise of several
milliseconds either way, so the front's own work on the same two requests is also timed in this
process (``front_costs``: body to token ids, result to answer), and their difference is the
translation's cost per request (target <= 2 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
TPSERVE = [sys.executable, "-m", "tpserve"]
CONTEXT = 8192
# The shape's overrides for a chat model: a longer context, and the bundled tokenizer's special
# token ids (its end-of-text is 0; the shape's default 2 is an ordinary token of that tokenizer).
AGENT_OVERRIDES = dict(max_position_embeddings=CONTEXT, bos_token_id=0, eos_token_id=0)

PARAGRAPH = ("You are an interactive command line tool that helps users with software engineering tasks. "
             "Use the tools available to you to read files, search the code, run commands and edit files. "
             "Keep answers short and precise; prefer editing existing files to creating new ones; never "
             "invent file paths; run the tests after a change and report what failed. ")


def tools() -> list[dict]:
    """Claude-Code-like tools: a name, a long description and an input schema each."""
    def tool(name, what, props, required):
        return {"name": name, "description": f"{what} " + "Use it when the task needs it; " * 6,
                "input_schema": {"type": "object", "properties": props, "required": required,
                                 "additionalProperties": False}}
    path = {"type": "string", "maxLength": 24, "description": "An absolute path to a file"}
    return [
        tool("Read", "Reads a file from the local filesystem.",
             {"file_path": {"enum": ["/repo/src/main.py", "/repo/README.md"]}}, ["file_path"]),
        tool("Write", "Writes a file to the local filesystem.",
             {"file_path": path, "content": {"type": "string", "maxLength": 40}}, ["file_path", "content"]),
        tool("Edit", "Replaces a string in a file.",
             {"file_path": path, "old_string": {"type": "string", "maxLength": 20},
              "new_string": {"type": "string", "maxLength": 20}}, ["file_path", "old_string", "new_string"]),
        tool("Bash", "Runs a shell command.",
             {"command": {"type": "string", "maxLength": 30}, "timeout": {"type": "integer", "maximum": 600}},
             ["command"]),
        tool("Glob", "Finds files by a glob pattern.", {"pattern": {"type": "string", "maxLength": 20}},
             ["pattern"]),
        tool("Grep", "Searches file contents with a regular expression.",
             {"pattern": {"type": "string", "maxLength": 20}, "path": path}, ["pattern"]),
        tool("TodoWrite", "Updates the task list.",
             {"todos": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}},
             ["todos"]),
        tool("WebFetch", "Fetches a URL.", {"url": {"type": "string", "maxLength": 30}}, ["url"]),
    ]


def system(session: int, paragraphs: int) -> list[dict]:
    head = f"Session {session}. You are Claude Code, Anthropic's official CLI for Claude."
    return [{"type": "text", "text": head},
            {"type": "text", "text": PARAGRAPH * paragraphs, "cache_control": {"type": "ephemeral"}}]


TASK = {"role": "user", "content": "Read the main module and tell me what it does."}
FILE = "def main():\n    print('hello')\n\n\nif __name__ == '__main__':\n    main()\n" * 8


def stream_turn(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """(seconds to message_start, the answer assembled from the events) of one streamed turn."""
    start = time.perf_counter()
    ttft, message, blocks, partial = None, None, [], {}
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/messages answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            if kind == "message_start":
                ttft = time.perf_counter() - start
                message = event["message"]
            elif kind == "content_block_start":
                blocks.append(dict(event["content_block"]))
                partial[event["index"]] = ""
            elif kind == "content_block_delta":
                d, block = event["delta"], blocks[event["index"]]
                if d["type"] == "text_delta":
                    block["text"] += d["text"]
                elif d["type"] == "input_json_delta":
                    partial[event["index"]] += d["partial_json"]
            elif kind == "message_delta":
                message.update(event["delta"], usage=event["usage"])
            elif kind == "error":
                raise RuntimeError(f"error event: {event}")
    for i, block in enumerate(blocks):
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(partial[i] or "{}")
            except ValueError:
                block["input"] = {}  # cut by max_tokens
    message["content"] = blocks
    return ttft, message


def count(client: httpx.Client, body: dict) -> int:
    keep = {k: body[k] for k in ("model", "system", "messages", "tools", "tool_choice") if k in body}
    r = client.post("/v1/messages/count_tokens", json=keep)
    r.raise_for_status()
    return r.json()["input_tokens"]


def as_chat(body: dict) -> dict:
    """The chat completions body of a Messages body (as the Messages API translates it)."""
    messages = [{"role": "system", "content": "\n\n".join(b["text"] for b in body["system"])}]
    for m in body["messages"]:
        if isinstance(m["content"], str):
            messages.append(m)
            continue
        texts = [b["text"] for b in m["content"] if b["type"] == "text"]
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                 for b in m["content"] if b["type"] == "tool_use"]
        for b in m["content"]:
            if b["type"] == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]})
        if m["role"] == "assistant":
            messages.append({"role": "assistant", "content": "".join(texts),
                             **({"tool_calls": calls} if calls else {})})
        elif texts:
            messages.append({"role": "user", "content": "".join(texts)})
    tools_ = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in body["tools"]]
    return {"model": body["model"], "messages": messages, "tools": tools_, "max_tokens": body["max_tokens"],
            "temperature": body.get("temperature", 1.0)}


CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/README.md"}}\n</tool_call>'


def front_costs(path: Path, body: dict, chat: dict, rounds: int) -> tuple[float, float]:
    """Median seconds of the HTTP front's own work on one request, in this process (no daemon,
    no network): the Messages body translated, validated, rendered and tokenized, and its answer
    built (``messages_input``, ``messages_output``), against the same request as a chat body
    (``openai_api`` and ``chat_output``). Their difference is the translation's cost, free of the
    noise of a loaded machine that the end-to-end pairs carry."""
    import asyncio

    from tpserve.client.client import Delta, GenerateResult
    from tpserve.fronts.http import openai_api as O, structured_api
    from tpserve.fronts.http.messages_input import prepare
    from tpserve.fronts.http.messages_output import Message
    from tpserve.fronts.http.app import Front
    from tpserve.fronts.http.chat_output import Response

    from tpserve.tokenizer import load_tokenizer

    # a tokenizer of its own: the front then tokenizes long texts itself (without one given it
    # asks the daemon, which this measurement has not)
    front = Front("ipc:///unused", str(path), "bench", CONTEXT, tokenizer=load_tokenizer(path))

    def result(ids):
        return GenerateResult("r", CALL, [1], "stop", len(ids), 1)

    async def messages():
        job, ids, t = await prepare(front, json.loads(json.dumps(body)))
        return Message(front, job, t, len(ids)).whole(CALL, result(ids))

    async def chat_path():
        b = json.loads(json.dumps(chat))
        job = O.parse_chat(b, "bench")
        await structured_api.prepare(job, b, O.build_request)
        text = await front.chat_text(job.messages, job.chat_options, tools=job.tools.tools)
        ids = await front.encode(text, False, field="messages")
        response = Response(front, job, [ids])
        response.add(0, Delta("r", CALL, [1]))
        response.add(0, result(ids))
        return response.whole()

    async def run():
        times = {messages: [], chat_path: []}
        for i in range(rounds + 2):
            for f in ((messages, chat_path) if i % 2 else (chat_path, messages)):
                start = time.perf_counter()
                answer = await f()
                if i >= 2:  # two warm-up rounds
                    times[f].append(time.perf_counter() - start)
            assert "tool_use" in json.dumps(answer) or "tool_calls" in json.dumps(answer)
        return statistics.median(times[messages]), statistics.median(times[chat_path])
    try:
        return asyncio.run(run())
    finally:
        asyncio.run(front.close())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPE_DIRS), default="40m")
    ap.add_argument("--context-tokens", type=int, default=3000,
                    help="about how many tokens the system prompt and tools take together")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=30, help="requests per endpoint for the translation's cost")
    ap.add_argument("--max-tokens", type=int, default=48, help="each turn's max_tokens")
    args = ap.parse_args()

    path = build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}-agent",
                             **{**SHAPE_OVERRIDES[args.shape], **AGENT_OVERRIDES})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(BUNDLED / name, path / name)
    rd = tempfile.mkdtemp(prefix="tpba-", dir="/tmp")
    cmd = TPSERVE + ["start", "--runtime-dir", rd, "--http-port", "0", "--served-model-name", "bench",
                     "--model", str(path), "--dtype", "bfloat16", "--max-model-len", str(CONTEXT),
                     "--kv-cache-memory-gb", "0.5"]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "TPSERVE_API_KEY": ""})
    if out.returncode != 0:
        shutil.rmtree(rd, ignore_errors=True)
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    url = out.stdout.split()[1]
    try:
        with httpx.Client(base_url=url, timeout=600, headers={"anthropic-version": "2023-06-01"}) as client:
            # size the system prompt: paragraphs until system + tools reach the target
            base = {"model": "bench", "tools": tools(), "messages": [TASK]}
            one = count(client, {**base, "system": system(0, 1)})
            two = count(client, {**base, "system": system(0, 2)})
            paragraphs = max(1, 1 + round((args.context_tokens - one) / max(1, two - one)))
            ttft1, ttft2, cached2, prompts = [], [], [], None
            for s in range(args.sessions + 1):  # session 0 warms the front and the engine up
                first = {**base, "system": system(s + 1, paragraphs), "max_tokens": args.max_tokens,
                         "temperature": 0, "tool_choice": {"type": "tool", "name": "Read"}}
                t1, answer = stream_turn(client, first)
                use = next((b for b in answer["content"] if b["type"] == "tool_use"), None)
                if use is None:
                    raise RuntimeError(f"turn 1 made no tool call: {answer}")
                second = {**first, "tool_choice": {"type": "auto"}, "messages": [
                    TASK, {"role": "assistant", "content": answer["content"]},
                    {"role": "user",
                     "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": FILE}]}]}
                t2, answer2 = stream_turn(client, second)
                if s:
                    ttft1.append(t1)
                    ttft2.append(t2)
                    cached2.append(answer2["usage"]["cache_read_input_tokens"])
                    u1, u2 = answer["usage"], answer2["usage"]
                    prompts = (u1["input_tokens"] + u1["cache_read_input_tokens"],
                               u2["input_tokens"] + u2["cache_read_input_tokens"])
            # the translation's cost: the same request through both endpoints
            whole = {**second, "max_tokens": 1}
            chat = as_chat(whole)
            times = {"messages": [], "chat": []}
            used = {}
            for i in range(args.pairs + 1):
                order = [("messages", "/v1/messages", whole), ("chat", "/v1/chat/completions", chat)]
                for name, route, body in (order if i % 2 == 0 else order[::-1]):
                    start = time.perf_counter()
                    r = client.post(route, json=body)
                    elapsed = time.perf_counter() - start
                    r.raise_for_status()
                    usage = r.json()["usage"]
                    used[name] = (usage.get("prompt_tokens")
                                  or usage["input_tokens"] + usage["cache_read_input_tokens"])
                    if i:
                        times[name].append(elapsed)
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)
    fm, fc = front_costs(path, whole, chat, max(args.pairs, 10))
    m1, m2 = statistics.median(ttft1), statistics.median(ttft2)
    mm, mc = statistics.median(times["messages"]), statistics.median(times["chat"])
    same = "yes" if used["messages"] == used["chat"] else "no"
    print(f"bench_agent_turns shape={args.shape} sessions={args.sessions} "
          f"turn1_prompt={prompts[0]} turn2_prompt={prompts[1]} ttft1_ms={m1 * 1e3:.1f} "
          f"ttft2_ms={m2 * 1e3:.1f} ttft_ratio={m2 / m1:.3f} turn2_cache_read_input_tokens={min(cached2)}")
    print(f"bench_agent_turns translation pairs={args.pairs} max_tokens=1 e2e messages_ms={mm * 1e3:.2f} "
          f"chat_ms={mc * 1e3:.2f} difference_ms={(mm - mc) * 1e3:.2f} same_prompt={same} "
          f"({used['messages']} and {used['chat']} tokens); front's work messages_ms={fm * 1e3:.3f} "
          f"chat_ms={fc * 1e3:.3f} overhead_ms={(fm - fc) * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
