"""`tpserve` command line: start/serve/stop/status the daemon, generate through it, profile it, make keys.

Every option can also come from the environment as ``TPSERVE_<OPTION>`` (e.g. TPSERVE_MODEL,
TPSERVE_RUNTIME_DIR, TPSERVE_ADDRESS). Bad values exit with status 2 and name the option;
operational failures (no daemon, daemon refused a request) exit with status 1.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from tpserve.client import protocol as P
from tpserve.client.client import Client, ClientTimeout, RequestError
from tpserve.server.daemon import run_daemon, torchrun_rank
from tpserve.fronts.grpc.front import GrpcOptions, check_grpc_available, check_grpc_host
from tpserve.fronts.http.front import DEFAULT_REQUEST_TIMEOUT, HttpOptions, check_http_host
from tpserve.fronts.process import DEFAULT_UPSTREAM_TIMEOUT, FrontError
from tpserve.fronts.http.guard import parse_allowed_hosts
from tpserve.client.keys import KeyFileError, generate_keypair, load_public_key, load_secret_keys, public_keys_in
from tpserve.server.kv_events import KVEventsOptions
from tpserve.cli.options import config_from_options, engine_options, options_argv
from tpserve.client.addresses import (InsecureAddressError, RuntimeDirError, check_address, client_address,
                                      connect_address, read_ready, resolve_address, resolve_runtime_dir)
from tpserve.server.runtime import (LOG_NAME, PID_NAME, cleanup_stale, ensure_runtime_dir,
                                    live_daemon_pid, read_pid)
from tpserve.procs import descendants, kill_tree, pid_alive, wait_gone
from tpserve.server.server import ServerOptions
from tpserve.errors import InvalidFieldError, TpserveError
from tpserve.limits import check_timeout
from tpserve.sampling import SamplingParams

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)


@click.group(context_settings=CONTEXT)
def main():
    """tpserve: a tensor-parallel LLM serving daemon.

    Start a daemon with `tpserve start --model DIR`, send it prompts with
    `tpserve generate "..."` (or the Python `tpserve.Client`), watch it with `tpserve status`
    and stop it with `tpserve stop`. By default the daemon listens on an ipc socket in the
    runtime dir ($TPSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/tpserve, else ~/.tpserve).
    """


# ---- shared options ----------------------------------------------------------------------
def runtime_dir_option(f):
    return click.option("--runtime-dir", type=click.Path(file_okay=False), show_envvar=True, envvar="TPSERVE_RUNTIME_DIR",
                        help="directory of the socket, pid file and log "
                             "[default: $XDG_RUNTIME_DIR/tpserve or ~/.tpserve]")(f)


def address_option(f):
    return click.option("--address", show_envvar=True, envvar="TPSERVE_ADDRESS", metavar="ADDR",
                        help="ZMQ endpoint: ipc://PATH or tcp://HOST:PORT "
                             "[default: ipc://RUNTIME_DIR/tpserve.sock]")(f)


def daemon_options(f):
    opts = [
        address_option,
        runtime_dir_option,
        click.option("--curve-secret-key", type=click.Path(dir_okay=False), show_envvar=True, envvar="TPSERVE_CURVE_SECRET_KEY",
                     metavar="FILE", help="server .key_secret file from `tpserve keys`: encrypt with "
                     "CurveZMQ (required for a non-loopback tcp address)"),
        click.option("--curve-client-keys", type=click.Path(file_okay=False), show_envvar=True, envvar="TPSERVE_CURVE_CLIENT_KEYS",
                     metavar="DIR", help="accept only clients whose public key (*.key) is in DIR "
                     "[default: any client that has the server's public key]"),
        click.option("--max-requests-per-connection", type=click.IntRange(min=1), default=4096, show_default=True,
                     show_envvar=True, envvar="TPSERVE_MAX_REQUESTS_PER_CONNECTION",
                     help="requests one client connection may have in flight; more are refused "
                          "(too_many_requests)"),
        click.option("--shutdown-grace", type=float, default=30.0, show_default=True,
                     show_envvar=True, envvar="TPSERVE_SHUTDOWN_GRACE",
                     help="on SIGTERM (`tpserve stop`), stop admitting and let the requests in flight, queued "
                          "ones included, finish for up to this many seconds before aborting them"),
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
        click.option("--http-allowed-hosts", default=None, show_envvar=True, envvar="TPSERVE_HTTP_ALLOWED_HOSTS",
                     metavar="NAMES", help="Host header names the HTTP front answers besides loopback ones: "
                     "comma-separated, '*.suffix' or '*' for any [default: loopback names only on a loopback "
                     "--http-host, any name on another]"),
        click.option("--http-request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT, show_default=True,
                     show_envvar=True, envvar="TPSERVE_HTTP_REQUEST_TIMEOUT",
                     help="seconds an HTTP client has to send a request head (then 408), and then its body"),
        click.option("--http-upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT, show_default=True,
                     show_envvar=True, envvar="TPSERVE_HTTP_UPSTREAM_TIMEOUT",
                     help="the HTTP front ends its requests in flight (error, then [DONE]; or 503), and the "
                          "gRPC front its calls (UNAVAILABLE), when the daemon has not answered its ping, or the "
                          "front itself was stalled, this many seconds"),
        click.option("--grpc-port", type=click.IntRange(0, 65535), default=None, show_envvar=True,
                     envvar="TPSERVE_GRPC_PORT", metavar="PORT",
                     help="also serve vLLM's gRPC engine service on this port, with the KV-cache events "
                          "smg's cache-aware routing indexes (needs the grpc extra; 0: any free port)"),
        click.option("--grpc-host", default="127.0.0.1", show_default=True, show_envvar=True,
                     envvar="TPSERVE_GRPC_HOST", help="gRPC address; a non-loopback one needs --api-key"),
        click.option("--served-model-name", default=None, show_envvar=True, envvar="TPSERVE_SERVED_MODEL_NAME",
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


def client_options(timeout: float):
    """Options of commands that talk to a running daemon; ``timeout`` is the --timeout default."""
    def decorate(f):
        return _client_options(f, timeout)
    return decorate


def _client_options(f, timeout: float):
    opts = [
        address_option,
        runtime_dir_option,
        click.option("--timeout", type=float, default=timeout, show_default=True, show_envvar=True, envvar="TPSERVE_TIMEOUT",
                     help="seconds to wait for each reply"),
        click.option("--server-key", show_envvar=True, envvar="TPSERVE_SERVER_KEY", metavar="FILE",
                     help="the daemon's public key file (.key) when it uses CurveZMQ"),
        click.option("--client-key", type=click.Path(dir_okay=False), show_envvar=True, envvar="TPSERVE_CLIENT_KEY",
                     metavar="FILE", help="this client's .key_secret file [default: a fresh key pair]"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


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
            raise click.BadParameter(f"must be > 0, got {kw[name]}", param_hint=f"'--{name.replace('_', '-')}'")
    return HttpOptions(kw["http_port"], kw["http_host"], kw["api_key"] or None, allowed, kw["http_request_timeout"],
                       kw["http_upstream_timeout"])


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
        raise click.BadParameter(f"must be > 0, got {kw['http_upstream_timeout']}", param_hint="'--http-upstream-timeout'")
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


def _client(kw: dict) -> Client:
    if kw["address"]:
        address = kw["address"]
    else:
        # The runtime dir's daemon: its pid-file lock says at once whether it is alive (a socket
        # file left by a killed daemon would only time out), and its ready file has the address
        # it serves on, which need not be the default socket (e.g. --address tcp://...).
        rd = resolve_runtime_dir(kw["runtime_dir"])
        if (_live_pid(rd) if rd.is_dir() else None) is None:
            _fail(f"no tpserve daemon is running with runtime dir {rd} (no live process holds "
                  f"{rd / PID_NAME}); start one with `tpserve start`")
        address = client_address(None, rd)
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        _fail(f"no tpserve daemon at {address} (the socket does not exist); start one with `tpserve start`")
    server_key = client_keys = None
    try:
        if kw.get("server_key"):
            server_key = load_public_key(kw["server_key"])
        if kw.get("client_key"):
            client_keys = load_secret_keys(kw["client_key"])
    except KeyFileError as e:
        raise click.BadParameter(str(e)) from None
    return Client(address, timeout=kw["timeout"],
                  runtime_dir=kw["runtime_dir"], server_public_key=server_key, client_keys=client_keys)


def _live_pid(rd: Path) -> int | None:
    try:
        return live_daemon_pid(rd)
    except RuntimeDirError as e:
        _fail(str(e))


def _fail(message: str) -> None:
    click.echo(f"tpserve: {message}", err=True)
    sys.exit(1)


# ---- serve / start -----------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
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
    try:
        code = run_daemon(config, address, rd, opts, http=http, grpc=grpc)
    except (RuntimeDirError, OSError, TpserveError) as e:
        _fail(str(e))
    except Exception as e:  # the traceback goes to the log; the last line says why in one line
        logging.getLogger("tpserve.daemon").exception("the daemon failed")
        _fail(f"the daemon failed: {type(e).__name__}: {e}")
    sys.exit(code)


@main.command(context_settings=CONTEXT)
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
    pid = _live_pid(rd)
    if pid is not None:
        _fail(f"a daemon (pid {pid}) is already running with runtime dir {rd}; `tpserve stop` it first")
    cleanup_stale(rd)

    argv = [sys.executable, "-m", "tpserve", "serve", "--runtime-dir", str(rd.absolute()),
            "--address", address, "--shutdown-grace", str(kw["shutdown_grace"]), "--log-level", kw["log_level"],
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
            log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} tpserve start: launching the daemon\n".encode())
            log_file.flush()
        except OSError as e:
            _fail(_unwritable(log_path, e))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    deadline = time.monotonic() + startup_timeout
    while True:
        code = proc.poll()
        if code is not None:
            _fail(f"the daemon exited with status {code} while starting; from {log_path}:\n"
                  + _log_tail(log_path, offset, skip=1))
        ready = read_ready(rd)
        if ready and ready.get("pid") == proc.pid:
            break
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            _fail(f"the daemon was not ready within {startup_timeout:g} s (killed); from {log_path}:\n"
                  + _log_tail(log_path, offset, skip=1))
        time.sleep(0.1)
    # The ready file says the engine is loaded; a ping proves the socket answers. With a client
    # allow-list this process holds no allowed key, so the ready file has to do.
    if opts.curve_client_keys_dir is None:
        client = Client(connect_address(address), timeout=30.0, server_public_key=opts.curve_public_key)
        try:
            client.ping()
        except ClientTimeout as e:
            _fail(f"the daemon (pid {proc.pid}) is up but did not answer a ping: {e}")
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
        return f"no space left on the file system of {log_path} ({e.strerror}): free some space and start again"
    return f"cannot write the daemon's log {log_path}: {e.strerror or e}"


# ---- stop --------------------------------------------------------------------------------
_STOP_MARGIN = 30.0  # s `stop` waits beyond the daemon's drain before killing it


@main.command(context_settings=CONTEXT)
@runtime_dir_option
@click.option("--timeout", type=float, default=None, show_envvar=True, envvar="TPSERVE_STOP_TIMEOUT",
              help="seconds to wait for a graceful exit before killing the daemon and its workers "
                   f"[default: the daemon's --shutdown-grace + {_STOP_MARGIN:g}; with --now, {_STOP_MARGIN:g}]")
@click.option("--now", is_flag=True, help="abort the requests in flight at once instead of letting them "
                                          "finish (SIGUSR1; a second SIGTERM does the same)")
def stop(runtime_dir, timeout, now):
    """Stop the daemon: SIGTERM (a drain: requests in flight finish for up to its --shutdown-grace,
    new ones are refused), then SIGKILL of its whole process tree after --timeout."""
    rd = resolve_runtime_dir(runtime_dir)
    pid = _live_pid(rd) if rd.is_dir() else None
    if pid is None:
        _fail(f"no tpserve daemon is running with runtime dir {rd}")
    if timeout is None:
        ready = read_ready(rd) or {}
        grace = ready.get("shutdown_grace") if ready.get("pid") == pid else None
        timeout = _STOP_MARGIN + (0.0 if now else float(grace if isinstance(grace, (int, float)) else 30.0))
    tree = [pid] + descendants(pid)
    try:
        os.kill(pid, signal.SIGUSR1 if now else signal.SIGTERM)
    except ProcessLookupError:
        pass
    if wait_gone([pid], timeout):
        # Workers normally exit with the daemon; give stragglers a moment, then make sure.
        if not wait_gone(tree, 5.0):
            for p in tree:
                if pid_alive(p):
                    kill_tree(p)
        click.echo(f"stopped tpserve daemon (pid {pid})")
    else:
        tree += [p for p in descendants(pid) if p not in tree]
        click.echo(f"the daemon (pid {pid}) did not exit within {timeout:g} s; killing it and its workers",
                   err=True)
        kill_tree(pid)
        for p in tree:
            kill_tree(p)
        wait_gone(tree, 10.0)
        # A killed daemon could not unlink its plan-channel segments; their names carry its pid.
        from tpserve.workers.shm_ring import cleanup_stale_segments
        cleanup_stale_segments()
        click.echo(f"killed tpserve daemon (pid {pid})")
    cleanup_stale(rd)


# ---- status ------------------------------------------------------------------------------
_STATUS_LINES = [
    ("pid", "pid", "{}"),
    ("model", "model", "{}"),
    ("tensor parallel", "tensor_parallel_size", "{}"),
    ("uptime", "uptime_s", "{:.0f} s"),
    ("state", "state", "{}"),
    ("ready", "ready", "{}"),
    ("drain left", "drain_left_s", "{:.1f} s"),  # only while draining
    ("failure", "failure", "{}"),  # only once the engine failed
    ("HTTP front", ("http_front", "http_front_restarts"), "{} (restarts: {})"),  # with --http-port
    ("HTTP front exit", "http_front_last_exit", "{}"),  # once it has died
    ("gRPC front", ("grpc_front", "grpc_front_restarts", "grpc_url"), "{} (restarts: {}) at {}"),  # with --grpc-port
    ("gRPC front exit", "grpc_front_last_exit", "{}"),
    ("requests running", "num_running", "{}"),
    ("requests waiting", ("num_waiting", "max_waiting_requests"), "{} (limit {})"),
    ("waiting tokens", ("num_waiting_tokens", "max_waiting_tokens"), "{} (limit {})"),
    ("refused", ("refused_max_waiting_requests", "refused_max_waiting_tokens", "refused_shutting_down",
                 "refused_admission"),
     "queue full {} / queued tokens {} / draining {} / never fits {}"),
    ("timed out", "num_timed_out", "{}"),
    ("scheduling order", "scheduling_order", "{}"),
    ("KV blocks used", ("kv_blocks_used", "kv_blocks_total"), "{} / {}"),
    ("prefix cache hits", "prefix_cache_hit_rate", "{:.1%}"),
    ("preemptions", ("num_preemptions", "num_priority_preemptions"), "{} ({} for a better priority)"),
    # only with speculative decoding on
    ("spec acceptance", ("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length"),
     "{:.1%} of draft tokens, mean acceptance length {:.2f}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("prompt tokens", "prompt_tokens", "{}"),
    ("generated tokens", "generation_tokens", "{}"),
]


@main.command(context_settings=CONTEXT)
@client_options(timeout=5.0)
@click.option("--json", "as_json", is_flag=True, help="print the raw status map as JSON")
@click.option("--metrics", "as_metrics", is_flag=True,
              help="print the daemon's Prometheus metrics (the text /metrics serves)")
def status(as_json, as_metrics, **kw):
    """Show the running daemon's model, load and KV-cache use (asks the daemon itself)."""
    with _client(kw) as client:
        try:
            if as_metrics:
                click.echo(client.metrics(), nl=False)
                return
            stats = client.status()
        except ClientTimeout as e:
            rd = resolve_runtime_dir(kw["runtime_dir"])
            pid = read_pid(rd) if rd.is_dir() else None
            hint = f" (pid file {rd}/tpserve.pid names pid {pid})" if pid else ""
            _fail(f"{e}: is it running?{hint}")
    if as_json:
        click.echo(json.dumps(stats, indent=2, sort_keys=True))
        return
    click.echo(f"tpserve daemon at {client.address}")
    stats = dict(stats)
    for limit in ("max_waiting_requests", "max_waiting_tokens"):
        if limit in stats and stats[limit] is None:  # present but None: no limit
            stats[limit] = "none"
    for label, keys, fmt in _STATUS_LINES:
        keys = keys if isinstance(keys, tuple) else (keys,)
        if all(stats.get(k) is not None for k in keys):
            try:
                value = fmt.format(*(stats[k] for k in keys))
            except (ValueError, TypeError):
                value = " / ".join(str(stats[k]) for k in keys)
            click.echo(f"  {label:<18} {value}")


# ---- profile -----------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.option("--seconds", type=click.FloatRange(0.0, P.MAX_PROFILE_SECONDS, min_open=True), default=5.0,
              show_default=True, help="how long to record")
@client_options(timeout=60.0)
def profile(seconds, **kw):
    """Record a torch profiler trace of every rank while the daemon serves.

    Prints the trace files (Chrome trace JSON, one per rank, in the daemon's runtime dir);
    open them in Perfetto or chrome://tracing. --timeout counts after --seconds.
    """
    with _client(kw) as client:
        try:
            files = client.profile(seconds)
        except ClientTimeout as e:
            _fail(str(e))
        except RequestError as e:
            _fail(f"profiling failed: {e}")
    for f in files:
        click.echo(f)


# ---- generate ----------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(min=1), default=SamplingParams.max_tokens, show_default=True,
              help="most tokens to generate")
@click.option("--temperature", type=float, default=SamplingParams.temperature, show_default=True,
              help="0 for greedy decoding")
@click.option("--top-p", type=float, default=SamplingParams.top_p, show_default=True,
              help="nucleus sampling: smallest token set with this probability mass (1 disables)")
@click.option("--top-k", type=int, default=SamplingParams.top_k, show_default=True,
              help="sample among the k most likely tokens (-1 disables)")
@click.option("--seed", type=int, default=None, help="make the sampled output reproducible")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--stop-token-id", type=int, multiple=True, help="stop token id (repeatable)")
@click.option("--ignore-eos", is_flag=True, help="keep generating past the end-of-sequence token")
@click.option("--no-stream", is_flag=True, help="print the completion once it is finished")
@click.option("--show-finish", is_flag=True, help="print finish reason and token counts to stderr")
@click.option("--priority", type=int, default=None,
              help="lower is served first (a daemon started with --scheduling-order priority)")
@click.option("--request-timeout", type=float, default=None, metavar="SECONDS",
              help="the daemon ends the request after this many seconds (finish_reason timeout)")
@client_options(timeout=30.0)
def generate(prompt, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_id, ignore_eos,
             no_stream, show_finish, priority, request_timeout, **kw):
    """Send PROMPT ('-' reads standard input) to the daemon and print the completion as it streams."""
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_id),
                                ignore_eos=ignore_eos)
    except InvalidFieldError as e:
        option = e.field.split("[")[0]
        option = {"stop_token_ids": "stop-token-id"}.get(option, option.replace("_", "-"))
        raise click.BadParameter(e.reason, param_hint=f"'--{option}'") from None
    with _client(kw) as client:
        try:
            extra = dict(priority=priority, request_timeout=request_timeout)
            if no_stream:
                result = client.generate(prompt, params, **extra)
                click.echo(result.text)
            else:
                with client.stream(prompt, params, **extra) as stream:  # Ctrl-C aborts the request
                    for delta in stream:
                        click.echo(delta.text, nl=False)
                        sys.stdout.flush()
                click.echo()
                result = stream.result
        except ClientTimeout as e:
            _fail(str(e))
        except (RequestError, P.ProtocolError) as e:
            _fail(f"request failed: {e}")
    if show_finish:
        click.echo(f"[finish_reason={result.finish_reason} prompt_tokens={result.prompt_tokens} "
                   f"completion_tokens={result.completion_tokens}]", err=True)
    if result.finish_reason == "abort":
        _fail(f"the request was aborted ({result.abort_reason or 'by the daemon'})")


# ---- keys --------------------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="tpserve", show_default=True, help="file name stem: NAME.key, NAME.key_secret")
@click.option("--force", is_flag=True, help="overwrite existing key files")
def keys(directory, name, force):
    """Generate a CurveZMQ key pair into DIRECTORY.

    NAME.key holds the public key (give it to the other side); NAME.key_secret holds both keys
    (mode 0600; pass it to `tpserve start --curve-secret-key`, or a client's --client-key).
    """
    try:
        public_path, secret_path = generate_keypair(directory, name, force)
    except (KeyFileError, OSError) as e:
        _fail(str(e))
    click.echo(f"public key: {public_path}")
    click.echo(f"secret key: {secret_path}")
    click.echo(f"public key (Z85): {load_public_key(public_path).decode()}")


if __name__ == "__main__":  # pragma: no cover
    main()
