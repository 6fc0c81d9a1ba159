"""`tpserve stop` and `tpserve status`: ending the runtime dir's daemon, and asking it how it is.

Light: neither command imports the server or the engine; `status` imports the client library
when it connects. Both find the daemon by its pid-file lock, so a daemon killed with SIGKILL
is told apart at once from a live one, and the files it left (pid, ready, socket) are removed.

`stop` never hangs on a stalled daemon. After SIGTERM (SIGUSR1 with --now) it waits for the
daemon to exit; a daemon that was stopped (SIGSTOP) is continued first, so that it can drain.
The daemon's serving loop must have ended (its ready file is gone) by the daemon's
--shutdown-grace plus ``LOOP_SLACK`` seconds -- a loop still running then is stuck in a step
or blocked, and would never read the stop -- and the daemon must be gone by the grace plus
``STOP_MARGIN`` seconds (--timeout sets this bound alone). Past either, `stop` says so on stderr
and kills the daemon's whole process tree (SIGKILL), then removes what it left behind.
"""
from __future__ import annotations

import json
import os
import signal
import time

import click

from tpserve.cli.common import CONTEXT, client_options, connect, fail, live_pid, runtime_dir_option
from tpserve.client.addresses import read_ready, resolve_runtime_dir
from tpserve.procs import descendants, kill_tree, pid_alive, wait_gone
from tpserve.server.runtime import cleanup_stale, read_pid

STOP_MARGIN = 30.0  # s `stop` waits beyond the daemon's drain before killing it
LOOP_SLACK = 10.0   # s past its drain by which the daemon's serving loop must have ended
DEFAULT_GRACE = 30.0  # the daemon's --shutdown-grace when its ready file does not say


# ---- stop --------------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@runtime_dir_option
@click.option("--timeout", type=float, default=None, show_envvar=True, envvar="TPSERVE_STOP_TIMEOUT",
              help="seconds to wait for a graceful exit before killing the daemon and its workers "
                   f"[default: the daemon's --shutdown-grace + {STOP_MARGIN:g}, and a daemon whose "
                   f"serving loop still runs at its grace + {LOOP_SLACK:g} is killed then; with --now, "
                   f"{STOP_MARGIN:g}]")
@click.option("--now", is_flag=True, help="abort the requests in flight at once instead of letting them "
                                          "finish (SIGUSR1; a second SIGTERM does the same)")
def stop(runtime_dir, timeout, now):
    """Stop the daemon: SIGTERM (a drain: requests in flight finish for up to its --shutdown-grace,
    new ones are refused), then SIGKILL of its whole process tree when it does not exit."""
    rd = resolve_runtime_dir(runtime_dir)
    pid = live_pid(rd) if rd.is_dir() else None
    if pid is None:
        fail(f"no tpserve daemon is running with runtime dir {rd}")
    serving = _serving(rd, pid)  # without a ready file it is still starting: no drain to wait for
    grace = 0.0 if now else _grace(rd, pid)
    loop_deadline = None
    if timeout is None:
        timeout = STOP_MARGIN + grace
        if serving:
            loop_deadline = grace + LOOP_SLACK
    tree = [pid] + descendants(pid)
    try:
        os.kill(pid, signal.SIGUSR1 if now else signal.SIGTERM)
    except ProcessLookupError:
        pass
    _continue_stopped(tree)
    stalled = _wait_exit(rd, pid, timeout, loop_deadline)
    if stalled is None:
        # Workers normally exit with the daemon; give stragglers a moment, then make sure.
        if not wait_gone(tree, 5.0):
            for p in tree:
                if pid_alive(p):
                    kill_tree(p)
        click.echo(f"stopped tpserve daemon (pid {pid})")
    else:
        tree += [p for p in descendants(pid) if p not in tree]
        click.echo(f"tpserve: the daemon (pid {pid}) {stalled}; killing it and its workers", err=True)
        kill_tree(pid)
        for p in tree:
            kill_tree(p)
        if not wait_gone(tree, 10.0):
            left = [p for p in tree if pid_alive(p)]
            fail(f"processes {left} of the daemon (pid {pid}) survived SIGKILL for 10 s")
        # A killed daemon could not unlink its plan-channel segments; their names carry its pid.
        from tpserve.workers.shm_ring import cleanup_stale_segments
        cleanup_stale_segments()
        click.echo(f"killed tpserve daemon (pid {pid})")
    cleanup_stale(rd)


def _serving(rd, pid: int) -> bool:
    """Whether ``pid``'s serving loop runs: the daemon writes its ready file once it serves and
    removes it as soon as the loop has ended."""
    return (read_ready(rd) or {}).get("pid") == pid


def _grace(rd, pid: int) -> float:
    ready = read_ready(rd) or {}
    grace = ready.get("shutdown_grace") if ready.get("pid") == pid else None
    if isinstance(grace, (int, float)) and not isinstance(grace, bool) and grace >= 0:
        return float(grace)
    return DEFAULT_GRACE


def _wait_exit(rd, pid: int, timeout: float, loop_deadline: float | None) -> str | None:
    """Wait for ``pid`` to exit: None once it has, else why `stop` gives up on it."""
    start = time.monotonic()
    while pid_alive(pid):
        waited = time.monotonic() - start
        if loop_deadline is not None and waited >= loop_deadline and _serving(rd, pid):
            return (f"is stalled: its serving loop still runs {waited:.0f} s after the stop, past its drain "
                    f"and {LOOP_SLACK:g} s more")
        if waited >= timeout:
            return f"did not exit within {timeout:g} s"
        time.sleep(0.05)
    return None


def _continue_stopped(pids: list[int]) -> None:
    """SIGCONT to the processes stopped by a signal (SIGSTOP, SIGTSTP): a stopped daemon keeps
    the stop signal pending and can neither drain nor exit."""
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2:][:1] == b"T":
            click.echo(f"tpserve: pid {p} of the daemon was stopped (SIGSTOP); continuing it", err=True)
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


# ---- status ------------------------------------------------------------------------------
_STATUS_LINES = [
    ("pid", "pid", "{}"),
    ("model", "model", "{}"),
    ("runner", "runner", "{}"),  # generate, or pooling: embeddings and scores (--runner)
    ("tensor parallel", "tensor_parallel_size", "{}"),
    ("batch invariant", "batch_invariant", "{}"),  # --batch-invariant (docs/protocol.md)
    ("uptime", "uptime_s", "{:.0f} s"),
    ("state", "state", "{}"),
    ("ready", "ready", "{}"),
    ("drain left", "drain_left_s", "{:.1f} s"),  # only while draining
    ("failure", "failure", "{}"),  # only once the engine failed
    ("CPU operators", "cpu_ops", "{}"),  # loaded, unavailable, disabled; unused on an accelerator
    ("WARNING", "cpu_ops_reason", "C++ CPU operators not loaded ({}): the slower plain-torch path runs"),
    ("HTTP front", ("http_front", "http_front_restarts"), "{} (restarts: {})"),  # with --http-port
    ("HTTP front exit", "http_front_last_exit", "{}"),  # once it has died
    # with --grpc-port
    ("gRPC front", ("grpc_front", "grpc_front_restarts", "grpc_url"), "{} (restarts: {}) at {}"),
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
    ("KV cache dtype", "kv_cache_dtype", "{}"),
    ("prefix cache hits", "prefix_cache_hit_rate", "{:.1%}"),
    ("KV host tier", ("kv_offload_host_blocks", "kv_offload_host_bytes", "kv_offload_host_capacity_bytes",
                     "kv_offload_host_hits", "kv_offload_host_misses", "kv_offload_host_loads",
                     "kv_offload_host_saves",
                     "kv_offload_host_corrupt", "kv_offload_host_load_ms_avg"),
     "{} blocks, {} of {} bytes; hits {}, misses {}, loads {}, saves {}, corrupt {}, "
     "load {:.1f} ms avg"),  # with --kv-offload-*
    ("KV disk tier", ("kv_offload_disk_blocks", "kv_offload_disk_bytes", "kv_offload_disk_capacity_bytes",
                     "kv_offload_disk_hits", "kv_offload_disk_misses", "kv_offload_disk_loads",
                     "kv_offload_disk_saves",
                     "kv_offload_disk_corrupt", "kv_offload_disk_load_ms_avg"),
     "{} blocks, {} of {} bytes; hits {}, misses {}, loads {}, saves {}, corrupt {}, "
     "load {:.1f} ms avg"),  # with --kv-offload-*
    ("preemptions", ("num_preemptions", "num_priority_preemptions"), "{} ({} for a better priority)"),
    # only with speculative decoding on
    ("spec acceptance", ("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length"),
     "{:.1%} of draft tokens, mean acceptance length {:.2f}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("prompt tokens", "prompt_tokens", "{}"),
    ("generated tokens", "generation_tokens", "{}"),
    ("pooling requests", ("pooling_requests", "pooling_prompts", "pooling_prompt_tokens"),
     "{} ({} prompts, {} tokens)"),  # --runner pooling
]


@click.command(context_settings=CONTEXT)
@client_options(timeout=5.0)
@click.option("--json", "as_json", is_flag=True, help="print the raw status map as JSON")
@click.option("--metrics", "as_metrics", is_flag=True,
              help="print the daemon's Prometheus metrics (the text /metrics serves)")
def status(as_json, as_metrics, **kw):
    """Show the running daemon's model, load and KV-cache use (asks the daemon itself)."""
    with connect(kw) as client:
        from tpserve.client.client import ClientTimeout  # loaded by connect: no daemon, no import
        try:
            if as_metrics:
                click.echo(client.metrics(), nl=False)
                return
            stats = client.status()
        except ClientTimeout as e:
            rd = resolve_runtime_dir(kw["runtime_dir"])
            pid = read_pid(rd) if rd.is_dir() else None
            hint = f" (pid file {rd}/tpserve.pid names pid {pid})" if pid else ""
            fail(f"{e}: is it running?{hint}")
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


