"""The OpenAI-compatible HTTP front: a separate process, one more ZMQ client of the daemon.

Design. The HTTP front runs in its own process, started and stopped by the daemon's life cycle
(``HttpFrontProcess``), and talks to the daemon through the same ZMQ socket and protocol as
any other client. Reasons:

* isolation: a burst of HTTP connections, JSON parsing, tokenization or chat templating never
  runs on the engine loop, whose step time is the latency every client sees; a crash in the
  web stack cannot take the engine down;
* the engine process stays single-threaded, with no asyncio loop to interleave with steps;
* several fronts (another port, another host behind an API key) are just more clients, and
  the ZMQ path is not weakened: the front has no privilege a ZMQ client lacks;
* the cost is one loopback hop per message (tens of microseconds, against steps of
  milliseconds), and the front tokenizes prompts itself, so the daemon receives token ids.

Life cycle: the daemon spawns ``python -m tpserve.daemon.http_front`` once the engine is
loaded; the child binds its port, then writes the bound port to an inherited pipe (so port 0
works and a busy port fails the daemon's start-up). The child asks the kernel to SIGTERM it
when the daemon dies (PR_SET_PDEATHSIG) and the daemon stops it (SIGTERM, then SIGKILL) on
every exit path, so no front outlives its daemon. A front that dies on its own is restarted on
the same port, a bounded number of times in a row (``HttpFrontProcess``); the daemon's status
map says ``http_front`` running / restarting / failed, and ``/health`` how often it restarted.

Under attack or breakage: connections are capped below the descriptor limit and must deliver
their request in time (http_conn.py); Host names and body types are checked (http_guard.py);
requests whose daemon side may be gone are ended (http_upstream.py); the log stays one line per
condition (quiet_log.py).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 while the daemon answers, with ``{"status": "ok", "http_front_restarts",
"http_front_last_exit"}``), ``GET /metrics``. Streaming is server-sent events as OpenAI sends them.
``n`` > 1 submits the first completion of a prompt alone and its siblings once the first has
produced a token: by then the prompt's full KV blocks are in the prefix cache, so the siblings
share them instead of computing the prompt again. A client that disconnects has its requests
aborted (the daemon frees their blocks). With an API key every ``/v1`` call needs
``Authorization: Bearer KEY``; a non-loopback host is refused without one.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tpserve.daemon.runtime import InsecureAddressError, is_loopback_tcp
from tpserve.errors import TpserveError
from tpserve.procs import die_with_parent, freeze_heap

log = logging.getLogger("tpserve.http")

_STOP_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 30.0  # s a client has for a request head, then for its body
DEFAULT_UPSTREAM_TIMEOUT = 30.0  # s of no answer from the daemon (or of a stalled front) that end requests


@dataclass
class HttpOptions:
    """Where the front listens; ``api_key`` None leaves ``/v1`` open (loopback hosts only).

    ``allowed_hosts``: Host names answered besides loopback ones (http_guard.py; None: loopback
    names only on a loopback bind, any elsewhere). ``request_timeout``: seconds a client has for
    a request head, then for its body (http_conn.py). ``upstream_timeout``: the front ends its
    requests in flight when the daemon has not answered a ping, or the front itself was stalled,
    for that many seconds (http_upstream.py)."""

    port: int
    host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT


class HttpFrontError(TpserveError, RuntimeError):
    """The HTTP front could not start (port busy, bad host...)."""


def check_http_host(host: str, api_key: str | None) -> None:
    """Refuse to expose the HTTP API beyond this machine without an API key."""
    if not api_key and not is_loopback_host(host):
        raise InsecureAddressError(
            f"refusing to serve HTTP on {host}: it is not a loopback address, so it needs an API key "
            "(--api-key or TPSERVE_API_KEY), or bind 127.0.0.1")


def is_loopback_host(host: str) -> bool:
    return is_loopback_tcp(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")


def describe_exit(code: int) -> str:
    """A Popen return code in words: "status 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


# ---- the daemon's side: one child process, restarted when it dies ---------------------------
class FrontProcess:
    """Starts a front (a child process that is one more ZMQ client of the daemon) as a child of
    the daemon, restarts it when it dies, and stops it. Subclasses say which front: ``NAME`` in
    messages, ``KEY`` in the status map, ``SCHEME`` of its URL, and the argv of its process.

    ``start`` spawns the first front and waits until it listens (its failure fails the daemon's
    start-up). Afterwards a watch thread restarts a front that exits on its own, on the same
    port, after a pause that doubles with each restart in a row (``RESTART_DELAYS``); a front
    that served ``STABLE_S`` seconds resets that count. After ``MAX_RESTARTS`` restarts in a row
    it gives up: ``status()`` then says ``failed`` (the ZMQ socket keeps serving). ``url`` once
    started."""

    MAX_RESTARTS = 5
    RESTART_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)
    STABLE_S = 60.0
    NAME = "front"
    KEY = "front"
    SCHEME = "http"
    SERVES = "the API"

    def __init__(self, options, module: str, daemon_address: str, model_path: str, model_name: str,
                 max_model_len: int, server_public_key: bytes | None, extra: list[str]):
        """``options`` has ``host``, ``port`` and ``api_key``; ``module`` is run with the
        arguments of ``front_arguments`` and ``extra``."""
        self.options = options
        self.argv = [sys.executable, "-m", module, "--address", daemon_address, "--host", options.host,
                     "--model-path", model_path, "--model-name", model_name, "--max-model-len", str(max_model_len),
                     "--parent-pid", str(os.getpid()), *extra]
        if server_public_key:
            self.argv += ["--server-key", server_public_key.decode()]
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.state = "stopped"
        self.restarts = 0
        self.last_exit: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start(self, timeout: float = 120.0) -> str:
        """Spawn the front and wait until it listens; returns its base URL."""
        self._stopping.clear()
        proc, port = self._spawn(self.options.port, timeout)
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        self.port, self.url, self.state = port, f"{self.SCHEME}://{host}:{port}", "running"
        log.info("%s (pid %d) serving %s at %s", self.NAME, proc.pid, self.SERVES, self.url)
        threading.Thread(target=self._watch, args=(proc, timeout), name=f"{self.KEY}-watch", daemon=True).start()
        return self.url

    def status(self) -> dict:
        """The front's state for the daemon's status map."""
        return {self.KEY: self.state, f"{self.KEY}_restarts": self.restarts,
                f"{self.KEY}_last_exit": self.last_exit, f"{self.SCHEME}_url": self.url}

    def _spawn(self, port: int, timeout: float) -> tuple[subprocess.Popen, int]:
        r, w = os.pipe()
        env = dict(os.environ)
        env.pop("TPSERVE_API_KEY", None)
        if self.options.api_key:
            env["TPSERVE_API_KEY"] = self.options.api_key  # not on argv, where `ps` shows it
        argv = self.argv + ["--port", str(port), "--restarts", str(self.restarts)]
        if self.last_exit:
            argv += ["--last-exit", self.last_exit]
        try:
            with self._lock:
                if self._stopping.is_set():
                    raise HttpFrontError(f"the {self.NAME} is being stopped")
                # Its own session: a terminal's Ctrl-C reaches the daemon, which stops the front
                # itself, instead of killing the front first (which would read as a crash).
                self.proc = proc = subprocess.Popen(argv + ["--ready-fd", str(w)], pass_fds=(w,), env=env,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(w)
        try:
            return proc, self._read_port(proc, r, port, timeout)
        finally:
            os.close(r)

    def _watch(self, proc: subprocess.Popen, timeout: float) -> None:
        """Restart the front whenever it exits on its own (see the class doc)."""
        in_a_row = 0
        while True:
            began = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            self.last_exit = describe_exit(code)
            if time.monotonic() - began >= self.STABLE_S:
                in_a_row = 0
            if in_a_row >= self.MAX_RESTARTS:
                self.state = "failed"
                log.error("the %s (pid %d) exited with %s; it was restarted %d times in a row: "
                          "giving up, %s no longer answers (the ZMQ socket still does)",
                          self.NAME, proc.pid, self.last_exit, in_a_row, self.url)
                return
            self.state = "restarting"
            delay = self.RESTART_DELAYS[min(in_a_row, len(self.RESTART_DELAYS) - 1)]
            log.error("the %s (pid %d) exited with %s; restarting it in %g s on %s",
                      self.NAME, proc.pid, self.last_exit, delay, self.url)
            while True:
                in_a_row += 1
                if self._stopping.wait(delay):
                    return
                self.restarts += 1
                try:
                    proc, _ = self._spawn(self.port, timeout)
                    break
                except HttpFrontError as e:
                    if self._stopping.is_set():
                        return
                    self.last_exit = str(e)
                    if in_a_row >= self.MAX_RESTARTS:
                        self.state = "failed"
                        log.error("the %s could not be restarted (%s): giving up, %s no longer "
                                  "answers (the ZMQ socket still does)", self.NAME, e, self.url)
                        return
                    delay = self.RESTART_DELAYS[min(in_a_row, len(self.RESTART_DELAYS) - 1)]
                    log.error("the %s could not be restarted (%s); next try in %g s", self.NAME, e, delay)
            self.state = "running"
            log.info("%s restarted (pid %d, restart %d) at %s", self.NAME, proc.pid, self.restarts, self.url)

    def _read_port(self, proc: subprocess.Popen, fd: int, port: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                _terminate(proc)
                raise HttpFrontError(f"the {self.NAME} did not listen within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:  # the child closed the pipe: it exited
                    code = proc.wait()
                    raise HttpFrontError(f"the {self.NAME} exited with {describe_exit(code)} before listening "
                                         f"on {self.options.host}:{port} (see the log above)")
                data += chunk
        return int(data.split(b"\n")[0])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds; no restart after it; idempotent."""
        with self._lock:
            self._stopping.set()
            proc, self.proc = self.proc, None
        if self.state != "failed":
            self.state = "stopped"
        if proc is not None:
            _terminate(proc)


class HttpFrontProcess(FrontProcess):
    """The OpenAI-compatible HTTP front's process (see FrontProcess)."""

    NAME = "HTTP front"
    KEY = "http_front"
    SCHEME = "http"
    SERVES = "the OpenAI API"

    def __init__(self, options: HttpOptions, daemon_address: str, model_path: str, model_name: str,
                 max_model_len: int, server_public_key: bytes | None = None):
        check_http_host(options.host, options.api_key)
        extra = ["--upstream-timeout", str(options.upstream_timeout), "--request-timeout", str(options.request_timeout)]
        if options.allowed_hosts is not None:
            extra += ["--allowed-hosts", ",".join(options.allowed_hosts)]
        super().__init__(options, "tpserve.daemon.http_front", daemon_address, model_path, model_name,
                         max_model_len, server_public_key, extra)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the front process's main --------------------------------------------------------------
def front_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The argv every front process takes from FrontProcess (its subclass adds its own)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--address", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--server-key", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--ready-fd", type=int, default=None)
    ap.add_argument("--restarts", type=int, default=0, help="how often the daemon restarted the front")
    ap.add_argument("--last-exit", default=None, help="how the previous front ended")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = front_arguments("python -m tpserve.daemon.http_front", "tpserve's HTTP front (started by the daemon)")
    ap.add_argument("--upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT,
                    help="the daemon's --http-upstream-timeout")
    ap.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT)
    ap.add_argument("--allowed-hosts", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tpserve.daemon import quiet_log
    quiet_log.install()
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    api_key = os.environ.get("TPSERVE_API_KEY") or None
    check_http_host(args.host, api_key)
    import uvicorn

    from tpserve.daemon.http_conn import connection_limits, guarded_protocol
    max_connections, backlog = connection_limits()
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 1
    sock.listen(backlog)
    from tpserve.daemon.http_app import Front, create_app
    from tpserve.daemon.http_guard import HostPolicy, parse_allowed_hosts
    from tpserve.daemon.http_upstream import UpstreamWatch

    front = Front(args.address, args.model_path, args.model_name, args.max_model_len, api_key,
                  args.server_key.encode() if args.server_key else None)
    front.restarts, front.last_exit = args.restarts, args.last_exit
    hosts = HostPolicy.for_bind(parse_allowed_hosts(args.allowed_hosts), is_loopback_host(args.host))
    # log_config None: uvicorn's records go to the root handler, through quiet_log's rate limit.
    # ws "none": an upgrade would leave the guarded protocol.
    config = uvicorn.Config(create_app(front, hosts), log_level="warning", log_config=None, access_log=False,
                            timeout_graceful_shutdown=2, lifespan="off", ws="none", backlog=backlog,
                            http=guarded_protocol(max_connections, args.request_timeout))
    server = uvicorn.Server(config)
    if args.ready_fd is not None:  # connections queue in the backlog until uvicorn accepts them
        os.write(args.ready_fd, f"{sock.getsockname()[1]}\n".encode())
        os.close(args.ready_fd)

    async def serve():
        asyncio.get_running_loop().set_exception_handler(quiet_log.loop_exception_handler)
        freeze_heap()  # the app, tokenizer and modules: a full collection of them stalled streams
        watch = UpstreamWatch(front, args.upstream_timeout)
        watch.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            watch.stop()
            await front.close()
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
