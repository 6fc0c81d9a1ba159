"""The daemon's life cycle around one Server: what `tpserve serve` runs (and `start` detaches).

Order of events, each step undone in reverse on the way out:

1. runtime dir (0700), address policy check, pid-file lock (refuses a second daemon);
2. bind the socket (fails fast on a busy address, before the slow model load);
3. load the engine (spawns tensor-parallel workers); SIGTERM/SIGINT here abort the start-up;
4. with an HTTP port, start the HTTP front (a child process, one more ZMQ client; see
   http_front.py) and wait until it listens; a front that dies later is restarted, and the
   status map reports its state (``http_front``, ``http_front_restarts``); the same for the
   gRPC front with a gRPC port (grpc_front.py: ``grpc_front``, ``grpc_front_restarts``);
5. write the ready file -- `tpserve start` waits for it -- then serve;
6. first SIGTERM/SIGINT: drain -- stop admitting (``shutting_down``; the HTTP front answers
   503), let the requests in flight, queued ones included, finish for up to
   ServerOptions.shutdown_grace seconds, abort the rest (``done`` with finish_reason "abort",
   abort_reason "shutting_down"), engine.shutdown(), exit 0. A second SIGTERM/SIGINT during the
   drain, or SIGUSR1 at any time (`tpserve stop --now`), ends the drain at once the same way
   (exit 0); if the serving loop does not get there within ``NOW_TIMEOUT`` s (an engine stuck
   in a step), or a signal arrives once the loop has ended (engine.shutdown() hanging), the
   workers (and the front) are killed and the daemon exits at once (status 1). The HTTP front
   is stopped on every way out.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

from tpserve.config import EngineConfig
from tpserve.client.addresses import READY_NAME, check_address, connect_address, resolve_address
from tpserve.server.runtime import PidFile, ensure_runtime_dir, write_ready
from tpserve.procs import freeze_heap, kill_tree
from tpserve.fronts.grpc.front import GrpcFrontProcess, GrpcOptions, kv_events_for_grpc
from tpserve.fronts.http.front import HttpFrontProcess, HttpOptions
from tpserve.fronts.process import FrontError
from tpserve.server.server import Server, ServerOptions
from tpserve.server.status import served_model_name

log = logging.getLogger("tpserve.daemon")

NOW_TIMEOUT = 10.0  # s the serving loop has to end after a "stop now" before the daemon is killed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _StartupInterrupted(Exception):
    """A stop signal arrived while the engine was loading."""


def run_daemon(config: EngineConfig, address: str | None, runtime_dir: str | os.PathLike | None,
               options: ServerOptions, engine_factory=None, http: HttpOptions | None = None,
               grpc: GrpcOptions | None = None) -> int:
    """Serve until stopped; returns the process exit status. Must run on the main thread.

    ``http`` starts the OpenAI-compatible HTTP front with the daemon and stops it with it;
    ``grpc`` the gRPC front (grpc_front.py), which relays the KV events the daemon then publishes."""
    rd = ensure_runtime_dir(runtime_dir)
    address = resolve_address(address, rd)
    check_address(address, options.curve_secret_key is not None)
    if (http is not None or grpc is not None) and options.curve_client_keys_dir:
        raise FrontError("the HTTP and gRPC fronts cannot be combined with a CurveZMQ client allow-list "
                             "(--curve-client-keys): they connect with a key of their own")
    if grpc is not None:
        options = dataclasses.replace(options, kv_events=kv_events_for_grpc(options.kv_events, rd))
    pidfile = PidFile(rd)
    pidfile.acquire()
    engine = server = front = grpc_front = None
    shutting_down = threading.Event()
    serving = threading.Event()      # the serving loop runs (a "stop now" can still reach it)
    watchdog: list[threading.Timer] = []

    def startup_signal(signum, frame):
        raise _StartupInterrupted(signal.Signals(signum).name)

    def first_signal(signum, frame):
        log.info("received %s: draining (send it again, or `tpserve stop --now`, to abort what runs now)",
                 signal.Signals(signum).name)
        for s in STOP_SIGNALS:
            signal.signal(s, now_signal)
        server.request_shutdown()

    def now_signal(signum, frame):
        if not serving.is_set() or watchdog:
            log.warning("received %s again: killing workers and exiting now", signal.Signals(signum).name)
            _force_exit(engine, shutting_down, pidfile)
        log.warning("received %s: aborting the requests in flight and exiting now", signal.Signals(signum).name)
        for s in STOP_SIGNALS:
            signal.signal(s, now_signal)
        server.request_shutdown(now=True)
        timer = threading.Timer(NOW_TIMEOUT, _stuck_exit, args=(engine, shutting_down, pidfile))
        timer.daemon = True
        timer.start()
        watchdog.append(timer)

    old_handlers = {s: signal.signal(s, startup_signal) for s in (*STOP_SIGNALS, signal.SIGUSR1)}
    code = 0
    if options.profile_dir is None:
        options = dataclasses.replace(options, profile_dir=str(rd.absolute()))
    try:
        server = Server(None, address, options)
        if engine_factory is None:
            from tpserve.engine import Engine
            engine_factory = Engine
        engine = engine_factory(config)
        server.engine = engine
        for s in STOP_SIGNALS:
            signal.signal(s, first_signal)
        signal.signal(signal.SIGUSR1, now_signal)
        url = None
        if http is not None:
            front = HttpFrontProcess(http, connect_address(address), str(engine.config.model_path),
                                     served_model_name(engine, options), _usable_context(engine.config),
                                     options.curve_public_key)
            url = front.start()
        grpc_url = None
        if grpc is not None:
            grpc_front = GrpcFrontProcess(grpc, connect_address(address), str(engine.config.model_path),
                                          served_model_name(engine, options), _usable_context(engine.config),
                                          options.kv_events, options.curve_public_key)
            grpc_url = grpc_front.start()
        fronts = [f for f in (front, grpc_front) if f is not None]
        if fronts:
            server.status_extras = lambda: {k: v for f in fronts for k, v in f.status().items()}
        old_wakeup = signal.set_wakeup_fd(server.wake_fd, warn_on_full_buffer=False)
        write_ready(rd, address, url, shutdown_grace=options.shutdown_grace, grpc=grpc_url)
        stats = engine.stats()
        _warn_without_cpu_ops(stats)
        log.info("tpserve ready on %s (pid %d, model %s, tensor parallel %s)", address, os.getpid(),
                 stats.get("model"), stats.get("tensor_parallel_size"))
        serving.set()
        freeze_heap()
        try:
            code = server.run()
        finally:
            serving.clear()
            for timer in watchdog:
                timer.cancel()
            signal.set_wakeup_fd(old_wakeup)
    except _StartupInterrupted as e:
        log.info("received %s while starting: exiting", e)
        if engine is None:  # workers of a half-built engine have nobody to shut them down
            kill_tree(os.getpid(), include_root=False)
    finally:
        for s in (*STOP_SIGNALS, signal.SIGUSR1):
            signal.signal(s, now_signal)
        (rd / READY_NAME).unlink(missing_ok=True)
        if front is not None:
            front.stop()
        if grpc_front is not None:
            grpc_front.stop()
        if server is not None:
            server.close()
        if engine is not None:
            shutting_down.set()
            engine.shutdown()
        pidfile.release()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    log.info("tpserve stopped (exit status %d)", code)
    return code


def _warn_without_cpu_ops(stats: dict) -> None:
    """A WARNING block in the start log when a CPU engine runs without tpserve's C++ operators
    (engine stats ``cpu_ops``: unavailable or disabled), with the reason and what to do."""
    state = stats.get("cpu_ops")
    if state not in ("unavailable", "disabled"):
        return
    if state == "unavailable":
        fix = ("`python -m tpserve.kernels.cpu_extension` shows the build's error; the build needs a C++ "
               "compiler, ninja and the package's tpserve/kernels/csrc/*.h headers")
    else:
        fix = "unset TPSERVE_CPU_OPS (or set it to 1) to use them"
    rule = "!" * 72
    reason = stats.get("cpu_ops_reason") or "no reason given"
    for line in (rule,
                 f"tpserve's C++ CPU operators are {state.upper()}: {reason}",
                 "this daemon runs the plain-torch CPU path instead, several times slower",
                 fix,
                 "`tpserve status` (CPU operators) and /metrics (tpserve:cpu_ops_loaded 0) say so too",
                 rule):
        log.warning("%s", line)


def _usable_context(config) -> int:
    """Tokens one request may hold: max_model_len, or less when the KV pool is smaller (the
    HTTP front sizes a chat request's default max_tokens by it, so the default is admitted)."""
    context = int(config.max_model_len)
    if getattr(config, "num_kv_blocks", None):
        context = min(context, int(config.num_kv_blocks) * int(config.block_size))
    return context


def _force_exit(engine, shutting_down: threading.Event, pidfile: PidFile) -> None:
    """Kill every descendant, give engine.shutdown() two seconds to free shared memory, exit 1."""
    kill_tree(os.getpid(), include_root=False)
    if engine is not None and not shutting_down.is_set():
        # In a thread: the main thread may be inside the engine right now.
        t = threading.Thread(target=_quiet_shutdown, args=(engine,), daemon=True)
        t.start()
        t.join(2.0)
    pidfile.release()
    os._exit(1)


def _stuck_exit(engine, shutting_down: threading.Event, pidfile: PidFile) -> None:
    log.error("the serving loop did not end within %g s of a stop-now signal (an engine step stuck?): "
              "killing workers and exiting", NOW_TIMEOUT)
    _force_exit(engine, shutting_down, pidfile)


def _quiet_shutdown(engine) -> None:
    try:
        engine.shutdown()
    except Exception:
        pass


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None
