"""Idle connections against the HTTP front: does /health still answer, what does the log do.

    python scripts/probe_http_idle.py [--conns 20000] [--partial] [--hold 5] [--window 5] [--model DIR]

Starts a daemon with `--http-port 0` (no API key), opens ``--conns`` TCP connections to the
front that send nothing (``--partial``: an unfinished request head, the slow-headers attack),
waits ``--hold`` seconds, then asks ``GET /health`` (10 s limit) while they are open, and
measures what the front wrote to the daemon's log meanwhile (over ``--window`` seconds at
least). Prints one line: the /health
status and latency, the front's open file descriptors, how many of the idle connections the
front had closed, and the log's growth (lines and tracebacks per second).
"""
from __future__ import annotations

import argparse
import errno
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TPSERVE = [sys.executable, "-m", "tpserve"]
FRONT_MODULE = "tpserve.fronts.http.front"  # what the daemon runs as its HTTP front (python -m)


def front_pid(daemon_pid: int) -> int | None:
    from tpserve.procs import descendants
    for p in descendants(daemon_pid):
        try:
            if FRONT_MODULE in Path(f"/proc/{p}/cmdline").read_text().split("\0"):
                return p
        except OSError:
            pass
    return None


def start_daemon(extra: list[str], model: str | None) -> tuple[str, str, int] | None:
    """`tpserve start --http-port 0` without an API key: (runtime dir, front URL, front pid);
    None (the reason on stderr, the daemon stopped) if it does not start or its front's
    process is not found."""
    rd = tempfile.mkdtemp(prefix="tpp-", dir="/tmp")
    cmd = TPSERVE + ["start", "--runtime-dir", rd, "--http-port", "0"] + extra
    if model:
        cmd += ["--model", model]
    env = {k: v for k, v in os.environ.items() if k != "TPSERVE_API_KEY"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        shutil.rmtree(rd, ignore_errors=True)
        print(out.stderr, file=sys.stderr)
        return None
    fpid = front_pid(int(Path(rd, "tpserve.pid").read_text()))
    if fpid is None:
        print(f"no process of the daemon runs `python -m {FRONT_MODULE}`: where is its HTTP front?",
              file=sys.stderr)
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)
        return None
    return rd, out.stdout.split()[1], fpid


def open_idle(host: str, port: int, n: int, partial: bool) -> list[socket.socket]:
    """``n`` non-blocking connections; a full listen backlog must not block this loop."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        code = s.connect_ex((host, port))
        if code not in (0, errno.EINPROGRESS):
            s.close()
            break
        socks.append(s)
    if partial:
        time.sleep(1.0)
        for s in socks:
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                pass
    return socks


def hold_idle(host: str, port: int, n: int, partial: bool, conn) -> None:
    """A helper process: opens ``n`` connections, says how many, holds them until told, then
    says how many the front had closed (one process cannot hold 20,000 descriptors)."""
    socks = open_idle(host, port, n, partial)
    conn.send(len(socks))
    conn.recv()
    conn.send(closed_by_peer(socks))
    for s in socks:
        s.close()


def closed_by_peer(socks: list[socket.socket]) -> int:
    closed = 0
    for s in socks:
        try:
            data = s.recv(4096)
            closed += not data or data.startswith(b"HTTP/1.1 4") or data.startswith(b"HTTP/1.1 5")
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


def health(url: str) -> tuple[str, float]:
    import httpx
    start = time.perf_counter()
    try:
        status = str(httpx.get(url + "/health", timeout=10).status_code)
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, time.perf_counter() - start


def log_counts(path: Path) -> tuple[int, int, int]:
    data = path.read_bytes() if path.exists() else b""
    return len(data), data.count(b"\n"), data.count(b"Traceback")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conns", type=int, default=20000)
    ap.add_argument("--partial", action="store_true", help="send an unfinished request head")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds between opening and /health")
    ap.add_argument("--window", type=float, default=5.0, help="seconds the log's growth is measured over, "
                    "at least (from /health on)")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    per_proc = max(1, hard - 256)
    started = start_daemon([], args.model)
    if started is None:
        return 1
    rd, url, fpid = started
    host, port = url.removeprefix("http://").rsplit(":", 1)
    log_path = Path(rd, "tpserve.log")
    holders = []
    try:
        before_status, before_s = health(url)
        ctx = multiprocessing.get_context("fork")
        left = args.conns
        while left > 0:
            here, there = ctx.Pipe()
            p = ctx.Process(target=hold_idle, args=(host, int(port), min(left, per_proc), args.partial, there))
            p.start()
            holders.append((p, here))
            left -= min(left, per_proc)
        opened = sum(h.recv() for _, h in holders)
        time.sleep(args.hold)
        size0, lines0, tb0 = log_counts(log_path)
        t0 = time.monotonic()
        status, latency = health(url)
        window = max(time.monotonic() - t0, 1.0)
        time.sleep(max(0.0, args.window - window))  # a long enough window for the log rates
        window = time.monotonic() - t0
        size1, lines1, tb1 = log_counts(log_path)
        try:
            fds = len(os.listdir(f"/proc/{fpid}/fd"))
        except OSError:
            fds = -1
        alive = Path(f"/proc/{fpid}").exists()
        for _, h in holders:
            h.send("stop")
        closed = sum(h.recv() for _, h in holders)
    finally:
        for p, _ in holders:
            p.join(30)
            if p.is_alive():
                p.kill()
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        kept = Path(tempfile.gettempdir(), "probe_http_idle.log")
        if log_path.exists():
            shutil.copy(log_path, kept)
        shutil.rmtree(rd, ignore_errors=True)
    print(f"probe_http_idle conns={opened} partial={int(args.partial)} hold_s={args.hold:g} "
          f"health_before={before_status} ({before_s * 1e3:.0f} ms) health={status} ({latency * 1e3:.0f} ms) "
          f"front_alive={int(alive)} front_fds={fds} closed_by_front={closed} "
          f"log_lines_per_s={(lines1 - lines0) / window:.0f} tracebacks_per_s={(tb1 - tb0) / window:.0f} "
          f"log_kib_per_s={(size1 - size0) / window / 1024:.1f} (log kept in {kept})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
