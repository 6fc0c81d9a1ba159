"""scripts/bench_serving.py's client side and the id tokenizer of scripts/bench_models.py:
what a text-only peer reads back, how streamed events become token timestamps, and the note
printed when a server's counts differ from the trace. No server is started."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_models  # noqa: E402
import bench_serving  # noqa: E402


def test_id_tokenizer_reads_back_the_ids_and_decodes_one_piece_per_id(tmp_path):
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    vocab = 300
    bench_models.write_id_tokenizer(tmp_path, vocab)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [5, 299, 0, 1, 2, 7, 7, 42]
    text = bench_models.id_text(ids)
    assert text == "t5 t299 t0 t1 t2 t7 t7 t42"
    assert tok(text)["input_ids"] == ids                  # nothing added, nothing merged
    stream = DecodeStream([], skip_special_tokens=True)   # as transformers serve streams
    pieces = [stream.step(tok._tokenizer, i) for i in ids]
    assert all(pieces) and "".join(pieces) == text


class _SSEServer:
    """One canned HTTP response: chunked SSE ``events``, then ``[DONE]``; keeps the request."""

    def __init__(self, events: list[dict]):
        self.events, self.body = events, None

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        self.body = json.loads(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for payload in [json.dumps(e) for e in self.events] + ["[DONE]"]:
            data = f"data: {payload}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()


def _stream(events, driver_kw, prompt=(5, 6, 7), max_tokens=4):
    async def run():
        fake = _SSEServer(events)
        server = await asyncio.start_server(fake.handle, bench_serving.HOST, 0)
        port = server.sockets[0].getsockname()[1]
        rec = bench_serving.Record()
        try:
            await bench_serving.OpenAIDriver(port, "m", **driver_kw).stream(list(prompt),
                                                                             max_tokens, rec)
        finally:
            server.close()
            await server.wait_closed()
        return fake.body, rec
    return asyncio.run(run())


def _text(t, finish=None, usage=None):
    e = {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}
    if usage:
        e["usage"] = usage
    return e


def test_text_events_count_one_token_each_and_usage_fills_merged_ones():
    events = [_text(" t9"), _text(" t4 t8"),                # the second event carries 2 tokens
              _text("", "length", {"prompt_tokens": 3, "completion_tokens": 4})]
    body, rec = _stream(events, dict(detok=bench_models.id_text, per_event=True,
                                     extra={"generation_config": "{}"}))
    assert body["prompt"] == "t5 t6 t7" and body["model"] == "m"
    assert body["generation_config"] == "{}" and body["max_tokens"] == 4
    assert len(rec.times) == 4 and rec.times[-1] == rec.times[-2]
    assert rec.server_prompt_tokens == 3


def test_an_error_event_fails_the_request():
    with pytest.raises(RuntimeError, match="stream error: out of memory"):
        _stream([_text(" t1"), {"error": "out of memory"}], dict(per_event=True))


def test_count_note_names_every_difference_and_is_empty_when_none():
    trace = [bench_serving.Request(0.0, [3] * 10, 4), bench_serving.Request(0.1, [4] * 6, 2)]
    good = [bench_serving.Record(times=[1.0] * 4, done=2.0, server_prompt_tokens=10),
            bench_serving.Record(times=[1.0] * 2, done=2.0)]
    assert bench_serving.count_note(trace, good) == ""
    bad = [bench_serving.Record(times=[1.0] * 3, done=2.0, server_prompt_tokens=11),
           bench_serving.Record(error="RuntimeError: boom")]
    note = bench_serving.count_note(trace, bad)
    assert "prompt_tokens server=11 trace=10" in note
    assert "output_tokens received=3 asked=4" in note
    assert "errors=1 first: RuntimeError: boom" in note


def test_transformers_cache_holds_the_kv_budget_capped_at_max_num_seqs_contexts():
    cfg = dict(num_hidden_layers=8, num_key_value_heads=4, head_dim=64, hidden_size=512,
               num_attention_heads=8, max_position_embeddings=8192)
    args = argparse.Namespace(dtype="bfloat16", kv_cache_memory_gb=2.0, max_num_seqs=64)
    # 8 KiB of bf16 K and V per token: 2 GiB hold 262,144 tokens, 1,024 blocks of 256.
    assert bench_serving.transformers_kv_blocks(cfg, args) == 1024
    args.max_num_seqs = 4                                  # 4 x 8,192 tokens: 128 blocks
    assert bench_serving.transformers_kv_blocks(cfg, args) == 128


def test_a_429_marks_the_request_refused_and_the_overload_summary_counts_it():
    async def run():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(handle, bench_serving.HOST, 0)
        try:
            records = await bench_serving.replay(
                bench_serving.OpenAIDriver(server.sockets[0].getsockname()[1], None),
                [bench_serving.Request(0.0, [5, 6], 4)], 30)
        finally:
            server.close()
            await server.wait_closed()
        return records
    (refused,) = asyncio.run(run())
    assert refused.refused and refused.done is None and refused.error is None
    fast = bench_serving.Record(sent=0.0, times=[0.5, 0.6], done=0.7)
    slow = bench_serving.Record(sent=0.0, times=[3.0], done=3.5)
    lost = bench_serving.Record(sent=0.0, times=[0.1])                   # never finished
    s = bench_serving.overload_summary([fast, slow, refused, lost], ttft_bound=2.0, seconds=4.0)
    assert (s["good"], s["good_per_s"], s["refused"], s["done"], s["unfinished"]) == (1, 0.25, 1, 2, 1)
    assert s["ttft"] == [0.5, 3.0]
    assert "refused=1" in bench_serving.count_note([bench_serving.Request(0.0, [1], 1)] * 4,
                                                   [fast, slow, refused, lost])
