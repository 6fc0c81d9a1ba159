"""What every front shares: a child process of the daemon, one more ZMQ client of it.

``FrontProcess`` starts a front as a child of the daemon once the engine is loaded (the child
binds its port, then writes the bound port to an inherited pipe, so port 0 works and a busy port
fails the daemon's start-up), restarts it when it dies (bounded, with back-off) and stops it
(SIGTERM, then SIGKILL) on every way out; the child asks the kernel to end it when the daemon
dies (PR_SET_PDEATHSIG). ``front_arguments`` is the argv every front's main takes from it.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

from tpserve.errors import TpserveError

log = logging.getLogger("tpserve.front")

_STOP_TIMEOUT = 5.0
DEFAULT_UPSTREAM_TIMEOUT = 30.0  # s of no answer from the daemon (or of a stalled front) that end requests


class FrontError(TpserveError, RuntimeError):
    """A front could not start (port busy, bad host...)."""


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
                    raise FrontError(f"the {self.NAME} is being stopped")
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
                except FrontError as e:
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
                raise FrontError(f"the {self.NAME} did not listen within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:  # the child closed the pipe: it exited
                    code = proc.wait()
                    raise FrontError(f"the {self.NAME} exited with {describe_exit(code)} before listening "
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


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
