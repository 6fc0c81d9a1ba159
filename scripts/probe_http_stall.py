"""A stalled HTTP front: SIGSTOP it while streams run, SIGCONT it, and see whether they all end.

    python scripts/probe_http_stall.py [--streams 16] [--whole 4] [--stop-s 40] [--upstream-timeout 30]

Starts a daemon with `--http-port 0` on the bundled model (or ``--model``), starts ``--streams``
streaming and ``--whole`` non-streamed completions (greedy, ignore_eos, max_tokens 900), stops
the front with SIGSTOP for ``--stop-s`` seconds once every stream has its first chunk, then
resumes it and waits up to ``--wait-s`` seconds for every request to end. Prints one line: how
many streams ended normally, ended with an error event then ``[DONE]``, or are still open at the end of the wait (and how
many requests the daemon still runs then: open streams with none in flight hang for good); how
many non-streamed requests got a response (and which statuses); whether the daemon dropped the
front ("not reading" in its log).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from probe_http_idle import TPSERVE, start_daemon  # scripts/ is on the path of a script


class StreamRun(threading.Thread):
    """One streamed completion read line by line: its chunks, error events and ``[DONE]``."""

    def __init__(self, url: str, i: int, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.i, self.max_tokens = url, i, max_tokens
        self.chunks = self.errors = 0
        self.done = False
        self.failure: str | None = None
        self.first = threading.Event()

    def run(self):
        import httpx
        body = {"prompt": [(7 * self.i + j) % 3000 + 1 for j in range(8)], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=None) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        if "error" in json.loads(line[6:]):
                            self.errors += 1
                        else:
                            self.chunks += 1
                            self.first.set()
        except Exception as e:  # the outcome is what is measured
            self.failure = type(e).__name__
        finally:
            self.first.set()


class WholeRun(threading.Thread):
    def __init__(self, url: str, i: int, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.i, self.max_tokens = url, i, max_tokens
        self.status: str | None = None

    def run(self):
        import httpx
        body = {"prompt": [(11 * self.i + j) % 3000 + 1 for j in range(8)], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True}
        try:
            self.status = str(httpx.post(self.url + "/v1/completions", json=body, timeout=None).status_code)
        except Exception as e:
            self.status = type(e).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--whole", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=900)
    ap.add_argument("--stop-s", type=float, default=40.0)
    ap.add_argument("--wait-s", type=float, default=60.0)
    ap.add_argument("--upstream-timeout", type=float, default=30.0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    blocks = (args.streams + args.whole) * (args.max_tokens + 64) // 16 + 16
    started = start_daemon(["--http-upstream-timeout", str(args.upstream_timeout), "--num-kv-blocks", str(blocks),
                            "--block-size", "16"], args.model)
    if started is None:
        return 1
    rd, url, fpid = started
    log_path = Path(rd, "tpserve.log")
    try:
        streams = [StreamRun(url, i, args.max_tokens) for i in range(args.streams)]
        wholes = [WholeRun(url, i, args.max_tokens) for i in range(args.whole)]
        for t in streams + wholes:
            t.start()
        for s in streams:
            s.first.wait(120)
        os.kill(fpid, signal.SIGSTOP)
        time.sleep(args.stop_s)
        os.kill(fpid, signal.SIGCONT)
        deadline = time.monotonic() + args.wait_s
        for t in streams + wholes:
            t.join(max(0.0, deadline - time.monotonic()))
        dropped = "not reading" in log_path.read_text(errors="replace")
        from tpserve.client.client import Client
        with Client(runtime_dir=rd, timeout=30) as c:  # streams still open with nothing in flight hang
            in_flight = c.status()["requests_in_flight"]
        # Counted before the daemon stops: stopping it ends whatever still hangs.
        normal = sum(s.done and not s.errors and not s.is_alive() for s in streams)
        error_done = sum(s.done and s.errors > 0 and not s.is_alive() for s in streams)
        still_open = sum(s.is_alive() for s in streams)
        statuses = collections.Counter(w.status if not w.is_alive() else "open" for w in wholes)
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)
    broken = args.streams - normal - error_done - still_open
    print(f"probe_http_stall streams={args.streams} stop_s={args.stop_s:g} upstream_timeout_s={args.upstream_timeout:g} "
          f"daemon_dropped_front={int(dropped)} streams_finished={normal} streams_error_then_done={error_done} "
          f"streams_cut_without_done={broken} streams_open={still_open} daemon_in_flight={in_flight} "
          f"whole={','.join(f'{k}:{v}' for k, v in sorted(statuses.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
