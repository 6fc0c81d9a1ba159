"""The HTTP front under hostile or broken conditions: idle and half-sent connections, a stalled
front or daemon, a dead front, cross-site requests, malformed JSON, non-ASCII API keys.

One daemon for the module, started with few file descriptors (so a few hundred idle connections
exhaust them), short client and request timeouts, and no API key on loopback (the case a web
page can reach). Stalls whose effect depends on the daemon dropping the front run against a
fake daemon (a ROUTER socket in this process), which drops deterministically.
"""
from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq
from click.testing import CliRunner

from tpserve.client import protocol as P
from tpserve.cli.main import main
from tpserve.client.client import Client
from tpserve.procs import descendants

TPSERVE = [sys.executable, "-m", "tpserve"]
BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"
NOFILE = 600          # the daemon's (and so the front's) descriptor limit
UPSTREAM_TIMEOUT = 2.0  # --http-upstream-timeout: the front's upstream watch
REQUEST_TIMEOUT = 2.0


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TPSERVE_API_KEY"}


def _few_descriptors():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


class GuardedDaemon:
    def __init__(self):
        self.rd = tempfile.mkdtemp(prefix="tpg-", dir="/tmp")
        out = subprocess.run(TPSERVE + ["start", "--runtime-dir", self.rd, "--num-kv-blocks", "600",
                                        "--block-size", "4", "--http-port", "0", "--http-upstream-timeout",
                                        str(UPSTREAM_TIMEOUT), "--http-request-timeout", str(REQUEST_TIMEOUT),
                                        "--startup-timeout", "200"],
                             capture_output=True, text=True, timeout=240, env=_env(), preexec_fn=_few_descriptors)
        if out.returncode != 0:
            shutil.rmtree(self.rd, ignore_errors=True)
        assert out.returncode == 0, out.stderr + out.stdout
        self.address, self.url = out.stdout.split()
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.pid = int(Path(self.rd, "tpserve.pid").read_text())
        self.log = Path(self.rd, "tpserve.log")

    def front_pid(self) -> int:
        fronts = [p for p in descendants(self.pid) if "tpserve.fronts.http.front" in _cmdline(p)]
        assert len(fronts) == 1, fronts
        return fronts[0]

    def status(self) -> dict:
        with Client(self.address, timeout=30) as c:
            return c.status()

    def stop(self):
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", self.rd, "--timeout", "60"], capture_output=True)
        shutil.rmtree(self.rd, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def daemon():
    d = GuardedDaemon()
    yield d
    d.stop()


def get(daemon, path, **kw):
    return httpx.get(daemon.url + path, timeout=60, **kw)


def complete(daemon, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(daemon.url + "/v1/completions", content=data, timeout=120,
                      headers={"Content-Type": "application/json", **(headers or {})})


def wait_until(predicate, timeout: float, what: str, period: float = 0.1):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(period)


class Requests:
    """One streamed and (optionally) one non-streamed completion, each on its own thread: the
    stream's ``data:`` payloads (``first`` is set by the first), the other's response."""

    def __init__(self, url: str, body: dict, whole: bool = True):
        self.url, self.body = url, body
        self.events: list[str] = []
        self.whole: httpx.Response | None = None
        self.first = threading.Event()
        self.threads = [threading.Thread(target=self._stream, daemon=True)]
        if whole:
            self.threads.append(threading.Thread(target=self._whole, daemon=True))
        for t in self.threads:
            t.start()

    def _stream(self):
        with httpx.stream("POST", self.url + "/v1/completions", json={**self.body, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()

    def _whole(self):
        self.whole = httpx.post(self.url + "/v1/completions", json=self.body, timeout=60)

    def join(self, timeout: float) -> bool:
        """True once every request has ended."""
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)


def assert_ended_with_upstream_error(events: list[str]):
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_lost" and error["type"] == "server_error", error


# ---- 1. idle and slow connections ----------------------------------------------------------
def test_health_answers_while_idle_connections_exceed_the_descriptors(daemon):
    """More idle (and half-sent) connections than the front has descriptors: /health still
    answers, the front lives, and the log gets no traceback, only a line or two."""
    log_start = daemon.log.stat().st_size
    socks = []
    try:
        for i in range(NOFILE + 200):
            s = socket.socket()
            s.setblocking(False)
            assert s.connect_ex((daemon.host, daemon.port)) in (0, errno.EINPROGRESS)
            socks.append(s)
        for s in socks[::2]:
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            except OSError:
                pass
        reply = get(daemon, "/health")
        assert reply.status_code == 200, reply.text
        assert get(daemon, "/v1/models").json()["data"][0]["id"] == "default-model"
    finally:
        for s in socks:
            s.close()
    log = daemon.log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
    assert len(log.splitlines()) <= 6, log


def test_incomplete_request_head_gets_408_then_close(daemon):
    with socket.create_connection((daemon.host, daemon.port), timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the blank line never comes
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_fresh_connection_that_sends_nothing_is_closed(daemon):
    with socket.create_connection((daemon.host, daemon.port), timeout=60) as s:
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408"), got


def test_incomplete_body_is_closed_and_logged_in_one_line(daemon):
    log_start = daemon.log.stat().st_size
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    with socket.create_connection((daemon.host, daemon.port), timeout=60) as s:
        s.sendall(head)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert b"200 OK" not in got
    # A client that leaves mid-body: the same one line, no traceback.
    for _ in range(3):
        with socket.create_connection((daemon.host, daemon.port), timeout=60) as s:
            s.sendall(head)
    assert complete(daemon, {"prompt": "x", "max_tokens": 1}).status_code == 200  # still serving
    log = daemon.log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log, log
    assert len(log.splitlines()) <= 3, log


# ---- 4. Host and Content-Type ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_foreign_host_names_are_refused(daemon, path):
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.evil.example"):
        reply = get(daemon, path, headers={"Host": host})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_host", (host, reply.text)
    for host in (f"localhost:{daemon.port}", f"127.0.0.1:{daemon.port}", f"[::1]:{daemon.port}", "127.1.2.3",
                 "api.localhost"):
        assert get(daemon, path, headers={"Host": host}).status_code == 200, host


def test_foreign_host_cannot_post_either(daemon):
    reply = complete(daemon, {"prompt": "x", "max_tokens": 1}, headers={"Host": "rebound.example:8000"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                   None, "application/jsonp"])
def test_json_endpoints_take_only_json_bodies(daemon, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = httpx.post(daemon.url + path, content=body, headers=headers, timeout=60)
        assert reply.status_code == 415, reply.text
        error = reply.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    ok = httpx.post(daemon.url + "/v1/completions", content=body, timeout=60,
                    headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


# ---- 5. malformed JSON ---------------------------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    (b'{"prompt": ["fine", "x\\udfff"], "max_tokens": 1}', "prompt[1]"),
    (b'{"prompt": "x", "stop": ["\\udc00"], "max_tokens": 1}', "stop[0]"),
    (b'{"prompt": "x", "model": "\\ud83d"}', "model"),
    (b'{"prompt": "x", "\\ud800": 1}', None),
    (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", None),
    (b"[" * 100000, None),
])
def test_lone_surrogates_and_deep_nesting_are_400(daemon, raw, param):
    log_start = daemon.log.stat().st_size
    reply = complete(daemon, raw)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_json", error
    assert "Error" not in error["message"]  # says what is wrong, not which Python exception
    assert "Traceback" not in daemon.log.read_bytes()[log_start:].decode(errors="replace")


def test_lone_surrogate_in_chat_content_is_400(daemon):
    raw = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\ud800"}]}'
    reply = httpx.post(daemon.url + "/v1/chat/completions", content=raw, timeout=60,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "messages[1].content"
    pair = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'  # a valid pair
    assert httpx.post(daemon.url + "/v1/chat/completions", content=pair, timeout=60,
                      headers={"Content-Type": "application/json"}).status_code == 200


# ---- 2. a stalled daemon ends the streams ---------------------------------------------------------
def test_streams_end_when_the_daemon_stops_answering(daemon):
    """SIGSTOP the daemon mid-stream: the front's pings go unanswered, every stream ends with an
    error event then [DONE], a non-streamed request gets a 503; after SIGCONT nothing is left."""
    # Both requests must still be running when the daemon stops: as long as the model allows
    # (~1 s here; 150 tokens took 0.1 s, which a status poll could miss), watched by one client
    # polling every 10 ms.
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with Client(daemon.address, timeout=30) as client:
        requests = Requests(daemon.url, body)
        assert requests.first.wait(60)
        wait_until(lambda: client.status()["requests_in_flight"] == 2, 60, "both requests running",
                   period=0.01)
        os.kill(daemon.pid, signal.SIGSTOP)
    try:
        assert requests.join(60), "a request still hangs"
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert_ended_with_upstream_error(requests.events)
    assert requests.whole.status_code == 503 and requests.whole.json()["error"]["code"] == "upstream_lost"
    # The front aborted them: nothing runs on for nobody.
    wait_until(lambda: daemon.status()["requests_in_flight"] == 0, 60, "requests aborted")
    assert complete(daemon, {"prompt": "x", "max_tokens": 1}).status_code == 200


# ---- 3. a dead front comes back (last: it replaces the module's front) -----------------------------
def test_killed_front_is_restarted_and_reported(daemon):
    first = daemon.front_pid()
    assert daemon.status()["http_front"] == "running"
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: daemon.status().get("http_front_restarts") == 1 and daemon.status()["http_front"] == "running",
               120, "front restarted")
    assert daemon.front_pid() != first
    health = get(daemon, "/health")  # the same URL
    assert health.status_code == 200
    assert health.json()["http_front_restarts"] == 1 and health.json()["http_front_last_exit"] == "signal SIGKILL"
    out = subprocess.run(TPSERVE + ["status", "--runtime-dir", daemon.rd], capture_output=True, text=True)
    assert "HTTP front         running (restarts: 1)" in out.stdout, out.stdout
    assert "signal SIGKILL" in out.stdout
    assert complete(daemon, {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_front_that_keeps_dying_is_given_up_and_reported():
    from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
    front = HttpFrontProcess(HttpOptions(0), "ipc:///nonexistent", str(BUNDLED), "m", 64)
    front.argv = [sys.executable, "-c", "import os, sys; os.write(int(sys.argv[-1]), b'4321\\n'); sys.exit(7)"]
    front.RESTART_DELAYS = (0.01,)
    try:
        front.start(timeout=30)
        wait_until(lambda: front.status()["http_front"] == "failed", 120, "given up")
        status = front.status()
        assert status["http_front_restarts"] == front.MAX_RESTARTS
        assert status["http_front_last_exit"] == "status 7"
    finally:
        front.stop()
    assert front.status()["http_front"] == "failed"


# ---- 2. a stalled front, against a fake daemon that drops it ----------------------------------------
class FakeDaemon(threading.Thread):
    """A ROUTER socket answering like a daemon that dropped its client after two deltas of each
    request: pings are answered (unless ``mute``), aborts get ``unknown_id``."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.mute = threading.Event()
        self.generates = 0
        self._halt = threading.Event()
        self._ready = threading.Event()

    def run(self):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(self.address)
        self._ready.set()
        try:
            while not self._halt.is_set():
                if not sock.poll(100):
                    continue
                peer, frame = sock.recv_multipart()
                msg = P.decode(frame, "request")
                if isinstance(msg, P.GenerateRequest):
                    self.generates += 1
                    replies = [P.DeltaReply(msg.id, "a", [1]), P.DeltaReply(msg.id, "b", [2])] if msg.stream else []
                elif isinstance(msg, P.PingRequest):
                    replies = [] if self.mute.is_set() else [P.PongReply(msg.id)]
                elif isinstance(msg, P.AbortRequest):
                    replies = [P.ErrorReply(P.UNKNOWN_ID, "not in flight", id=msg.id)]
                else:
                    replies = []
                for r in replies:
                    sock.send_multipart([peer, P.encode(r)])
        finally:
            sock.close(0)
            ctx.term()

    def start(self):
        super().start()
        self._ready.wait(10)

    def stop(self):
        self._halt.set()
        self.join(10)


@pytest.fixture(scope="module")
def fake_front(tmp_path_factory):
    """A real front process (upstream timeout 1 s) in front of a FakeDaemon."""
    from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
    fake = FakeDaemon(f"ipc://{tmp_path_factory.mktemp('fake')}/fake.sock")
    fake.start()
    front = HttpFrontProcess(HttpOptions(0, allowed_hosts=("api.example.com",), upstream_timeout=1.0),
                             fake.address, str(BUNDLED), "m", 64)
    front.start(timeout=120)
    yield fake, front
    front.stop()
    fake.stop()


def test_front_answers_the_configured_host_names(fake_front):
    _, front = fake_front
    assert httpx.get(front.url + "/v1/models", headers={"Host": "api.example.com:443"}, timeout=30).status_code == 200
    assert httpx.get(front.url + "/v1/models", headers={"Host": "localhost"}, timeout=30).status_code == 200
    refused = httpx.get(front.url + "/v1/models", headers={"Host": "other.example.com"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host"


def test_streams_of_a_stalled_front_end_with_an_error_then_done(fake_front):
    """The front is stopped longer than its upstream timeout; the daemon dropped its
    requests (the fake sends nothing more): on SIGCONT every stream ends, error event then [DONE],
    and a non-streamed request gets a 503."""
    fake, front = fake_front
    body = {"prompt": [5, 6, 7], "max_tokens": 50}
    requests = Requests(front.url, body)
    wait_until(lambda: fake.generates == 2, 60, "both requests sent")
    # Both deltas reach the client before the stall: one still in the front's socket when it
    # stops is, by design, ended with the others (the watch's tick runs first after a stall).
    wait_until(lambda: len(requests.events) >= 2, 60, "both deltas streamed")
    os.kill(front.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # longer than the upstream timeout: the front cannot know whether the daemon dropped it
    finally:
        os.kill(front.proc.pid, signal.SIGCONT)
    assert requests.join(60), "a request still hangs"
    assert [json.loads(e)["choices"][0]["text"] for e in requests.events[:2]] == ["a", "b"]
    assert_ended_with_upstream_error(requests.events)
    assert requests.whole.status_code == 503 and requests.whole.json()["error"]["code"] == "upstream_lost"
    # A request sent after the stall is not ended by it...
    late = Requests(front.url, body, whole=False)
    assert late.first.wait(60)
    assert not late.join(3.0), late.events  # still waiting for the daemon's next message, as it should
    fake.mute.set()  # ...until the daemon stops answering pings
    assert late.join(60)
    assert_ended_with_upstream_error(late.events)
    fake.mute.clear()


def test_allowed_hosts_option():
    from tpserve.fronts.http.guard import HostPolicy, parse_allowed_hosts
    policy = HostPolicy.for_bind(parse_allowed_hosts("api.example.com, *.corp.example"), loopback_bind=True)
    assert policy.allows("api.example.com") and policy.allows("x.corp.example") and policy.allows("::1")
    assert not policy.allows("corp.example.evil") and not policy.allows("example.com")
    assert HostPolicy.for_bind(None, loopback_bind=False).allows("anything.example")
    assert not HostPolicy.for_bind(None, loopback_bind=True).allows("anything.example")
    assert HostPolicy.for_bind(("*",), loopback_bind=True).allows("anything.example")
    runner = CliRunner()
    bad = runner.invoke(main, ["serve", "--http-port", "0", "--http-allowed-hosts", "a.*.example"])
    assert bad.exit_code == 2 and "--http-allowed-hosts" in bad.output
    from_env = runner.invoke(main, ["serve", "--http-port", "0"], env={"TPSERVE_HTTP_ALLOWED_HOSTS": "x/y"})
    assert from_env.exit_code == 2 and "--http-allowed-hosts" in from_env.output
    bad_timeout = runner.invoke(main, ["serve", "--http-port", "0", "--http-request-timeout", "0"])
    assert bad_timeout.exit_code == 2 and "--http-request-timeout" in bad_timeout.output
    help_text = runner.invoke(main, ["start", "--help"], terminal_width=200).output
    for opt in ("--http-allowed-hosts", "TPSERVE_HTTP_ALLOWED_HOSTS", "--http-request-timeout",
                "TPSERVE_HTTP_REQUEST_TIMEOUT"):
        assert opt in help_text


# ---- 6. a non-ASCII API key ------------------------------------------------------------------------
def test_non_ascii_api_key_matches_its_utf8_header():
    from tpserve.fronts.http.app import Front, create_app
    key = "clé-✓-ключ"
    app = create_app(Front("ipc:///nonexistent", str(BUNDLED), "m", 64, api_key=key, tokenizer=None))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            ok = await c.get("/v1/models", headers={"Authorization": f"Bearer {key}".encode("utf-8")})
            wrong = await c.get("/v1/models", headers={"Authorization": "Bearer cl\xe9".encode("latin-1")})
            none = await c.get("/v1/models")
            return ok.status_code, wrong.status_code, none.status_code

    assert asyncio.run(go()) == (200, 401, 401)


# ---- the connection cap and the rate limit, in process -------------------------------------------
class SmallServer:
    """uvicorn with the guarded protocol (2 connections at most) on a thread; its app answers
    ``/wait`` once ``release`` is set and everything else at once."""

    def __init__(self):
        import uvicorn
        from tpserve.fronts.http.conn import guarded_protocol
        self.release = threading.Event()

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            while scope["path"] == "/wait" and not self.release.is_set():
                await asyncio.sleep(0.01)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, lifespan="off", ws="none", http=guarded_protocol(2, 30.0))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn started")

    def connect(self, request: bytes | None = None) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        if request is not None:
            s.sendall(request)
        return s

    def stop(self):
        self.release.set()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def _read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(4096):
        got += chunk
        if got.endswith(b"ok") or b"}}" in got:
            break
    return got


def test_full_front_closes_its_longest_idle_connection():
    server = SmallServer()
    try:
        oldest = server.connect()
        newer = server.connect()
        wait_until(lambda: len(server.server.server_state.connections) == 2, 30, "two connections accepted")
        third = server.connect(_get("/now"))
        assert _read_all(third).startswith(b"HTTP/1.1 200")
        assert oldest.recv(4096) == b""  # closed to make room, without an answer
        newer.sendall(_get("/now"))
        assert _read_all(newer).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_full_front_with_every_request_in_progress_answers_503():
    server = SmallServer()
    try:
        busy = [server.connect(_get("/wait")) for _ in range(2)]
        wait_until(lambda: len(server.server.server_state.tasks) == 2, 30, "two requests in progress")
        refused = server.connect(_get("/now"))
        reply = _read_all(refused)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        server.release.set()
        for s in busy:
            assert _read_all(s).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_rate_limit_writes_one_line_per_condition_and_interval():
    import logging
    from tpserve.fronts.http.quiet_log import RateLimit
    now = [0.0]
    limit = RateLimit(10.0, clock=lambda: now[0])
    logger = logging.getLogger("tpserve.test_rate_limit")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.addFilter(limit)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.error("accept failed on fd %d", i, exc_info=True)
        logger.warning("another condition")
        now[0] = 11.0
        logger.error("accept failed on fd %d", 5000, exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "accept failed on fd 0", "another condition", "accept failed on fd 5000 [999 more like this in the last 11 s]"]
    assert records[0].exc_info is not None and records[2].exc_info is None  # one traceback per condition


def test_accepted_connections_send_without_waiting_for_acks():
    """An answer goes out in several writes; with Nagle's algorithm each write after the first
    waits for the ACK a keep-alive client delays (40 ms a request): TCP_NODELAY is set."""
    server = SmallServer()
    try:
        client = server.connect()
        wait_until(lambda: len(server.server.server_state.connections) == 1, 30, "connection accepted")
        (conn,) = server.server.server_state.connections
        sock = conn._raw_transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        client.sendall(_get("/now"))
        assert _read_all(client).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()
