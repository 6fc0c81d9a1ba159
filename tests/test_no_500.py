"""No input makes the HTTP front answer 500: malformed or absurd requests are 400s naming what
is wrong; a 500 is left for the front's own bugs (and logged).

In process: the front's app with a stand-in tokenizer (the exception safety net; a body over the
cap answered 413 while its client is still sending it). Against a daemon on the bundled model:
the probes that found 500s (JSON nested 2,000 levels deep as a schema's text or a tool call's
arguments), an admission error naming max_tokens, and /detokenize of no tokens.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from test_http import HttpDaemon
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http.app import Front, create_app

DEEP = 2000  # levels: past Python's recursion limit (1,000)


# ---- in process ----------------------------------------------------------------------------
def _app():
    front = Front("ipc:///nonexistent/tpserve.sock", "unused", "m", 1024, tokenizer=object())
    app = create_app(front)

    @app.get("/raise/{what}")
    async def boom(what: str):
        if what == "recursion":
            def down(n):
                return down(n + 1)
            down(0)
        if what == "recursion-cause":
            try:
                json.loads("[" * DEEP + "]" * DEEP)
            except RecursionError as e:
                raise ValueError("could not read it") from e
        if what == "field":
            raise InvalidFieldError("tools[0].function.parameters", "makes a grammar over its size budget")
        raise KeyError("a bug of the front")
    return app


def _get(app, path: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get(path)
    return asyncio.run(go())


@pytest.mark.parametrize("what,status,param", [
    ("recursion", 400, None),
    ("recursion-cause", 400, None),
    ("field", 400, "tools[0].function.parameters"),
    ("bug", 500, None),
])
def test_an_unexpected_exception_is_a_400_when_the_input_caused_it(what, status, param):
    r = _get(_app(), f"/raise/{what}")
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if status == 400:
        message = r.json()["error"]["message"]
        assert "nested too deeply" in message or "grammar" in message


class FrontServer:
    """The front's app under uvicorn with the front's connection protocol, on a thread."""

    def __init__(self, request_timeout: float):
        import uvicorn
        from tpserve.fronts.http.conn import guarded_protocol
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(_app(), log_config=None, lifespan="off", ws="none",
                                http=guarded_protocol(64, request_timeout))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def test_a_413_reaches_a_client_that_sends_its_whole_body_before_reading():
    """A client writing a body over the cap, slower than the body deadline, reads the 413 once it
    has written (http.client and many others read only then): the front half-closes and discards
    the rest instead of resetting the connection under the client's writes."""
    server = FrontServer(request_timeout=1.0)
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n")
        chunk = b" " * 65536
        until = time.monotonic() + 2.5  # past the 1 s body deadline
        sent = 0
        while time.monotonic() < until:
            s.sendall(chunk)  # was: BrokenPipeError / ConnectionResetError after ~1 s
            sent += len(chunk)
            time.sleep(0.02)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        s.close()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"request_too_large" in reply and b"connection: close" in reply.lower()
    finally:
        server.stop()


# ---- against a daemon --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url():
    daemon = HttpDaemon(api_key=None, num_kv_blocks=600)
    yield daemon.url
    daemon.stop()


DEEP_SCHEMA = '{"anyOf":[' * DEEP + '{"type":"string"}' + "]}" * DEEP
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
USER = [{"role": "user", "content": "hi"}]

# (what, endpoint, body)
PROBES = [
    ("structured_outputs.json as text", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": DEEP_SCHEMA}}),
    ("response_format schema as text", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2,
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": DEEP_SCHEMA}}}),
    ("tool call arguments", "/v1/chat/completions",
     {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP_ARRAY}}]}],
      "max_tokens": 2}),
    ("logit_bias key", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {DEEP_ARRAY: 1}}),
    ("body", "/v1/completions", DEEP_ARRAY),
    ("stop as nested arrays", "/v1/completions", {"prompt": "x", "stop": json.loads("[" * 900 + "]" * 900)}),
]


@pytest.mark.parametrize("what,path,body", PROBES, ids=[p[0] for p in PROBES])
def test_deep_nesting_anywhere_is_a_400(url, what, path, body):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]


def test_a_max_tokens_past_the_context_is_named(url):
    for n in (1, 16):
        body = {"prompt": "x", "n": n, "max_tokens": 2**31 - 1}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_detokenize_of_no_tokens_is_the_empty_text(url):
    r = httpx.post(url + "/detokenize", json={"tokens": []}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == "", r.text
