"""`tpserve start` and `tpserve serve`: the daemon's options, checked before anything starts, and
running it in the foreground (`serve`) or detached and waited for (`start`).

This is the one CLI module that imports the server, the fronts and (through the engine options)
EngineConfig; it is loaded only for these two commands.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from tpserve.cli.common import CONTEXT, address_option, fail, live_pid, runtime_dir_option
from tpserve.cli.options import config_from_options, engine_options, options_argv
from tpserve.client.client import Client, ClientTimeout
from tpserve.client.addresses import (InsecureAddressError, RuntimeDirError, check_address, connect_address,
                                      read_ready, resolve_address)
from tpserve.client.keys import KeyFileError, load_secret_keys, public_keys_in
from tpserve.errors import InvalidFieldError, TpserveError
from tpserve.fronts.grpc.front import GrpcOptions, check_grpc_available, check_grpc_host
from tpserve.fronts.http.front import DEFAULT_REQUEST_TIMEOUT, HttpOptions, check_http_host
from tpserve.fronts.http.guard import parse_allowed_hosts
from tpserve.fronts.http.reasoning import CHOICES as PARSERS
from tpserve.fronts.http.response_store import DEFAULT_CAPACITY as DEFAULT_STORE_SIZE
from tpserve.fronts.process import DEFAULT_UPSTREAM_TIMEOUT, FrontError
from tpserve.limits import check_timeout
from tpserve.procs import kill_tree
from tpserve.server.daemon import run_daemon, torchrun_rank
from tpserve.server.kv_events import KVEventsOptions
from tpserve.server.runtime import LOG_NAME, cleanup_stale, ensure_runtime_dir
from tpserve.server.server import ServerOptions


def daemon_options(f):
    opts = [
        address_option,
        runtime_dir_option,
        click.option("--curve-secret-key", type=click.Path(dir_okay=False), show_envvar=True,
                     envvar="TPSERVE_CURVE_SECRET_KEY",
                     metavar="FILE", help="server .key_secret file from `tpserve keys`: encrypt with "
                     "CurveZMQ (required for a non-loopback tcp address)"),
        click.option("--curve-client-keys", type=click.Path(file_okay=False), show_envvar=True,
                     envvar="TPSERVE_CURVE_CLIENT_KEYS",
                     metavar="DIR", help="accept only clients whose public key (*.key) is in DIR "
                     "[default: any client that has the server's public key]"),
        click.option("--max-requests-per-connection", type=click.IntRange(min=1), default=4096,
                     show_default=True,
                     show_envvar=True, envvar="TPSERVE_MAX_REQUESTS_PER_CONNECTION",
                     help="requests one client connection may have in flight; more are refused "
                          "(too_many_requests)"),
        click.option("--shutdown-grace", type=float, default=30.0, show_default=True,
                     show_envvar=True, envvar="TPSERVE_SHUTDOWN_GRACE",
                     help="on SIGTERM (`tpserve stop`), stop admitting and let the requests in flight, "
                          "queued ones included, finish for up to this many seconds before aborting them"),
        click.option("--request-timeout", type=float, default=None, show_envvar=True,
                     envvar="TPSERVE_REQUEST_TIMEOUT", metavar="SECONDS",
                     help="end a request without a timeout of its own after this many seconds "
                          "(finish_reason 'timeout') [default: no limit]"),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                     show_default=True, show_envvar=True, envvar="TPSERVE_LOG_LEVEL"),
        click.option("--http-port", type=click.IntRange(0, 65535), default=None, show_envvar=True,
                     envvar="TPSERVE_HTTP_PORT", metavar="PORT",
                     help="also serve the OpenAI-compatible HTTP API and /metrics on this port "
                          "(0: any free port; the ready file and `start` name it)"),
        click.option("--http-host", default="127.0.0.1", show_default=True, show_envvar=True,
                     envvar="TPSERVE_HTTP_HOST", help="HTTP address; a non-loopback one needs --api-key"),
        click.option("--api-key", default=None, show_envvar=True, envvar="TPSERVE_API_KEY", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every /v1 HTTP call"),
        click.option("--http-allowed-hosts", default=None, show_envvar=True,
                     envvar="TPSERVE_HTTP_ALLOWED_HOSTS",
                     metavar="NAMES", help="Host header names the HTTP front answers besides loopback ones: "
                     "comma-separated, '*.suffix' or '*' for any [default: loopback names only on a loopback "
                     "--http-host, any name on another]"),
        click.option("--http-request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT, show_default=True,
                     show_envvar=True, envvar="TPSERVE_HTTP_REQUEST_TIMEOUT",
                     help="seconds an HTTP client has to send a request head (then 408), and then its body"),
        click.option("--http-upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT,
                     show_default=True,
                     show_envvar=True, envvar="TPSERVE_HTTP_UPSTREAM_TIMEOUT",
                     help="the HTTP front ends its requests in flight (error, then [DONE]; or 503), and the "
                          "gRPC front its calls (UNAVAILABLE), when the daemon has not answered its ping, "
                          "or the front itself was stalled, this many seconds"),
        click.option("--reasoning-parser", type=click.Choice(PARSERS), default=None, show_envvar=True,
                     envvar="TPSERVE_REASONING_PARSER",
                     help="split chat answers at </think> into message.reasoning_content / reasoning "
                          "and content (vLLM's parser names); openai_gptoss: gpt-oss's harmony format "
                          "[default: openai_gptoss for gpt-oss, else none]"),
        click.option("--responses-store-size", type=click.IntRange(0, 1_000_000), default=DEFAULT_STORE_SIZE,
                     show_default=True, show_envvar=True, envvar="TPSERVE_RESPONSES_STORE_SIZE", metavar="N",
                     help="the Responses API keeps the last N stored responses (GET /v1/responses/{id}, "
                          "previous_response_id) in the HTTP front's memory; 0 keeps none"),
        click.option("--grpc-port", type=click.IntRange(0, 65535), default=None, show_envvar=True,
                     envvar="TPSERVE_GRPC_PORT", metavar="PORT",
                     help="also serve vLLM's gRPC engine service on this port, with the KV-cache events "
                          "smg's cache-aware routing indexes (needs the grpc extra; 0: any free port)"),
        click.option("--grpc-host", default="127.0.0.1", show_default=True, show_envvar=True,
                     envvar="TPSERVE_GRPC_HOST", help="gRPC address; a non-loopback one needs --api-key"),
        click.option("--served-model-name", default=None, show_envvar=True,
                     envvar="TPSERVE_SERVED_MODEL_NAME",
                     metavar="NAME", help="model name of the HTTP API and metrics [default: the model "
                                          "directory's name]"),
        *kv_events_options,
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


kv_events_options = [
    click.option("--kv-events-endpoint", default=None, show_envvar=True, envvar="TPSERVE_KV_EVENTS_ENDPOINT",
                 metavar="ADDR", help="publish prefix-cache events (vLLM's KV-events format, ZMQ PUB) on "
                 "this address, e.g. tcp://127.0.0.1:5557, for routers with a KV index"),
    click.option("--kv-events-replay-endpoint", default=None, show_envvar=True,
                 envvar="TPSERVE_KV_EVENTS_REPLAY_ENDPOINT", metavar="ADDR",
                 help="ROUTER address where subscribers ask for missed event batches"),
    click.option("--kv-events-topic", default="", show_envvar=True, envvar="TPSERVE_KV_EVENTS_TOPIC",
                 help="topic frame of every event message [default: empty]"),
    click.option("--kv-events-format", type=click.Choice(["map", "array"]), default="map", show_default=True,
                 show_envvar=True, envvar="TPSERVE_KV_EVENTS_FORMAT",
                 help="each event a tagged map (current vLLM) or a positional array (earlier vLLM releases)"),
    click.option("--kv-events-allow-remote", is_flag=True, default=False, show_envvar=True,
                 envvar="TPSERVE_KV_EVENTS_ALLOW_REMOTE",
                 help="allow non-loopback event addresses (the events carry prompt token ids)"),
]


def _kv_events_options(kw: dict) -> KVEventsOptions | None:
    if not kw["kv_events_endpoint"]:
        if kw["kv_events_replay_endpoint"]:
            raise click.BadParameter("needs --kv-events-endpoint", param_hint="'--kv-events-replay-endpoint'")
        return None
    try:
        return KVEventsOptions(kw["kv_events_endpoint"], kw["kv_events_replay_endpoint"] or None,
                               kw["kv_events_topic"], kw["kv_events_allow_remote"], kw["kv_events_format"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--kv-events-endpoint'") from None


def _kv_events_argv(kw: dict) -> list[str]:
    """The --kv-events-* options again, for the daemon `start` spawns."""
    if not kw["kv_events_endpoint"]:
        return []
    argv = ["--kv-events-endpoint", kw["kv_events_endpoint"], "--kv-events-topic", kw["kv_events_topic"],
            "--kv-events-format", kw["kv_events_format"]]
    if kw["kv_events_replay_endpoint"]:
        argv += ["--kv-events-replay-endpoint", kw["kv_events_replay_endpoint"]]
    return argv + (["--kv-events-allow-remote"] if kw["kv_events_allow_remote"] else [])


def _server_options(kw: dict) -> ServerOptions:
    if kw["shutdown_grace"] < 0:
        raise click.BadParameter(f"must be >= 0, got {kw['shutdown_grace']}", param_hint="'--shutdown-grace'")
    if kw["request_timeout"] is not None:
        try:
            check_timeout(kw["request_timeout"], "request_timeout")
        except InvalidFieldError as e:
            raise click.BadParameter(e.reason, param_hint="'--request-timeout'") from None
    opts = ServerOptions(shutdown_grace=kw["shutdown_grace"], request_timeout=kw["request_timeout"],
                         max_requests_per_connection=kw["max_requests_per_connection"],
                         served_model_name=kw["served_model_name"] or None, kv_events=_kv_events_options(kw))
    if kw["curve_secret_key"]:
        try:
            opts.curve_public_key, opts.curve_secret_key = load_secret_keys(kw["curve_secret_key"])
        except KeyFileError as e:
            raise click.BadParameter(str(e), param_hint="'--curve-secret-key'") from None
    if kw["curve_client_keys"]:
        if not kw["curve_secret_key"]:
            raise click.BadParameter("needs --curve-secret-key (client keys only apply to CurveZMQ)",
                                     param_hint="'--curve-client-keys'")
        try:
            public_keys_in(kw["curve_client_keys"])
        except KeyFileError as e:
            raise click.BadParameter(str(e), param_hint="'--curve-client-keys'") from None
        opts.curve_client_keys_dir = os.path.abspath(kw["curve_client_keys"])
    return opts


def _http_options(kw: dict, opts: ServerOptions) -> HttpOptions | None:
    """The HTTP front's options, or None without --http-port."""
    if kw["http_port"] is None:
        if kw["reasoning_parser"]:
            raise click.BadParameter("needs --http-port: the HTTP front splits chat answers at </think>",
                                     param_hint="'--reasoning-parser'")
        return None
    if opts.curve_client_keys_dir:
        raise click.BadParameter("cannot be combined with --curve-client-keys (the HTTP front connects "
                                 "to the daemon with a key of its own)", param_hint="'--http-port'")
    try:
        check_http_host(kw["http_host"], kw["api_key"])
    except InsecureAddressError as e:
        raise click.BadParameter(str(e), param_hint="'--http-host'") from None
    try:
        allowed = parse_allowed_hosts(kw["http_allowed_hosts"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--http-allowed-hosts'") from None
    for name in ("http_request_timeout", "http_upstream_timeout"):
        if not kw[name] > 0:
            raise click.BadParameter(f"must be > 0, got {kw[name]}",
                                     param_hint=f"'--{name.replace('_', '-')}'")
    return HttpOptions(kw["http_port"], kw["http_host"], kw["api_key"] or None, allowed,
                       kw["http_request_timeout"],
                       kw["http_upstream_timeout"], kw["reasoning_parser"], kw["responses_store_size"])


def _grpc_options(kw: dict, opts: ServerOptions) -> GrpcOptions | None:
    """The gRPC front's options, or None without --grpc-port."""
    if kw["grpc_port"] is None:
        return None
    if opts.curve_client_keys_dir:
        raise click.BadParameter("cannot be combined with --curve-client-keys (the gRPC front connects "
                                 "to the daemon with a key of its own)", param_hint="'--grpc-port'")
    try:
        check_grpc_host(kw["grpc_host"], kw["api_key"])
        check_grpc_available()
    except InsecureAddressError as e:
        raise click.BadParameter(str(e), param_hint="'--grpc-host'") from None
    except FrontError as e:
        raise click.BadParameter(str(e), param_hint="'--grpc-port'") from None
    if not kw["http_upstream_timeout"] > 0:
        raise click.BadParameter(f"must be > 0, got {kw['http_upstream_timeout']}",
                                 param_hint="'--http-upstream-timeout'")
    return GrpcOptions(kw["grpc_port"], kw["grpc_host"], kw["api_key"] or None, kw["http_upstream_timeout"])


def _check_address(address: str, opts: ServerOptions) -> None:
    try:
        check_address(address, opts.curve_secret_key is not None)
    except (InsecureAddressError, RuntimeDirError) as e:
        raise click.BadParameter(str(e), param_hint="'--address'") from None


def _runtime_dir(path) -> Path:
    try:
        return ensure_runtime_dir(path)
    except (OSError, RuntimeDirError) as e:
        raise click.BadParameter(str(e), param_hint="'--runtime-dir'") from None


# ---- serve / start -----------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@daemon_options
@engine_options
def serve(**kw):
    """Run the daemon in the foreground (for torchrun and service managers).

    Under torchrun (RANK/WORLD_SIZE set) rank 0 becomes the daemon and every other rank a
    tensor-parallel worker. SIGTERM/SIGINT stop it gracefully; a second one stops it at once.
    """
    config = config_from_options(kw)
    rank = torchrun_rank()
    if rank is not None and rank != 0:
        from tpserve.workers.worker import run_torchrun_worker
        sys.exit(run_torchrun_worker(config) or 0)
    logging.basicConfig(level=kw["log_level"].upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = _server_options(kw)
    http = _http_options(kw, opts)
    grpc = _grpc_options(kw, opts)
    rd = _runtime_dir(kw["runtime_dir"])
    address = resolve_address(kw["address"], rd)
    _check_address(address, opts)
    cleanup_stale(rd)  # what a killed daemon left (a live one's files stay: its pid-file lock)
    try:
        code = run_daemon(config, address, rd, opts, http=http, grpc=grpc)
    except (RuntimeDirError, OSError, TpserveError) as e:
        fail(str(e))
    except Exception as e:  # the traceback goes to the log; the last line says why in one line
        logging.getLogger("tpserve.daemon").exception("the daemon failed")
        fail(f"the daemon failed: {type(e).__name__}: {e}")
    sys.exit(code)


@click.command(context_settings=CONTEXT)
@daemon_options
@engine_options
def start(**kw):
    """Start the daemon in the background and wait until it is ready.

    The daemon runs in a new session with its output appended to RUNTIME_DIR/tpserve.log;
    `start` prints its address once it answers, or the end of the log if it failed.
    """
    config = config_from_options(kw)
    opts = _server_options(kw)
    http = _http_options(kw, opts)
    grpc = _grpc_options(kw, opts)
    rd = _runtime_dir(kw["runtime_dir"])
    address = resolve_address(kw["address"], rd)
    _check_address(address, opts)
    startup_timeout = config.startup_timeout  # the daemon's engine gets the same (options_argv)
    pid = live_pid(rd)
    if pid is not None:
        fail(f"a daemon (pid {pid}) is already running with runtime dir {rd}; `tpserve stop` it first")
    cleanup_stale(rd)

    argv = [sys.executable, "-m", "tpserve", "serve", "--runtime-dir", str(rd.absolute()),
            "--address", address, "--shutdown-grace", str(kw["shutdown_grace"]),
            "--log-level", kw["log_level"],
            "--max-requests-per-connection", str(kw["max_requests_per_connection"])]
    if kw["request_timeout"] is not None:
        argv += ["--request-timeout", str(kw["request_timeout"])]
    if kw["curve_secret_key"]:
        argv += ["--curve-secret-key", os.path.abspath(kw["curve_secret_key"])]
    if opts.curve_client_keys_dir:
        argv += ["--curve-client-keys", opts.curve_client_keys_dir]
    if opts.served_model_name:
        argv += ["--served-model-name", opts.served_model_name]
    argv += _kv_events_argv(kw)
    env = dict(os.environ)
    if http is not None:
        argv += ["--http-port", str(http.port), "--http-host", http.host,
                 "--http-request-timeout", str(http.request_timeout),
                 "--http-upstream-timeout", str(http.upstream_timeout)]
        if http.allowed_hosts is not None:
            argv += ["--http-allowed-hosts", ",".join(http.allowed_hosts)]
        if http.reasoning_parser:
            argv += ["--reasoning-parser", http.reasoning_parser]
        argv += ["--responses-store-size", str(http.responses_store_size)]
        if http.api_key:
            env["TPSERVE_API_KEY"] = http.api_key  # the environment, not argv, where `ps` shows it
    if grpc is not None:
        argv += ["--grpc-port", str(grpc.port), "--grpc-host", grpc.host,
                 "--http-upstream-timeout", str(grpc.upstream_timeout)]
        if grpc.api_key:
            env["TPSERVE_API_KEY"] = grpc.api_key
    argv += options_argv(config)

    log_path = rd / LOG_NAME
    with open(log_path, "ab") as log_file:
        offset = log_file.tell()
        try:
            # A line of our own first: a full disk shows here, not as a daemon dying silently
            # (it could not write why: its output goes to this file).
            stamp = time.strftime('%Y-%m-%d %H:%M:%S')
            log_file.write(f"{stamp} tpserve start: launching the daemon\n".encode())
            log_file.flush()
        except OSError as e:
            fail(_unwritable(log_path, e))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    deadline = time.monotonic() + startup_timeout
    while True:
        code = proc.poll()
        if code is not None:
            fail(f"the daemon exited with status {code} while starting; from {log_path}:\n"
                  + _log_tail(log_path, offset, skip=1))
        ready = read_ready(rd)
        if ready and ready.get("pid") == proc.pid:
            break
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            fail(f"the daemon was not ready within {startup_timeout:g} s (killed); from {log_path}:\n"
                  + _log_tail(log_path, offset, skip=1))
        time.sleep(0.1)
    # The ready file says the engine is loaded; a ping proves the socket answers. With a client
    # allow-list this process holds no allowed key, so the ready file has to do.
    if opts.curve_client_keys_dir is None:
        client = Client(connect_address(address), timeout=30.0, server_public_key=opts.curve_public_key)
        try:
            client.ping()
        except ClientTimeout as e:
            fail(f"the daemon (pid {proc.pid}) is up but did not answer a ping: {e}")
        finally:
            client.close()
    click.echo(address)
    if ready.get("http"):
        click.echo(ready["http"])
    if ready.get("grpc"):
        click.echo(ready["grpc"])


def _log_tail(path: Path, offset: int, lines: int = 30, skip: int = 0) -> str:
    """The last ``lines`` lines written after ``offset`` (past the first ``skip``: start's own).
    An empty log on a full file system says so: the daemon could not write why it failed."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    tail = "\n".join(text.rstrip().splitlines()[skip:][-lines:])
    if tail:
        return tail
    free = _free_bytes(path.parent)
    if free is not None and free < _MIN_FREE_BYTES:
        return (f"(the log is empty) no space left on the file system of {path.parent} ({free} bytes free): "
                "the daemon could not write its files or its log; free some space and start again")
    return "(the log is empty)"


# Less than this on the runtime dir's file system counts as full: the daemon writes its pid,
# ready and log files there.
_MIN_FREE_BYTES = 64 * 1024


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _unwritable(log_path: Path, e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the file system of {log_path} ({e.strerror}): "
                "free some space and start again")
    return f"cannot write the daemon's log {log_path}: {e.strerror or e}"


