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

Life cycle: the daemon spawns ``python -m tpserve.fronts.http.front`` once the engine is
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

import asyncio
import logging
import os
import socket
import sys
from dataclasses import dataclass

from tpserve.client.addresses import InsecureAddressError, is_loopback_tcp
from tpserve.fronts.http.reasoning import CHOICES as PARSERS
from tpserve.fronts.http.response_store import DEFAULT_CAPACITY as DEFAULT_STORE_SIZE
from tpserve.fronts.http.response_store import ResponseStore
from tpserve.fronts.process import DEFAULT_UPSTREAM_TIMEOUT, FrontProcess, front_arguments
from tpserve.procs import die_with_parent, freeze_heap

log = logging.getLogger("tpserve.http")

DEFAULT_REQUEST_TIMEOUT = 30.0  # s a client has for a request head, then for its body


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
    reasoning_parser: str | None = None  # reasoning.py's parser of chat answers (--reasoning-parser)
    responses_store_size: int = DEFAULT_STORE_SIZE  # responses kept for GET / previous_response_id


def check_http_host(host: str, api_key: str | None) -> None:
    """Refuse to expose the HTTP API beyond this machine without an API key."""
    if not api_key and not is_loopback_host(host):
        raise InsecureAddressError(
            f"refusing to serve HTTP on {host}: it is not a loopback address, so it needs an API key "
            "(--api-key or TPSERVE_API_KEY), or bind 127.0.0.1")


def is_loopback_host(host: str) -> bool:
    return is_loopback_tcp(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")


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
        if options.reasoning_parser:
            extra += ["--reasoning-parser", options.reasoning_parser]
        if options.responses_store_size != DEFAULT_STORE_SIZE:
            extra += ["--responses-store-size", str(options.responses_store_size)]
        super().__init__(options, "tpserve.fronts.http.front", daemon_address, model_path, model_name,
                         max_model_len, server_public_key, extra)


# ---- the front process's main --------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = front_arguments("python -m tpserve.fronts.http.front", "tpserve's HTTP front (started by the daemon)")
    ap.add_argument("--upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT,
                    help="the daemon's --http-upstream-timeout")
    ap.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT)
    ap.add_argument("--allowed-hosts", default=None)
    ap.add_argument("--reasoning-parser", default=None, choices=PARSERS)
    ap.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tpserve.fronts.http import quiet_log
    quiet_log.install()
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    api_key = os.environ.get("TPSERVE_API_KEY") or None
    check_http_host(args.host, api_key)
    import uvicorn

    from tpserve.fronts.http.conn import connection_limits, guarded_protocol
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
    from tpserve.fronts.http.app import Front, create_app
    from tpserve.fronts.http.guard import HostPolicy, parse_allowed_hosts
    from tpserve.fronts.upstream import UpstreamWatch

    front = Front(args.address, args.model_path, args.model_name, args.max_model_len, api_key,
                  args.server_key.encode() if args.server_key else None,
                  reasoning_parser=args.reasoning_parser)
    front.responses_store = ResponseStore(args.responses_store_size)  # responses_api.py's store
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
