"""The gRPC front: the daemon as a gRPC worker of smg, with its KV-cache events.

Like the HTTP front (http_front.py), it is a child process of the daemon and one more ZMQ
client of it, started once the engine is loaded, restarted when it dies (bounded, the same
``FrontProcess``), stopped on every way out, and killed by the kernel if the daemon dies
(PR_SET_PDEATHSIG). It serves ``vllm.grpc.engine.VllmEngine`` (grpc_api.py), so smg
(``smg launch --worker-urls grpc://127.0.0.1:PORT``) routes to it as to a vLLM gRPC worker,
and it relays the daemon's KV-cache events (kv_relay.py) on ``SubscribeKvEvents``, which smg's
cache-aware policy indexes to know which replica holds which prefix, evictions included.

``tpserve start --grpc-port PORT`` starts it. The daemon then publishes its KV events even
without ``--kv-events-endpoint``: on ``ipc://RUNTIME_DIR/kv-events.sock`` (and a replay socket
beside it) for the front to read; with ``--kv-events-endpoint`` the front reads that one (and
the daemon adds a replay socket in the runtime dir if none was given).

Security: on a loopback host anyone on this machine may call it, as the ZMQ socket; a
non-loopback ``--grpc-host`` needs ``--api-key``, which every call must then send as
``authorization: Bearer KEY`` metadata (UNAUTHENTICATED otherwise).

Requires the ``grpc`` extra (grpcio and smg-grpc-proto): ``pip install 'tpserve[grpc]'``.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from tpserve.fronts.http.front import is_loopback_host

from tpserve.fronts.process import DEFAULT_UPSTREAM_TIMEOUT, FrontProcess, FrontError, front_arguments
from tpserve.server.kv_events import KVEventsOptions
from tpserve.client.addresses import InsecureAddressError
from tpserve.procs import die_with_parent, freeze_heap

log = logging.getLogger("tpserve.grpc")

KV_EVENTS_NAME = "kv-events.sock"
KV_REPLAY_NAME = "kv-events-replay.sock"


@dataclass
class GrpcOptions:
    """Where the gRPC front listens; ``api_key`` None: no key (a loopback host only)."""

    port: int
    host: str = "127.0.0.1"
    api_key: str | None = None
    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT  # as the HTTP front's (http_upstream.py)


def check_grpc_host(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback host without a key, and a key gRPC metadata cannot carry."""
    if api_key and not (api_key.isascii() and api_key.isprintable()):
        raise InsecureAddressError("the API key has non-ASCII or unprintable characters, which gRPC "
                                   "metadata (authorization: Bearer KEY) cannot carry; use an ASCII key with --grpc-port")
    if not api_key and not is_loopback_host(host):
        raise InsecureAddressError(
            f"refusing to serve gRPC on {host}: it is not a loopback address, so it needs an API key "
            "(--api-key or TPSERVE_API_KEY), or bind 127.0.0.1")


def check_grpc_available() -> None:
    """A clear error when the ``grpc`` extra is not installed."""
    try:
        import grpc  # noqa: F401
        import smg_grpc_proto  # noqa: F401
    except ImportError as e:
        raise FrontError(f"--grpc-port needs the grpc extra (pip install 'tpserve[grpc]'): {e}") from None


def kv_events_for_grpc(options: KVEventsOptions | None, runtime_dir: str | os.PathLike) -> KVEventsOptions:
    """The daemon's event publishing when a gRPC front relays it (see the module doc)."""
    rd = Path(runtime_dir).absolute()
    replay = f"ipc://{rd / KV_REPLAY_NAME}"
    if options is None:
        return KVEventsOptions(f"ipc://{rd / KV_EVENTS_NAME}", replay)
    if options.replay_endpoint is None:
        return KVEventsOptions(options.endpoint, replay, options.topic, options.allow_remote, options.format)
    return options


class GrpcFrontProcess(FrontProcess):
    """The gRPC front's process (see FrontProcess)."""

    NAME = "gRPC front"
    KEY = "grpc_front"
    SCHEME = "grpc"
    SERVES = "vLLM's gRPC engine service"

    def __init__(self, options: GrpcOptions, daemon_address: str, model_path: str, model_name: str,
                 max_model_len: int, kv_events: KVEventsOptions | None, server_public_key: bytes | None = None):
        check_grpc_host(options.host, options.api_key)
        check_grpc_available()
        extra = ["--upstream-timeout", str(options.upstream_timeout)]
        if kv_events is not None:
            extra += ["--kv-events-endpoint", kv_events.endpoint, "--kv-events-topic", kv_events.topic]
            if kv_events.replay_endpoint:
                extra += ["--kv-events-replay-endpoint", kv_events.replay_endpoint]
        super().__init__(options, "tpserve.fronts.grpc.front", daemon_address, model_path, model_name,
                         max_model_len, server_public_key, extra)


def _key_interceptor(api_key: str):
    import grpc

    expected = f"Bearer {api_key}".encode()

    class KeyCheck(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if hmac.compare_digest(given.encode() if isinstance(given, str) else given, expected):
                return await continuation(details)
            return _refuse_handler()

    def _refuse_handler():
        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer KEY'")
        return grpc.unary_unary_rpc_method_handler(refuse)

    return KeyCheck()


async def serve(args, api_key: str | None, stop: asyncio.Event | None = None, on_ready=None) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set); ``on_ready(port)`` once listening
    (default: the port to ``args.ready_fd``). Returns the exit status."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as VG

    from tpserve.client.client import AsyncClient
    from tpserve.fronts.grpc.api import GrpcFront, VllmEngineService
    from tpserve.fronts.upstream import UpstreamWatch
    from tpserve.fronts.grpc.kv_relay import KvEventsFeed, KvRelay

    relay = feed_task = None
    if args.kv_events_endpoint:
        relay = KvRelay()
        if args.kv_events_replay_endpoint:
            feed = KvEventsFeed(relay, args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic)
            feed_task = asyncio.create_task(feed.run())
    client = AsyncClient(args.address, timeout=30.0,
                         server_public_key=args.server_key.encode() if args.server_key else None)
    front = GrpcFront(client, args.model_path, args.model_name, args.max_model_len, relay)
    front.restarts, front.last_exit = args.restarts, args.last_exit
    server = grpc.aio.server(interceptors=[_key_interceptor(api_key)] if api_key else None,
                             options=[("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
    VG.add_VllmEngineServicer_to_server(VllmEngineService(front), server)
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        port = server.add_insecure_port(f"{host}:{args.port}")
    except RuntimeError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 1
    if not port:
        log.error("cannot listen on %s:%d", args.host, args.port)
        return 1
    await server.start()
    if on_ready is not None:
        on_ready(port)
    elif args.ready_fd is not None:
        os.write(args.ready_fd, f"{port}\n".encode())
        os.close(args.ready_fd)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, stop.set)
        freeze_heap()
    watch = UpstreamWatch(front, args.upstream_timeout)
    watch.start()
    waiter = asyncio.create_task(stop.wait())
    watched = [waiter] + ([feed_task] if feed_task is not None else [])
    done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if feed_task is not None and feed_task in done:
        log.error("the KV events feed ended: %r", feed_task.exception())
        code = 1
    watch.stop()
    await server.stop(grace=2.0)
    for t in watched:
        t.cancel()
    await client.close()
    return code


def main(argv: list[str] | None = None) -> int:
    ap = front_arguments("python -m tpserve.fronts.grpc.front", "tpserve's gRPC front (started by the daemon)")
    ap.add_argument("--kv-events-endpoint", default=None)
    ap.add_argument("--kv-events-replay-endpoint", default=None)
    ap.add_argument("--kv-events-topic", default="")
    ap.add_argument("--upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    api_key = os.environ.get("TPSERVE_API_KEY") or None
    check_grpc_host(args.host, api_key)
    return asyncio.run(serve(args, api_key))


if __name__ == "__main__":
    sys.exit(main())
