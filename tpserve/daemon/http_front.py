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
every exit path, so no front outlives its daemon.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Streaming is server-sent events as OpenAI sends them.
``n`` > 1 submits the first completion of a prompt alone and its siblings once the first has
produced a token: by then the prompt's full KV blocks are in the prefix cache, so the siblings
share them instead of computing the prompt again. A client that disconnects has its requests
aborted (the daemon frees their blocks). With an API key every ``/v1`` call needs
``Authorization: Bearer KEY``; a non-loopback host is refused without one.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
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

log = logging.getLogger("tpserve.http")

_STOP_TIMEOUT = 5.0


@dataclass
class HttpOptions:
    """Where the front listens; ``api_key`` None leaves ``/v1`` open (loopback hosts only)."""

    port: int
    host: str = "127.0.0.1"
    api_key: str | None = None


class HttpFrontError(TpserveError, RuntimeError):
    """The HTTP front could not start (port busy, bad host...)."""


def check_http_host(host: str, api_key: str | None) -> None:
    """Refuse to expose the HTTP API beyond this machine without an API key."""
    target = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if not api_key and not is_loopback_tcp(target):
        raise InsecureAddressError(
            f"refusing to serve HTTP on {host}: it is not a loopback address, so it needs an API key "
            "(--api-key or TPSERVE_API_KEY), or bind 127.0.0.1")


# ---- the daemon's side: one child process --------------------------------------------------
class HttpFrontProcess:
    """Starts the front as a child of the daemon and stops it; ``url`` once started."""

    def __init__(self, options: HttpOptions, daemon_address: str, model_path: str, model_name: str,
                 max_model_len: int, server_public_key: bytes | None = None):
        check_http_host(options.host, options.api_key)
        self.options = options
        self.argv = [sys.executable, "-m", "tpserve.daemon.http_front", "--address", daemon_address,
                     "--host", options.host, "--port", str(options.port), "--model-path", model_path,
                     "--model-name", model_name, "--max-model-len", str(max_model_len),
                     "--parent-pid", str(os.getpid())]
        if server_public_key:
            self.argv += ["--server-key", server_public_key.decode()]
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, timeout: float = 120.0) -> str:
        """Spawn the front and wait until it listens; returns its base URL."""
        r, w = os.pipe()
        env = dict(os.environ)
        env.pop("TPSERVE_API_KEY", None)
        if self.options.api_key:
            env["TPSERVE_API_KEY"] = self.options.api_key  # not on argv, where `ps` shows it
        try:
            self.proc = subprocess.Popen(self.argv + ["--ready-fd", str(w)], pass_fds=(w,), env=env,
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
        try:
            port = self._read_port(r, timeout)
        finally:
            os.close(r)
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        self.url = f"http://{host}:{port}"
        log.info("HTTP front (pid %d) serving the OpenAI API at %s", self.proc.pid, self.url)
        threading.Thread(target=self._watch, args=(self.proc,), name="http-front-watch", daemon=True).start()
        return self.url

    def _watch(self, proc: subprocess.Popen) -> None:
        """Say so in the daemon's log if the front dies on its own (the ZMQ side keeps serving)."""
        code = proc.wait()
        if self.proc is proc:  # not stopped by us
            log.error("the HTTP front (pid %d) exited with status %s; %s no longer answers (the ZMQ "
                      "socket still does)", proc.pid, code, self.url)

    def _read_port(self, fd: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise HttpFrontError(f"the HTTP front did not listen within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:  # the child closed the pipe: it exited
                    code = self.proc.wait()
                    raise HttpFrontError(f"the HTTP front exited with status {code} before listening "
                                         f"on {self.options.host}:{self.options.port} (see the log above)")
                data += chunk
        return int(data.split(b"\n")[0])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the front process's main --------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGTERM this process when the daemon dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpserve.daemon.http_front",
                                 description="tpserve's HTTP front (started by the daemon)")
    ap.add_argument("--address", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--server-key", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--ready-fd", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    api_key = os.environ.get("TPSERVE_API_KEY") or None
    check_http_host(args.host, api_key)
    import uvicorn

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 1
    sock.listen(1024)
    from tpserve.daemon.http_app import Front, create_app

    front = Front(args.address, args.model_path, args.model_name, args.max_model_len, api_key,
                  args.server_key.encode() if args.server_key else None)
    config = uvicorn.Config(create_app(front), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2, lifespan="off")
    server = uvicorn.Server(config)
    if args.ready_fd is not None:  # connections queue in the backlog until uvicorn accepts them
        os.write(args.ready_fd, f"{sock.getsockname()[1]}\n".encode())
        os.close(args.ready_fd)

    async def serve():
        try:
            await server.serve(sockets=[sock])
        finally:
            await front.close()
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
