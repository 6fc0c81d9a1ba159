"""How long a huge text prompt stalls the other clients' streams (ZMQ and the HTTP front).

    python scripts/bench_tokenize_stall.py [--model DIR] [--chars 1000000] [--rounds 2]

One daemon (`tpserve start --http-port 0`, the bundled model by default). For each path (ZMQ
client, then the OpenAI HTTP API) and each round: greedy streams of another client run one
after another, and
the worst gap between two of its deltas is taken over a few seconds (baseline), then again
from the moment a ``--chars``-character text prompt is sent on the same path until that
request is answered (an admission error: the prompt is far longer than the model's context,
but it has to be tokenized to know). Prints one line: worst baseline gap and worst gap with
the huge prompt, per path (the worst over all rounds), their ratio, the ratio of the
per-round medians, the median ratio of the stream's deltas per second with and without it, the
CPU time the hypervisor stole in each kind of window (/proc/stat; on a virtual machine a stolen
tick stalls a stream for 10 ms or more, whatever runs), and the worst-gap ratio over the rounds
in which nothing was stolen.
The stream is watched without the huge prompt for as long as with it (the worst of a longer
window is larger). Timings depend on the machine's load. Before the first round the script waits
until the daemon's tokenizer process is up (a fresh daemon starts it in the background), as on a
daemon that has served a while: the first huge prompt would otherwise also wait for that
process's start, which under the streams' load takes seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

from bench_daemon_run import isa, started_daemon

_STREAM_TOKENS = 1000


def huge_text(chars: int) -> str:
    """Words of this repository's Python sources in random order: text a tokenizer works on."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tpserve")
    words = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    words += fh.read().split()
    rng = random.Random(0)
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


class Arrivals:
    """Arrival times of one stream's deltas, collected on a thread."""

    def __init__(self, run):
        self.times: list[float] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, args=(run,), daemon=True)
        self._thread.start()
        self.first.wait(120)

    def _collect(self, run):
        try:
            for _ in run():
                self.times.append(time.perf_counter())
                self.first.set()
                if self.stop.is_set():
                    break  # closing the stream aborts the request
        finally:
            self.first.set()
            self.done.set()

    def worst_gap(self, start: float, end: float) -> float:
        """The longest time without a delta within [start, end] (a window edge counts as a delta)."""
        inside = [t for t in self.times if start <= t <= end]
        points = [start] + inside + [min(end, self.times[-1] if self.done.is_set() else end)]
        return max(b - a for a, b in zip(points, points[1:]))

    def count(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.times)

    def finish(self):
        self.stop.set()
        self._thread.join(600)


def zmq_stream(address):
    from tpserve.client.client import Client

    def run():
        with Client(address, timeout=600) as c:
            while True:  # one stream after another, for as long as the measurement reads
                for d in c.stream([5, 6, 7, 8], temperature=0.0, max_tokens=_STREAM_TOKENS, ignore_eos=True):
                    yield d
    return run


def http_stream(url):
    import httpx

    def run():
        body = {"model": "bench", "prompt": [5, 6, 7, 8], "max_tokens": _STREAM_TOKENS, "temperature": 0,
                "stream": True, "ignore_eos": True}
        # One client, its connection kept alive, as a real client's: a new httpx client per stream
        # costs ~40 ms of its own (an SSL context), a gap at every restart that tpserve never saw.
        with httpx.Client(timeout=600) as client:
            while True:
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            yield json.loads(line[6:])
    return run


def zmq_huge(address):
    """A sender of the huge prompt over ZMQ, connected (and its modules imported) beforehand."""
    from tpserve.client.client import Client, RequestError
    client = Client(address, timeout=600)
    client.ping()

    def send(text):
        with client:
            try:
                client.generate(text, max_tokens=1)
            except RequestError as e:
                return e.code
        return "ok"
    return send


def http_huge(url):
    """A sender of the huge prompt over HTTP, connected (and its modules imported) beforehand."""
    import httpx
    client = httpx.Client(timeout=600)
    client.get(url + "/health")

    def send(text):
        try:
            return client.post(url + "/v1/completions", json={"model": "bench", "prompt": text,
                                                               "max_tokens": 1}).status_code
        finally:
            client.close()
    return send


def tokenizer_ready(address: str) -> None:
    """Return once the daemon's tokenizer process answers: a ``tokenize`` request of a text longer
    than the daemon's inline limit (ServerOptions.inline_tokenize_chars, 8,192 characters) is
    tokenized there, after the start-up the daemon began in the background."""
    from tpserve.client.client import Client
    with Client(address, timeout=600) as c:
        c.tokenize(huge_text(65_536))


def _huge_sender(conn, path: str, target: str, chars: int) -> None:
    """Child process: build the prompt and its client, wait for "go", send it, report the
    answer, and exit once told to. Only the sending itself falls in the measured windows: the
    client's imports and connection, or its exit (each some tens of ms of CPU on a 2-core
    machine), would be costs of this benchmark, not of tpserve."""
    text = huge_text(chars)
    send = zmq_huge(target) if path == "zmq" else http_huge(target)
    conn.send("ready")
    conn.recv()
    conn.send(send(text))
    conn.recv()


def steal_ms() -> float:
    """CPU time the hypervisor took from this machine's CPUs so far (/proc/stat "steal"), in ms:
    a virtual CPU descheduled for a tick stalls whatever ran on it, tpserve or not."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def measure(stream, path: str, target: str, chars: int, baseline_s: float):
    """(worst gap without, worst gap with the huge prompt in flight, its answer, whether the
    stream outlasted it, deltas per second without and with it). The huge prompt is built and
    sent by another process, so its own encoding work does not compete with this process's
    reading of the stream. The worst of a window grows with its length, so the stream is
    watched without the huge prompt for at least as long as it is watched with it: before the
    prompt is sent, and again after it is answered as long as needed."""
    import multiprocessing as mp
    parent, child = mp.Pipe()
    sender = mp.get_context("spawn").Process(target=_huge_sender, args=(child, path, target, chars))
    sender.start()
    parent.recv()
    a = Arrivals(stream)
    t0, s0 = time.perf_counter(), steal_ms()
    time.sleep(baseline_s)
    t1, s1 = time.perf_counter(), steal_ms()
    parent.send("go")
    answer = parent.recv()
    t2, s2 = time.perf_counter(), steal_ms()
    time.sleep(max(0.0, (t2 - t1) - (t1 - t0)))
    t3, s3 = time.perf_counter(), steal_ms()
    covered = not a.done.is_set()  # the stream still ran when the last window closed
    parent.send("exit")
    base = max(a.worst_gap(t0, t1), a.worst_gap(t2, t3) if t3 > t2 + 0.01 else 0.0)
    stalled = a.worst_gap(t1, t2)
    rate_base = (a.count(t0, t1) + a.count(t2, t3)) / ((t1 - t0) + (t3 - t2))
    rate_huge = a.count(t1, t2) / (t2 - t1)
    a.finish()
    sender.join()
    return base, stalled, answer, covered, rate_base, rate_huge, (s1 - s0) + (s3 - s2), s2 - s1


def _unstolen(path: str, rows) -> str:
    """The worst-gap ratio over the rounds in which the hypervisor stole nothing, in either window."""
    calm = [r for r in rows if r[6] == 0 and r[7] == 0]
    if not calm:
        return f"{path}_rounds_without_steal=0 "
    ratio = max(r[1] for r in calm) / max(r[0] for r in calm)
    return f"{path}_rounds_without_steal={len(calm)} {path}_ratio_without_steal={ratio:.2f} "


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--chars", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-s", type=float, default=2.0)
    args = ap.parse_args()
    results = {"zmq": [], "http": []}
    try:
        with started_daemon(args.model, http=True) as (address, url):
            tokenizer_ready(address)
            for _ in range(args.rounds):
                results["zmq"].append(measure(zmq_stream(address), "zmq", address, args.chars, args.baseline_s))
                results["http"].append(measure(http_stream(url), "http", url, args.chars, args.baseline_s))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    fields = []
    for path, rows in results.items():
        base = max(r[0] for r in rows)
        stalled = max(r[1] for r in rows)
        med_base, med_stalled = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        fields.append(f"{path}_baseline_gap_s={base:.3f} {path}_huge_prompt_gap_s={stalled:.3f} "
                      f"{path}_ratio={stalled / base:.2f} {path}_median_ratio={med_stalled / med_base:.2f} "
                      f"{path}_rate_ratio={statistics.median(r[5] / r[4] for r in rows):.2f} "
                      f"{path}_steal_ms_baseline={sum(r[6] for r in rows):.0f} "
                      f"{path}_steal_ms_huge_prompt={sum(r[7] for r in rows):.0f} "
                      + _unstolen(path, rows) +
                      f"{path}_answer={rows[-1][2]}"
                      + ("" if all(r[3] for r in rows) else f" {path}_stream_ended_early=1"))
    print(f"bench_tokenize_stall model={os.path.basename(args.model or 'default-model')} isa={isa()} "
          f"dtype=auto chars={args.chars} rounds={args.rounds} " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
